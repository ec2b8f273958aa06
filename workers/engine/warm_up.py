"""Warming a fresh engine's LoRA lane at its start, so that no user's first adapter request pays
for compiling the LoRA kernels (one part of the engine slot, workers/engine/slot.py).

On CUDA vLLM's LoRA kernels (Triton: `_lora_shrink_kernel`, `_lora_expand_kernel`) are compiled
in each EngineCore process at their first use: ~25 s of the first adapter request on the H200
host (issue 39, vLLM 0.26; Triton's disk cache, `TRITON_CACHE_DIR`, keeps them for later
processes). So before an engine that serves adapters admits anything, it runs one base request
and one request through a warm-up adapter (`WARM_ADAPTER`: zeros, so it changes nothing, of the
engine's `max_lora_rank`, on every projection a Llama-family layer has, so that every kernel
shape a user adapter can use is compiled), then unloads it. The CPU's LoRA ops compile nothing:
there the first adapter request takes what the later ones take (tiny-llama, 0.088 s against
0.087 s: bench/engine_restart.py), so the CPU is not warmed (`warms_lora`).

A warm-up that fails is logged and the engine serves anyway: it is an optimisation, never a gate
(a model whose layers are not named like Llama's, whose adapter vLLM refuses, is served cold).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

from app.request_ids import CANARY_PREFIX
from app.requests.adapters import AdapterRef
from app.requests.model_files import ensure_model_files
from app.requests.models import ModelSpec
from workers.engine.suspects import canary_request

log = logging.getLogger("vigil.engine")

WARM_ADAPTER = "vigil-warm-up"
# Platforms whose LoRA kernels are compiled in each engine process at first use.
JIT_LORA_PLATFORMS = ("cuda",)
# The longest a warm-up may take (a cold Triton compile of both kernels took ~25 s on the H200).
WARM_UP_TIMEOUT_S = 120.0
# A Llama-family decoder layer's projections, by module: (name, input dim, output dim) of config.
_PROJECTIONS = (("self_attn", "q_proj", "hidden", "q"), ("self_attn", "k_proj", "hidden", "kv"),
                ("self_attn", "v_proj", "hidden", "kv"), ("self_attn", "o_proj", "q", "hidden"),
                ("mlp", "gate_proj", "hidden", "inter"), ("mlp", "up_proj", "hidden", "inter"),
                ("mlp", "down_proj", "inter", "hidden"))


def warms_lora(spec: ModelSpec, platform: str) -> bool:
    """Whether an engine of `spec` on `platform` gets its LoRA lane warmed at start: it serves
    adapters, on a platform whose LoRA kernels compile at first use."""
    return bool(spec.max_loras) and platform in JIT_LORA_PLATFORMS


def warm_adapter_dir(model_dir: Path, rank: int, root: Path | None = None) -> Path:
    """The warm-up adapter for the model at `model_dir` at `rank` (peft's layout, zeros, float16),
    built once under `root` (the temporary directory by default) and named after the model's
    config and the rank; written under a temporary name and renamed into place."""
    cfg_text = (model_dir / "config.json").read_text()
    key = hashlib.sha256(f"{cfg_text}|{rank}".encode()).hexdigest()[:16]
    root = root or Path(tempfile.gettempdir()) / "vigil-lora-warm-up"
    dest = root / f"{key}-r{rank}"
    if (dest / "adapter_config.json").exists():
        return dest
    import torch
    from safetensors.torch import save_file

    cfg = json.loads(cfg_text)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    dims = {"hidden": cfg["hidden_size"], "q": heads * head_dim,
            "kv": cfg.get("num_key_value_heads", heads) * head_dim,
            "inter": cfg["intermediate_size"]}
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for module, proj, d_in, d_out in _PROJECTIONS:
            key_ = f"base_model.model.model.layers.{i}.{module}.{proj}"
            tensors[f"{key_}.lora_A.weight"] = torch.zeros(rank, dims[d_in], dtype=torch.float16)
            tensors[f"{key_}.lora_B.weight"] = torch.zeros(dims[d_out], rank, dtype=torch.float16)
    tmp = root / f".{dest.name}.{os.getpid()}.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "target_modules": [p for _, p, _, _ in _PROJECTIONS],
        "base_model_name_or_path": str(model_dir)}))
    try:
        os.replace(tmp, dest)
    except OSError:  # another worker built it first
        if not (dest / "adapter_config.json").exists():
            raise
    return dest


async def warm_lanes(engine, spec: ModelSpec, timeout: float = WARM_UP_TIMEOUT_S) -> dict:
    """Run one base request and one through the warm-up adapter on `engine` (loaded first,
    unloaded after), within `timeout` seconds; returns the seconds each part took ({"base",
    "adapter"}), or {"failed": why} (logged; the engine serves anyway)."""
    took: dict = {}
    ref = None
    try:
        async with asyncio.timeout(timeout):
            t0 = time.monotonic()
            await engine.run(canary_request(spec), f"{CANARY_PREFIX}warm-base")
            took["base"] = round(time.monotonic() - t0, 3)
            t0 = time.monotonic()
            path = await asyncio.to_thread(warm_adapter_dir, Path(ensure_model_files(spec)),
                                           spec.max_lora_rank)
            ref = AdapterRef(WARM_ADAPTER, str(path), spec.name)
            await engine.add_adapter(ref)
            await engine.run(canary_request(spec), f"{CANARY_PREFIX}warm-lora", ref)
            took["adapter"] = round(time.monotonic() - t0, 3)
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # an optimisation, never a gate
        took = {"failed": f"{type(e).__name__}: {e}"}
        log.warning("could not warm the LoRA lane of the engine for %s (%s); its first adapter "
                    "request compiles the kernels", spec.name, took["failed"])
    finally:
        if ref is not None and not getattr(engine, "dead", False):
            try:
                await engine.remove_adapter(ref)
            except Exception as e:  # its slot is taken until an eviction: logged only
                log.warning("could not unload the warm-up adapter: %s", e)
    if "failed" not in took:
        log.info("warmed the engine for %s: base lane %.2f s, LoRA lane %.2f s", spec.name,
                 took["base"], took["adapter"])
    return took
