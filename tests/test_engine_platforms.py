"""Unit tier: what vLLM receives on each platform, without a GPU (workers/engine/vllm.py
`engine_args` fed memory plans over faked NVML cards; app/requests/engine_defaults.py).

- dtype per platform: bfloat16 on CUDA unless the entry says; float32 + LoRA refused on CUDA
  (vLLM's CUDA LoRA kernel asserts float16/bfloat16: read from vLLM's own source);
- the batch defaults are vllm serve's, checked against vLLM's own table; the worker's
  concurrency is at least the engine's max_num_seqs;
- a tensor-parallel worker's engine gets one rank per card;
- every engine schedules its waiting requests by vLLM's priority policy (tiers).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.errors import RequestError, TransientError
from app.requests.engine_defaults import batch_defaults, max_num_seqs, worker_concurrency
from app.requests.models import ModelSpec, load_registry
from app.settings import SettingsError, load_settings
from tests.cuda_plans import H200, cuda_plan, tiny
from tests.fake_nvml import FakeCard, FakeNvml
from workers.engine.memory import GiB, plan_memory, probe_memory
from workers.engine.vllm_args import engine_args


# -- dtype ---------------------------------------------------------------------------------------
def test_tiny_llama_is_float32_on_the_cpu_and_bfloat16_on_cuda():
    spec = tiny()
    assert spec.dtype_on("cpu") == "float32" and spec.dtype_on("cuda") == "bfloat16"
    assert engine_args(spec, platform="cpu")["dtype"] == "float32"
    args = engine_args(spec, cuda_plan(spec))
    assert args["dtype"] == "bfloat16" and args["enable_lora"] is True


def test_gpu_engines_capture_cuda_graphs_and_cpu_engines_run_eager():
    # issue 39: no enforce_eager on a GPU entry unless it says so; the CPU stays eager.
    spec = tiny()
    assert "enforce_eager" not in engine_args(spec, cuda_plan(spec))
    assert engine_args(spec, platform="cpu")["enforce_eager"] is True
    own = ModelSpec(name="m", memory_gib=16, engine_args={"enforce_eager": True})
    assert engine_args(own, cuda_plan(own))["enforce_eager"] is True  # debugging: its own
    compiled = ModelSpec(name="m", engine_args={"enforce_eager": False})
    assert engine_args(compiled, platform="cpu")["enforce_eager"] is False


def test_an_entrys_own_dtype_wins_on_every_platform_or_per_platform():
    every = ModelSpec(name="a", engine_args={"dtype": "float16"})
    assert every.dtype_on("cuda") == every.dtype_on("cpu") == "float16"
    per = ModelSpec(name="b", dtypes={"cuda": "float16"})
    assert per.dtype_on("cuda") == "float16" and per.dtype_on("cpu") is None
    assert "dtype" not in engine_args(per, platform="cpu")  # vLLM's own choice on the CPU
    with pytest.raises(ValueError, match="not both"):
        ModelSpec(name="c", dtypes={"cpu": "float32"}, engine_args={"dtype": "float16"})


def test_vllms_cuda_lora_kernel_still_takes_half_precision_only():
    """The rule's reason, read from the installed vLLM: lora_shrink asserts float16/bfloat16."""
    import vllm

    src = (Path(vllm.__file__).parent / "lora/ops/triton_ops/lora_shrink_op.py").read_text()
    assert "assert inputs.dtype in [torch.float16, torch.bfloat16]" in src


def test_float32_with_lora_said_for_cuda_is_refused_at_registry_load(tmp_path):
    f = tmp_path / "models.json"
    f.write_text(json.dumps({"models": [{"name": "m", "path": "/x", "max_loras": 2,
                                         "dtypes": {"cuda": "float32"}}]}))
    with pytest.raises(SettingsError, match="float32 with LoRA .* cannot run on CUDA.*lora_shrink"):
        load_registry(load_settings(models_file=f))


def test_float32_for_every_platform_with_lora_loads_but_a_gpu_worker_refuses_it(tmp_path):
    """An entry float32 everywhere runs on CPU workers; a GPU worker refuses it at start, and the
    engine refuses it as invalid_model_config before vLLM sees it."""
    f = tmp_path / "models.json"
    f.write_text(json.dumps({"models": [{"name": "m", "path": "/x", "max_loras": 2,
                                         "engine_args": {"dtype": "float32"}}]}))
    reg = load_registry(load_settings(models_file=f))
    reg.refuse_unrunnable("cpu")
    with pytest.raises(SettingsError, match=f"VIGIL_MODELS_FILE={f}: model m: float32 with LoRA"):
        reg.refuse_unrunnable("cuda", f"VIGIL_MODELS_FILE={f}")
    reg.refuse_unrunnable("cuda", names=["tiny-llama"])  # a worker not serving m is not stopped
    with pytest.raises(SettingsError, match="model m: float32"):
        reg.refuse_unrunnable("cuda", names=["tiny-llama", "m"])
    with pytest.raises(RequestError, match="^model_not_found: no model named 'nope'"):
        reg.refuse_unrunnable("cuda", names=["nope"])
    spec = reg.get("m")
    with pytest.raises(RequestError, match="^invalid_model_config: model m: float32 with LoRA"):
        engine_args(spec, cuda_plan(spec))
    assert engine_args(spec, platform="cpu")["dtype"] == "float32"
    assert reg.get("tiny-llama").platform_problem("cuda") is None


def test_vigil_worker_gpu_stops_at_start_on_an_entry_that_cannot_run(tmp_path, monkeypatch,
                                                                     capsys):
    from app.ops import cli, worker_start
    from app.requests import models

    f = tmp_path / "models.json"
    f.write_text(json.dumps({"models": [{"name": "m", "path": "/x", "max_loras": 2,
                                         "engine_args": {"dtype": "float32"}}]}))
    monkeypatch.setenv("VIGIL_MODELS_FILE", str(f))
    monkeypatch.setattr(worker_start, "get_settings", lambda: load_settings(models_file=f))
    monkeypatch.setattr(worker_start, "get_registry",
                        lambda: models.load_registry(load_settings(models_file=f)))
    cards = FakeNvml([FakeCard(70 * GiB)])
    monkeypatch.setattr(worker_start, "check_gpus", lambda entries: (
        probe_memory("cuda", entries, cards).cards, {"driver": "580", "driver_cuda": "13.0",
                                                     "torch": "2.13.0", "torch_cuda": "13.0"}))
    monkeypatch.setattr(cli.os, "execv", lambda *a: pytest.fail("the worker was started"))
    assert cli.main(["worker", "--gpu", "0"]) == 2
    assert "model m: float32 with LoRA" in capsys.readouterr().err
    assert cli.main(["worker", "--gpu", "0", "--pools", "m"]) == 2
    # A GPU worker serving only other pools starts: the CPU-only entry is not its business.
    monkeypatch.setattr(worker_start, "preflight", lambda s: None)
    execs = []
    monkeypatch.setattr(cli.os, "execv", lambda path, argv: execs.append(argv))
    monkeypatch.setattr(cli.os, "environ", dict(cli.os.environ))
    assert cli.main(["worker", "--gpu", "0", "--pools", "tiny-llama"]) == 0
    assert execs and "vigil.pool.m" not in execs[0][execs[0].index("-Q") + 1]


# -- the batch, and the worker's threads -----------------------------------------------------------
@pytest.mark.parametrize("total_gib, name", [(141, "NVIDIA H200"), (80, "NVIDIA H100 80GB HBM3"),
                                             (80, "NVIDIA A100-SXM4-80GB"), (24, "NVIDIA L4"),
                                             (180, "NVIDIA B200")])
def test_cuda_batch_defaults_are_vllm_serves(total_gib, name, monkeypatch):
    """Witness: vLLM's own table (EngineArgs.get_batch_defaults), its OPENAI_API_SERVER column,
    with vLLM told it runs on such a card."""
    from vllm.engine import arg_utils
    from vllm.usage.usage_lib import UsageContext

    fake = SimpleNamespace(get_device_total_memory=lambda: total_gib * GiB,
                           get_device_name=lambda: name, is_tpu=lambda: False,
                           is_cpu=lambda: False)
    monkeypatch.setattr(arg_utils, "current_platform", fake)
    tokens, seqs = arg_utils.EngineArgs.get_batch_defaults(world_size=1)
    ours = batch_defaults("cuda", total_gib * GiB, name)
    assert ours == {"max_num_seqs": seqs[UsageContext.OPENAI_API_SERVER],
                    "max_num_batched_tokens": tokens[UsageContext.OPENAI_API_SERVER]}


def test_the_cpu_keeps_vllms_library_defaults():
    assert batch_defaults("cpu", 16 * GiB) == {}
    assert max_num_seqs({}, "cpu") == 128
    spec = tiny()
    args = engine_args(spec, platform="cpu")
    assert "max_num_seqs" not in args and "max_num_batched_tokens" not in args


def test_a_gpu_engine_gets_the_platforms_batch_under_what_the_registry_says():
    spec = ModelSpec(name="m", memory_gib=16)
    args = engine_args(spec, cuda_plan(spec))
    assert args["max_num_seqs"] == 1024 and args["max_num_batched_tokens"] == 8192
    own = ModelSpec(name="m", memory_gib=16, engine_args={"max_num_seqs": 256})
    assert engine_args(own, cuda_plan(own))["max_num_seqs"] == 256


def test_every_engine_schedules_by_priority_unless_its_entry_says_and_vllm_takes_it():
    """The waiting requests in vLLM go by tier (app/requests/tiers.py `engine_priority`): the
    policy is vLLM's own "priority", which its scheduler config accepts; an entry's own wins."""
    from vllm.config import SchedulerConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    from app.requests.tiers import engine_priority

    spec = tiny()
    for args in (engine_args(spec, platform="cpu"), engine_args(spec, cuda_plan(spec))):
        assert args["scheduling_policy"] == "priority"
    own = ModelSpec(name="m", memory_gib=16, engine_args={"scheduling_policy": "fcfs"})
    assert engine_args(own, platform="cpu")["scheduling_policy"] == "fcfs"
    assert AsyncEngineArgs(model="x", scheduling_policy="priority").scheduling_policy == \
        SchedulerConfig(policy="priority", max_model_len=512,
                        is_encoder_decoder=False).policy == "priority"
    assert [engine_priority(t) for t in ("interactive", "default", "bulk", None)] == \
        [0, 1, 2, 1]


def test_a_workers_threads_are_at_least_its_engines_max_num_seqs(capsys):
    from app.ops.worker_start import worker_threads

    h200 = [FakeCard(139 * GiB, **H200)]
    assert worker_concurrency(128, [{}], "cuda", 141 * GiB, "NVIDIA H200") == 1024
    assert worker_concurrency(128, [{}], "cpu") == 128
    assert worker_concurrency(2000, [{"max_num_seqs": 512}], "cuda", 141 * GiB) == 2000
    cards = probe_memory("cuda", ("0",), FakeNvml(h200)).cards
    assert worker_threads(128, [ModelSpec(name="m")], "cuda", list(cards)) == 1024
    assert "concurrency 128 raised to 1024" in capsys.readouterr().err
    l4 = probe_memory("cuda", ("0",), FakeNvml([FakeCard(20 * GiB, total=24 * GiB)])).cards
    assert worker_threads(128, [ModelSpec(name="m")], "cuda", list(l4)) == 256


# -- tensor parallelism ----------------------------------------------------------------------------
def test_a_tensor_parallel_worker_runs_one_rank_per_card():
    spec = ModelSpec(name="llama-70b", memory_gib=140, kv_cache_floor_gib=16,
                     engine_args={"gpu_memory_utilization": 0.9, "max_model_len": 8192})
    plan = cuda_plan(spec, n=4, free=139 * GiB)
    args = engine_args(spec, plan)
    assert args["tensor_parallel_size"] == 4 and args["dtype"] == "bfloat16"
    assert "distributed_executor_backend" not in args  # vLLM's own choice on CUDA (mp)
    assert args["gpu_memory_utilization"] == 0.9 and args["max_model_len"] == 8192
    with pytest.raises(TransientError, match="^memory_pressure: "):  # 156 GiB on one card
        cuda_plan(spec, n=1)
    assert "tensor_parallel_size" not in engine_args(ModelSpec(name="s"), cuda_plan(
        ModelSpec(name="s")))
    with pytest.raises(RequestError, match="asks for tensor_parallel_size 4, but this worker "
                       "has 2 card"):
        engine_args(ModelSpec(name="x", engine_args={"tensor_parallel_size": 4}),
                    cuda_plan(ModelSpec(name="x"), n=2))


def test_a_tensor_parallel_start_behind_a_cotenant_on_one_card_is_sized_to_that_card():
    spec = ModelSpec(name="llama-70b", memory_gib=140, kv_cache_floor_gib=16)
    nvml = FakeNvml([FakeCard(139 * GiB, **H200), FakeCard(139 * GiB, **H200),
                     FakeCard(100 * GiB, **H200), FakeCard(139 * GiB, **H200)])
    plan = plan_memory(spec, probe_memory("cuda", ("0", "1", "2", "3"), nvml))
    util = engine_args(spec, plan)["gpu_memory_utilization"]
    assert plan.sized_down and util < (100 * GiB) / (141 * GiB)


def test_vigil_worker_gpu_execs_celery_with_the_cards_order_and_threads(monkeypatch, capsys):
    """The whole start of `vigil worker --gpu 1` under an inherited CUDA_VISIBLE_DEVICES=4,5 on
    H200s: the card it checks and pins is 5, in PCI bus order, and Celery runs 1,024 threads
    (vllm serve's max_num_seqs there), with the worker's setting saying so."""
    import os

    from app.ops import cli, worker_start

    env = {k: v for k, v in os.environ.items()}
    env.update(CUDA_VISIBLE_DEVICES="4,5", CUDA_DEVICE_ORDER="FASTEST_FIRST")
    monkeypatch.setattr(os, "environ", env)
    cards = FakeNvml([FakeCard(139 * GiB, **H200) for _ in range(6)])
    checked = []

    def check(entries):
        checked.append(entries)
        return (list(probe_memory("cuda", entries, cards).cards),
                {"driver": "580.82.07", "driver_cuda": "13.0", "torch": "2.13.0",
                 "torch_cuda": "13.0"})

    monkeypatch.setattr(worker_start, "check_gpus", check)
    monkeypatch.setattr(worker_start, "preflight", lambda s: None)
    execs = []
    monkeypatch.setattr(cli.os, "execv", lambda path, argv: execs.append(argv))
    assert cli.main(["worker", "--gpu", "1", "--pools", "tiny-llama"]) == 0
    assert checked == [("5",)]
    argv = execs[0]
    assert argv[argv.index("-c") + 1] == "1024" and argv[argv.index("-n") + 1] == "gpu1@%h"
    assert env["CUDA_VISIBLE_DEVICES"] == "5" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["VIGIL_WORKER_CONCURRENCY"] == "1024"
    err = capsys.readouterr().err
    assert "CUDA_DEVICE_ORDER=FASTEST_FIRST replaced by PCI_BUS_ID" in err
    assert "NVIDIA driver 580.82.07 (CUDA 13.0), torch 2.13.0 (built for CUDA 13.0)" in err
    assert "GPU 5: NVIDIA H200" in err and "raised to 1024" in err
