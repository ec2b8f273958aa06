"""Per-platform engine defaults, in one place: the batch vLLM runs (`max_num_seqs`,
`max_num_batched_tokens`) and the dtype, where the registry entry does not say.

Vigil builds its engines with `AsyncLLM.from_engine_args`, whose usage context gets vLLM's
library defaults: 128 sequences and 2,048 batched tokens whatever the card. `vllm serve` takes
more on large cards (vLLM 0.32, `EngineArgs.get_batch_defaults`, its OPENAI_API_SERVER column):
1,024 / 16,384 on cards of 160 GiB or more, 1,024 / 8,192 on 70 GiB or more except A100s (H100,
H200), 256 / 2,048 on the others. A GPU worker gets the same; the CPU keeps vLLM's own (the
tests run tiny-llama there). `vigil worker` raises its concurrency to the largest
`max_num_seqs` of the pools it serves (`worker_concurrency`): with fewer task threads than the
engine's sequences its batch never runs full.

Compilation: on the CPU, eager (`enforce_eager`) unless the entry says otherwise: torch.compile
costs ~10 s of every engine start on 2 cores (measured with tiny-llama) and the CPU has no CUDA
graphs to capture. On CUDA, vLLM's own default: torch.compile and CUDA graphs, which are much of
a GPU engine's speed; their compile is cached on disk (`VLLM_CACHE_ROOT`, the images' volume:
docker/README.md) and their capture is paid at every engine start, restarts included (measured by
bench/gpu_check.py's engine smoke: `start_s`, `restart_s`).

dtype: on CUDA, bfloat16 unless the entry says otherwise (vLLM's CUDA LoRA kernels accept
float16 and bfloat16 only: `lora_shrink` asserts, killing EngineCore at the first adapter
request); on the CPU, vLLM's own choice unless the entry says.
"""
from __future__ import annotations

GiB = 1 << 30
# vLLM's SchedulerConfig.DEFAULT_MAX_NUM_SEQS: what an engine runs when nobody says.
VLLM_DEFAULT_MAX_NUM_SEQS = 128
CUDA_DTYPE = "bfloat16"
FLOAT32 = ("float32", "float", "fp32")


def batch_defaults(platform: str, card_total: int | None = None, card_name: str = "") -> dict:
    """The engine args of the batch on `platform` ("cuda" or "cpu") for a card of `card_total`
    bytes named `card_name` (the smallest card of a tensor-parallel worker): vllm serve's."""
    if platform != "cuda":
        return {}
    total = card_total or 0
    if total >= 160 * GiB:
        return {"max_num_seqs": 1024, "max_num_batched_tokens": 16384}
    if total >= 70 * GiB and "a100" not in card_name.lower():
        return {"max_num_seqs": 1024, "max_num_batched_tokens": 8192}
    return {"max_num_seqs": 256, "max_num_batched_tokens": 2048}


def compile_defaults(platform: str) -> dict:
    """The engine args of compilation on `platform` where the registry entry does not say:
    eager on the CPU, vLLM's torch.compile and CUDA graphs on CUDA (module docstring)."""
    return {} if platform == "cuda" else {"enforce_eager": True}


def default_dtype(platform: str) -> str | None:
    """The dtype an entry that names none runs with on `platform` (None: vLLM's own)."""
    return CUDA_DTYPE if platform == "cuda" else None


def max_num_seqs(engine_args: dict, platform: str, card_total: int | None = None,
                 card_name: str = "") -> int:
    """The sequences an engine with these registry engine args runs at once on `platform`."""
    if "max_num_seqs" in engine_args:
        return int(engine_args["max_num_seqs"])
    return int(batch_defaults(platform, card_total, card_name).get(
        "max_num_seqs", VLLM_DEFAULT_MAX_NUM_SEQS))


def worker_concurrency(configured: int, engine_args: list[dict], platform: str,
                       card_total: int | None = None, card_name: str = "") -> int:
    """A worker's task threads: `configured`, raised to the largest `max_num_seqs` among the
    engines it may run (the registry entries of its pools), so its engine's batch can fill."""
    return max([configured] + [max_num_seqs(a, platform, card_total, card_name)
                               for a in engine_args])
