"""Chat messages -> prompt token ids, with each model's own chat template (for `vigil batch`).

The tokenizer is loaded from the model's local path (`ModelSpec.path`; the built-in tiny-llama is
built there first) with transformers' AutoTokenizer, once per model per process. The template is
rendered with `add_generation_prompt=True` and the text tokenized without special tokens, as
vLLM's own chat endpoint does: a template that writes BOS itself would otherwise get a second one.
Sending token ids also lets the producer refuse an over-long conversation before publishing.
Needs transformers (the `cpu` or `gpu` extra).
"""
from __future__ import annotations

from typing import Callable

from app.errors import INVALID_REQUEST, RequestError
from app.requests.models import ModelRegistry, ModelSpec, get_registry
from app.settings import get_settings


class ChatTemplates:
    """Renders chat messages for the models of `registry`; callable as `render_chat` in
    app/requests/batch_file.py. A model whose tokenizer cannot be loaded, or that has no chat template,
    fails every chat line for it with the same RequestError(invalid_request), found once.
    `build_local(spec)` builds a locally built model's files first (app/requests/model_files.py)."""

    def __init__(self, registry: ModelRegistry,
                 build_local: Callable[[ModelSpec], object] = lambda spec: None):
        self._registry = registry
        self._build_local = build_local
        self._tokenizers: dict[str, object] = {}
        self._broken: dict[str, RequestError] = {}

    def __call__(self, model: str, messages: list[dict]) -> list[int]:
        """Prompt token ids for `messages` (a list of {"role", "content"}) on `model`. Raises
        RequestError: model_not_found for an unregistered model, invalid_request when the model
        has no usable chat template or the template refuses the conversation."""
        tok = self._tokenizer(self._registry.get(model))
        from jinja2 import TemplateError

        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except TemplateError as e:  # e.g. "roles must alternate user/assistant"
            raise RequestError.of(INVALID_REQUEST,
                                  f"the chat template of {model} refused the messages: {e}"
                                  ) from None
        ids = tok.encode(text, add_special_tokens=False)
        if not ids:
            raise RequestError.of(INVALID_REQUEST, f"the chat template of {model} rendered nothing")
        return ids

    def _tokenizer(self, spec: ModelSpec):
        if spec.name in self._broken:
            raise self._broken[spec.name]
        if spec.name not in self._tokenizers:
            try:
                self._tokenizers[spec.name] = _load(spec, self._build_local)
            except RequestError as e:
                self._broken[spec.name] = e
                raise
        return self._tokenizers[spec.name]


def _load(spec: ModelSpec, build_local: Callable[[ModelSpec], object]):
    def refuse(why: str) -> RequestError:
        return RequestError.of(INVALID_REQUEST, f"model {spec.name} cannot render chat messages: "
                               f"{why}; send a rendered prompt to /v1/completions instead")

    if not spec.path:
        raise refuse("its registry entry has no local path to load a tokenizer from")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise refuse("transformers is not installed (install the cpu or gpu extra)") from None
    build_local(spec)
    try:
        tok = AutoTokenizer.from_pretrained(spec.path, local_files_only=True)
    except (OSError, ValueError) as e:  # missing files, or a config transformers cannot read
        raise refuse(f"no tokenizer could be loaded from {spec.path} ({e})") from None
    if not getattr(tok, "chat_template", None):
        raise refuse("its tokenizer has no chat template")
    return tok


def rest_of_context(model: str, prompt_tokens: int) -> int | None:
    """The max_tokens of a chat line that names none: what is left of the model's context
    (`max_model_len`) after its prompt, at most VIGIL_MAX_TOKENS_CAP and at least 1 (a prompt
    that fills the context then ends prompt_too_long); None when the registry does not give
    the model's context."""
    spec = get_registry().get(model)
    if not spec.max_model_len:
        return None
    return max(1, min(get_settings().max_tokens_cap, spec.max_model_len - prompt_tokens))
