"""LoRA adapters as first-class requests: which adapters a request may name, and where they are.

`generate.delay(model="tiny-llama", lora="sql-tune", ...)` names an adapter by

- registry name: an `adapters` entry of VIGIL_MODELS_FILE,
  `{"adapters": [{"name": "sql-tune", "path": "/adapters/sql", "base": "tiny-llama"}]}`;
- or path: a directory under one of VIGIL_ADAPTER_ROOTS (comma-separated). The path is resolved
  (symlinks, `..`) before the check, so nothing outside the roots can be named.

Anything else is refused with `invalid_request` at submit time, and again in the worker (which
may have other roots). The request's pool is its base model. Whether the files are there and
fit the engine is checked by the worker's gate before the engine sees the request
(workers/engine/lora_gate.py).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from app.errors import INVALID_REQUEST, RequestError

_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class AdapterSpec(BaseModel):
    """One registered adapter."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=_NAME)
    path: str
    base: str


@dataclass(frozen=True)
class AdapterRef:
    """A resolved adapter: a stable `name` (the registry name, or `path:<hash>` for a path),
    the directory, and the base model it was registered for (None for a path)."""

    name: str
    path: str
    base: str | None

    def lora_int_id(self) -> int:
        """vLLM's integer id for this adapter: stable per name, never 0."""
        return int(hashlib.sha256(self.name.encode()).hexdigest()[:7], 16) + 1


def load_adapters(models_file: Path | None) -> dict[str, AdapterSpec]:
    """The `adapters` entries of the models file (the file itself is validated by
    app/requests/models.py; an invalid entry raises there as a SettingsError)."""
    if models_file is None:
        return {}
    raw = json.loads(Path(models_file).read_text())
    return {a.name: a for a in (AdapterSpec(**e) for e in raw.get("adapters", []))}


def resolve_adapter(lora: str, model: str, adapters: dict[str, AdapterSpec],
                    roots: list[str]) -> AdapterRef:
    """The adapter a request names, or RequestError(invalid_request) saying why not."""
    if lora in adapters:
        a = adapters[lora]
        if a.base != model:
            raise RequestError.of(INVALID_REQUEST, f"adapter {lora!r} is for base model "
                                  f"{a.base!r}, not {model!r}")
        return AdapterRef(a.name, a.path, a.base)
    if "/" not in lora:
        known = ", ".join(sorted(adapters)) or "none"
        raise RequestError.of(INVALID_REQUEST, f"no adapter named {lora!r} is registered "
                              f"(known: {known}); a path must be under VIGIL_ADAPTER_ROOTS")
    real = os.path.realpath(lora)
    for root in roots:
        r = os.path.realpath(root)
        if real != r and os.path.commonpath([real, r]) == r:
            digest = hashlib.sha256(real.encode()).hexdigest()[:16]
            return AdapterRef(f"path:{digest}", real, None)
    raise RequestError.of(INVALID_REQUEST, f"adapter path {lora!r} is not under an adapter root "
                          f"(VIGIL_ADAPTER_ROOTS: {', '.join(roots) or 'none set'})")


def files_fingerprint(path: str) -> str:
    """A fingerprint of an adapter directory's files (name, size, modification time of each):
    it changes when the adapter is rewritten, so tokens made with the old files are never
    continued with the new ones ('' when the directory cannot be read)."""
    try:
        entries = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns)
                         for e in os.scandir(path) if e.is_file())
    except OSError:
        return ""
    return hashlib.sha256(repr(entries).encode()).hexdigest()[:16]
