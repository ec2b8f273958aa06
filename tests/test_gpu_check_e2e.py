"""Worker tier: bench/gpu_check.py's real-engine smoke (bench/gpu_engine_smoke.py) as a dry run on
the CPU build of vLLM: the model and adapter built here, Vigil's engine host with the real engine,
a base and an adapter request, EngineCore SIGKILLed under a 400-token request that must finish
on the recovered engine, timed as the GPU check's `restart_s` fact reads it. On a GPU host the same script runs bfloat16 on the card; here it runs
float32 (no GPU: the CUDA kernels are what this cannot check)."""
from __future__ import annotations

import json
import os
import subprocess
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.worker
REPO = Path(__file__).resolve().parent.parent


def test_the_engine_smoke_passes_on_the_cpu_build(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_VISIBLE_DEVICES", "VIGIL_ENGINE_ERROR_LOG",
                        "VLLM_LOGGING_CONFIG_PATH")}
    # vLLM names its ZeroMQ sockets after TMPDIR, and a socket path has 107 characters at
    # most: pytest's tmp_path (under pytest-xdist, one level deeper) can be longer.
    short = Path(tempfile.mkdtemp(prefix="smoke-", dir="/tmp"))
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TMPDIR=str(short))
    try:
        out = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_engine_smoke.py"),
                              str(1 << 30)], env=env, cwd=REPO, capture_output=True, text=True,
                             timeout=420)
    finally:
        shutil.rmtree(short, ignore_errors=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("SMOKE ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    smoke = json.loads(lines[-1][len("SMOKE "):])
    assert smoke["device"] == "cpu"
    assert smoke["ok"], smoke
    assert smoke["killed"] >= 1 and smoke["restarts"] == 1 and smoke["long_tokens"] == 400
    # the restart_s fact, from the smoke's own figures (its bound is a GPU's: not held here)
    from bench.gpu_facts import restart_s

    fact = restart_s(smoke)
    assert fact.name == "restart_s" and fact.ok is not None
    assert fact.detail.startswith(f"{smoke['recovered_s']:.1f} s from SIGKILL of EngineCore")
    assert smoke["long_warm_s"] > 0 and smoke["lora_s"] > 0
    # no flashinfer in the CPU build: the smoke's engine runs vLLM's own sampler
    assert smoke["sampler_env"] == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
