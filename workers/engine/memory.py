"""The worker's own memory measurement, and the sizing of an engine to what is free.

vLLM reports a memory squeeze at engine start and a broken model the same way (one RuntimeError
in the parent, docs/field-notes.md), so the worker measures first and remembers what it decided:

- `probe_memory()` reads free/total memory where the engine will put its KV cache: on a GPU
  through NVML only (app/devices.py: without nvidia-ml-py the probe refuses, since torch would
  create a CUDA context in the worker), every card of a tensor-parallel worker; on the CPU from
  the NUMA node's meminfo with the very formula vLLM's CPU worker uses (MemFree + file pages +
  reclaimable slab, clamped to the cgroup limit).
- `plan_memory()` sizes the engine to what is free, never above what the registry entry asks for
  and never below its floor. Below the floor it does not try at all: `memory_pressure` at once
  (a start that would fail after ~20 s, or push the host into the OOM killer, is not worth it).
  When it had to size below the request, `MemoryPlan.sized_down` is True, and an engine start
  that fails anyway is classified `memory_pressure` (retried); with the full request granted, a
  failure is the model's fault (`invalid_model_config` / `model_not_found`, not retried).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from app.devices import Card, read_cards, visible_entries
from app.errors import MEMORY_PRESSURE, TransientError
from app.requests.models import ModelSpec
from app.settings_defaults import DEFAULT_GPU_HEADROOM_MIB

GiB = 1 << 30
MiB = 1 << 20
DEFAULT_GPU_UTILIZATION = 0.9
# vLLM rounds its budget up (ceil(total x utilization)); a lowered utilization is rounded down
# to this many decimals first, so the budget vLLM computes never exceeds the one granted.
UTIL_DECIMALS = 4


@dataclass(frozen=True)
class MemoryProbe:
    """Free and total bytes where the engine would live, and where the numbers came from. On a
    tensor-parallel worker `free` is what a start may use on all its cards together (the
    smallest card's free times their number: the smallest bounds every rank) and `total` their
    sum; `cards` holds each card."""
    device: str  # "cpu" or "cuda"
    free: int
    total: int
    source: str  # "nvml", "node-meminfo", "psutil"
    cards: tuple[Card, ...] = ()

    def heartbeat_fields(self) -> dict:
        """The registry entry's device fields: `device`, `device_free_bytes`,
        `device_total_bytes`, and on a GPU `device_cards` (`entry:free:total` per card)."""
        out = {"device": self.device, "device_free_bytes": self.free,
               "device_total_bytes": self.total}
        if self.cards:
            out["device_cards"] = ",".join(f"{c.entry}:{c.free}:{c.total}" for c in self.cards)
        return out


@dataclass(frozen=True)
class MemoryPlan:
    """How an engine start is sized. `requested` and `granted` are in the same unit: the KV cache
    on the CPU, the engine's whole device budget on a GPU (per card on a tensor-parallel
    worker: the smallest card's)."""
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
        cards = f" on {len(self.probe.cards)} cards, per card" if len(self.probe.cards) > 1 else ""
        return (f"{self.probe.device} free {self.probe.free / GiB:.2f}/"
                f"{self.probe.total / GiB:.2f} GiB ({self.probe.source}){cards}; requested "
                f"{self.requested / GiB:.2f} GiB, granted {self.granted / GiB:.2f} GiB, "
                f"floor {self.floor / GiB:.2f} GiB")


def worker_device() -> tuple[str, tuple[str, ...] | int]:
    """("cuda", the CUDA_VISIBLE_DEVICES entries) for a worker pinned to GPUs (`vigil worker
    --gpu` sets it: indexes, or UUIDs when an inherited list named cards by UUID), else ("cpu",
    NUMA node of the first CPU this process may use)."""
    entries = visible_entries(os.environ.get("CUDA_VISIBLE_DEVICES"))
    if entries and all(e.isdigit() or e.startswith(("GPU-", "MIG-")) for e in entries):
        return "cuda", entries
    return "cpu", _numa_node_of(min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                else 0)


def _numa_node_of(cpu: int) -> int:
    for p in Path(f"/sys/devices/system/cpu/cpu{cpu}").glob("node*"):
        if p.name[4:].isdigit():
            return int(p.name[4:])
    return 0


def probe_memory(device: str = "cpu", where: tuple[str, ...] | int | str = 0,
                 nvml=None) -> MemoryProbe:
    """Measure free/total memory on `device`: the cards `where` names (CUDA_VISIBLE_DEVICES
    entries, or one index) through NVML, or the CPU's NUMA node `where` (see the module
    docstring for the sources). A lost card raises WorkerFatalError (app/devices.py)."""
    if device == "cuda":
        entries = (str(where),) if isinstance(where, (int, str)) else tuple(where)
        return _probe_cuda(entries, nvml)
    return _probe_cpu_node(int(where))


def _probe_cuda(entries: tuple[str, ...], nvml=None) -> MemoryProbe:
    # NVML only: no torch fallback (app/devices.py, NvmlMissing says why).
    cards = tuple(read_cards(entries, nvml))
    return MemoryProbe("cuda", min(c.free for c in cards) * len(cards),
                       sum(c.total for c in cards), "nvml", cards)


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


def plan_memory(spec: ModelSpec, probe: MemoryProbe,
                headroom: int = DEFAULT_GPU_HEADROOM_MIB * MiB) -> MemoryPlan:
    """Size `spec`'s engine to `probe`; raises TransientError(memory_pressure) below the floor.

    CPU: the KV cache gets min(request, free - the model's other needs), passed to vLLM as
    `kv_cache_memory_bytes`. An operator's VLLM_CPU_KVCACHE_SPACE overrides vLLM's setting, so
    then the request is fixed: granted in full or refused.
    GPU: vLLM's own start-up check wants ceil(gpu_memory_utilization x total) free on each card
    after its process made a CUDA context there. Each card's budget is min(request, free -
    `headroom`), `headroom` being that context's cost (VIGIL_GPU_HEADROOM_MIB); the smallest
    card's bounds the start (one utilization for every rank), and a smaller budget is passed as
    a lower utilization, rounded down. The floor (memory_gib + kv_cache_floor_gib, the whole
    model's) is split over the cards, as tensor parallelism splits weights and KV heads.
    """
    reserve = int(spec.memory_gib * GiB)
    kv_floor = int(spec.kv_cache_floor_gib * GiB)
    if probe.device == "cuda":
        util = float(spec.engine_args.get("gpu_memory_utilization", DEFAULT_GPU_UTILIZATION))
        cards = probe.cards or (Card("0", "", "", probe.free, probe.total),)
        fraction = min(util, min((c.free - headroom) / c.total for c in cards))
        small = min(cards, key=lambda c: c.total)
        requested = math.ceil(util * small.total)
        if fraction >= util:
            granted, args = requested, {}
        else:
            fraction = math.floor(max(fraction, 0.0) * 10**UTIL_DECIMALS) / 10**UTIL_DECIMALS
            granted = int(fraction * small.total)
            args = {"gpu_memory_utilization": fraction}
        floor = math.ceil(spec.start_floor_bytes() / len(cards))
    else:
        fixed = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
        if fixed.isdigit():
            requested = int(fixed) * GiB
        else:
            requested = spec.kv_cache_bytes()
        granted = min(requested, probe.free - reserve)
        floor = requested if fixed.isdigit() else min(kv_floor, requested)
        args = {} if fixed.isdigit() else {"kv_cache_memory_bytes": max(granted, 0)}
    plan = MemoryPlan(requested, max(granted, 0), floor, probe, args)
    if granted < floor:
        raise TransientError.of(MEMORY_PRESSURE, f"not enough free memory to start {spec.name}: "
                                f"{plan.describe()}")
    return plan
