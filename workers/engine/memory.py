"""The worker's own memory measurement, and the sizing of an engine to what is free.

vLLM reports a memory squeeze at engine start and a broken model the same way (one RuntimeError
in the parent, docs/field-notes.md), so the worker measures first and remembers what it decided:

- `probe_memory()` reads free/total memory where the engine will put its KV cache: on a GPU
  through NVML (or `torch.cuda.mem_get_info`), on the CPU from the NUMA node's meminfo with the
  very formula vLLM's CPU worker uses (MemFree + file pages + reclaimable slab, clamped to the
  cgroup limit).
- `plan_memory()` sizes the engine to what is free, never above what the registry entry asks for
  and never below its floor. Below the floor it does not try at all: `memory_pressure` at once
  (a start that would fail after ~20 s, or push the host into the OOM killer, is not worth it).
  When it had to size below the request, `MemoryPlan.sized_down` is True, and an engine start
  that fails anyway is classified `memory_pressure` (retried); with the full request granted, a
  failure is the model's fault (`invalid_model_config` / `model_not_found`, not retried).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from app.errors import MEMORY_PRESSURE, TransientError
from app.requests.models import ModelSpec

GiB = 1 << 30
# What a GPU engine start needs beyond its own budget (CUDA context, NCCL buffers, fragmentation).
GPU_HEADROOM_BYTES = 512 << 20
DEFAULT_GPU_UTILIZATION = 0.9


@dataclass(frozen=True)
class MemoryProbe:
    """Free and total bytes where the engine would live, and where the numbers came from."""
    device: str  # "cpu" or "cuda"
    free: int
    total: int
    source: str  # "nvml", "torch", "node-meminfo", "psutil"


@dataclass(frozen=True)
class MemoryPlan:
    """How an engine start is sized. `requested` and `granted` are in the same unit: the KV cache
    on the CPU, the engine's whole device budget on a GPU."""
    requested: int
    granted: int
    floor: int
    probe: MemoryProbe
    engine_args: dict = field(default_factory=dict)

    @property
    def sized_down(self) -> bool:
        """True when less than the registry's request was free: a failed start is then taken as
        memory pressure, not as a broken model."""
        return self.granted < self.requested

    def describe(self) -> str:
        """One line for logs and error details."""
        return (f"{self.probe.device} free {self.probe.free / GiB:.2f}/"
                f"{self.probe.total / GiB:.2f} GiB ({self.probe.source}); requested "
                f"{self.requested / GiB:.2f} GiB, granted {self.granted / GiB:.2f} GiB, "
                f"floor {self.floor / GiB:.2f} GiB")


def worker_device() -> tuple[str, int]:
    """("cuda", physical index) for a worker pinned to a GPU (`vigil worker --gpu N` sets
    CUDA_VISIBLE_DEVICES), else ("cpu", NUMA node of the first CPU this process may use)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if visible.isdigit():
        return "cuda", int(visible)
    return "cpu", _numa_node_of(min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                else 0)


def _numa_node_of(cpu: int) -> int:
    for p in Path(f"/sys/devices/system/cpu/cpu{cpu}").glob("node*"):
        if p.name[4:].isdigit():
            return int(p.name[4:])
    return 0


def probe_memory(device: str = "cpu", index: int = 0) -> MemoryProbe:
    """Measure free/total memory on `device` (see the module docstring for the sources)."""
    if device == "cuda":
        return _probe_cuda(index)
    return _probe_cpu_node(index)


def _probe_cuda(index: int) -> MemoryProbe:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
            return MemoryProbe("cuda", int(info.free), int(info.total), "nvml")
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library: ask the CUDA runtime (index is the visible device 0)
        import torch

        free, total = torch.cuda.mem_get_info(0)
        return MemoryProbe("cuda", int(free), int(total), "torch")


def _probe_cpu_node(node: int) -> MemoryProbe:
    path = Path(f"/sys/devices/system/node/node{node}/meminfo")
    if not path.exists():

        vm = psutil.virtual_memory()
        return _clamp_cgroup(MemoryProbe("cpu", int(vm.available), int(vm.total), "psutil"))
    info: dict[str, int] = {}
    for line in path.read_text().splitlines():
        parts = line.split()  # "Node 0 MemFree:  14639592 kB"
        if len(parts) >= 4 and parts[3].isdigit():
            info[parts[2].rstrip(":")] = int(parts[3]) * 1024
    free = (info.get("MemFree", 0) + info.get("Active(file)", 0) + info.get("Inactive(file)", 0)
            + info.get("SReclaimable", 0))
    return _clamp_cgroup(MemoryProbe("cpu", free, info.get("MemTotal", 0), "node-meminfo"))


def _cgroup_limit_and_usage() -> tuple[int | None, int | None]:
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            raw = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if raw.isdigit():
            return int(raw), usage
        return None, usage
    return None, None


def _clamp_cgroup(p: MemoryProbe) -> MemoryProbe:
    limit, usage = _cgroup_limit_and_usage()
    if limit is None or limit >= p.total:
        return p
    return MemoryProbe(p.device, max(0, min(p.free, limit - (usage or 0))), limit, p.source)


def plan_memory(spec: ModelSpec, probe: MemoryProbe) -> MemoryPlan:
    """Size `spec`'s engine to `probe`; raises TransientError(memory_pressure) below the floor.

    CPU: the KV cache gets min(request, free - the model's other needs), passed to vLLM as
    `kv_cache_memory_bytes`. An operator's VLLM_CPU_KVCACHE_SPACE overrides vLLM's setting, so
    then the request is fixed: granted in full or refused.
    GPU: the engine's budget (gpu_memory_utilization x total, vLLM's own start-up check) gets
    min(request, free - headroom); a smaller budget is passed as a lower utilization.
    """
    reserve = int(spec.memory_gib * GiB)
    kv_floor = int(spec.kv_cache_floor_gib * GiB)
    if probe.device == "cuda":
        util = float(spec.engine_args.get("gpu_memory_utilization", DEFAULT_GPU_UTILIZATION))
        requested = int(util * probe.total)
        granted = min(requested, probe.free - GPU_HEADROOM_BYTES)
        floor = reserve + kv_floor
        args = {} if granted >= requested else {
            "gpu_memory_utilization": max(granted, 0) / probe.total}
    else:
        fixed = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
        if fixed.isdigit():
            requested = int(fixed) * GiB
        else:
            requested = int(spec.engine_args.get("kv_cache_memory_bytes",
                                                 spec.kv_cache_gib * GiB))
        granted = min(requested, probe.free - reserve)
        floor = requested if fixed.isdigit() else min(kv_floor, requested)
        args = {} if fixed.isdigit() else {"kv_cache_memory_bytes": max(granted, 0)}
    plan = MemoryPlan(requested, max(granted, 0), floor, probe, args)
    if granted < floor:
        raise TransientError.of(MEMORY_PRESSURE, f"not enough free memory to start {spec.name}: "
                                f"{plan.describe()}")
    return plan
