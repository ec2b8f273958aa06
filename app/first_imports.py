"""The heavy modules a process imports once, on one thread, before its own threads start.

vLLM and transformers import much of themselves lazily, and transformers 5 resolves its public
names through a lazy module (`transformers.AutoTokenizer` imports its submodule on first use).
Two threads that import those modules for the first time at once can leave one of them with a
partly built module: `ImportError: cannot import name 'PreTrainedConfig' from 'transformers'`
(a fresh clone's soak: the restarted victim's preload thread built its engine while its task
threads built SamplingParams; every request the worker then took ended `invalid_model_config`).
Four threads importing what a worker's threads import hit it in 8 runs of 8 on this machine;
vLLM's own modules race the same way ("cannot import name 'init_logger' from partially
initialized module 'vllm.logger'").

So a worker (workers/runtime.py) and the online API's gateway (app/ops/gateway.py) import here,
on the thread that starts them and before any thread of theirs runs, every heavy module their
threads import inside functions. tests/test_first_imports.py reads the code and fails when one
is missing from these lists. After this, what a thread imports first is the model's own code,
in the one thread that starts an engine or builds a render lane.

Before those imports, `vllm_env_defaults` sets what vLLM and the hub read as they are
imported (the worker's engine adds its own: workers/engine/vllm_args.py).

An entry "module:name" imports the module and resolves `name` in it (a lazily resolved name of
vllm's or transformers' top level).
"""
from __future__ import annotations

import importlib
import logging
import os
import time

log = logging.getLogger("vigil.imports")


def vllm_env_defaults() -> None:
    """The environment vLLM and the Hugging Face libraries read when they are imported, in every
    Vigil process that imports them (a worker: workers/engine/vllm_args.py adds its engine's
    own; the online API's gateway): the hub offline (models are local files), no usage stats,
    no tracking. Only defaults: an operator's setting wins. Must run before vLLM is imported."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")


# What a worker's task threads, engine loop and preload import (workers/, app/requests/).
WORKER_MODULES = (
    "torch", "safetensors.torch", "tokenizers.decoders", "jinja2", "jsonschema",
    "outlines_core", "xgrammar",
    "transformers:AutoTokenizer",
    "vllm:SamplingParams", "vllm.sampling_params", "vllm.config", "vllm.platforms",
    "vllm.engine.arg_utils", "vllm.v1.engine.async_llm", "vllm.v1.executor.uniproc_executor",
    "vllm.v1.engine.logprobs", "vllm.tokenizers.detokenizer_utils", "vllm.lora.request",
    "vllm.envs",
)

# What the gateway's event loop and lane threads import (app/online/, app/ops/, app/requests/).
GATEWAY_MODULES = (
    "jinja2", "jsonschema", "outlines_core", "xgrammar",
    "transformers:AutoTokenizer",
    "vllm.envs", "vllm:AsyncEngineArgs", "vllm.config", "vllm.logprobs", "vllm.renderers",
    "vllm.renderers.online_renderer",
    "vllm.entrypoints.openai.models.protocol", "vllm.entrypoints.openai.models.serving",
    "vllm.entrypoints.openai.chat_completion.protocol",
    "vllm.entrypoints.openai.completion.protocol",
    "vllm.entrypoints.scale_out.render.serving", "vllm.entrypoints.serve.engine.protocol",
    "vllm.entrypoints.serve.tokenize.protocol", "vllm.entrypoints.serve.tokenize.serving",
)


def import_first(entries: tuple[str, ...]) -> float:
    """Import every entry (and resolve a "module:name" entry's name) on the calling thread;
    returns the seconds it took. Call it before the threads that import them start. An entry
    that cannot be imported is logged and skipped: the engine start or the render lane that
    needs it then fails with its own typed error, as it would have without this."""
    started = time.monotonic()
    for entry in entries:
        module, _, name = entry.partition(":")
        try:
            loaded = importlib.import_module(module)
            if name:
                getattr(loaded, name)
        except Exception as e:  # reported again where the module is needed
            log.warning("could not import %s ahead of the threads: %s: %s", entry,
                        type(e).__name__, e)
    return time.monotonic() - started
