"""Unit tier: a run's prompt rendered for vLLM on the engine's loop (workers/engine/render.py),
over a stand-in for vLLM's renderer and the model's fast tokenizer. The real pair is witnessed
by the contract e2e tests: prompt logprobs and echo compared with vLLM's own for the same
request (tests/test_generation_contract_e2e.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from app.requests.schemas import GenerateRequest
from workers.engine.render import RENDER_ON_LOOP_CHARS, PromptRenderer


def words(text: str) -> list[int]:
    """The renderer's tokenization here: one id per character, BOS (1) first."""
    return [1] + [ord(c) for c in text]


class Renderer:
    def __init__(self, **params):
        self.default_cmpl_tok_params = SimpleNamespace(**{"add_special_tokens": True, **params})
        self.calls: list[dict] = []

    def render_cmpl(self, prompts, params):
        (p,) = prompts
        self.calls.append(dict(p))
        if len(p.get("prompt_token_ids") or words(p.get("prompt", ""))) > 2000:
            raise ValueError("This model's maximum context length is 2000 tokens")
        ids = p["prompt_token_ids"] if "prompt_token_ids" in p else words(p["prompt"])
        return [{"type": "token", "prompt_token_ids": list(ids), "prompt": p.get("prompt")}]


class Rust:
    def __init__(self, differs_on: str | None = None):
        self.differs_on = differs_on
        self.encoded = 0

    def encode(self, text, add_special_tokens=True):
        self.encoded += 1
        ids = words(text) if text != self.differs_on else words(text)[1:]
        return SimpleNamespace(ids=ids)


def llm(renderer=None, rust=None):
    return SimpleNamespace(renderer=renderer, tokenizer=SimpleNamespace(_tokenizer=rust))


def req(**kw):
    return GenerateRequest(model="tiny-llama", max_tokens=1, **kw)


def test_a_short_text_is_tokenized_by_the_fast_tokenizer_and_checked_by_the_renderer():
    r, rust = Renderer(), Rust()
    render = PromptRenderer(llm(r, rust))
    assert render.shortcut
    r.calls.clear()
    out = render(req(prompt="hello"))
    assert out["type"] == "token" and out["prompt_token_ids"] == words("hello")
    assert r.calls == [{"prompt_token_ids": words("hello"), "prompt": "hello"}]
    with pytest.raises(ValueError, match="maximum context length"):  # the renderer's check
        render(req(prompt="y" * 2500))


def test_the_shortcut_is_refused_when_the_fast_tokenizer_differs_from_the_renderer():
    from workers.engine.render import PROBES

    r = Renderer()
    render = PromptRenderer(llm(r, Rust(differs_on=PROBES[-1])))
    assert not render.shortcut
    r.calls.clear()
    assert render(req(prompt="hello"))["prompt_token_ids"] == words("hello")
    assert r.calls == [{"prompt": "hello"}]  # the renderer tokenized it itself


@pytest.mark.parametrize("params", [{"truncate_prompt_tokens": 10}, {"do_lower_case": True},
                                    {"add_special_tokens": False}])
def test_the_shortcut_is_refused_when_the_renderer_asks_for_more_than_special_tokens(params):
    assert not PromptRenderer(llm(Renderer(**params), Rust())).shortcut


def test_token_prompts_are_rendered_long_texts_and_renderless_vllms_stay_raw():
    r, rust = Renderer(), Rust()
    render = PromptRenderer(llm(r, rust))
    assert render(req(prompt_token_ids=[5, 6]))["prompt_token_ids"] == [5, 6]
    long = "z" * (RENDER_ON_LOOP_CHARS + 1)
    before = rust.encoded
    assert render(req(prompt=long)) == {"prompt": long} and rust.encoded == before
    bare = PromptRenderer(llm(None, rust))
    assert bare(req(prompt="hi")) == {"prompt": "hi"}
    assert bare(req(prompt_token_ids=[7])) == {"prompt_token_ids": [7]}
