"""The model registry: name -> where the weights are, engine args, memory needed.

A pool is a registered model; each pool has its own Celery queue (app/state/queues.py). The registry is
`BUILTIN_MODELS` plus the entries of the JSON file named by `VIGIL_MODELS_FILE`:

    {"models": [{"name": "llama-8b", "path": "/models/llama-3-8b", "max_model_len": 8192,
                 "vocab_size": 128256, "memory_gib": 24, "kv_cache_gib": 40,
                 "kv_cache_floor_gib": 8, "engine_args": {"max_num_seqs": 256}}]}

`max_model_len` and `vocab_size`, when known, let the producer refuse an oversized token prompt
or an out-of-vocabulary id before publishing; the engine checks again either way.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from app.errors import MODEL_NOT_FOUND, RequestError
from app.requests.adapters import load_adapters
from app.requests.engine_defaults import FLOAT32, default_dtype
from app.settings import SettingsError, VigilSettings, get_settings
from app.state.queues import pool_queue

TINY_LLAMA = "tiny-llama"
# The built-in model's recipe (app/requests/model_files.py builds it): bump TINY_VERSION when the
# recipe changes, so cached builds are rebuilt.
TINY_VERSION = 1
TINY_VOCAB_SIZE = 2048
TINY_MAX_POSITIONS = 512
_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class ModelSpec(BaseModel):
    """One registry entry. `builder` names a recipe that builds the weights locally."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=_NAME)
    path: str | None = None
    builder: str | None = None
    max_model_len: int | None = Field(None, ge=1)
    vocab_size: int | None = Field(None, ge=1)
    # Memory the engine needs besides its KV cache (weights, activations, its processes).
    memory_gib: float = Field(1.0, gt=0)
    # The KV cache asked for, and the least worth starting with when memory is short
    # (workers/engine/memory.py sizes each engine start between the two).
    kv_cache_gib: float = Field(1.0, gt=0)
    kv_cache_floor_gib: float = Field(0.25, gt=0)
    engine_args: dict[str, Any] = Field(default_factory=dict)
    # LoRA: adapters kept warm in the engine at once (0: this model serves no adapters), the
    # largest rank accepted, and whether the engine computes base requests correctly in a batch
    # with adapter requests (vLLM CPU 0.32 does not: docs/field-notes.md), else they never share one.
    max_loras: int = Field(0, ge=0, le=64)
    max_lora_rank: int = Field(16, ge=1, le=512)
    lora_mixing_safe: bool = False
    # The dtype vLLM gets on each platform. Unset: `engine_args.dtype` if the entry has one (every
    # platform), else bfloat16 on CUDA and vLLM's own choice on the CPU
    # (app/requests/engine_defaults.py).
    dtypes: dict[Literal["cpu", "cuda"], str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_dtype_and_one_that_runs(self) -> "ModelSpec":
        if self.dtypes and "dtype" in self.engine_args:
            raise ValueError(f"model {self.name}: give the dtype in `dtypes` (per platform) or "
                             "in `engine_args.dtype` (every platform), not both")
        if "cuda" in self.dtypes:  # said explicitly: it can never run, wherever it is loaded
            problem = self.platform_problem("cuda")
            if problem:
                raise ValueError(problem)
        tp = self.engine_args.get("tensor_parallel_size")
        if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
            raise ValueError(f"model {self.name}: engine_args.tensor_parallel_size must be a "
                             f"whole number of cards, 1 or more, got {tp!r}")
        return self

    @property
    def queue(self) -> str:
        """The pool's own queue (its default-job requests)."""
        return pool_queue(self.name)

    def dtype_on(self, platform: str) -> str | None:
        """The dtype this model runs with on `platform` ("cuda" or "cpu"); None: vLLM's own."""
        return (self.dtypes.get(platform) or self.engine_args.get("dtype")
                or default_dtype(platform))

    def kv_cache_bytes(self) -> int:
        """The KV cache a start of this model asks for, in bytes: its engine args'
        `kv_cache_memory_bytes`, else `kv_cache_gib` (the one place it is decided; the memory
        plan grants it or less, workers/engine/memory.py)."""
        return int(self.engine_args.get("kv_cache_memory_bytes", self.kv_cache_gib * (1 << 30)))

    def start_floor_bytes(self) -> int:
        """The least memory a start of this model needs, in bytes: its weights and other needs
        (`memory_gib`) plus the smallest KV cache it may run with (`kv_cache_floor_gib`)."""
        return int(self.memory_gib * (1 << 30)) + int(self.kv_cache_floor_gib * (1 << 30))

    def platform_problem(self, platform: str) -> str | None:
        """Why this entry cannot run on `platform` (None when it can): on CUDA, float32 with
        LoRA lanes, which vLLM's CUDA LoRA kernels refuse (lora_shrink asserts float16 or
        bfloat16), killing EngineCore at the first adapter request."""
        if platform == "cuda" and self.max_loras and str(self.dtype_on("cuda")) in FLOAT32:
            return (f"model {self.name}: float32 with LoRA (max_loras {self.max_loras}) cannot "
                    "run on CUDA: vLLM's CUDA LoRA kernels take float16 or bfloat16 only "
                    "(lora_shrink asserts) and the first adapter request would kill EngineCore; "
                    'set "dtypes": {"cuda": "bfloat16"} (or float16), or max_loras 0')
        return None

    def card_problem(self, cards: int) -> str | None:
        """Why this entry cannot run on a GPU worker of `cards` cards (None when it can): its
        engine args ask for a `tensor_parallel_size` other than their number (vLLM runs one rank
        per card of the worker; an entry without one takes the worker's number)."""
        asked = self.engine_args.get("tensor_parallel_size")
        if asked is None or asked == cards:
            return None
        return (f"model {self.name} asks for tensor_parallel_size {asked}, but this worker has "
                f"{cards} card(s): serve it with workers of {asked} cards (--gpu, --pools)")


def _builtins(settings: VigilSettings) -> list[ModelSpec]:
    return [
        ModelSpec(
            name=TINY_LLAMA,
            path=str(settings.cache_dir / "models" / f"tiny-llama-v{TINY_VERSION}"),
            builder="tiny-llama",
            max_model_len=TINY_MAX_POSITIONS,
            vocab_size=TINY_VOCAB_SIZE,
            # measured: ~1.8 GB of RSS in the engine's processes besides a 1 GiB KV cache
            memory_gib=2.0,
            kv_cache_gib=1.0,
            kv_cache_floor_gib=0.25,
            # Eager on the CPU, CUDA graphs on a GPU: the platform's default
            # (app/requests/engine_defaults.py `compile_defaults`).
            engine_args={"max_model_len": TINY_MAX_POSITIONS, "seed": 0,
                         # Its random weights pick the whitespace a JSON grammar allows between
                         # tokens for ever; compact JSON leaves them none (docs/field-notes.md).
                         "structured_outputs_config": {"backend": "xgrammar",
                                                       "disable_any_whitespace": True}},
            # float32 on the CPU: bfloat16 died with SIGILL on these CPUs at batch ~20
            # (docs/operations.md); CUDA gets bfloat16, the only dtypes its LoRA kernels take.
            dtypes={"cpu": "float32"},
            max_loras=2,
            max_lora_rank=8,
        )
    ]


class ModelRegistry:
    """Read-only map of model name -> ModelSpec."""

    def __init__(self, specs: list[ModelSpec], adapters: dict | None = None):
        self._specs = {s.name: s for s in specs}
        self.adapters = adapters or {}

    def names(self) -> list[str]:
        """All registered model names, sorted."""
        return sorted(self._specs)

    def get(self, name: str) -> ModelSpec:
        """The spec for `name`; RequestError(model_not_found) naming the known models otherwise."""
        try:
            return self._specs[name]
        except (KeyError, TypeError):
            known = ", ".join(self.names())
            raise RequestError.of(
                MODEL_NOT_FOUND, f"no model named {name!r} is registered (known: {known})"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def split_by_cards(self, names: list[str], cards: int) -> tuple[list[str], dict[str, str]]:
        """(the pools of `names` a GPU worker of `cards` cards can run, in order; {pool: why not}
        for the others: `ModelSpec.card_problem`). An unknown name raises
        RequestError(model_not_found)."""
        kept, skipped = [], {}
        for name in names:
            problem = self.get(name).card_problem(cards)
            if problem:
                skipped[name] = problem
            else:
                kept.append(name)
        return kept, skipped

    def refuse_unrunnable(self, platform: str, source: str = "the model registry",
                          names: list[str] | None = None) -> None:
        """Raise SettingsError naming every entry of `names` (the pools a worker serves; None:
        every entry) that cannot run on `platform` (a GPU worker calls it at start: an entry
        that would kill its engine must stop it, not a request; one it does not serve is none
        of its business). An unknown name raises RequestError(model_not_found)."""
        chosen = self.names() if names is None else [self.get(n).name for n in names]
        problems = [p for p in (self._specs[n].platform_problem(platform) for n in chosen) if p]
        if problems:
            raise SettingsError(f"invalid settings: {source}: " + "; ".join(problems))


def load_registry(settings: VigilSettings) -> ModelRegistry:
    """Builtins plus `settings.models_file`; a bad file raises SettingsError naming the variable."""
    specs = {s.name: s for s in _builtins(settings)}
    adapters = {}
    if settings.models_file is not None:
        try:
            raw = json.loads(Path(settings.models_file).read_text())
            for entry in raw.get("models", []):
                spec = ModelSpec(**entry)
                specs[spec.name] = spec
            adapters = load_adapters(settings.models_file)
        except (OSError, ValueError, ValidationError, AttributeError, TypeError) as e:
            raise SettingsError(
                f"invalid settings: VIGIL_MODELS_FILE={settings.models_file}: {e}") from None
    return ModelRegistry(list(specs.values()), adapters)


@functools.lru_cache(maxsize=1)
def get_registry() -> ModelRegistry:
    """The process-wide registry built from `get_settings()`."""
    return load_registry(get_settings())


def valid_model_name(name: str) -> bool:
    """True when `name` could be a registry name (used before a lookup to keep errors short)."""
    return isinstance(name, str) and re.match(_NAME, name) is not None
