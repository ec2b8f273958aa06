"""The GPU check: one PASS/FAIL line per fact about Vigil's CUDA path that only a GPU host can show
(issue 34). It replaces bench/gpu_memory_check.py, whose steps are its first and third facts.

    python -m bench.gpu_check [--index 0] [--hold-fraction 0.8] [--requests 1000] [--no-engine]

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
  5. request_cpu        the per-request CPU of a real worker (instant engine: Vigil's whole path,
                        no model) on this host's cores; needs redis-server, else SKIP
  6. engine_smoke       with vLLM installed: a random-weight model built here, bfloat16, LoRA on;
                        one base and one adapter request, EngineCore SIGKILLed under a request
                        and the request finished on a recovered engine, and the card's memory
                        back in NVML after shutdown; without vLLM, SKIP

Needs only what a bare GPU host has plus carried wheels: the NVIDIA driver, torch (CUDA build),
nvidia-ml-py, Vigil's own dependencies; nvidia-smi for part of fact 1; redis-server for fact 5;
vLLM for fact 6. Nothing is downloaded (no package index, no model hub: the model and its adapter
are built locally). Runs in well under 8 minutes (two engine starts of a tiny model dominate).

Exit status: 0 when no fact failed (SKIPs allowed), 1 when one failed, 77 when there is no GPU
here (one `NO GPU` line, nothing checked). Put the figures in docs/field-notes.md with the host's
GPU, driver and commit.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.devices import DEVICE_ORDER, NvmlMissing, load_nvml, read_cards  # noqa: E402
from app.errors import TransientError  # noqa: E402
from app.requests.models import ModelSpec  # noqa: E402
from app.settings_defaults import DEFAULT_GPU_HEADROOM_MIB  # noqa: E402
from workers.engine.memory import GiB, MiB, plan_memory, probe_memory  # noqa: E402

EXIT_NO_GPU = 77  # automake's "skipped"
FREE_TOLERANCE = 256 * MiB  # two reads of free memory a moment apart, by two APIs
SMI_TOLERANCE = 64 * MiB
TOTAL_TOLERANCE = 0.02  # NVML's total counts memory the driver reserves; CUDA's does not
BACK_TOLERANCE = 256 * MiB  # memory back after an engine shut down


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
    """Fact 5: every request succeeded; the figure is the worker's CPU per request."""
    return Fact("request_cpu", done == n,
                f"{done}/{n} requests; worker CPU {1000 * cpu_s / max(n, 1):.2f} ms/request, "
                f"{n / max(wall_s, 1e-9):.0f} requests/s, on {cores} cores")


# -- the measurements (GPU only) -----------------------------------------------------------------
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


class Child:
    """A helper process that prints one line when ready and lives until closed."""

    def __init__(self, code: str, *args: str, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        self.first = self.proc.stdout.readline().strip()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _card_env(entry: str) -> dict:
    return {"CUDA_DEVICE_ORDER": DEVICE_ORDER, "CUDA_VISIBLE_DEVICES": entry}


def _free(entry: str) -> int:
    return read_cards((entry,))[0].free


def _smi(index: int) -> dict | None:
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=memory.free,memory.total",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         check=True).stdout.strip()
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


def check_memory(entry: str, headroom: int) -> list[Fact]:
    """Facts 1 and 2: one context process gives torch's reading and the context's cost."""
    before = _free(entry)
    ctx = Child(CONTEXT, "0", env=_card_env(entry))
    try:
        torch_mem = json.loads(ctx.first)
        card = read_cards((entry,))[0]
        facts = [nvml_agrees({"free": card.free, "total": card.total}, torch_mem,
                             _smi(int(entry))),
                 context_cost(before, card.free, _process_used(entry, ctx.proc.pid), headroom)]
    finally:
        ctx.close()
    return facts


def check_sized_down(entry: str, hold_fraction: float, headroom: int) -> Fact:
    """Fact 3."""
    spec = ModelSpec(name="gpu-check", memory_gib=2, kv_cache_floor_gib=1,
                     engine_args={"gpu_memory_utilization": 0.9})
    total = read_cards((entry,))[0].total
    holder = Child(HOLDER, str(int(total * hold_fraction)), env=_card_env(entry))
    try:
        try:
            plan = plan_memory(spec, probe_memory("cuda", (entry,)), headroom)
        except TransientError:
            plan = None
        util = (plan.engine_args.get("gpu_memory_utilization", 0.9) if plan else 0.9)
        out = subprocess.run([sys.executable, "-c", ENGINECORE_LIKE, str(util)],
                             capture_output=True, text=True, env={**os.environ,
                                                                  **_card_env(entry)})
        seen = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        holder.close()
    deadline = time.monotonic() + 30
    full = None
    while time.monotonic() < deadline:
        full = plan_memory(spec, probe_memory("cuda", (entry,)), headroom)
        if not full.sized_down:
            break
        time.sleep(0.5)
    return sized_down_start(plan, seen["free"], seen["total"], seen["passed"], full)


def check_same_card() -> Fact:
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
                             env=env, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    return same_card(uuids, cuda(DEVICE_ORDER), cuda(None))


def check_request_cpu(n: int) -> Fact:
    """Fact 5: a real worker (instant engine) on a private redis-server."""
    import psutil

    from app.local.embedded import (EmbeddedRedis, redis_server_path, start_worker,
                                    stop_process, wait_for)
    try:
        redis_server_path()
    except RuntimeError as e:
        return Fact("request_cpu", None, str(e))
    redis = EmbeddedRedis().start()
    os.environ["VIGIL_REDIS_URL"] = redis.url
    tmp = Path(tempfile.mkdtemp(prefix="vigil-gpu-check-"))
    worker = start_worker(redis.url, "gpucheck@%h", tmp / "worker.log", concurrency=64,
                          VIGIL_ENGINE="instant", VIGIL_CACHE_DIR=str(tmp / "cache"))
    try:
        from tasks.inference import generate

        wait_for(lambda: generate.delay(model="tiny-llama", prompt="warm", max_tokens=1).get(
            timeout=120) is not None, 180, what="the worker's first answer")
        proc = psutil.Process(worker.pid)
        t0 = proc.cpu_times()
        start = time.monotonic()
        results = [generate.delay(model="tiny-llama", prompt=f"hello {i}", max_tokens=1)
                   for i in range(n)]
        done = sum(1 for r in results if r.get(timeout=300).get("completion_tokens"))
        wall = time.monotonic() - start
        t1 = proc.cpu_times()
        cpu = (t1.user + t1.system) - (t0.user + t0.system)
        return request_cpu(n, done, cpu, wall, os.cpu_count() or 0)
    finally:
        stop_process(worker)
        redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def check_engine(entry: str, headroom: int) -> Fact:
    """Fact 6, in a process of its own (bench/gpu_engine_smoke.py) so that the card's memory is
    measured after everything of the engine is gone."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return Fact("engine_smoke", None, "vLLM is not installed here")
    baseline = _free(entry)
    out = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_engine_smoke.py"),
                          str(headroom)], capture_output=True, text=True, timeout=420,
                         env={**os.environ, **_card_env(entry), "HF_HUB_OFFLINE": "1"})
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("SMOKE ")]
    if out.returncode != 0 or not lines:
        return Fact("engine_smoke", False, f"the smoke process failed (exit {out.returncode}): "
                    + " | ".join(out.stderr.strip().splitlines()[-5:]))
    smoke = json.loads(lines[-1][len("SMOKE "):])
    deadline = time.monotonic() + 30
    after = _free(entry)
    while baseline - after > BACK_TOLERANCE and time.monotonic() < deadline:
        time.sleep(0.5)
        after = _free(entry)
    back = baseline - after <= BACK_TOLERANCE
    return Fact("engine_smoke", bool(smoke["ok"]) and back,
                f"{smoke['detail']}; NVML free {_gib(baseline)} before, {_gib(after)} after "
                f"shutdown ({'back' if back else 'NOT back'})")


def main(argv: list[str] | None = None) -> int:
    """Run every fact on the card `--index`; print one line per fact."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", type=int, default=0, help="the card (PCI bus order)")
    ap.add_argument("--hold-fraction", type=float, default=0.8)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--no-engine", action="store_true", help="skip the vLLM engine smoke")
    a = ap.parse_args(argv)
    reason = no_gpu_reason()
    if reason:
        print(f"NO GPU here ({reason}): nothing checked; run bench/gpu_check.py on a host with "
              "an NVIDIA GPU, its driver, nvidia-ml-py and a CUDA build of torch", flush=True)
        return EXIT_NO_GPU
    headroom = int(os.environ.get("VIGIL_GPU_HEADROOM_MIB", DEFAULT_GPU_HEADROOM_MIB)) * MiB
    entry = str(a.index)
    started = time.monotonic()
    facts: list[Fact] = []
    steps = [lambda: check_memory(entry, headroom),
             lambda: [check_sized_down(entry, a.hold_fraction, headroom)],
             lambda: [check_same_card()],
             lambda: [check_request_cpu(a.requests)],
             lambda: [Fact("engine_smoke", None, "--no-engine")] if a.no_engine
             else [check_engine(entry, headroom)]]
    names = ["nvml_agrees", "sized_down_start", "same_card", "request_cpu", "engine_smoke"]
    for name, step in zip(names, steps):
        try:
            new = step()
        except Exception as e:  # one broken step must not hide the others' lines
            new = [Fact(name, False, f"{type(e).__name__}: {e}")]
        for f in new:
            print(f.line(), flush=True)
        facts += new
    card = read_cards((entry,))[0]
    print(f"gpu_check: {card.name} {card.uuid}, {len(facts)} facts in "
          f"{time.monotonic() - started:.0f} s", flush=True)
    return exit_status(facts)


if __name__ == "__main__":
    sys.exit(main())
