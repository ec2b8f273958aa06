"""The real-engine smoke of bench/gpu_check.py (its facts 7 and 8), run by it in a process of its
own:

    CUDA_VISIBLE_DEVICES=0 CUDA_DEVICE_ORDER=PCI_BUS_ID python bench/gpu_engine_smoke.py HEADROOM

Without CUDA_VISIBLE_DEVICES it runs on the CPU build (float32): a dry run of everything but the
kernels (tests/test_gpu_check_e2e.py).

Builds a random-weight Llama here (tiny-llama's recipe at hidden 512, head_dim 128) and a LoRA
adapter for it (random, written with safetensors: no peft), then runs Vigil's engine host with
the real vLLM engine as a worker does (its memory planner over NVML, its engine factory, its
vLLM logging config): bfloat16 (the CUDA default), LoRA lanes on; one base request, one adapter
request, then a 400-token request whose EngineCore is SIGKILLed mid-generation and which must
finish on the recovered engine (`recovered_s`: bench/gpu_facts.py's `restart_s` fact, with the
same request's time on the warm engine beside it, `long_warm_s`). CUDA graphs are on, as on
every GPU registry entry (app/requests/engine_defaults.py): their capture is in `start_s` and
`recovered_s`. Where flashinfer is not importable, its engine runs with
`VLLM_USE_FLASHINFER_SAMPLER=0` (vLLM 0.26's sampler imports flashinfer otherwise: issue 39).
Prints one `SMOKE {json}` line; exit 0 unless it crashed.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.logging_setup import configure_vllm_logging  # noqa: E402
from app.requests.adapters import AdapterRef  # noqa: E402
from app.requests.models import ModelSpec  # noqa: E402
from app.requests.schemas import GenerateRequest  # noqa: E402

HIDDEN = 512
RANK = 8


def build_adapter(model_dir: Path, dest: Path, rank: int = RANK, seed: int = 1) -> Path:
    """A LoRA adapter (q_proj, v_proj of every layer) for the model at `model_dir`, in peft's
    file layout, random and large enough to move greedy tokens."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * (
        h // cfg["num_attention_heads"])
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for proj, out in (("q_proj", h), ("v_proj", kv)):
            key = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, h, generator=g) * 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.5
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    (dest / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "target_modules": ["q_proj", "v_proj"], "base_model_name_or_path": str(model_dir)}))
    return dest


def sampler_env(find_spec=importlib.util.find_spec) -> dict:
    """The environment the smoke's engine needs for vLLM's sampler: without flashinfer
    importable, vLLM's own sampler (`VLLM_USE_FLASHINFER_SAMPLER=0`; an operator's setting
    wins)."""
    if "VLLM_USE_FLASHINFER_SAMPLER" in os.environ:
        return {}
    try:
        found = find_spec("flashinfer") is not None
    except (ImportError, ValueError):
        found = False
    return {} if found else {"VLLM_USE_FLASHINFER_SAMPLER": "0"}


def main() -> int:
    headroom = int(sys.argv[1])
    tmp = Path(tempfile.mkdtemp(prefix="vigil-gpu-smoke-"))
    configure_vllm_logging(tmp / "cache", "WARNING")  # before vLLM is imported: as a worker
    from app.requests.model_files import build_tiny_llama
    from workers.engine.host import EngineHost, HostEvents
    from workers.engine.kinds import engine_factory
    from workers.engine.memory import plan_memory, probe_memory, worker_device
    from workers.engine.processes import engine_core_pids
    from workers.engine.vllm_args import engine_env_defaults

    engine_env_defaults()
    sampler = sampler_env()
    os.environ.update(sampler)  # before the engine starts: its EngineCore inherits it
    model = build_tiny_llama(tmp / "model", hidden_size=HIDDEN)
    adapter = build_adapter(model, tmp / "adapter")
    device = worker_device()  # the card CUDA_VISIBLE_DEVICES names; the CPU where none is
    spec = ModelSpec(name="gpu-check", path=str(model), max_model_len=512, vocab_size=2048,
                     memory_gib=2, kv_cache_floor_gib=0.25, max_loras=1, max_lora_rank=RANK,
                     # CUDA: bfloat16 by default; the CPU (a dry run of this script) float32
                     dtypes={"cpu": "float32"},
                     # CUDA graphs on CUDA, as every GPU entry (their capture is in start_s
                     # and restart_s); eager on the CPU (app/requests/engine_defaults.py)
                     engine_args={"max_model_len": 512, "seed": 0,
                                  **({"gpu_memory_utilization": 0.3} if device[0] == "cuda"
                                     else {})})
    class Sized(HostEvents):  # every start sized to the card's free memory, as a worker's
        def plan_memory(self, s):
            return plan_memory(s, probe_memory(*device), headroom)

    host = EngineHost(engine_factory("vllm"), idle_cleanup=0, events=Sized()).start()
    out: dict = {}
    try:
        ask = GenerateRequest(model="gpu-check", prompt="the quick brown fox", max_tokens=16,
                              temperature=0)
        t0 = time.monotonic()
        base = host.generate(ask, spec, "smoke-base", 300)
        out["start_s"] = round(time.monotonic() - t0, 1)
        t0 = time.monotonic()
        lora = host.generate(ask, spec, "smoke-lora", 300,
                             adapter=AdapterRef("gpu-check-adapter", str(adapter), "gpu-check"))
        out["lora_s"] = round(time.monotonic() - t0, 2)  # the first adapter request
        out["base_tokens"], out["lora_tokens"] = len(base.token_ids), len(lora.token_ids)
        out["adapter_changed_tokens"] = base.token_ids != lora.token_ids
        long = GenerateRequest(model="gpu-check", prompt="tell me a long story", max_tokens=400,
                               temperature=0, ignore_eos=True)
        out["long_asked"] = long.max_tokens
        t0 = time.monotonic()
        host.generate(long, spec, "smoke-long-warm", 600)
        out["long_warm_s"] = round(time.monotonic() - t0, 2)
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(host.generate, long, spec, "smoke-long", 600)
            deadline = time.monotonic() + 60
            while host.snapshot()["in_flight"] < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)  # inside the generation
            killed = engine_core_pids()
            for pid in killed:
                os.kill(pid, 9)
            t1 = time.monotonic()
            result = fut.result(timeout=600)
        out["killed"] = len(killed)
        out["recovered_s"] = round(time.monotonic() - t1, 1)
        out["long_tokens"] = len(result.token_ids)
        out["restarts"] = host.stats.restarts
    finally:
        host.shutdown(60)
    ok = (out.get("base_tokens") == 16 and out.get("lora_tokens") == 16
          and out.get("killed", 0) >= 1 and out.get("long_tokens") == 400
          and out.get("restarts") == 1)
    out["device"] = device[0]
    out["sampler_env"] = sampler
    detail = (f"{spec.dtype_on(device[0]) or 'auto'} + LoRA engine on {device[0]} started in {out.get('start_s')} s; base and adapter "
              f"requests {out.get('base_tokens')}/{out.get('lora_tokens')} tokens (adapter "
              f"{'changed' if out.get('adapter_changed_tokens') else 'did not change'} greedy "
              f"tokens); EngineCore SIGKILLed under a 400-token request: "
              f"{out.get('long_tokens')} tokens after a recovery of {out.get('recovered_s')} s, "
              f"{out.get('restarts')} restart(s)")
    print("SMOKE " + json.dumps({"ok": ok, "detail": detail, **out}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
