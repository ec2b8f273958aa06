"""A real `vigil api` process for the online API's tests (its own port, the suite's Redis), and
an SSE reader of its streams."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import requests

from app.local.embedded import free_port, start_process, stop_process, vigil_env, wait_for
from app.online.sse import parse_sse

TOKEN = "online-test-token"


class Gateway:
    """`vigil api --port P` on `redis_url` with VIGIL_API_TOKEN = TOKEN."""

    def __init__(self, redis_url: str, tmp: Path, name: str = "api", workers: int = 1, **env):
        self.port = free_port()
        self.log = tmp / f"{name}.log"
        self.proc = start_process(
            [sys.executable, "-m", "app.ops.cli", "api", "--port", str(self.port),
             "--address", "127.0.0.1", "--workers", str(workers)],
            vigil_env(redis_url, VIGIL_API_TOKEN=TOKEN, **env), self.log)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 180) -> "Gateway":
        """Until it answers /health and has rendered tiny-llama once (/tokenize)."""

        def ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"vigil api exited; log:\n{self.log.read_text()[-4000:]}")
            try:
                r = requests.post(self.url + "/tokenize", headers=self.headers(),
                                  json={"model": "tiny-llama", "prompt": "x"}, timeout=60)
                return r.status_code == 200
            except requests.RequestException:
                return False

        wait_for(ready, timeout, 0.5, "vigil api to serve")
        return self

    def headers(self, token: str = TOKEN, **extra) -> dict:
        return {"Authorization": f"Bearer {token}", **extra}

    def stop(self) -> None:
        stop_process(self.proc, timeout=30)


def stream_events(url: str, body: dict, headers: dict, on_event=None, timeout: float = 300):
    """POST a streamed call and read its events: [(id, parsed data or "[DONE]")]. `on_event(i,
    id, data)` sees each as it comes; returning False stops reading (the connection closes)."""
    out = []
    with requests.post(url, json=body, headers=headers, stream=True, timeout=timeout) as r:
        if r.status_code >= 400:
            raise AssertionError(f"{r.status_code}: {r.text}")
        for i, (eid, data) in enumerate(parse_sse(r.iter_lines(decode_unicode=False))):
            parsed = data if data == "[DONE]" else json.loads(data)
            out.append((eid, parsed))
            if on_event is not None and on_event(i, eid, parsed) is False:
                break
    return out


def assembled(events, index: int = 0) -> str:
    """The text a client assembles for choice `index` (completions' `text`, chat's content)."""
    text = []
    for _, data in events:
        if not isinstance(data, dict):
            continue
        for c in data.get("choices") or ():
            if c["index"] != index:
                continue
            if "delta" in c:
                text.append(c["delta"].get("content") or "")
            else:
                text.append(c.get("text") or "")
    return "".join(text)


def serving_gateway(redis_url: str, tmp: Path):
    """A started gateway for a test module's fixture (yield it; stopped after)."""
    g = Gateway(redis_url, tmp).wait_ready()
    try:
        yield g
    finally:
        g.stop()
