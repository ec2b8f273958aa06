"""Worker tier: LoRA adapters on the real vLLM CPU engine (tiny-llama, max_loras 2, rank <= 8),
with adapters built locally by peft. A bad adapter fails only its own requests, without killing
the engine; base requests are computed as if no adapter were in the fleet (vLLM CPU 0.32 gets
them wrong in a mixed batch, so Vigil never mixes them: this test is the guard)."""
from __future__ import annotations

import shutil

import pytest

from app.errors import RequestError
from app.requests.models import get_registry
from app.state.store import RequestStore
from tasks.inference import generate
from tests.conftest import CACHE_DIR

pytestmark = pytest.mark.worker
ROOT = CACHE_DIR / "adapters"
PROMPTS = [f"the story of the {w} begins" for w in ("cat", "dog", "owl", "fox", "bee", "elk")]


@pytest.fixture(scope="module")
def adapters():
    """Adapters under VIGIL_ADAPTER_ROOTS: two good ones, rank 16 (above the engine's 8), and
    one made for a model with another hidden size."""
    from app.local.tiny_adapter import build_tiny_adapter
    from app.requests.model_files import ensure_tiny_llama

    base = ensure_tiny_llama(get_registry().get("tiny-llama").path)
    return {
        "good": build_tiny_adapter(base, ROOT / "good", seed=1),
        "other": build_tiny_adapter(base, ROOT / "other", seed=2),
        "third": build_tiny_adapter(base, ROOT / "third", seed=3),
        "rank16": build_tiny_adapter(base, ROOT / "rank16", rank=16),
        "wide": build_tiny_adapter(base, ROOT / "wide", hidden_size=64),
    }


@pytest.fixture()
def store(redis_server):
    return RequestStore(redis_server.client(), 3600)


def greedy(prompt, lora=None, n=12):
    kw = {"lora": str(lora)} if lora is not None else {}
    return generate.delay(model="tiny-llama", prompt=prompt, max_tokens=n, temperature=0.0,
                          ignore_eos=True, **kw)


def test_adapters_change_outputs_and_base_outputs_do_not_depend_on_the_batch(
        warm_worker, adapters):
    """Given base-only greedy outputs, when the same base prompts run in one burst with requests
    for two adapters, then every base output is identical to its base-only one, each adapter's
    output differs from the base, and results name their adapter."""
    alone = [greedy(p).get(timeout=120)["token_ids"] for p in PROMPTS]
    burst = []
    for p in PROMPTS:
        burst += [greedy(p), greedy(p, adapters["good"]), greedy(p, adapters["other"])]
    outs = [r.get(timeout=300) for r in burst]
    base, good, other = outs[0::3], outs[1::3], outs[2::3]
    assert [o["token_ids"] for o in base] == alone
    assert all(g["token_ids"] != a for g, a in zip(good, alone))
    assert all(o["token_ids"] != g["token_ids"] for o, g in zip(other, good))
    assert all(g["lora"] == str(adapters["good"]) and "lora" not in b for g, b in zip(good, base))


def test_a_bad_adapter_in_a_busy_batch_fails_only_its_requests_and_never_restarts_the_engine(
        warm_worker, adapters, store):
    """Given a busy mix of base and good-adapter requests, when requests name a missing adapter
    directory, an adapter of rank 16 (the engine takes 8) and one made for another base model,
    then exactly those fail, on their first attempt, with lora_adapter_invalid and the cause;
    the rest succeed and the engine was neither restarted nor reloaded."""
    before = warm_worker.entry()
    good = [greedy(p, adapters["good"], 24) for p in PROMPTS] + [greedy(p, n=24) for p in PROMPTS]
    bad = {"missing": greedy("x", ROOT / "no-such-adapter"), "rank16": greedy("x", adapters["rank16"]),
           "wide": greedy("x", adapters["wide"])}
    causes = {"missing": "no adapter directory", "rank16": "rank 16 is above",
              "wide": "an adapter for another base model"}
    for kind, r in bad.items():
        with pytest.raises(RequestError, match="^lora_adapter_invalid: ") as ei:
            r.get(timeout=300)
        assert causes[kind] in str(ei.value)
        assert [h["outcome"] for h in store.history(r.id)] == ["failed"]
    assert all(r.get(timeout=300)["completion_tokens"] == 24 for r in good)
    after = warm_worker.entry()
    assert after["engine_restarts"] == before["engine_restarts"]
    assert after["engine_loads"] == before["engine_loads"]


def test_an_adapter_still_being_written_keeps_its_request_pending_until_it_is_complete(
        warm_worker, adapters, store):
    """Given an adapter directory with no config yet (a writer is still copying it), then its
    request waits, retried without using up attempts, and succeeds once the adapter is complete,
    with the same output as the finished adapter gives."""
    from app.local.embedded import wait_for

    target = ROOT / "late"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    shutil.copy(adapters["good"] / "adapter_model.safetensors", target)
    r = greedy(PROMPTS[0], target)
    wait_for(lambda: sum(h["error"] == "lora_adapter_pending" for h in store.history(r.id)) >= 2,
             120, what="the request to be retried while the adapter is incomplete")
    assert store.get(r.id)["status"] in ("PENDING", "RUNNING")
    shutil.copy(adapters["good"] / "adapter_config.json", target)
    out = r.get(timeout=300)
    assert out["token_ids"] == greedy(PROMPTS[0], adapters["good"]).get(timeout=120)["token_ids"]
    assert out["attempts"] == 1  # the waits did not use up attempts


def test_a_third_adapter_evicts_the_least_recently_used_one_on_the_real_engine(
        warm_worker, adapters):
    """Given the engine's two adapter slots (max_loras 2), when a third adapter is asked for
    after the other two, then the least recently used one is evicted (vigil_lora_evictions),
    the third loads, outputs stay each adapter's own, and the engine is neither restarted nor
    reloaded; the evicted one loads again through the same gate when asked for."""
    prompt = PROMPTS[1]
    firsts = {k: greedy(prompt, adapters[k]).get(timeout=120)["token_ids"]
              for k in ("good", "other")}
    before = warm_worker.entry()
    third = greedy(prompt, adapters["third"]).get(timeout=120)["token_ids"]
    again = greedy(prompt, adapters["good"]).get(timeout=120)["token_ids"]
    from app.local.embedded import wait_for

    after = wait_for(lambda: (lambda e: e if int(e["lora_evictions"]) >= int(
        before["lora_evictions"]) + 2 else None)(warm_worker.entry()), 10,
        what="the heartbeat to report the evictions")
    assert int(after["lora_loads"]) >= int(before["lora_loads"]) + 2
    assert third not in firsts.values() and again == firsts["good"]
    assert after["engine_restarts"] == before["engine_restarts"]
    assert after["engine_loads"] == before["engine_loads"]
