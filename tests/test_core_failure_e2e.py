"""Worker tier: EngineCore's own failure, read from a real death on the CPU build of vLLM.

A real tiny-llama engine (Vigil's engine factory, Vigil's vLLM logging config) is handed an
adapter request whose adapter directory is missing, past the gate: vLLM's EngineCore raises in
its engine step, logs "EngineCore encountered a fatal error." with the traceback, and dies; the
front end sees only EngineDeadError. The worker's engine error file must hold vLLM's own record,
and the verdict must be "not a CUDA fault" (None: the suspects decide), with EngineCore's exit
code read from vLLM's process manager. No CUDA fault can be produced here (no GPU): the CUDA
texts are unit-tested in tests/test_core_failure.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.worker
REPO = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent('''
    import asyncio, json, os, sys
    from pathlib import Path

    def main():
        from app.logging_setup import configure_vllm_logging
        from app.settings import load_settings
        settings = load_settings()
        configure_vllm_logging(settings.cache_dir, "INFO")  # before vLLM is imported
        from app.core_log import CoreLog
        from app.requests.adapters import AdapterRef
        from app.requests.models import load_registry
        from app.requests.schemas import GenerateRequest
        from workers.engine.kinds import engine_factory

        spec = load_registry(settings).get("tiny-llama")
        out = {"log": os.environ["VIGIL_ENGINE_ERROR_LOG"]}

        async def go():
            engine = engine_factory("vllm")(spec, None)
            req = GenerateRequest(model="tiny-llama", prompt="hello there", max_tokens=4,
                                  ignore_eos=True)
            ok = await engine.run(req, "first")
            out["first_tokens"] = len(ok.token_ids)
            gone = AdapterRef("ghost", str(Path(sys.argv[1]) / "no-such-adapter"), "tiny-llama")
            try:
                await engine.run(req, "second", gone)  # past the gate: straight to vLLM
                out["second"] = "finished"
            except Exception as e:
                out["second"] = type(e).__name__
            for _ in range(100):
                if engine.core_exit_codes():
                    break
                await asyncio.sleep(0.1)
            out["dead"] = engine.dead
            out["exit_codes"] = engine.core_exit_codes()
            cause = engine.death_cause()
            out["cause"] = None if cause is None else str(cause)
            log, mark = engine.core_log
            out["logged"] = log.failure_since(mark)
            engine.shutdown(20)

        asyncio.run(go())
        print("RESULT " + json.dumps(out))

    if __name__ == "__main__":
        main()
''')


def test_a_real_enginecore_death_is_read_from_its_own_log_and_is_no_cuda_fault(tmp_path):
    script = tmp_path / "death.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("VIGIL_ENGINE_ERROR_LOG",
                                                            "VLLM_LOGGING_CONFIG_PATH")}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", VIGIL_CACHE_DIR=str(tmp_path / "c"))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["first_tokens"] == 4
    assert out["second"] == "EngineDeadError" and out["dead"] is True
    logged = out["logged"]
    assert "vllm.v1.engine.core: EngineCore encountered a fatal error." in logged, logged[:2000]
    assert "LoRAAdapterNotFoundError" in logged or "no-such-adapter" in logged
    assert out["cause"] is None  # not a CUDA fault: the recovery's suspects decide
    assert list(out["exit_codes"].values()) and all(c != 0 for c in out["exit_codes"].values())
    assert Path(out["log"]).parent == tmp_path / "c" / "engine-errors"
