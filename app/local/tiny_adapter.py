"""LoRA adapters for tiny-llama, built locally with peft (random non-zero weights, a few KB): for
tests, drills and trying adapters without a model hub. Needs the `peft` package (dev extra).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


def build_tiny_adapter(model_path: str | os.PathLike, dest: str | os.PathLike, *, rank: int = 8,
                       seed: int = 1, hidden_size: int | None = None) -> Path:
    """Write a LoRA adapter (q_proj, v_proj) for the tiny model at `model_path` into `dest`.

    Both LoRA matrices are random, so the adapter changes greedy outputs. `hidden_size` builds
    it for a differently shaped model instead (an adapter "for another base model"), keeping
    `model_path` as its declared base so only the engine can tell.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(str(model_path))
    if hidden_size is not None:
        config.hidden_size = hidden_size
        config.intermediate_size = 2 * hidden_size
    model = LlamaForCausalLM(config)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"],
                      init_lora_weights=False, lora_dropout=0.0)
    peft_model = get_peft_model(model, lora)
    with torch.no_grad():  # big enough to move greedy choices of a random model
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(8.0)
    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    peft_model.save_pretrained(str(tmp))
    cfg_path = tmp / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = str(model_path)
    cfg_path.write_text(json.dumps(cfg, indent=1))
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return dest
