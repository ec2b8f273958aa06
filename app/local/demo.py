"""`vigil demo` / `make demo`: the whole system end to end on one machine.

Starts a private Redis, one CPU worker (real vLLM engine, tiny-llama built locally), the
housekeeper, beat, Flower and `vigil api`; a separate producer process sends prompts as
`generate.delay` does and shows progress; then one chat completion streamed through the online
API (with the curl command that asks the same), a summary, the Flower URL, and a clean shutdown
that leaves no process
behind. With `keep` (`vigil demo --keep`) the fleet and Flower stay up after the summary, to be
looked at (Flower, `vigil status`), until Ctrl-C or SIGTERM; then the same clean shutdown.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import requests
from rich.console import Console

from app.local.embedded import (REPO, EmbeddedRedis, free_port, start_housekeeper, start_process,
                                start_worker, stop_process, vigil_env, wait_for)
from app.online.sse import parse_sse
from app.requests.model_files import ensure_model_files
from app.requests.models import TINY_LLAMA, get_registry
from app.settings import load_settings
from app.state.store import RequestStore, open_store


def _flower_ok(port: int, auth: tuple[str, str]) -> bool:
    try:
        r = requests.get(f"http://127.0.0.1:{port}/api/workers?refresh=1", auth=auth, timeout=5)
        return r.status_code == 200 and bool(r.json())
    except (requests.RequestException, ValueError):
        return False


def hold_until_interrupted() -> None:
    """Block until Ctrl-C (SIGINT) or SIGTERM; both return normally. Both are handled here even
    when this process was started with SIGINT ignored (a background job of a shell)."""
    stop = []
    handlers = {sig: signal.signal(sig, lambda *_: stop.append(1))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop:
            time.sleep(0.2)
    finally:
        for sig, previous in handlers.items():
            signal.signal(sig, previous)


def run_demo(n: int = 100, max_tokens: int = 32, keep: bool = False,
             hold: Callable[[], None] = hold_until_interrupted) -> int:
    """Run the demo; 0 when every prompt got a result. With `keep`, the fleet and Flower stay
    up after the summary until `hold` returns (Ctrl-C or SIGTERM), then stop cleanly."""
    console = Console()
    logs = Path(tempfile.mkdtemp(prefix="vigil-demo-"))
    cache = os.environ.get("VIGIL_CACHE_DIR") or str(Path.home() / ".cache" / "vigil")
    env = {"VIGIL_CACHE_DIR": cache}
    procs: list[subprocess.Popen] = []
    rds = None
    try:
        with console.status("building tiny-llama (random weights, local tokenizer)..."):
            os.environ["VIGIL_CACHE_DIR"] = cache  # read by the registry's first use, just below
            model_dir = ensure_model_files(get_registry().get(TINY_LLAMA))
        console.print(f"[green]tiny-llama[/] ready in {model_dir}")
        rds = EmbeddedRedis().start()
        console.print(f"private Redis on {rds.url}")
        worker = start_worker(rds.url, "demo-cpu@%h", logs / "worker.log", pools="tiny-llama", **env)
        procs.append(worker)
        beat = start_process([sys.executable, "-m", "celery", "-A", "app", "beat", "-l", "INFO",
                              "-s", str(logs / "beat-schedule")],
                             vigil_env(rds.url, **env), logs / "beat.log")
        procs.append(beat)
        procs.append(start_housekeeper(rds.url, logs / "housekeeper.log", **env))
        fport, fpass = free_port(), secrets.token_urlsafe(9)
        # `vigil flower`, as the Procfile runs it: the password travels in the environment.
        flower = start_process([sys.executable, "-m", "app.ops.cli", "flower", "--port", str(fport),
                                "--address", "127.0.0.1"],
                               vigil_env(rds.url, VIGIL_FLOWER_USER="vigil",
                                         VIGIL_FLOWER_PASSWORD=fpass, **env),
                               logs / "flower.log")
        procs.append(flower)
        # `vigil api`, as the Procfile's web process runs it: OpenAI's online API.
        aport, atoken = free_port(), secrets.token_urlsafe(12)
        procs.append(start_process([sys.executable, "-m", "app.ops.cli", "api", "--port",
                                    str(aport), "--address", "127.0.0.1"],
                                   vigil_env(rds.url, VIGIL_API_TOKEN=atoken, **env),
                                   logs / "api.log"))
        # The fleet's settings (vigil_env: this environment, on the private Redis).
        store = open_store(load_settings(redis_url=rds.url))
        with console.status("starting the worker and loading the engine (about 20-40 s)..."):
            wait_for(lambda: _engine_ready(store, worker), 300, 0.5, "the worker's engine")
        console.print("worker [bold]demo-cpu[/] is up with a warm engine; sending prompts")
        rc = subprocess.call([sys.executable, "-m", "app.local.demo_producer", "--n", str(n),
                              "--max-tokens", str(max_tokens)],
                             env=vigil_env(rds.url, **env), cwd=str(REPO))
        show_streamed_chat(console, aport, atoken, logs)
        lasts = "it keeps running until Ctrl-C" if keep else "it stops with the demo"
        if _flower_ok(fport, ("vigil", fpass)) or _wait_flower(fport, ("vigil", fpass)):
            console.print(f"Flower: http://127.0.0.1:{fport}  (user [bold]vigil[/], password "
                          f"[bold]{fpass}[/]) — {lasts}", soft_wrap=True)
        else:
            console.print(f"[yellow]Flower did not answer; see {logs / 'flower.log'}[/]")
        console.print(f"logs: {logs}")
        if keep:
            console.print(f"the fleet keeps running (Redis {rds.url}; try "
                          f"[bold]VIGIL_REDIS_URL={rds.url} vigil status[/]); "
                          "press Ctrl-C to stop it", soft_wrap=True)
            sys.stdout.flush()
            hold()
        return rc
    finally:
        with console.status("shutting down (worker stops its engine cleanly)..."):
            for p in reversed(procs):
                stop_process(p, timeout=60)
            if rds is not None:
                rds.stop()
        left = [p.pid for p in procs if p.poll() is None]
        console.print("stopped cleanly: no process left" if not left
                      else f"[red]still running: {left}[/]")


CHAT = {"model": TINY_LLAMA, "stream": True, "max_tokens": 48,
        "messages": [{"role": "user", "content": "Tell me about Vigil."}]}


def show_streamed_chat(console: Console, port: int, token: str, logs: Path) -> bool:
    """One streamed chat completion through `vigil api` (the online API), its text printed as
    its events come, and the curl command that asks the same; False when the API did not
    answer (its log says why)."""
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {token}"}
    try:
        wait_for(lambda: _answers(url + "/health", auth), 120, 0.5, "vigil api")
        console.print(f"the online API streams a chat completion ({url}/v1/chat/completions):")
        n = 0
        with requests.post(url + "/v1/chat/completions", json=CHAT, headers=auth, stream=True,
                           timeout=120) as r:
            r.raise_for_status()
            for _, data in parse_sse(r.iter_lines()):
                if data == "[DONE]":
                    break
                for c in json.loads(data).get("choices") or ():
                    text = (c.get("delta") or {}).get("content") or ""
                    n += 1
                    console.print(text, end="", markup=False, highlight=False)
        console.print(f"\n[green]{n} events[/], each with an `id:` a client reconnects with")
        console.print(f"try it: curl -N {url}/v1/chat/completions -H 'Authorization: Bearer "
                      f"{token}' -d '{json.dumps(CHAT)}'", soft_wrap=True, markup=False,
                      highlight=False)
        return True
    except (TimeoutError, requests.RequestException, ValueError) as e:
        console.print(f"[yellow]the online API did not answer ({e}); see {logs / 'api.log'}[/]")
        return False


def _answers(url: str, headers: dict) -> bool:
    try:
        return requests.get(url, headers=headers, timeout=2).status_code == 200
    except requests.RequestException:
        return False


def _wait_flower(port: int, auth: tuple[str, str]) -> bool:
    try:
        wait_for(lambda: _flower_ok(port, auth), 20, 0.5, "Flower")
        return True
    except TimeoutError:
        return False


def _engine_ready(store: RequestStore, worker: subprocess.Popen) -> bool:
    if worker.poll() is not None:
        raise RuntimeError(f"the worker exited with code {worker.returncode}")
    return any(e.engine_loads >= 1 for e in store.workers.entries())
