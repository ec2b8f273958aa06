"""Unit tests: where the model runs (workers/engine/vllm_args.py `chooses_executor`, `executor_args`).

On the CPU Vigil runs the model inside EngineCore (measured: bench/engine_layout.py); a registry
entry that chooses the executor itself keeps vLLM's choice. The engine side is exercised by every
worker-tier test; these check the rule without importing vLLM."""
from __future__ import annotations

from workers.engine.vllm_args import chooses_executor


def test_one_device_and_no_executor_named_leaves_the_choice_to_vigil():
    assert not chooses_executor({})
    assert not chooses_executor({"max_model_len": 512, "enforce_eager": True})
    assert not chooses_executor({"tensor_parallel_size": 1, "pipeline_parallel_size": "1"})


def test_a_registry_entry_that_names_an_executor_or_asks_for_devices_keeps_it():
    assert chooses_executor({"distributed_executor_backend": "mp"})
    assert chooses_executor({"tensor_parallel_size": 2})
    assert chooses_executor({"pipeline_parallel_size": "2"})
    assert chooses_executor({"data_parallel_size": 4})


def test_the_engines_distributed_init_is_on_loopback_unless_the_operator_says(monkeypatch):
    # vLLM's own get_ip() is the witness: it is what its executor's rendezvous address uses
    # (tcp://<get_ip()>:port in vLLM 0.26, whose reverse lookup cost 21-25 s per start on the
    # H200 host; 0.32 rendezvous on a file store on one device, get_ip() elsewhere).
    from vllm.utils.network_utils import get_ip, get_loopback_ip

    from workers.engine.vllm_args import engine_env_defaults

    for name in ("VLLM_HOST_IP", "VLLM_LOOPBACK_IP"):  # unset here, as they were after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    engine_env_defaults()
    assert get_ip() == "127.0.0.1" and get_loopback_ip() == "127.0.0.1"
    monkeypatch.setenv("VLLM_HOST_IP", "10.1.2.3")  # an operator's choice wins
    engine_env_defaults()
    assert get_ip() == "10.1.2.3"


def test_the_engines_openmp_threads_wait_passively_unless_the_operator_says(monkeypatch):
    """Given the engine's environment (the worker's and the benches' direct engines'), then the
    OpenMP runtime a spawned engine process loads (torch's libgomp, the witness: it prints what
    it read with OMP_DISPLAY_ENV=VERBOSE) spins 0 times before it sleeps (its default is 300,000
    spins), and an operator's OMP_WAIT_POLICY wins."""
    import os
    import subprocess
    import sys

    from workers.engine.vllm_args import engine_env_defaults

    def spins() -> int:
        env = dict(os.environ, OMP_DISPLAY_ENV="VERBOSE")
        out = subprocess.run([sys.executable, "-c", "import torch; torch.ones(64).sum()"],
                             env=env, capture_output=True, text=True, timeout=120)
        line = next(x for x in out.stderr.splitlines() if "GOMP_SPINCOUNT" in x)
        return int(line.split("=", 1)[1].strip().strip("'"))

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    engine_env_defaults()
    assert spins() == 0
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    engine_env_defaults()
    assert spins() > 300_000
