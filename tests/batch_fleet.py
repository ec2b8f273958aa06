"""Shared by the batch object tests (tests/test_batch_objects.py, tests/test_batch_ticks.py): a
fleet played on a real Redis with an injected clock (`Fleet`), and the lines of a batch file."""
from __future__ import annotations

import json

import openai.types
import redis

from app.errors import TerminalError
from app.fleet import batches
from app.fleet.batch_tick import BatchDriver
from app.fleet.jobs import end_job
from app.fleet.outcomes import end_request, end_requests_failed
from app.requests.models import get_registry
from app.requests.submit import submit_many, submit_request
from app.settings import load_settings
from app.state.batches import BatchStore
from app.state.store import RequestStore
from tests.conftest import CACHE_DIR
from tests.unit_helpers import RecordingPorts

T0 = 1_800_000_000.0


def line(cid: str, prompt="hello", url="/v1/completions", **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url,
            "body": {"model": "tiny-llama", "prompt": prompt, "max_tokens": 4, **body}}


CHAT_LINE = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}}


def jsonl(*lines) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


class Fleet:
    """A batch store, a request store and a driver on one Redis; `sent` holds every request
    id published, in order."""

    def __init__(self, client: redis.Redis, **overrides):
        self.client = client
        self.settings = load_settings(redis_url="redis://unused:1/0", cache_dir=CACHE_DIR,
                                      **overrides)
        self.store = RequestStore(client, 3600)
        self.bs = BatchStore(client)
        self.sent: list[str] = []
        self.messages: list[list[str]] = []  # the request ids of each message published
        self.many_calls = 0
        self.publish_fails_after: int | None = None  # messages, then OSError on every publish
        self.now = T0
        self.driver = BatchDriver(self.bs, self.store, self.settings, submit=self.submit,
                                  end_requests=self.end_requests, end_job=self.end_job,
                                  render_chat=lambda m, msgs: [5, 6, 7],
                                  chat_budget=lambda m, n: None, submit_many=self.submit_many)

    def submit(self, rid: str, kwargs: dict) -> None:
        submit_request(kwargs, rid, settings=self.settings, registry=get_registry(),
                       store=self.store, ports=RecordingPorts(),
                       send=lambda *a, **kw: self.sent.append(rid))
        self.messages.append([rid])

    def submit_many(self, lines: list[tuple[str, dict]]) -> None:
        fleet = self
        self.many_calls += 1

        class Ports(RecordingPorts):
            def send_many(self, kwargs, task_id, **options):
                if fleet.publish_fails_after is not None \
                        and len(fleet.messages) >= fleet.publish_fails_after:
                    raise OSError("connection reset by peer")
                ids = [x["id"] for x in kwargs["requests"]]
                fleet.sent.extend(ids)
                fleet.messages.append(ids)

        submit_many([kw for _, kw in lines], [rid for rid, _ in lines], settings=self.settings,
                    registry=get_registry(), store=self.store, ports=Ports())

    def end_requests(self, ids: list[str], code: str, reason: str) -> int:
        return end_requests_failed(self.store, ids, TerminalError.of(code, reason), now=self.now)

    def end_job(self, name: str, reason: str, code: str) -> int:
        return end_job(self.store, name, self.now, reason, None, lambda q, n: None,
                       get_registry().names(), 3600, code=code)

    def create(self, data: bytes, window: str = "24h", endpoint="/v1/completions",
               metadata=None) -> str:
        f = batches.upload_file(self.bs, data, "in.jsonl", "batch", self.now, self.settings)
        return batches.create_batch(self.bs, f["id"], endpoint, window, metadata, self.now,
                                    self.settings)["id"]

    def tick(self, dt: float = 1.0) -> dict:
        self.now += dt
        return self.driver.advance_all(self.now)

    def obj(self, bid: str) -> dict:
        """The batch's object, validated with the official client's own type (so every status
        the tests reach is checked against it)."""
        b = batches.get_batch(self.bs, bid)
        openai.types.Batch.model_validate(b)
        return b

    def until_ended(self, bid: str, work: bool = False, ticks: int = 20) -> str:
        """Tick (finishing every open request first, with `work`) until the batch ends; its
        final status. Fails after `ticks` ticks instead of hanging."""
        for _ in range(ticks):
            if work:
                for rid in self.open_ids():
                    self.finish(rid)
            status = self.tick().get(bid)
            if status in batches.ENDED:
                return status
        raise AssertionError(f"batch {bid} still {status} after {ticks} ticks")

    def open_ids(self) -> list[str]:
        return [rid for rid in dict.fromkeys(self.sent)
                if (self.store.get(rid) or {}).get("status") in ("PENDING", "RUNNING")]

    def finish(self, rid: str, text: str = "out") -> None:
        """What a worker does with a finished generation."""
        rec = self.store.get(rid)
        end_request(self.store, rid, now=self.now, result={
            "model": rec["model"], "text": text, "finish_reason": "length",
            "prompt_tokens": 1, "completion_tokens": 4, "token_ids": [1, 2, 3, 4]})

    def fail(self, rid: str, err) -> None:
        end_request(self.store, rid, error=err, now=self.now)

    def content(self, file_id: str | None) -> list[dict]:
        if file_id is None:
            return []
        meta = self.bs.file(file_id)
        openai.types.FileObject.model_validate(batches.file_object(meta))
        data = b"".join(batches.file_content(self.bs, file_id))
        assert len(data) == int(meta["bytes"])
        return [json.loads(x) for x in data.splitlines()]
