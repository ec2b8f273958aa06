"""Unit tier: bench/gpu_check.py where no GPU is: it stops cleanly with one `NO GPU` line (exit
77), and every verdict it prints on a GPU host is a pure function of its readings, tested here
with readings that pass and readings that fail; its smoke's hand-made LoRA adapter is one that
peft loads and Vigil's adapter gate accepts."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.requests.models import ModelSpec
from bench.gpu_check import (EXIT_NO_GPU, Fact, context_cost, exit_status, no_gpu_reason,
                             nvml_agrees, request_cpu, same_card, sized_down_start, vllm_rule)
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
