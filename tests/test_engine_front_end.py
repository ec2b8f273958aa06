"""Unit tier: vLLM's front end made lighter per request (workers/engine/front_end.py). The token
strings are checked against vLLM's own function on the real tiny-llama tokenizer, wrapped in the
pool of copies vLLM's renderer puts it in; a whole run's logprob strings are compared with a bare
AsyncLLM's by tests/test_generation_contract_e2e.py."""
from __future__ import annotations

import importlib
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.requests.model_files import ensure_model_files
from app.requests.models import ModelSpec
from workers.engine import front_end
from workers.engine.front_end import TokenStrings, lighten, release


@pytest.fixture
def logprobs_module(monkeypatch):
    """vLLM's logprobs module, its function put back after the test."""
    module = importlib.import_module(front_end.LOGPROBS_MODULE)
    monkeypatch.setattr(module, front_end.CONVERT, getattr(module, front_end.CONVERT))
    return module


@pytest.fixture
def envs():
    import vllm.envs as envs

    yield envs
    release()


def tiny_tokenizer(tmp_path: Path):
    from vllm.tokenizers import get_tokenizer
    from vllm.tokenizers.hf import maybe_make_thread_pool

    spec = ModelSpec(name="tiny-llama", path=str(tmp_path / "models" / "tiny-llama-v1"),
                     builder="tiny-llama")
    tok = get_tokenizer(ensure_model_files(spec))
    maybe_make_thread_pool(tok, 2)  # as vLLM's renderer does (HfRenderer)
    return tok


class Counted:
    """vLLM's function, counting the ids it is asked for."""

    def __init__(self, convert):
        self.convert, self.asked = convert, []

    def __call__(self, tokenizer, ids):
        self.asked.extend(ids)
        return self.convert(tokenizer, ids)


def test_token_strings_are_vllms_own_and_each_id_is_decoded_once(tmp_path):
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

    tok = tiny_tokenizer(tmp_path)
    ids = list(range(len(tok)))
    rng = random.Random(7)
    counted = Counted(convert_ids_list_to_tokens)
    strings = TokenStrings(counted)
    for _ in range(3):  # steps of 6 ids (a sampled token and its top 5), repeats included
        order = ids + rng.sample(ids, 50)
        rng.shuffle(order)
        for i in range(0, len(order), 6):
            chunk = order[i:i + 6]
            assert strings(tok, chunk) == convert_ids_list_to_tokens(tok, chunk)
    assert sorted(counted.asked) == ids  # every id decoded by vLLM once, none twice
    assert any(s.startswith(" ") for s in strings(tok, ids))  # leading spaces restored too


def test_each_tokenizer_has_strings_of_its_own():
    class Tok:  # a tokenizer whose strings are its name and the id
        def __init__(self, name):
            self.name = name

    strings = TokenStrings(lambda tok, ids: [f"{tok.name}{t}" for t in ids])
    a, b = Tok("a"), Tok("b")
    assert strings(a, [1, 2]) == ["a1", "a2"]
    assert strings(b, [2, 1]) == ["b2", "b1"]
    assert strings(a, [2, 3]) == ["a2", "a3"]


def test_lighten_reads_the_eos_id_once_and_the_renderer_answers_it(logprobs_module, envs):
    reads = []

    class Renderer:
        tokenizer = object()

        def get_eos_token_id(self):
            reads.append(1)
            return 2

    llm = SimpleNamespace(renderer=Renderer())
    assert lighten(llm) == ["token strings", "eos id", "environment"]
    assert [llm.renderer.get_eos_token_id() for _ in range(5)] == [2] * 5
    assert len(reads) == 1
    wrapped = getattr(logprobs_module, front_end.CONVERT)
    assert isinstance(wrapped, TokenStrings)
    lighten(llm)  # a second engine in the process: the function is wrapped once
    assert getattr(logprobs_module, front_end.CONVERT) is wrapped


def test_a_renderer_without_a_tokenizer_keeps_its_own_eos_id(logprobs_module, envs):
    renderer = SimpleNamespace(tokenizer=None, get_eos_token_id=lambda: None)
    assert "eos id" not in lighten(SimpleNamespace(renderer=renderer))


def test_the_environment_is_cached_while_the_engine_is_up_and_read_again_after(
        logprobs_module, envs, monkeypatch):
    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", "7")
    lighten(SimpleNamespace(renderer=None))
    assert envs._is_envs_cache_enabled() and envs.VLLM_MAX_N_SEQUENCES == 7
    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", "9")
    assert envs.VLLM_MAX_N_SEQUENCES == 7  # read once while the engine is up
    release()
    assert not envs._is_envs_cache_enabled() and envs.VLLM_MAX_N_SEQUENCES == 9
