"""GPU check for the memory probe and the memory_pressure signal (issue 3), for a machine with an
NVIDIA GPU and torch (vLLM is not needed). Runs in well under five minutes:

    python bench/gpu_memory_check.py [--index 0] [--hold-fraction 0.8]

1. Compares the worker's own probe (workers/engine/memory.py: NVML, else torch) with `nvidia-smi`.
2. Sizes a model entry asking for the default budget (gpu_memory_utilization 0.9) on the idle
   card: expected granted in full.
3. Starts a second process that holds `--hold-fraction` of the card with a torch allocation,
   probes again, and shows that the sizing logic now sizes below the request, or refuses with
   memory_pressure when even the floor does not fit.
4. Releases the holder and shows the full grant again.
Prints one JSON line per step; exit status 0 when every expectation held.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.errors import TransientError  # noqa: E402
from app.requests.models import ModelSpec  # noqa: E402
from workers.engine.memory import GiB, plan_memory, probe_memory  # noqa: E402

HOLDER = """
import sys, torch
n = int(sys.argv[1])
x = torch.empty(n, dtype=torch.uint8, device="cuda:0")
x.fill_(1)
torch.cuda.synchronize()
print("held", flush=True)
sys.stdin.read()
"""


def smi(index: int) -> dict:
    out = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=memory.free,memory.total",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         check=True).stdout.strip()
    free_mib, total_mib = (int(x) for x in out.split(","))
    return {"free": free_mib << 20, "total": total_mib << 20}


def step(name: str, **fields) -> None:
    print(json.dumps({"step": name, **fields}), flush=True)


def sizing(spec: ModelSpec, index: int) -> dict:
    p = probe_memory("cuda", index)
    try:
        plan = plan_memory(spec, p)
        return {"probe_free_gib": round(p.free / GiB, 2), "source": p.source,
                "requested_gib": round(plan.requested / GiB, 2),
                "granted_gib": round(plan.granted / GiB, 2), "sized_down": plan.sized_down,
                "engine_args": plan.engine_args}
    except TransientError as e:
        return {"probe_free_gib": round(p.free / GiB, 2), "source": p.source,
                "refused": str(e)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--hold-fraction", type=float, default=0.8)
    a = ap.parse_args()
    ok = True
    probe = probe_memory("cuda", a.index)
    ref = smi(a.index)
    diff_mib = abs(probe.free - ref["free"]) / (1 << 20)
    step("probe_vs_nvidia_smi", probe_free=probe.free, probe_total=probe.total,
         source=probe.source, smi_free=ref["free"], smi_total=ref["total"],
         free_diff_mib=round(diff_mib, 1))
    ok &= diff_mib < 256 and abs(probe.total - ref["total"]) < (64 << 20)

    # A model needing 16 GiB besides a KV cache of at least 4 GiB, asking for 90% of the card.
    spec = ModelSpec(name="gpu-check", memory_gib=16, kv_cache_floor_gib=4,
                     engine_args={"gpu_memory_utilization": 0.9})
    idle = sizing(spec, a.index)
    step("idle_card", **idle)
    ok &= idle.get("sized_down") is False

    hold = int(probe.total * a.hold_fraction)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(a.index))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(hold)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env=env)
    try:
        assert holder.stdout.readline().strip() == b"held"
        time.sleep(0.5)
        squeezed = sizing(spec, a.index)
        step("card_held_by_another_process", held_gib=round(hold / GiB, 2),
             smi_free=smi(a.index)["free"], **squeezed)
        ok &= squeezed.get("sized_down") is True or "memory_pressure" in squeezed.get("refused", "")
    finally:
        holder.kill()
        holder.wait()
    time.sleep(1.0)
    after = sizing(spec, a.index)
    step("after_holder_exit", **after)
    ok &= after.get("sized_down") is False
    step("result", ok=bool(ok))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
