"""Unit tier (with one subprocess): the heavy modules a worker's and a gateway's threads import
lazily are imported first, on one thread, before those threads start (app/first_imports.py).

transformers 5's lazy names race when two threads import them for the first time at once
(`ImportError: cannot import name 'AutoTokenizer' from 'transformers'`): a fresh clone's soak
lost a restarted worker's engine to it. The lists are read against the code here, the threads
are run for real in a fresh interpreter, and the worker's start is checked to import them
before its runtime starts a thread."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.first_imports import GATEWAY_MODULES, WORKER_MODULES

REPO = Path(__file__).resolve().parent.parent
HEAVY = {"vllm", "torch", "transformers", "peft", "tokenizers", "safetensors", "jinja2",
         "pynvml", "xgrammar", "outlines_core", "jsonschema"}
# Packages whose top-level names are resolved lazily: a name imported from them must be listed
# as "package:name" (importing the package alone does not resolve it).
LAZY_NAMES = {"vllm", "transformers"}
# The builder of the locally made test models runs in the one thread that starts an engine or
# builds a render lane (under that lane's lock), never beside another first import of its own.
ONE_THREAD_ONLY = {"app/requests/model_files.py"}


def road(*globs: str) -> list[Path]:
    files = []
    for pattern in globs:
        files += [p for p in sorted(REPO.glob(pattern))
                  if str(p.relative_to(REPO)) not in ONE_THREAD_ONLY]
    return files


WORKER_ROAD = ("workers/**/*.py", "app/requests/*.py")
GATEWAY_ROAD = ("app/online/*.py", "app/ops/gateway.py", "app/ops/api_online.py",
                "app/requests/*.py")


def lazy_imports(files: list[Path], root: Path = REPO) -> dict[str, list[str]]:
    """file -> the heavy imports made inside its functions, as "module" or "module:name"."""
    out: dict[str, list[str]] = {}
    for path in files:
        found = []
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.module \
                        and node.module.split(".")[0] in HEAVY:
                    if node.module in LAZY_NAMES:
                        found += [f"{node.module}:{a.name}" for a in node.names]
                    else:
                        found.append(node.module)
                elif isinstance(node, ast.Import):
                    found += [a.name for a in node.names if a.name.split(".")[0] in HEAVY]
        if found:
            out[str(path.relative_to(root))] = sorted(set(found))
    return out


def uncovered(imports: dict[str, list[str]], listed: tuple[str, ...]) -> dict[str, list[str]]:
    covered = set(listed) | {e.partition(":")[0] for e in listed}
    missing = {f: [m for m in mods if m not in covered] for f, mods in imports.items()}
    return {f: m for f, m in missing.items() if m}


@pytest.mark.parametrize("globs,listed", [(WORKER_ROAD, WORKER_MODULES),
                                          (GATEWAY_ROAD, GATEWAY_MODULES)],
                         ids=["worker", "gateway"])
def test_every_heavy_module_a_process_threads_import_lazily_is_imported_first(globs, listed):
    """Given every import inside a function of the worker's code (or the gateway's), each heavy
    module and each lazily resolved vllm/transformers name is on that process' list."""
    imports = lazy_imports(road(*globs))
    assert imports, "the scan found no lazy import at all: it reads the wrong files"
    assert not uncovered(imports, listed), uncovered(imports, listed)


def test_the_scan_reports_a_lazy_import_missing_from_a_list(tmp_path):
    """The check above can fail: a new function-level import that no list names is reported."""
    f = tmp_path / "new.py"
    f.write_text("def f():\n    from transformers import GenerationConfig\n"
                 "    import vllm.v1.core.sched\n")
    assert uncovered(lazy_imports([f], tmp_path), WORKER_MODULES) == {
        "new.py": ["transformers:GenerationConfig", "vllm.v1.core.sched"]}


THREADS = r"""
import json, sys, threading, importlib
from app.first_imports import import_first, WORKER_MODULES, GATEWAY_MODULES
groups = json.loads(sys.argv[1])
import_first(WORKER_MODULES if sys.argv[2] == "worker" else GATEWAY_MODULES)
errors = []
def run(entries):
    try:
        for entry in entries:
            module, _, name = entry.partition(":")
            loaded = importlib.import_module(module)
            if name:
                getattr(loaded, name)
    except Exception as e:
        errors.append(f"{type(e).__name__}: {e}")
threads = [threading.Thread(target=run, args=(g,)) for g in groups]
[t.start() for t in threads]
[t.join() for t in threads]
print("ERRORS " + json.dumps(errors))
"""


@pytest.mark.parametrize("which,globs", [("worker", WORKER_ROAD), ("gateway", GATEWAY_ROAD)])
def test_threads_that_import_at_once_after_import_first_all_succeed(which, globs):
    """Given a fresh interpreter that ran `import_first` for the process, one thread per file of
    that process' code importing that file's lazy imports, all at once: every import succeeds.
    Without `import_first` four such threads failed 8 runs of 8 here ("cannot import name
    'AutoTokenizer' from 'transformers'")."""
    groups = list(lazy_imports(road(*globs)).values())
    assert len(groups) >= 4
    env = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, "-c", THREADS, json.dumps(groups), which],
                         cwd=REPO, capture_output=True, text=True, timeout=240,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("ERRORS ")][-1]
    assert json.loads(line[len("ERRORS "):]) == []


def test_a_model_engine_worker_imports_first_before_its_runtime_starts_a_thread(monkeypatch):
    """Given a worker runtime built for the vLLM or drill engine, `import_first` runs with the
    worker's list while the runtime is built (on the thread that starts the worker, before
    `start()` runs any thread); for the instant engine (no model) it does not."""
    from app.settings import load_settings
    from workers import runtime as rt_mod

    calls = []

    class Stop(Exception):
        pass

    def stop(*_):  # the runtime's next step after the imports: nothing later is needed here
        raise Stop

    monkeypatch.setattr(rt_mod, "import_first", lambda entries: calls.append(entries) or 0.0)
    monkeypatch.setattr(rt_mod, "open_store", lambda *a, **k: None)
    monkeypatch.setattr(rt_mod, "worker_device", stop)
    for engine in ("vllm", "drill", "instant"):
        with pytest.raises(Stop):
            rt_mod.WorkerRuntime(load_settings(engine=engine), "w", ports=None, guard=False)
    assert calls == [WORKER_MODULES, WORKER_MODULES]


@pytest.mark.parametrize("apply", ["engine", "gateway"])
def test_vllms_import_environment_is_set_by_the_engine_and_the_gateway_alike(monkeypatch, apply):
    """Given none of the settings vLLM and the hub read at import, when a worker's engine
    defaults (workers/engine/vllm_args.py) or the gateway's render lanes
    (app/online/render.py, through `vllm_env_defaults`) apply them, then vLLM reads no usage
    stats and no tracking (vllm.envs, the witness) and the hub is offline; an operator's
    setting wins."""
    import vllm.envs as envs

    from app.first_imports import vllm_env_defaults
    from workers.engine.vllm_args import engine_env_defaults

    names = ("HF_HUB_OFFLINE", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    defaults = engine_env_defaults if apply == "engine" else vllm_env_defaults
    defaults()
    assert envs.VLLM_NO_USAGE_STATS and envs.VLLM_DO_NOT_TRACK
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    defaults()
    assert os.environ["HF_HUB_OFFLINE"] == "0"
