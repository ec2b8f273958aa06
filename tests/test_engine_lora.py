"""Unit tier: LoRA in the engine host with fake engines: the gate (a refused adapter fails only
its requests), warm adapters (LRU within max_loras), lanes (base and adapter requests never share
a batch unless the model says mixing is safe; requests naming logprob_token_ids share one only
with requests naming as many), and admission of adapter names and paths."""
from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from app.errors import RequestError, TransientError
from app.requests.adapters import AdapterRef, AdapterSpec, resolve_adapter
from app.requests.models import ModelSpec
from app.requests.schemas import GenerateRequest
from tests.unit_helpers import outcomes
from workers.engine.output import EngineOutput

SPEC = ModelSpec(name="model-a", max_loras=2, max_lora_rank=8)


def make_adapter(root, name, rank=8, config=True, weights=True):
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    if config:
        (d / "adapter_config.json").write_text(json.dumps({"r": rank, "target_modules": ["q_proj"]}))
    if weights:
        (d / "adapter_model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    return AdapterRef(name, str(d), "model-a")


class Engine:
    """Records what shares the engine; add_adapter refuses names starting with 'bad'."""

    def __init__(self, world):
        self.world = world
        self.dead = False
        self.loaded: list[str] = []

    async def add_adapter(self, a):
        await asyncio.sleep(0.01)
        if a.name.startswith("bad"):
            raise Exception("Call to add_lora method failed: Worker failed with error 'LoRA rank "
                            "16 is greater than max_lora_rank 8.', please check the stack trace")
        self.loaded.append(a.name)
        self.world.adds.append(a.name)

    async def remove_adapter(self, a):
        self.loaded.remove(a.name)
        self.world.removes.append(a.name)

    async def run(self, r, rid, adapter=None):
        w = self.world
        kind = adapter.name if adapter is not None else "base"
        if r.logprob_token_ids:
            kind += f"+named:{len(r.logprob_token_ids)}"
        elif r.logprobs is not None:
            kind += "+top"
        if r.prompt_logprobs is not None:
            kind += "+prompt"
        w.running.append(kind)
        w.mixes.append(frozenset(w.running))
        w.together.append(tuple(sorted(w.running)))
        try:
            while not w.gate.is_set():
                await asyncio.sleep(0.002)
            await asyncio.sleep(0.005)
            return EngineOutput(kind, [1], "length", 1)
        finally:
            w.running.remove(kind)

    def child_pids(self):
        return []

    def shutdown(self, timeout):
        self.dead = True


class World:
    def __init__(self):
        self.gate = threading.Event()
        self.running: list[str] = []
        self.mixes: list[frozenset] = []
        self.together: list[tuple] = []  # what ran at once, each request counted
        self.adds: list[str] = []
        self.removes: list[str] = []
        self.engines: list[Engine] = []

    def __call__(self, spec, plan=None):
        e = Engine(self)
        self.engines.append(e)
        return e


def req():
    return GenerateRequest(model="model-a", prompt="hi", max_tokens=4)


def submit_all(h, jobs, spec=SPEC, timeout=20):
    with ThreadPoolExecutor(len(jobs)) as pool:
        futs = [pool.submit(h.generate, req(), spec, f"r{i}", timeout, a)
                for i, a in enumerate(jobs)]
        return outcomes(futs)


def test_a_refused_adapter_fails_only_its_requests_and_the_engine_lives_on(make_host, tmp_path):
    """Given base requests, good-adapter requests and requests naming an adapter the engine
    refuses, in one burst, then only the last fail, with lora_adapter_invalid and the engine's
    cause; the engine is never restarted."""
    w = World()
    w.gate.set()
    h = make_host(w)
    good = make_adapter(tmp_path, "good")
    bad = make_adapter(tmp_path, "bad")
    outs = submit_all(h, [None] * 6 + [good] * 6 + [bad] * 3)
    assert [o.text for o in outs[:12]] == ["base"] * 6 + ["good"] * 6
    for e in outs[12:]:
        assert isinstance(e, RequestError) and e.code == "lora_adapter_invalid"
        assert "LoRA rank 16 is greater than max_lora_rank 8" in str(e)
    assert h.stats.restarts == 0 and len(w.engines) == 1 and h.snapshot()["lora_refused"] >= 1
    assert w.adds.count("good") == 1  # one checked load, shared by its six requests


def test_base_and_adapter_requests_never_share_the_engine_unless_mixing_is_safe(make_host, tmp_path):
    a = make_adapter(tmp_path, "a")
    w = World()
    h = make_host(w)
    threading.Timer(0.2, w.gate.set).start()
    outs = submit_all(h, [None, a] * 8)
    assert all(not isinstance(o, Exception) for o in outs)
    assert all(not ("base" in m and "a" in m) for m in w.mixes)  # never together
    assert any(len(m) == 1 and "base" in m for m in w.mixes)

    w2 = World()
    safe = SPEC.model_copy(update={"lora_mixing_safe": True})
    h2 = make_host(w2)
    threading.Timer(0.2, w2.gate.set).start()
    submit_all(h2, [None, a] * 8, spec=safe)
    assert any("base" in m and "a" in m for m in w2.mixes)  # batched together when safe


def test_requests_naming_logprob_token_ids_share_the_engine_only_with_as_many_named(make_host):
    """vLLM 0.32's sampler gives every request of a batch the named ids' logprobs once one of
    them names ids (a logprobs=5 request beside one came back with its chosen token only, on
    the real engine: tests/test_generation_contract_e2e.py). Given plain requests, logprobs=5
    requests and requests naming 2 and 3 ids, in one burst, then a request naming ids never
    shares the engine with one that does not name as many, those naming 2 share it with each
    other, and every request is served."""
    w = World()
    h = make_host(w)
    base = GenerateRequest(model="model-a", prompt="hi", max_tokens=4)
    kinds = [base, base.model_copy(update={"logprobs": 5}),
             base.model_copy(update={"logprob_token_ids": [1, 2]}),
             base.model_copy(update={"logprob_token_ids": [3, 4]}),
             base.model_copy(update={"logprob_token_ids": [1, 2, 3]})] * 4
    threading.Timer(0.2, w.gate.set).start()
    with ThreadPoolExecutor(len(kinds)) as pool:
        futs = [pool.submit(h.generate, r, SPEC, f"n{i}", 20) for i, r in enumerate(kinds)]
        outs = [f.result() for f in futs]
    assert len(outs) == 20
    for m in w.mixes:
        named = {k for k in m if "named" in k}
        assert not named or m == named and len(named) == 1, m  # never beside another kind
    assert any(t.count("base+named:2") >= 2 for t in w.together)
    assert any("base" in m and "base+top" in m for m in w.mixes)  # the rest batch as before


def test_a_prompt_logprobs_request_runs_alone_in_an_engine_with_lora(make_host):
    """On an engine with LoRA enabled, vLLM 0.32 computes a prompt's logprobs with one adapter
    index per request of the batch, and a prefill beside another request killed EngineCore
    (tests/test_generation_contract_e2e.py sends two at once). Given plain, logprobs and
    prompt_logprobs requests in one burst, then each prompt_logprobs request runs alone in the
    engine and every request is served; on an engine without LoRA they batch as any."""
    base = GenerateRequest(model="model-a", prompt="hi", max_tokens=4)
    kinds = [base, base.model_copy(update={"prompt_logprobs": 1}),
             base.model_copy(update={"logprobs": 2, "prompt_logprobs": 0}),
             base.model_copy(update={"logprobs": 2})] * 3
    for spec, alone in ((SPEC, True), (SPEC.model_copy(update={"max_loras": 0}), False)):
        w = World()
        h = make_host(w)
        threading.Timer(0.2, w.gate.set).start()
        with ThreadPoolExecutor(len(kinds)) as pool:
            futs = [pool.submit(h.generate, r, spec, f"p{i}", 20) for i, r in enumerate(kinds)]
            assert len([f.result() for f in futs]) == 12
        with_prompt = [t for t in w.together if any("+prompt" in k for k in t)]
        assert with_prompt and all(len(t) == 1 for t in with_prompt) == alone, with_prompt


def test_warm_adapters_stay_within_max_loras_and_evict_the_least_recently_used(make_host, tmp_path):
    w = World()
    w.gate.set()
    h = make_host(w)
    a, b, c = (make_adapter(tmp_path, n) for n in "abc")
    for adapter in (a, b, a, c, b):
        assert h.generate(req(), SPEC, "r", 10, adapter).text == adapter.name
    # a, b loaded; a reused; c evicts b (least recently used); b comes back, evicting a
    assert w.adds == ["a", "b", "c", "b"] and w.removes == ["b", "a"]
    assert (h.snapshot()["lora_loads"], h.snapshot()["lora_evictions"]) == (4, 2)
    assert sorted(w.engines[0].loaded) == ["b", "c"]


def test_adapter_files_are_checked_before_the_engine_is_asked(make_host, tmp_path):
    """A missing directory and a rank above the model's max fail at once
    (lora_adapter_invalid); a directory still being written (no config yet) is
    lora_adapter_pending, retried; none of them reaches the engine."""
    w = World()
    w.gate.set()
    h = make_host(w)
    missing = AdapterRef("gone", str(tmp_path / "gone"), None)
    big = make_adapter(tmp_path, "big", rank=16)
    writing = make_adapter(tmp_path, "writing", config=False)
    with pytest.raises(RequestError, match="^lora_adapter_invalid: .*no adapter directory"):
        h.generate(req(), SPEC, "r1", 10, missing)
    with pytest.raises(RequestError, match="rank 16 is above model-a's max_lora_rank 8"):
        h.generate(req(), SPEC, "r2", 10, big)
    with pytest.raises(TransientError, match="^lora_adapter_pending: "):
        h.generate(req(), SPEC, "r3", 10, writing)
    assert w.adds == [] and h.snapshot()["in_flight"] == 0
    make_adapter(tmp_path, "writing")  # the writer finished
    assert h.generate(req(), SPEC, "r4", 10, writing).text == "writing"


def test_adapter_names_and_paths_are_resolved_or_refused(tmp_path):
    root = tmp_path / "adapters"
    (root / "x").mkdir(parents=True)
    registered = {"sql": AdapterSpec(name="sql", path="/a/sql", base="model-a")}
    assert resolve_adapter("sql", "model-a", registered, []).path == "/a/sql"
    with pytest.raises(RequestError, match="is for base model 'model-a', not 'model-b'"):
        resolve_adapter("sql", "model-b", registered, [])
    with pytest.raises(RequestError, match="no adapter named 'nope'"):
        resolve_adapter("nope", "model-a", registered, [str(root)])
    ref = resolve_adapter(str(root / "x"), "model-a", {}, [str(root)])
    assert ref.path == str((root / "x").resolve()) and ref.name.startswith("path:")
    for sneaky in (str(root / ".." / "elsewhere"), "/etc/passwd", str(root)):
        with pytest.raises(RequestError, match="^invalid_request: adapter path"):
            resolve_adapter(sneaky, "model-a", {}, [str(root)])


def test_a_model_without_adapters_refuses_lora_requests_at_submit():
    from app.requests.models import ModelRegistry
    from app.requests.admit import admit
    from app.settings import load_settings

    reg = ModelRegistry([ModelSpec(name="plain")])
    with pytest.raises(RequestError, match="model plain serves no LoRA adapters"):
        admit({"model": "plain", "prompt": "x", "lora": "sql"}, load_settings(), reg)


def test_a_config_hidden_by_a_network_filesystems_cache_is_found_after_one_listing(
        tmp_path, monkeypatch):
    """Given an adapter whose adapter_config.json a network filesystem's attribute cache still
    hides (the file appears only once its directory is listed: no real part does that on demand
    here, so the listing is the fake), then the gate lists the directory once and finds it; and
    an adapter still really being written is pending after exactly one listing."""
    from workers.engine import lora_gate

    hidden = make_adapter(tmp_path, "hidden", config=False)
    writing = make_adapter(tmp_path, "still-writing", config=False)
    listings: list[str] = []
    real_listdir = lora_gate.os.listdir

    def nfs_listdir(path):
        listings.append(str(path))
        if str(path) == hidden.path:  # the listing refreshes the cache: the file shows up
            make_adapter(tmp_path, "hidden")
        return real_listdir(path)

    monkeypatch.setattr(lora_gate.os, "listdir", nfs_listdir)
    assert lora_gate.check_adapter_files(hidden, SPEC)["r"] == 8
    assert listings == [hidden.path]
    with pytest.raises(TransientError, match="^lora_adapter_pending: "):
        lora_gate.check_adapter_files(writing, SPEC)
    assert listings == [hidden.path, writing.path]
