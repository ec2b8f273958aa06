"""The GPU check's verdicts (bench/gpu_check.py): the `Fact` each of its steps prints (one
PASS/FAIL/SKIP line; `FACT {json}` on its way out of a step process) and each fact's judgment, a
pure function of the readings, with the tolerances and the goal it is held against.
tests/test_gpu_check.py holds each with readings that pass and readings that fail.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from workers.engine.memory import GiB, MiB

FREE_TOLERANCE = 256 * MiB  # two reads of free memory a moment apart, by two APIs
SMI_TOLERANCE = 64 * MiB
TOTAL_TOLERANCE = 0.02  # NVML's total counts memory the driver reserves; CUDA's does not
BACK_TOLERANCE = 256 * MiB  # memory back after an engine shut down
# The goal of a dead engine's return (issue 39): SIGKILL of EngineCore -> the request it was
# running finished on a fresh engine, for a small model on one GPU.
RESTART_GOAL_S = 10.0
FACT_PREFIX = "FACT "  # a step process's line carrying one Fact (JSON)


@dataclass(frozen=True)
class Fact:
    """One checked fact: `ok` True (PASS), False (FAIL) or None (SKIP), and its figures."""
    name: str
    ok: bool | None
    detail: str

    def line(self) -> str:
        """`PASS name: detail`, `FAIL ...` or `SKIP ...`: one line per fact."""
        word = {True: "PASS", False: "FAIL", None: "SKIP"}[self.ok]
        return f"{word} {self.name}: {self.detail}"

    def wire(self) -> str:
        """The line a step process prints for this fact (`FACT {json}`)."""
        return FACT_PREFIX + json.dumps({"name": self.name, "ok": self.ok,
                                         "detail": self.detail})

    @classmethod
    def from_wire(cls, line: str) -> "Fact | None":
        """The fact of a `wire()` line; None for any other line."""
        if not line.startswith(FACT_PREFIX):
            return None
        try:
            d = json.loads(line[len(FACT_PREFIX):])
            return cls(str(d["name"]), d["ok"] if d["ok"] in (True, False, None) else False,
                       str(d["detail"]))
        except (ValueError, KeyError, TypeError):
            return None


def exit_status(facts: list[Fact]) -> int:
    """0 when no fact failed, 1 otherwise."""
    return 1 if any(f.ok is False for f in facts) else 0


def gib(b: int | float) -> str:
    """`b` bytes as GiB with two decimals ("1.50 GiB")."""
    return f"{b / GiB:.2f} GiB"


def nvml_agrees(nvml: dict, torch: dict, smi: dict | None) -> Fact:
    """Fact 1 from the three readings ({"free", "total"} in bytes; smi None when nvidia-smi is
    missing): free within FREE_TOLERANCE of torch's and SMI_TOLERANCE of nvidia-smi's, totals
    within TOTAL_TOLERANCE of torch's and 1 MiB of nvidia-smi's."""
    df = abs(nvml["free"] - torch["free"])
    dt = abs(nvml["total"] - torch["total"]) / nvml["total"]
    ok = df <= FREE_TOLERANCE and dt <= TOTAL_TOLERANCE
    detail = (f"NVML free {gib(nvml['free'])} / total {gib(nvml['total'])}; torch free "
              f"{gib(torch['free'])} / total {gib(torch['total'])} (free differs "
              f"{df / MiB:.0f} MiB, total {dt * 100:.2f}%)")
    if smi is None:
        detail += "; nvidia-smi not found"
    else:
        ds = abs(nvml["free"] - smi["free"])
        ok = ok and ds <= SMI_TOLERANCE and abs(nvml["total"] - smi["total"]) <= MiB
        detail += f"; nvidia-smi free {gib(smi['free'])} (differs {ds / MiB:.0f} MiB)"
    return Fact("nvml_agrees", ok, detail)


def context_cost(free_before: int, free_during: int, process_used: int | None,
                 headroom: int) -> Fact:
    """Fact 2: a context's cost (NVML free before minus during; NVML's per-process figure when
    it has one) at most `headroom`."""
    cost = max(free_before - free_during, process_used or 0)
    return Fact("context_cost", cost <= headroom,
                f"a CUDA context with cuBLAS costs {cost / MiB:.0f} MiB (free fell "
                f"{(free_before - free_during) / MiB:.0f} MiB"
                + (f", NVML per process {process_used / MiB:.0f} MiB" if process_used else "")
                + f"); headroom VIGIL_GPU_HEADROOM_MIB={headroom // MiB}")


def vllm_rule(free_after_context: int, total: int, util: float) -> bool:
    """vLLM's start-up rule (vllm/v1/worker/utils.py `request_memory`): free memory, once the
    process has its context, at least ceil(total x gpu_memory_utilization)."""
    return free_after_context >= math.ceil(total * util)


def sized_down_start(plan, free_after_context: int, torch_total: int, rule_passed: bool,
                     full_after) -> Fact:
    """Fact 3 from the squeezed plan, what a fresh process saw after making its context, whether
    vLLM's rule held there, and the plan once the co-tenant left (`full_after`)."""
    if plan is None:
        return Fact("sized_down_start", False, "the plan refused the start (memory_pressure) "
                    "although the card had room above the floor")
    util = plan.engine_args.get("gpu_memory_utilization")
    ok = plan.sized_down and util is not None and rule_passed and full_after is not None \
        and not full_after.sized_down
    return Fact("sized_down_start", ok,
                f"plan sized down to gpu_memory_utilization={util} ({plan.describe()}); a fresh "
                f"process saw {gib(free_after_context)} free after its context, vLLM's rule "
                f"wants {gib(math.ceil(torch_total * (util or 0)))}: "
                f"{'held' if rule_passed else 'FAILED'}; after the co-tenant left: "
                + ("full budget" if full_after is not None and not full_after.sized_down
                   else "still sized down"))


def same_card(nvml_uuids: list[str], cuda_uuids: list[str], default_order: list[str]) -> Fact:
    """Fact 4: index i names one card to NVML and to CUDA under PCI_BUS_ID (UUIDs compared
    without NVML's `GPU-` prefix); `default_order` is CUDA's under its own default order."""
    norm = [u.lower().removeprefix("gpu-") for u in nvml_uuids]
    cuda = [u.lower().removeprefix("gpu-") for u in cuda_uuids]
    differs = [u.lower().removeprefix("gpu-") for u in default_order] != norm
    return Fact("same_card", norm == cuda and len(norm) > 0,
                f"{len(norm)} card(s); PCI_BUS_ID order: NVML {norm} vs CUDA {cuda}; CUDA's "
                f"default order {'differs' if differs else 'is the same'} on this host")


def request_cpu(n: int, done: int, cpu_s: float, wall_s: float, cores: int) -> Fact:
    """Fact 6: every request succeeded; the figure is the worker's CPU per request."""
    return Fact("request_cpu", done == n,
                f"{done}/{n} requests; worker CPU {1000 * cpu_s / max(n, 1):.2f} ms/request, "
                f"{n / max(wall_s, 1e-9):.0f} requests/s, on {cores} cores")


def tp_context_cost(costs: dict[str, int], headroom: int, single: int | None = None) -> Fact:
    """Fact 5: what two tensor-parallel ranks cost on each card ({card: bytes}: NVML free before
    minus during), at most `headroom` on every card; `single`, fact 2's one-card figure, shows
    what NCCL added."""
    worst = max(costs.values()) if costs else 0
    ok = bool(costs) and worst <= headroom
    extra = (f"; NCCL and the second rank added {(worst - single) / MiB:.0f} MiB to the one-card "
             f"context" if single is not None else "")
    advice = "" if ok else (f"; raise VIGIL_GPU_HEADROOM_MIB on tensor-parallel workers to at "
                            f"least {math.ceil(worst / MiB / 64) * 64}")
    return Fact("tp_context_cost", ok,
                f"{len(costs)} ranks (CUDA context, NCCL after an all-reduce, cuBLAS) cost "
                + ", ".join(f"card {c}: {b / MiB:.0f} MiB" for c, b in costs.items())
                + f"; headroom VIGIL_GPU_HEADROOM_MIB={headroom // MiB}{extra}{advice} (vLLM's "
                "custom all-reduce buffers and more ranks come on top)")


def restart_s(smoke: dict, goal_s: float = RESTART_GOAL_S) -> Fact:
    """Fact 8 from the smoke's figures: the request killed with its EngineCore finished on a
    recovered engine within `goal_s` seconds of the SIGKILL (`recovered_s`)."""
    took = smoke.get("recovered_s")
    if took is None or not smoke.get("killed") or smoke.get("long_tokens") is None:
        return Fact("restart_s", False, "the smoke did not kill and recover an engine")
    whole = smoke.get("long_tokens") == smoke.get("long_asked")
    return Fact("restart_s", bool(whole and took <= goal_s), (
        f"{took:.1f} s from SIGKILL of EngineCore to the {smoke.get('long_tokens')}-token request "
        f"finished on the recovered engine (goal <= {goal_s:g} s; the same request took "
        f"{smoke.get('long_warm_s')} s on the warm engine); first start {smoke.get('start_s')} s, "
        f"first adapter request {smoke.get('lora_s')} s"))
