"""The gate a LoRA adapter passes before any request using it reaches the engine.

vLLM CPU 0.32 lets a bad adapter given to `generate` kill EngineCore and every request in flight
(docs/field-notes.md), while `add_lora` on a live engine fails the same adapter cleanly. So a request
with an adapter waits until the adapter is loaded into the live engine by a checked call, and a
bad adapter fails only its own requests (`lora_adapter_invalid: <cause>`), the engine untouched.

`check_adapter_files` runs first, off the event loop (it touches the filesystem):
- no directory: list the parent once and look again (network filesystems cache a failed lookup
  until the directory is listed), then `lora_adapter_invalid`;
- no `adapter_config.json` in the directory: list the directory once and look again (the same
  cache, one level down);
- a directory still without `adapter_config.json` or weights, or a config that does not parse
  yet: the adapter is still being written: `lora_adapter_pending` (retried without using up an attempt,
  bounded by the request's deadline);
- a rank above the model's `max_lora_rank`, tensors whose shapes do not fit the model (an adapter
  made for another base model: vLLM 0.32's `add_lora` accepts it and the first request using it
  kills EngineCore), or a declared base that is plainly another model: `lora_adapter_invalid`,
  before the engine is asked.
Then `add_lora` itself: any failure is `lora_adapter_invalid` with vLLM's cause.
"""
from __future__ import annotations

import json
import os
import struct

from app.errors import LORA_ADAPTER_INVALID, LORA_ADAPTER_PENDING, RequestError, TransientError
from app.requests.adapters import AdapterRef
from app.requests.models import ModelSpec

WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


def invalid(ref: AdapterRef, why: str) -> RequestError:
    """The request's adapter cannot be used: fail it, never retry."""
    return RequestError.of(LORA_ADAPTER_INVALID, f"adapter {ref.name} ({ref.path}): {why}")


def check_adapter_files(ref: AdapterRef, spec: ModelSpec) -> dict:
    """The adapter's parsed config, or a RequestError/TransientError saying why not (above)."""
    if not os.path.isdir(ref.path):
        try:
            os.listdir(os.path.dirname(ref.path) or ".")  # refresh a cached negative lookup
        except OSError:
            pass
        if not os.path.isdir(ref.path):
            raise invalid(ref, "no adapter directory there")
    config_path = os.path.join(ref.path, "adapter_config.json")
    pending = TransientError.of(LORA_ADAPTER_PENDING, f"adapter {ref.name} ({ref.path}) is not "
                                "complete yet (being written?); retrying")
    try:
        config = _read_config(config_path)
    except FileNotFoundError:
        # A network filesystem may cache the file's absence: one listing of the directory
        # refreshes it (as for the directory itself, above) before the adapter is judged pending.
        try:
            os.listdir(ref.path)
            config = _read_config(config_path)
        except (OSError, ValueError):
            raise pending from None
    except (OSError, ValueError):
        raise pending from None
    if not isinstance(config, dict):
        raise invalid(ref, "adapter_config.json is not a JSON object")
    if not any(os.path.exists(os.path.join(ref.path, w)) for w in WEIGHT_FILES):
        raise pending
    rank = config.get("r")
    if isinstance(rank, int) and rank > spec.max_lora_rank:
        raise invalid(ref, f"rank {rank} is above {spec.name}'s max_lora_rank "
                      f"{spec.max_lora_rank}")
    mismatch = shape_mismatch(ref.path, spec)
    if mismatch:
        raise invalid(ref, f"it does not fit {spec.name}: {mismatch} (an adapter for another "
                      "base model)")
    base = config.get("base_model_name_or_path")
    if isinstance(base, str) and base and spec.path and os.path.isdir(base) and \
            os.path.realpath(base) != os.path.realpath(spec.path):
        raise invalid(ref, f"it was made for the model at {base}, not {spec.name} "
                      f"({spec.path})")
    return config


def _read_config(path: str):
    with open(path) as f:
        return json.load(f)


def engine_cause(exc: BaseException) -> str:
    """vLLM's reason out of its wrapped add_lora error ("Call to add_lora method failed: Worker
    failed with error '<cause>' ..."), on one line."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    marker = "failed with error '"
    if marker in text:
        text = text.split(marker, 1)[1].split("'", 1)[0] or text
    return text[:300]


_OUT_DIMS = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "o_proj": "hidden",
             "gate_proj": "inter", "up_proj": "inter", "down_proj": "hidden"}


def _safetensors_shapes(path: str) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors file's header (no tensor data is read)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def shape_mismatch(adapter_dir: str, spec: ModelSpec) -> str:
    """Why the adapter's LoRA matrices cannot belong to `spec`'s model ('' if they fit or it
    cannot tell: no safetensors weights, or no local model config)."""
    weights = os.path.join(adapter_dir, "adapter_model.safetensors")
    model_cfg = os.path.join(spec.path or "", "config.json")
    if not (os.path.exists(weights) and os.path.exists(model_cfg)):
        return ""
    try:
        shapes = _safetensors_shapes(weights)
        with open(model_cfg) as f:
            mc = json.load(f)
    except (OSError, ValueError, KeyError):
        return "unreadable adapter weights"
    hidden = mc.get("hidden_size")
    heads = mc.get("num_attention_heads")
    kv_heads = mc.get("num_key_value_heads", heads)
    head_dim = mc.get("head_dim") or (hidden // heads if hidden and heads else None)
    dims = {"hidden": hidden, "inter": mc.get("intermediate_size"),
            "q": heads * head_dim if heads and head_dim else None,
            "kv": kv_heads * head_dim if kv_heads and head_dim else None}
    layers = mc.get("num_hidden_layers")
    for name, shape in shapes.items():
        parts = name.split(".")
        module = next((p for p in parts if p in _OUT_DIMS), None)
        if module is None or len(shape) != 2:
            continue
        if "layers" in parts and layers is not None:
            i = parts.index("layers")
            if i + 1 < len(parts) and parts[i + 1].isdigit() and int(parts[i + 1]) >= layers:
                return f"{name} is for layer {parts[i + 1]}; the model has {layers}"
        in_dim = dims["inter"] if module == "down_proj" else hidden
        out_dim = dims[_OUT_DIMS[module]]
        if "lora_A" in name and in_dim and shape[1] != in_dim:
            return f"{name} has input size {shape[1]}; the model's is {in_dim}"
        if "lora_B" in name and out_dim and shape[0] != out_dim:
            return f"{name} has output size {shape[0]}; the model's is {out_dim}"
    return ""
