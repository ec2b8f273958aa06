"""Unit tier: telling a CUDA fault from a request's fault by EngineCore's own failure
(app/core_log.py, workers/engine/classify.py `classify_core_failure`, the host's use of it).

The texts are vLLM's and torch's own: the lines vLLM logs when an engine process goes down are
read from the installed vLLM 0.32 source, and the same lines were read in vLLM's later source
(main-branch snapshot 00080ee13c7a, the 0.33 line: `EngineCore failed to start.`, `EngineCore
encountered a fatal error.`, `RuntimeError("Executor failed.")` and the free-memory check's
"... on startup is less than desired GPU memory utilization ..."; 0.33.0's release has them too).
A tensor-parallel rank's failure is logged by its WorkerProc ("WorkerProc failed to start.",
"WorkerProc failed.") before EngineCore's line. The records are written by
the real logging config vLLM's processes load (app/logging_setup.py), from a separate process,
with torch's real exception types, so the file the worker reads has the shape it has on a GPU.
A real EngineCore death on the CPU build is read in tests/test_core_failure_e2e.py.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from vllm.v1.engine.exceptions import EngineDeadError

from app.core_log import FAILURE_MARKERS, CoreLog
from app.errors import RequestError, TransientError, WorkerFatalError
from app.requests.models import ModelSpec
from app.requests.schemas import GenerateRequest
from tests.unit_helpers import wait_until
from workers.engine.classify import classify, classify_core_failure, classify_load_failure
from workers.engine.kinds import StartFailure, with_core_log
from workers.engine.memory import MemoryProbe, plan_memory

REPO = Path(__file__).resolve().parent.parent
GiB = 1 << 30

# torch's texts (c10's CUDA error check and the caching allocator), with this test's numbers.
ILLEGAL_ADDRESS = ("CUDA error: an illegal memory access was encountered\nCUDA kernel errors "
                   "might be asynchronously reported at some other API call, so the stacktrace "
                   "below might be incorrect.\nFor debugging consider passing "
                   "CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` to enable "
                   "device-side assertions.\n")
DEVICE_ASSERT = ILLEGAL_ADDRESS.replace("an illegal memory access was encountered",
                                        "device-side assert triggered")
CUDA_OOM = ("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of "
            "139.81 GiB of which 812.00 MiB is free. Including non-PyTorch memory, this process "
            "has 138.99 GiB memory in use. Of the allocated memory 131.20 GiB is allocated by "
            "PyTorch, and 1.10 GiB is reserved by PyTorch but unallocated. If reserved but "
            "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:"
            "True to avoid fragmentation.")
# vllm/v1/worker/utils.py `request_memory` (0.32's and 0.33's text), with this test's numbers.
START_CHECK = ("Free memory on device cuda:0 (24.1/139.81 GiB) on startup is less than desired "
               "GPU memory utilization (0.9, 125.83 GiB). Decrease GPU memory utilization or "
               "reduce GPU memory used by other processes.")
INIT_FAILED = ("Engine core initialization failed. See root cause above. Failed core proc(s): "
               "{'EngineCore_DP0': 1}")

WRITER = textwrap.dedent('''
    import json, logging.config, os, sys
    import torch
    from app.logging_setup import vllm_logging_config
    logging.config.dictConfig(vllm_logging_config("INFO"))
    path = os.environ["VIGIL_ENGINE_ERROR_LOG"]
    cases = json.loads(sys.argv[1])
    offsets = {}
    for name, records in cases.items():
        offsets[name] = os.path.getsize(path) if os.path.exists(path) else 0
        logging.getLogger("vllm.v1.engine.async_llm").info("an INFO line is not kept")
        for logger, kind, text, line in records:
            try:
                raise getattr(torch, kind, None) and getattr(torch, kind)(text) or \\
                    __builtins__.__dict__[kind](text)
            except Exception:
                logging.getLogger(logger).exception(line)
    print(json.dumps(offsets))
''')

# vllm/v1/worker/gpu_worker.py's memory profiling assertion (0.32's text), this test's numbers.
PROFILING = ("Error in memory profiling. Initial free memory 100.00 GiB, current free memory "
             "110.00 GiB. This happens when other processes sharing the same container release "
             "GPU memory while vLLM is profiling during initialization. To fix this, ensure "
             "consistent GPU memory allocation or isolate vLLM in its own container.")
# What EngineCore raises when a tensor-parallel rank failed to start
# (vllm/v1/executor/multiproc_executor.py `wait_for_ready`, 0.32).
RANK_FAILED = ("WorkerProc initialization failed due to an exception in a background process. "
               "See stack trace for root cause.")
CORE, WORKER = "vllm.v1.engine.core", "vllm.v1.executor.multiproc_executor"


def core(kind, text, line):
    """One record logged by EngineCore's logger."""
    return [(CORE, kind, text, line)]


def tp_start(kind, text):
    """A tensor-parallel start whose rank 1 failed: the rank's WorkerProc logs first, then
    EngineCore's own line, whose exception says only that a background process failed."""
    return [(WORKER, kind, text.replace("cuda:0", "cuda:1"), "WorkerProc failed to start."),
            (CORE, "Exception", RANK_FAILED, "EngineCore failed to start.")]


CASES = {
    "illegal_address": core("AcceleratorError", ILLEGAL_ADDRESS,
                            "EngineCore encountered a fatal error."),
    "device_assert": core("AcceleratorError", DEVICE_ASSERT,
                          "EngineCore encountered a fatal error."),
    "oom": core("OutOfMemoryError", CUDA_OOM, "EngineCore encountered a fatal error."),
    "python_error": core("ValueError", "LoRA rank 64 is greater than max_lora_rank 8.",
                         "EngineCore encountered a fatal error."),
    "start_check": core("ValueError", START_CHECK, "EngineCore failed to start."),
    "start_oom": core("OutOfMemoryError", CUDA_OOM, "EngineCore failed to start."),
    "start_config": core("ValueError", "No available memory for the cache blocks. Try increasing "
                         "`gpu_memory_utilization` when initializing the engine.",
                         "EngineCore failed to start."),
    "start_profiling": core("AssertionError", PROFILING, "EngineCore failed to start."),
    "tp_start_check": tp_start("ValueError", START_CHECK),
    "tp_start_oom": tp_start("OutOfMemoryError", CUDA_OOM),
    "tp_start_profiling": tp_start("AssertionError", PROFILING),
    "tp_start_config": tp_start("ValueError", "No available memory for the cache blocks."),
    "tp_rank_fault": [(WORKER, "AcceleratorError", ILLEGAL_ADDRESS, "WorkerProc failed."),
                      (CORE, "RuntimeError", "Executor failed.",
                       "EngineCore encountered a fatal error.")],
}


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """name -> what CoreLog reads after that case's offset, written by a real vLLM-config
    logger in another process."""
    path = tmp_path_factory.mktemp("core") / "engine-errors.log"
    env = {"VIGIL_ENGINE_ERROR_LOG": str(path), "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", WRITER, json.dumps(CASES)], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    offsets = json.loads(out.stdout.strip().splitlines()[-1])
    log = CoreLog(path)
    ends = list(offsets.values())[1:] + [path.stat().st_size]
    return {name: log.failure_since(off, end) for (name, off), end in zip(offsets.items(), ends)}


def test_vllm_still_logs_the_lines_the_worker_reads():
    import vllm

    root = Path(vllm.__file__).parent
    core = (root / "v1/engine/core.py").read_text()
    assert 'logger.exception("EngineCore encountered a fatal error.")' in core
    assert 'logger.exception("EngineCore failed to start.")' in core
    mp = (root / "v1/executor/multiproc_executor.py").read_text()
    assert 'logger.exception("WorkerProc hit an exception.")' in mp and "died unexpectedly" in mp
    check = (root / "v1/worker/utils.py").read_text()  # one message over several f-strings
    assert '"GiB) on startup "' in check.replace("{format_gib(init_snapshot.total_memory)} ", "")
    assert 'f"is less than desired GPU memory utilization "' in check
    assert "Engine core initialization failed" in (root / "v1/engine/utils.py").read_text()
    assert str(EngineDeadError()).startswith("EngineCore encountered an issue")
    for m in FAILURE_MARKERS:
        assert m in core or m in mp
    assert '"WorkerProc initialization failed due to an exception in a "' in mp
    assert '"background process. See stack trace for root cause."' in mp  # RANK_FAILED
    gpu = (root / "v1/worker/gpu_worker.py").read_text()
    assert '"Error in memory profiling. "' in gpu
    assert '"release GPU memory while vLLM is profiling during initialization. "' in gpu


def test_every_line_enginecore_or_a_workerproc_logs_going_down_is_a_failure_marker():
    """Completeness, read from vLLM's source: each `logger.exception("EngineCore ...")` or
    `("WorkerProc ...")`. A missing "WorkerProc failed to start." cut a tensor-parallel rank's
    own failure off what the worker read (invalid_model_config, never retried)."""
    import re

    import vllm

    root = Path(vllm.__file__).parent
    lines = set()
    for f in ("v1/engine/core.py", "v1/executor/multiproc_executor.py"):
        lines |= set(re.findall(r'logger\.exception\(\s*"((?:EngineCore|WorkerProc)[^"]*)"',
                                (root / f).read_text()))
    assert {"WorkerProc failed to start.", "WorkerProc failed.",
            "EngineCore failed to start."} <= lines
    for line in lines:
        assert any(line.startswith(m) for m in FAILURE_MARKERS), line


def test_the_file_holds_the_failure_and_its_traceback_and_nothing_before_it(logged):
    text = logged["illegal_address"]
    assert text.startswith("[") and "EngineCore encountered a fatal error." in text
    assert "torch.AcceleratorError: CUDA error: an illegal memory access" in text
    assert "INFO" not in text.split("\n")[0]  # INFO lines are not kept
    # The next case's offset starts after it: an earlier engine's fault is not this one's.
    assert "illegal memory access" not in logged["oom"]
    assert CoreLog(Path("/nonexistent")).failure_since(0) == ""


@pytest.mark.parametrize("case, cls, code", [
    ("illegal_address", WorkerFatalError, "cuda_context_lost"),
    ("device_assert", WorkerFatalError, "cuda_context_lost"),
    ("oom", TransientError, "allocation_failed"),
])
def test_a_cuda_fault_in_enginecore_is_told_from_a_requests(logged, case, cls, code):
    err = classify_core_failure(logged[case], {"EngineCore_DP0": 1})
    assert type(err) is cls and err.code == code
    assert "EngineCore logged: torch." in str(err) and "exit codes" in str(err)


def test_a_python_error_or_a_silent_death_leaves_the_verdict_to_the_suspects(logged):
    assert classify_core_failure(logged["python_error"]) is None
    assert classify_core_failure("") is None  # a SIGKILL logs nothing
    assert classify_core_failure(logged["start_config"]) is None


def _full_plan():
    return plan_memory(ModelSpec(name="m", memory_gib=10),
                       MemoryProbe("cuda", 139 * GiB, 141 * GiB, "nvml"))


@pytest.mark.parametrize("case", ["start_check", "start_oom"])
def test_a_start_that_ran_out_of_gpu_memory_is_memory_pressure_even_unsized(logged, case):
    """Before: invalid_model_config (never retried) whenever the start had its full budget,
    though a co-tenant that came and went during the start caused it."""
    plan = _full_plan()
    assert not plan.sized_down
    err = classify_load_failure(StartFailure(RuntimeError(INIT_FAILED), logged[case]), plan)
    assert isinstance(err, TransientError) and err.code == "memory_pressure"
    bare = classify_load_failure(RuntimeError(INIT_FAILED), plan)
    assert isinstance(bare, RequestError) and bare.code == "invalid_model_config"


@pytest.mark.parametrize("case, why", [
    ("tp_start_check", "Free memory on device cuda:1"),
    ("tp_start_oom", "CUDA out of memory"),
    ("tp_start_profiling", "Error in memory profiling"),
])
def test_a_tensor_parallel_rank_that_failed_to_start_for_memory_is_memory_pressure(logged, case,
                                                                                   why):
    """A rank's failure is logged by its WorkerProc before EngineCore's line, whose traceback
    only says a background process failed: the worker reads from the rank's line on. Before:
    invalid_model_config (never retried) with the full budget granted."""
    text = logged[case]
    assert "WorkerProc failed to start." in text.splitlines()[0]
    assert text.index(why) < text.index("EngineCore failed to start.")
    plan = _full_plan()
    err = classify_load_failure(StartFailure(RuntimeError(INIT_FAILED), text), plan)
    assert isinstance(err, TransientError) and err.code == "memory_pressure"
    assert why in str(err)  # the rank's line, not EngineCore's "background process" one


def test_a_tensor_parallel_rank_that_failed_to_start_for_its_config_stays_the_models_fault(
        logged):
    err = classify_load_failure(StartFailure(RuntimeError(INIT_FAILED),
                                             logged["tp_start_config"]), _full_plan())
    assert isinstance(err, RequestError) and err.code == "invalid_model_config"


def test_a_cotenant_that_freed_memory_while_vllm_profiled_is_memory_pressure(logged):
    """vLLM asserts free memory did not grow while it profiled; a co-tenant that left then is
    gone at the next start, so the start is retried, not ended as the model's fault."""
    err = classify_load_failure(StartFailure(RuntimeError(INIT_FAILED),
                                             logged["start_profiling"]), _full_plan())
    assert isinstance(err, TransientError) and err.code == "memory_pressure"
    assert "AssertionError: Error in memory profiling" in str(err)


def test_a_rank_that_died_of_a_cuda_fault_at_run_time_makes_the_worker_leave(logged):
    """The rank logs "WorkerProc failed." with the fault; EngineCore's line only says the
    executor failed."""
    text = logged["tp_rank_fault"]
    assert text.startswith("[") and "WorkerProc failed." in text.splitlines()[0]
    err = classify_core_failure(text, {"EngineCore_DP0": 1})
    assert isinstance(err, WorkerFatalError) and err.code == "cuda_context_lost"


def test_a_start_that_failed_for_its_config_stays_the_models_fault(logged):
    err = classify_load_failure(StartFailure(RuntimeError(INIT_FAILED), logged["start_config"]),
                                _full_plan())
    assert isinstance(err, RequestError) and err.code == "invalid_model_config"
    missing = classify_load_failure(StartFailure(FileNotFoundError("/m/config.json"),
                                                 logged["start_config"]), _full_plan())
    assert missing.code == "model_not_found"


def test_cuda_out_of_memory_raised_to_a_request_is_an_allocation_failure_not_a_lost_context():
    """`CUDA error: out of memory` (cudaErrorMemoryAllocation) leaves the context usable: it was
    matched as `cuda error` and made the worker leave."""
    err = classify(RuntimeError("CUDA error: out of memory\n" + ILLEGAL_ADDRESS[
        ILLEGAL_ADDRESS.index("CUDA kernel"):]))
    assert isinstance(err, TransientError) and err.code == "allocation_failed"
    assert classify(RuntimeError(ILLEGAL_ADDRESS)).code == "cuda_context_lost"


def test_the_factory_attaches_what_enginecore_logged_to_a_failed_start(tmp_path, monkeypatch):
    path = tmp_path / "errors.log"
    path.write_text("[old] vllm.v1.engine.core: EngineCore failed to start.\nValueError: old\n")
    monkeypatch.setenv("VIGIL_ENGINE_ERROR_LOG", str(path))

    def build(spec, plan):
        with path.open("a") as f:  # what EngineCore logs while the parent waits for it
            f.write(f"[x] vllm.v1.engine.core: EngineCore failed to start.\n"
                    f"Traceback (most recent call last):\nValueError: {START_CHECK}\n")
        raise RuntimeError(INIT_FAILED)

    with pytest.raises(StartFailure) as info:
        with_core_log(build)(ModelSpec(name="m"), None)
    assert "old" not in info.value.logged and START_CHECK in info.value.logged
    assert str(info.value.cause) == INIT_FAILED

    class Engine:
        pass

    engine = with_core_log(lambda spec, plan: Engine())(ModelSpec(name="m"), None)
    assert engine.core_log[0].path == path and engine.core_log[1] == path.stat().st_size


# -- the engine host acts on it ----------------------------------------------------------------
class CoreDeath:
    """A fake engine whose every run dies like vLLM's (EngineDeadError) and whose EngineCore
    said `cause` (None: said nothing telling)."""

    def __init__(self, cause, built):
        self.cause = cause
        self.dead = False
        built.append(self)

    async def run(self, r, rid):
        self.dead = True
        raise EngineDeadError()

    def death_cause(self):
        return self.cause

    def child_pids(self):
        return []

    def shutdown(self, timeout):
        self.dead = True


def req():
    return GenerateRequest(model="m", prompt="x", max_tokens=4)


def test_a_cuda_fault_makes_the_worker_leave_without_suspects_or_restarts(make_host):
    built, fatal = [], []
    lost = WorkerFatalError.of("cuda_context_lost", "the engine died of a CUDA fault")
    host = make_host(lambda spec, plan=None: CoreDeath(lost, built), on_fatal=fatal.append)
    with pytest.raises(WorkerFatalError, match="^cuda_context_lost: the engine died of a CUDA"):
        host.generate(req(), ModelSpec(name="m"), "r1", 5)
    wait_until(lambda: fatal)
    assert len(built) == 1 and host.stats.restarts == 0 and host.stats.canaries == 0


def test_an_out_of_memory_death_fails_its_requests_allocation_failed_and_counts(make_host):
    built = []
    oom = TransientError.of("allocation_failed", "the engine ran out of GPU memory")
    host = make_host(lambda spec, plan=None: CoreDeath(oom, built))
    with pytest.raises(TransientError, match="^allocation_failed: "):
        host.generate(req(), ModelSpec(name="m"), "r1", 5)
    assert host.snapshot()["death_streak"] == 1 and host.stats.canaries == 0  # no suspects re-run


def test_a_death_enginecore_explains_with_no_cuda_fault_is_judged_by_the_suspects(make_host):
    built = []
    host = make_host(lambda spec, plan=None: CoreDeath(None, built), death_limit=2)
    with pytest.raises(WorkerFatalError, match="^repeated_engine_death: "):
        host.generate(req(), ModelSpec(name="m"), "r1", 10)
    assert len(built) >= 2  # the recovery rebuilt the engine to re-run its suspect
