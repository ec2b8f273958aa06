"""How `vigil worker` and `vigil housekeeper` start: the cards a GPU worker is given, the pools
and task threads it serves, and the `celery worker` command line each execs (app/ops/cli.py
parses the arguments)."""
from __future__ import annotations

import argparse
import os
import sys

from app.devices import (DEVICE_ORDER, Card, GpuSpecError, NvmlMissing, cuda_versions,
                         describe_versions, gpu_label, load_nvml, node_name, read_cards,
                         version_problem, visible_devices, visible_entries)
from app.requests.engine_defaults import worker_concurrency
from app.requests.models import get_registry
from app.settings import get_settings
from app.state.conn import preflight
from app.state.queues import HOUSEKEEPING_QUEUE, declared_queues, pool_queue

# Celery's mingle waits a second at every worker start for its neighbours' revoked-task lists and
# clocks; Vigil's cancel needs no revoked-task list (a revoked request ends in its record,
# app/fleet/cancel.py, and a worker that never heard the revoke drops its message at claim).
WITHOUT_MINGLE = ("--without-mingle",)


def worker_argv(args: argparse.Namespace, concurrency: int,
                pools: list[str] | None = None) -> list[str]:
    """The `celery worker` command line for `vigil worker` (pure, for tests): it consumes
    housekeeping and the queues of `pools` (default: `--pools`, else every registered pool)."""
    if args.gpu is not None:
        name = args.name or node_name(args.gpu)
    else:
        name = args.name or "cpu@%h"
    if pools is None:
        pools = [p for p in (args.pools or "").split(",") if p]
    queues = ([HOUSEKEEPING_QUEUE] + [pool_queue(p) for p in pools] if pools
              else declared_queues(get_registry().names()))
    return [
        sys.executable, "-m", "celery", "-A", "app", "worker",
        "-P", "threads", "-c", str(args.concurrency or concurrency),
        "-n", name, "-Q", ",".join(queues), *(["-E"] if get_settings().task_events else []),
        "--prefetch-multiplier", "1", "-l", args.loglevel or get_settings().log_level,
        *WITHOUT_MINGLE,
    ]


def gpu_worker_env(indexes: tuple[int, ...], environ) -> dict[str, str]:
    """What a GPU worker on `indexes` adds to its environment before it execs Celery (pure):
    CUDA_DEVICE_ORDER=PCI_BUS_ID (NVML's numbering, so an index names one card to CUDA, NVML and
    nvidia-smi) and CUDA_VISIBLE_DEVICES, narrowed from an inherited one, which wins
    (app/devices.py). Raises GpuSpecError for a card the inherited list does not show."""
    return {"CUDA_DEVICE_ORDER": DEVICE_ORDER,
            "CUDA_VISIBLE_DEVICES": visible_devices(indexes, environ.get("CUDA_VISIBLE_DEVICES"))}


class GpuProblem(Exception):
    """The cards a GPU worker was given cannot be used from this host."""


def check_gpus(entries: tuple[str, ...], nvml=None, torch=None) -> tuple[list[Card], dict]:
    """The cards `entries` names and the driver's and torch's CUDA versions, or GpuProblem saying
    why they cannot be used (a worker that cannot work must not join the fleet and take
    requests). Reads NVML only: no CUDA context is made in this process."""
    if torch is None:
        try:
            import torch
        except ImportError:
            raise GpuProblem("PyTorch is not installed (install the gpu extra)") from None
    if torch.version.cuda is None:
        raise GpuProblem("this PyTorch is a CPU build: Torch not compiled with CUDA enabled")
    try:
        nvml = nvml or load_nvml()
        nvml.nvmlInit()
        try:
            count = int(nvml.nvmlDeviceGetCount())
        finally:
            nvml.nvmlShutdown()
    except NvmlMissing as e:
        raise GpuProblem(str(e)) from None
    except Exception as e:  # NVMLError: LIBRARY_NOT_FOUND, DRIVER_NOT_LOADED, ...
        raise GpuProblem(f"CUDA is not usable here: no NVIDIA driver or no device visible "
                         f"(NVML: {e})") from None
    missing = [e for e in entries if e.isdigit() and int(e) >= count]
    if missing:
        raise GpuProblem(f"there is no GPU {','.join(missing)} (this host shows {count})")
    try:
        cards = read_cards(entries, nvml)
    except Exception as e:
        raise GpuProblem(f"NVML cannot read GPU {','.join(entries)}: {e}") from None
    versions = cuda_versions(nvml, torch)
    problem = version_problem(versions)
    if problem:
        raise GpuProblem(problem)
    return cards, versions


def _gpu_start(args: argparse.Namespace) -> tuple[dict[str, str], list[Card]] | None:
    """Check the cards of `vigil worker --gpu` and print them with the CUDA versions; None (after
    printing why) when the worker must not start."""
    label = gpu_label(args.gpu)
    try:
        env = gpu_worker_env(args.gpu, os.environ)
        cards, versions = check_gpus(visible_entries(env["CUDA_VISIBLE_DEVICES"]))
    except (GpuSpecError, GpuProblem) as problem:
        print(f"vigil worker: cannot use GPU {label}: {problem}. Run `vigil worker --cpu` "
              "on a host without a GPU; otherwise check the NVIDIA driver (nvidia-smi) and "
              "that CUDA_VISIBLE_DEVICES does not hide the device", file=sys.stderr)
        return None
    order = os.environ.get("CUDA_DEVICE_ORDER")
    if order and order != DEVICE_ORDER:
        print(f"vigil worker: CUDA_DEVICE_ORDER={order} replaced by {DEVICE_ORDER}: NVML numbers "
              "cards by PCI bus, and the worker's memory probe must read the cards CUDA uses",
              file=sys.stderr)
    for c in cards:
        print(f"vigil worker: GPU {c.entry}: {c.name} {c.uuid}, {c.free / 2**30:.1f} of "
              f"{c.total / 2**30:.1f} GiB free", file=sys.stderr)
    print(f"vigil worker: {describe_versions(versions)}", file=sys.stderr)
    return env, cards


def gpu_pools(registry, pools: list[str], cards: int) -> list[str] | None:
    """The pools a GPU worker of `cards` cards serves: those its `--pools` named (`pools`), else
    every registered pool whose `tensor_parallel_size` it can run, a line for each left out. None,
    after printing why, when a named pool cannot run on that many cards or none is left: such a
    worker would take requests and fail them (vLLM runs one rank per card)."""
    kept, skipped = registry.split_by_cards(pools or registry.names(), cards)
    if pools and skipped:
        print(f"vigil worker: {'; '.join(skipped.values())}", file=sys.stderr)
        return None
    for pool, why in skipped.items():
        print(f"vigil worker: not consuming pool {pool}: {why}", file=sys.stderr)
    if not kept:
        print(f"vigil worker: no registered pool runs on {cards} card(s); start it with the "
              "cards a pool's tensor_parallel_size asks for", file=sys.stderr)
        return None
    return kept


def worker_threads(asked: int, specs: list, platform: str, cards: list[Card]) -> int:
    """The task threads of a worker that asked for `asked`: at least the largest max_num_seqs of
    the models it serves on `platform` (app/requests/engine_defaults.py), or its engine's batch
    never fills; says so when it raises the number."""
    small = min(cards, key=lambda c: c.total) if cards else None
    threads = worker_concurrency(asked, [spec.engine_args for spec in specs], platform,
                                 small.total if small else None, small.name if small else "")
    if threads > asked:
        print(f"vigil worker: concurrency {asked} raised to {threads}, the largest max_num_seqs "
              "of the pools it serves here, so the engine's batch can fill", file=sys.stderr)
    return threads


def run_worker(args: argparse.Namespace) -> int:
    """`vigil worker`: check its cards and pools, then exec `celery worker` (returns only the
    exit status of a worker that must not start)."""
    env: dict[str, str] = {}
    cards: list[Card] = []
    if args.gpu is not None:
        checked = _gpu_start(args)
        if checked is None:
            return 2
        env = checked[0]
        cards = checked[1]
    s = get_settings()
    reg = get_registry()
    pools = [p for p in (args.pools or "").split(",") if p]
    for p in pools:
        reg.get(p)  # an unknown pool fails here, by name, not later in a queue declaration
    served = pools or reg.names()
    if args.gpu is not None:
        # A pool whose tensor_parallel_size is not this worker's number of cards is not consumed
        # (named in --pools: the worker does not start).
        served = gpu_pools(reg, pools, len(cards))
        if served is None:
            return 2
        # An entry that would kill the engine stops the worker, not a request.
        reg.refuse_unrunnable("cuda", f"VIGIL_MODELS_FILE={s.models_file}" if s.models_file
                              else "the built-in models", served)
    asked = args.concurrency or s.worker_concurrency
    # A GPU engine runs up to max_num_seqs sequences; CPU workers keep the number given (small
    # ones are how tests and small hosts run them).
    threads = worker_threads(asked, [reg.get(p) for p in served], "cuda",
                             cards) if args.gpu is not None else asked
    # Redis refusing the credentials or the TLS handshake stops the worker here, by name;
    # Celery would retry the connection for many minutes (app/state/conn.py).
    preflight(s)
    os.environ.update(env)
    if threads != asked:  # the worker's Redis pools are sized from it: say what Celery runs
        os.environ["VIGIL_WORKER_CONCURRENCY"] = str(threads)
        args.concurrency = threads
    if args.pools:
        os.environ["VIGIL_POOLS"] = args.pools
    argv = worker_argv(args, s.worker_concurrency, served)
    os.execv(argv[0], argv)  # the worker replaces this process: signals reach Celery directly
    return 0  # pragma: no cover


def housekeeper_argv(args: argparse.Namespace, concurrency: int) -> list[str]:
    """The `celery worker` command line for `vigil housekeeper` (pure, for tests): a threads-pool
    worker consuming vigil.housekeeping only."""
    return [
        sys.executable, "-m", "celery", "-A", "app", "worker",
        "-P", "threads", "-c", str(args.concurrency or concurrency),
        "-n", args.name or "housekeeper@%h", "-Q", HOUSEKEEPING_QUEUE,
        "--prefetch-multiplier", "1", "-l", args.loglevel or get_settings().log_level,
        *WITHOUT_MINGLE,
    ]


def run_housekeeper(args: argparse.Namespace) -> int:
    """`vigil housekeeper`: exec a `celery worker` for beat's tasks only, no engine."""
    s = get_settings()
    preflight(s)  # bad credentials or TLS stop it here, by name
    os.environ["VIGIL_ROLE"] = "housekeeper"  # its worker hooks build no engine (lifecycle.py)
    argv = housekeeper_argv(args, s.housekeeper_concurrency)
    os.execv(argv[0], argv)  # signals reach Celery directly
    return 0  # pragma: no cover
