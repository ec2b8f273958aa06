"""The GPU check's measurements on the card (bench/gpu_check.py), GPU only: each `check_*` runs
in a step process (`--step NAME`) and its readings in helper processes of its own (the scripts
below), so that the check's own process never holds a CUDA context; each ends by `deadline`
(monotonic) and hands its readings to its verdict (bench/gpu_facts.py).
"""
from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from app.devices import DEVICE_ORDER, load_nvml, read_cards
from app.errors import TransientError
from app.requests.models import ModelSpec
from bench.gpu_facts import (BACK_TOLERANCE, Fact, context_cost, gib, nvml_agrees, request_cpu,
                             restart_s, same_card, sized_down_start, tp_context_cost)
from bench.gpu_steps import STEP_FACTS
from workers.engine.memory import MiB, plan_memory, probe_memory

REPO = Path(__file__).resolve().parents[1]


def _left(deadline: float, reserve: float = 0.0) -> float:
    """Seconds until `deadline` (monotonic), less `reserve`; at least one."""
    return max(1.0, deadline - time.monotonic() - reserve)


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
                 f"{smoke['detail']}; NVML free {gib(baseline)} before, {gib(after)} after "
                 f"shutdown ({'back' if back else 'NOT back'})"), restart_s(smoke)]
