"""A run's prompt rendered for vLLM on the engine's loop (workers/engine/vllm.py).

vLLM 0.32 sends a raw prompt, text or token ids, to its one tokenizer thread and back: two
wake-ups of the loop and a thread hop per request, and under short requests each run held its
batch seat 100-144 ms queued for that thread (docs/performance.md, "Where a short request's time
goes"). A rendered prompt (vLLM's renderer, `render_cmpl`, as its own server renders one:
tokenized and checked against the context) is taken in at once. So a run's prompt is rendered
here, in the run, unless it is a text over RENDER_ON_LOOP_CHARS (it stays raw, for that thread:
the loop never stalls on a long tokenization) or vLLM has no renderer (an older vLLM).

The text is tokenized by the model's fast tokenizer itself (its Rust `encode`, ~33 us for a
short prompt against ~86 us through transformers' call that vLLM makes), and the renderer is
given the token ids with the text: it checks them as it checks its own. That shortcut is taken
only when the renderer's defaults ask for nothing more than the special tokens (no truncation,
no lower-casing) and it gives the renderer's own ids for every probe text at the engine's start;
otherwise the renderer tokenizes.
"""
from __future__ import annotations

import logging
from typing import Callable

from app.requests.schemas import GenerateRequest

log = logging.getLogger("vigil.engine")

RENDER_ON_LOOP_CHARS = 8192
# Texts the shortcut must tokenize as the renderer does (spaces, tabs, new lines, accents, CJK,
# emoji, text that looks like special tokens, a long word).
PROBES = ("Hello, world!", "  two leading spaces,\ttabs\nand lines\n\n", "ünïcödé café naïve",
          "日本語のテキスト ✓ 🙂", "<s>not</s> special <unk> <|endoftext|>", "x" * 300,
          "The capital of France is")


class PromptRenderer:
    """Renders runs' prompts for one vLLM AsyncLLM (module docstring). Call on its loop."""

    def __init__(self, llm):
        renderer = getattr(llm, "renderer", None)
        self._renderer = renderer if hasattr(renderer, "render_cmpl") else None
        self._params = self._renderer.default_cmpl_tok_params if self._renderer else None
        self._encode = self._fast_encoder(llm) if self._renderer else None

    @property
    def shortcut(self) -> bool:
        """True when texts are tokenized by the fast tokenizer itself (module docstring)."""
        return self._encode is not None

    def __call__(self, req: GenerateRequest) -> dict:
        """vLLM's input for a run of `req` from its prompt: rendered, or the raw prompt (a text
        over RENDER_ON_LOOP_CHARS, or no renderer). Raises what vLLM's rendering raises (a
        prompt over the context)."""
        text = req.prompt
        prompt = {"prompt": text} if text is not None else {
            "prompt_token_ids": list(req.prompt_token_ids)}
        if self._renderer is None or (text is not None and len(text) > RENDER_ON_LOOP_CHARS):
            return prompt
        if text is not None and self._encode is not None:
            prompt["prompt_token_ids"] = self._encode(text)
        (rendered,) = self._renderer.render_cmpl([prompt], self._params)
        return rendered

    def _fast_encoder(self, llm) -> Callable[[str], list[int]] | None:
        """The fast tokenizer's own `encode` when it gives the renderer's ids (module
        docstring), else None."""
        params = self._params
        if (getattr(params, "truncate_prompt_tokens", None) is not None
                or getattr(params, "do_lower_case", False)
                or not getattr(params, "add_special_tokens", True)
                or getattr(params, "pad_prompt_tokens", None) is not None):
            return None
        rust = getattr(getattr(llm, "tokenizer", None), "_tokenizer", None)
        if rust is None or not hasattr(rust, "encode"):
            return None

        def encode(text: str) -> list[int]:
            return rust.encode(text, add_special_tokens=True).ids

        try:
            for text in PROBES:
                (theirs,) = self._renderer.render_cmpl([{"prompt": text}], params)
                if encode(text) != list(theirs["prompt_token_ids"]):
                    log.info("prompts are tokenized by vLLM's renderer: the fast tokenizer "
                             "differs from it on %r", text)
                    return None
        except Exception as e:  # the renderer refused a probe: leave it all to the renderer
            log.info("prompts are tokenized by vLLM's renderer (%s: %s)", type(e).__name__, e)
            return None
        return encode
