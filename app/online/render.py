"""vLLM's own request handling for the online API, per model, with no engine: what `vllm launch
render` (vLLM's GPU-less render server) builds, used in-process (docs/api.md, "The online API").

For each registered model, on first use: its vLLM ModelConfig (the model's own config, tokenizer,
generation config and context, as the worker's engine reads them), vLLM's `ServingRender`
(a completions or chat body -> prompt token ids and vLLM's SamplingParams: the chat template
with `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`; prompts as a
string, a list of strings, token ids or lists of them; max_tokens defaulting to the rest of the
context) and `ServingTokenization` (/tokenize, /detokenize, /tokenizer_info). So the prompt the
fleet runs is the token ids `vllm serve` would give its engine for the same body, and the
answers of those three endpoints are vLLM's.

A model's registered LoRA adapters are model ids of their own (as `vllm serve --lora-modules`
lists them): a request naming one is rendered with its base model and runs as a Vigil request
of the base with `lora` set. Needs vLLM (the `cpu` or `gpu` extra); imported on first use.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable

from app.errors import MODEL_NOT_FOUND, RequestError
from app.first_imports import vllm_env_defaults
from app.requests.models import ModelRegistry, ModelSpec

log = logging.getLogger("vigil.online")


@dataclass
class Lane:
    """One model's vLLM render state."""

    spec: ModelSpec
    path: str
    render: Any  # vllm ServingRender
    tokenization: Any  # vllm ServingTokenization
    models: Any  # vllm OpenAIModelRegistry (the served name)
    tokenizer: Any
    max_model_len: int


@dataclass(frozen=True)
class Target:
    """What a body's `model` names: the registered base model, and the adapter when it names
    one (its id is then the adapter's name)."""

    base: str
    adapter: str | None = None

    @property
    def served_as(self) -> str:
        """The model id the response names: what the body named."""
        return self.adapter or self.base


class Renderers:
    """The render lanes of every model of `registry`, built once each, lazily (the first build
    imports vLLM: ~10 s on 2 cores; `warm()` builds them all at start). `ensure_files(spec)`
    returns a model's local directory (building the built-in tiny-llama there first)."""

    def __init__(self, registry: ModelRegistry, ensure_files: Callable[[ModelSpec], str]):
        self.registry = registry
        self._ensure_files = ensure_files
        self._lanes: dict[str, Lane] = {}
        self._broken: dict[str, RequestError] = {}
        self._lock = threading.Lock()
        self._stop_warming = threading.Event()

    def target(self, name: object) -> Target:
        """The base model (and adapter) a body's `model` names; RequestError(model_not_found)
        listing the served ids otherwise."""
        if isinstance(name, str) and name in self.registry:
            return Target(name)
        adapter = self.registry.adapters.get(name) if isinstance(name, str) else None
        if adapter is not None and adapter.base in self.registry:
            return Target(adapter.base, adapter.name)
        raise RequestError.of(MODEL_NOT_FOUND, f"The model `{name}` does not exist. Served: "
                              f"{', '.join(self.served_ids())}.")

    async def default_lane(self) -> Lane:
        """The lane of the first registered model that renders (what /tokenize and
        /tokenizer_info use when no model is named, as a one-model `vllm serve` answers)."""
        last = None
        for name in self.registry.names():
            try:
                return await self.lane(name)
            except RequestError as e:
                last = e
        raise last or RequestError.of(MODEL_NOT_FOUND, "no model is registered")

    def served_ids(self) -> list[str]:
        """Every model id the API serves: the registered models, then their adapters."""
        return self.registry.names() + sorted(
            a.name for a in self.registry.adapters.values() if a.base in self.registry)

    async def lane(self, base: str) -> Lane:
        """`base`'s render lane, built on a thread the first time (the event loop keeps
        serving meanwhile)."""
        lane = self._lanes.get(base)
        if lane is not None:
            return lane
        return await asyncio.to_thread(self.lane_now, base)

    def lane_now(self, base: str) -> Lane:
        """`base`'s render lane, built here if need be (blocking). A model whose files or
        config vLLM cannot read raises RequestError(model_not_found) with vLLM's reason, found
        once."""
        with self._lock:
            if base in self._lanes:
                return self._lanes[base]
            if base in self._broken:
                raise self._broken[base]
            spec = self.registry.get(base)
            try:
                lane = _build(spec, self._ensure_files(spec))
            except RequestError as e:
                self._broken[base] = e
                raise
            except Exception as e:  # vLLM could not read the model: every request says why
                err = RequestError.of(MODEL_NOT_FOUND, f"model {base} cannot be served by the "
                                      f"online API here: {type(e).__name__}: {e}")
                self._broken[base] = err
                raise err from None
            self._lanes[base] = lane
            log.info("online API: %s rendered with vLLM's %s (context %d)", base,
                     type(lane.tokenizer).__name__, lane.max_model_len)
            return lane

    def warm(self) -> bool:
        """Build every model's lane now (at start: the first request then waits for nothing);
        a model that fails is logged and answers its error per request. False when
        `stop_warming` ended it early."""
        for name in self.registry.names():
            if self._stop_warming.is_set():
                return False
            try:
                self.lane_now(name)
            except RequestError as e:
                log.warning("online API: %s", e)
        return True

    def stop_warming(self) -> None:
        """`warm` builds no more lanes (the one under way finishes)."""
        self._stop_warming.set()


def _build(spec: ModelSpec, path: str) -> Lane:
    """vLLM's render state for one model, as vllm/entrypoints/launchers/render builds it."""
    vllm_env_defaults()

    import vllm.envs as envs
    from vllm import AsyncEngineArgs
    from vllm.config import VllmConfig
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIModelRegistry
    from vllm.entrypoints.scale_out.render.serving import ServingRender
    from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
    from vllm.renderers import renderer_from_config
    from vllm.renderers.online_renderer import OnlineRenderer

    keep = ("max_model_len", "tokenizer", "tokenizer_mode", "revision", "tokenizer_revision",
            "trust_remote_code", "dtype", "generation_config", "override_generation_config",
            "hf_overrides", "max_logprobs", "skip_tokenizer_init")
    args = {k: v for k, v in spec.engine_args.items() if k in keep}
    if spec.max_model_len and "max_model_len" not in args:
        args["max_model_len"] = spec.max_model_len
    dtype = spec.dtypes.get("cpu") if spec.dtypes else None
    if dtype and "dtype" not in args:
        args["dtype"] = dtype
    engine_args = AsyncEngineArgs(model=path, served_model_name=[spec.name], **args)
    model_config = engine_args.create_model_config()
    model_config.quantization = None  # no kernels here: vLLM's render server does the same
    envs.VLLM_CPU_KVCACHE_SPACE = 0  # no KV cache either
    config = VllmConfig(model_config=model_config,
                        structured_outputs_config=engine_args.create_structured_outputs_config())
    registry = OpenAIModelRegistry(model_config=model_config,
                                   base_model_paths=[BaseModelPath(name=spec.name,
                                                                   model_path=path)])
    renderer = renderer_from_config(config)
    online = OnlineRenderer(model_config=model_config, renderer=renderer, request_logger=None,
                            chat_template=None, chat_template_content_format="auto")
    online.warmup()
    render = ServingRender(registry, online)
    tokenization = ServingTokenization(registry, online, request_logger=None,
                                       chat_template=None, chat_template_content_format="auto")
    return Lane(spec, path, render, tokenization, registry, renderer.get_tokenizer(),
                model_config.max_model_len)
