"""The recipe of a vLLM engine: the environment vLLM reads (`engine_env_defaults`) and the
AsyncEngineArgs of an engine for a model (`engine_args`, with where its model runs:
`executor_args`). One recipe for the worker's engine (workers/engine/vllm.py) and the benches'
direct engines, so they cannot drift. vLLM is imported only inside the functions that need it.
"""
from __future__ import annotations

import os

from app.errors import INVALID_MODEL_CONFIG, RequestError
from app.first_imports import vllm_env_defaults
from app.requests.engine_defaults import batch_defaults, compile_defaults
from app.requests.models import ModelSpec
from workers.engine.memory import MemoryPlan

# The scheduling policy of every engine whose registry entry names none.
SCHEDULING_POLICY = "priority"
# Where an engine's processes meet (torch's distributed rendezvous): this host.
LOOPBACK = "127.0.0.1"
# The logits processor of every engine (vLLM imports it in EngineCore by this name).
RESUME_STEPS = "workers.engine.resume_steps:ResumedRuns"


def engine_env_defaults() -> None:
    """Environment vLLM reads at import/start: offline hub, spawn, one logging setup, CPU KV size,
    distributed init on loopback, OpenMP threads that wait passively.

    Only defaults: an operator's explicit setting wins. Must run before vLLM is imported.
    """
    vllm_env_defaults()  # the hub offline, no usage stats (app/first_imports.py)
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # No VLLM_CPU_KVCACHE_SPACE default: it would override the KV size that workers/engine/memory.py
    # picks for each engine start (an operator who sets it fixes the size instead).
    # With the model in a process of its own (vLLM's "mp" executor: several GPUs, or a registry
    # entry asking for it), vLLM gives that process 5 s to exit after a polite stop, then
    # SIGTERMs it; on a loaded host its exit takes longer, and a SIGTERMed one may leave its
    # shared-memory queue behind (docs/failure-modes.md, "Kills under load"). 20 s stays inside
    # the engine host's 30 s shutdown budget (workers/engine/host.py).
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "20")
    # Torch's distributed init on loopback: a Vigil engine never spans hosts (a worker's cards,
    # tensor-parallel ones too, are all on its host), and vLLM otherwise rendezvous on the
    # address of its default route (`get_ip()`), whose reverse lookup c10d makes at every start
    # ("The hostname of the client socket cannot be retrieved"): 21-25 s of each engine start on
    # the H200 host, where that lookup waited for a DNS timeout (docs/field-notes.md, "vLLM on
    # a GPU"). vLLM reads VLLM_HOST_IP first; VLLM_LOOPBACK_IP is its loopback choice.
    os.environ.setdefault("VLLM_HOST_IP", LOOPBACK)
    os.environ.setdefault("VLLM_LOOPBACK_IP", LOOPBACK)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The model's OpenMP threads (torch's intra-op pool) sleep while they wait for work instead
    # of spinning (libgomp's default). A worker shares its host's cores with its engine: Celery's
    # threads, the engine host's loop, vLLM's front end, Redis. On the CPU engine the spinning
    # threads burned what those needed: EngineCore took 175-185% of this 2-core machine for
    # 512 x 128 tokens, ~120% waiting passively for as many tokens a second through Vigil (the
    # direct engine's median 9% lower, inside the runs' spread), and the short workload ran
    # ~30% faster on both sides of the bench (docs/performance.md, "The fourth pass"). On a GPU
    # the model's threads barely use OpenMP; nothing changes there.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def engine_args(spec: ModelSpec, plan: MemoryPlan | None = None, *, lora: bool = True,
                platform: str | None = None) -> dict:
    """The AsyncEngineArgs (besides `model`) of an engine for `spec`: the one recipe for the
    worker's engine and the benchmark's direct engine (bench/direct_engine.py), so the two
    cannot drift. The registry's engine args, the memory plan's KV cache size (without a plan:
    the registry's `kv_cache_gib` as it is, since vLLM's own CPU default, 90% of the node, fails
    on any shared host), no periodic stats logging, and the LoRA lanes when the model serves
    adapters (`lora=False` leaves them out: for measuring what they cost). The registry's
    `structured_outputs_config` (a JSON object there) becomes vLLM's config object.

    Per platform (`platform`: the plan's device, else vLLM's current platform): the model's
    dtype there (`ModelSpec.dtype_on`), and the batch and compilation defaults of
    app/requests/engine_defaults.py under what the registry says (eager on the CPU, CUDA graphs
    on CUDA); on CUDA, one tensor-parallel rank per card of the worker (the
    plan's probe). vLLM's "priority" scheduling policy, so its waiting requests go by tier.
    Refuses, as `invalid_model_config`, an entry that cannot run here (float32
    with LoRA on CUDA) and a `tensor_parallel_size` other than the worker's number of cards."""
    platform = platform or (plan.probe.device if plan is not None else _current_platform())
    if plan is None and not os.environ.get("VLLM_CPU_KVCACHE_SPACE") and \
            "kv_cache_memory_bytes" not in spec.engine_args and \
            "gpu_memory_utilization" not in spec.engine_args and platform != "cuda" and \
            not os.environ.get("CUDA_VISIBLE_DEVICES"):
        plan_args = {"kv_cache_memory_bytes": spec.kv_cache_bytes()}
    else:
        plan_args = plan.engine_args if plan is not None else {}
    problem = spec.platform_problem(platform)
    if problem:
        raise RequestError.of(INVALID_MODEL_CONFIG, problem)
    cards = plan.probe.cards if plan is not None else ()
    small = min(cards, key=lambda c: c.total) if cards else None
    defaults = {**compile_defaults(platform),
                **batch_defaults(platform, small.total if small else None,
                                 small.name if small else "")}
    if cards:
        # The last guard: a GPU worker leaves such pools out at start and the reconcile never
        # lends them to it (ModelRegistry.split_by_cards, app/fleet/reconcile.py `fits`).
        problem = spec.card_problem(len(cards))
        if problem:
            raise RequestError.of(INVALID_MODEL_CONFIG, problem)
        if len(cards) > 1:
            defaults["tensor_parallel_size"] = len(cards)
    # vLLM's "priority" scheduling: the requests waiting in the engine are taken by their
    # tier (app/requests/tiers.py `engine_priority`), then by arrival, and vLLM's own KV-cache
    # preemption picks the youngest request of the lowest tier; it never stops a running
    # request for a waiting one (the engine host's preemption does: workers/engine/host.py).
    args = {"disable_log_stats": True, "scheduling_policy": SCHEDULING_POLICY,
            **executor_args(spec, platform), **defaults, **spec.engine_args, **plan_args}
    if "speculative_config" not in args:  # vLLM refuses custom processors with speculation
        # A resumed run samples as the unbroken run would (workers/engine/resume_steps.py).
        args["logits_processors"] = [RESUME_STEPS, *args.get("logits_processors", ())]
    dtype = spec.dtype_on(platform)
    if dtype is not None:
        args["dtype"] = dtype
    if isinstance(args.get("structured_outputs_config"), dict):
        # The registry is JSON; AsyncEngineArgs wants vLLM's config object (LLM converts it
        # itself, AsyncEngineArgs does not).
        from vllm.config import StructuredOutputsConfig

        args["structured_outputs_config"] = StructuredOutputsConfig(
            **args["structured_outputs_config"])
    if spec.max_loras and lora:
        args = {"enable_lora": True, "max_loras": spec.max_loras,
                "max_lora_rank": spec.max_lora_rank, **args}
    return args


def _current_platform() -> str:
    """vLLM's platform here: "cuda" or "cpu" (what an engine built without a plan runs on)."""
    from vllm.platforms import current_platform

    return "cuda" if current_platform.is_cuda() else "cpu"


def executor_args(spec: ModelSpec, platform: str | None = None) -> dict:
    """Where the model runs: inside EngineCore on the CPU, for an engine on one device.

    On a GPU with one device vLLM runs the model in EngineCore itself (its UniProcExecutor); on
    the CPU it always starts a model process of its own below EngineCore (the "mp" executor),
    which costs a second vLLM import at every engine start, a shared-memory queue between the
    two on every step, and a second core spinning while requests are in flight. Vigil asks for
    the GPU's layout on the CPU too (bench/engine_layout.py on tiny-llama: engine start 0.52x,
    generation 0.82x, memory 0.79x, the same greedy tokens; docs/performance.md). A registry
    entry that chooses the executor itself keeps vLLM's choice (`chooses_executor`)."""
    if chooses_executor(spec.engine_args):
        return {}
    if (platform or _current_platform()) != "cpu":
        return {}
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    return {"distributed_executor_backend": UniProcExecutor}


def chooses_executor(engine_args: dict) -> bool:
    """True when registry engine args choose where the model runs: they name an executor, or
    ask for more than one device (tensor, pipeline or data parallelism)."""
    return "distributed_executor_backend" in engine_args or any(
        int(engine_args.get(k, 1)) > 1
        for k in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"))
