"""The GPUs a worker owns: `vigil worker --gpu SPEC`, CUDA_VISIBLE_DEVICES, and NVML.

Shared by the `vigil worker` command (which checks the cards and sets the environment before it
execs Celery) and the worker process (whose memory probe reads the same cards):

- `parse_gpu_spec("0,1" | "0-3" | "2")`: the card indexes `--gpu` names, sorted, no duplicates.
- `gpu_label` / `node_name`: `gpu0@%h`, `gpu0-1@%h`, `gpu0-1_4@%h` (ranges joined with `-`).
- `visible_devices(indexes, inherited)`: the worker's CUDA_VISIBLE_DEVICES. **An inherited
  CUDA_VISIBLE_DEVICES wins** (Slurm and container runtimes set it for the job): `--gpu N`
  then picks the N-th entry of that list, which is never widened; without one, N is the card's
  own index.
- `DEVICE_ORDER`: CUDA numbers cards fastest-first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, while NVML
  always numbers them by PCI bus: on a host with mixed cards "GPU 1" would name two different
  cards. Workers run with PCI_BUS_ID, so an index means one card to CUDA, NVML and nvidia-smi.
- NVML (`nvidia-ml-py`, imported as `pynvml`) is the only way Vigil reads a card's memory: the
  torch fallback (`torch.cuda.mem_get_info`) creates a CUDA context, about half a GiB of the
  card, in the Celery process for its whole life, so its absence is an error (`NvmlMissing`).
  A card NVML reports lost (or no longer finds) is `WorkerFatalError(cuda_context_lost)`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from app.errors import CUDA_CONTEXT_LOST, WorkerFatalError

DEVICE_ORDER = "PCI_BUS_ID"
_SPEC_PART = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")
# NVML's return codes that mean the card is gone, not that NVML had a hiccup (nvml.h).
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_GPU_IS_LOST = 15
_LOST = (NVML_ERROR_NOT_FOUND, NVML_ERROR_GPU_IS_LOST)


class GpuSpecError(ValueError):
    """A `--gpu` value that names no card, or a card the inherited CUDA_VISIBLE_DEVICES hides."""


class NvmlMissing(RuntimeError):
    """nvidia-ml-py is not installed: the worker cannot read its cards without a CUDA context."""


NVML_MISSING = ("nvidia-ml-py is not installed (install the gpu extra: pip install "
                "'vigil[gpu]'); Vigil reads GPU memory through NVML only, because the torch "
                "fallback (torch.cuda.mem_get_info) would create a CUDA context, about 0.5 GiB of "
                "the card, in the worker process for its whole life")


def parse_gpu_spec(text: str) -> tuple[int, ...]:
    """The card indexes of a `--gpu` value: `N`, a list `0,1`, ranges `0-3`, or both (`0-1,4`).
    Raises GpuSpecError on anything else (an empty part, a reversed range, a negative index)."""
    out: set[int] = set()
    for part in str(text).split(","):
        m = _SPEC_PART.match(part)
        if not m:
            raise GpuSpecError(f"--gpu {text!r}: expected N, N,M or N-M (e.g. 0, 0,1 or 0-3)")
        lo, hi = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
        if hi < lo:
            raise GpuSpecError(f"--gpu {text!r}: range {lo}-{hi} runs backwards")
        out.update(range(lo, hi + 1))
    return tuple(sorted(out))


def gpu_label(indexes: tuple[int, ...]) -> str:
    """`0`, `0-1`, `0-3`, `0-1_4`: the indexes with runs written as ranges (a node-name part:
    commas would clash with Celery's lists of names)."""
    runs: list[list[int]] = []
    for i in sorted(indexes):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return "_".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def node_name(indexes: tuple[int, ...]) -> str:
    """The default Celery node name of a GPU worker: `gpu0@%h`, `gpu0-1@%h` (tensor parallel)."""
    return f"gpu{gpu_label(indexes)}@%h"


def visible_devices(indexes: tuple[int, ...], inherited: str | None) -> str:
    """The CUDA_VISIBLE_DEVICES of a worker on `indexes`. With an inherited list (Slurm, a
    container runtime, an operator), index N is that list's N-th entry (an index, a GPU-... or
    MIG-... UUID): the inherited list wins and is only narrowed. Raises GpuSpecError for an
    index past its end."""
    entries = [e.strip() for e in (inherited or "").split(",") if e.strip()]
    if inherited is None or not inherited.strip():
        return ",".join(str(i) for i in indexes)
    missing = [i for i in indexes if i >= len(entries)]
    if missing:
        raise GpuSpecError(
            f"--gpu {gpu_label(indexes)}: the inherited CUDA_VISIBLE_DEVICES={inherited} shows "
            f"{len(entries)} card(s), numbered 0-{len(entries) - 1} for --gpu; it wins over "
            "--gpu, which picks among the cards it shows")
    return ",".join(entries[i] for i in indexes)


def visible_entries(value: str | None) -> tuple[str, ...]:
    """The entries of a CUDA_VISIBLE_DEVICES value (indexes or UUIDs), empty when unset."""
    return tuple(e.strip() for e in (value or "").split(",") if e.strip())


@dataclass(frozen=True)
class Card:
    """One card as NVML sees it."""
    entry: str  # as CUDA_VISIBLE_DEVICES names it: an index, or a GPU-/MIG- UUID
    name: str
    uuid: str
    free: int
    total: int


def load_nvml():
    """The `pynvml` module of nvidia-ml-py; NvmlMissing without it (never torch)."""
    try:
        import pynvml
    except ImportError:
        raise NvmlMissing(NVML_MISSING) from None
    return pynvml


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _handle(nvml, entry: str):
    if entry.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(entry))
    return nvml.nvmlDeviceGetHandleByUUID(entry)


def read_cards(entries: tuple[str, ...], nvml=None) -> list[Card]:
    """Free/total memory of each card in `entries` (CUDA_VISIBLE_DEVICES entries, read with
    CUDA_DEVICE_ORDER=PCI_BUS_ID, so an index is NVML's index). A card NVML reports lost or no
    longer finds raises WorkerFatalError(cuda_context_lost); other NVML errors propagate."""
    nvml = nvml or load_nvml()
    nvml.nvmlInit()
    try:
        cards = []
        for entry in entries:
            try:
                h = _handle(nvml, entry)
                mem = nvml.nvmlDeviceGetMemoryInfo(h)
                cards.append(Card(entry, _text(nvml.nvmlDeviceGetName(h)),
                                  _text(nvml.nvmlDeviceGetUUID(h)), int(mem.free),
                                  int(mem.total)))
            except nvml.NVMLError as e:
                if getattr(e, "value", None) in _LOST:
                    raise WorkerFatalError.of(CUDA_CONTEXT_LOST, (
                        f"GPU {entry} is lost: NVML says {e}; of this worker's cards "
                        f"{','.join(entries)}, every one is needed")) from None
                raise
        return cards
    finally:
        nvml.nvmlShutdown()


def _cuda_version(code: int) -> str:
    """NVML's CUDA version integer (13000) as text ("13.0")."""
    return f"{code // 1000}.{(code % 1000) // 10}"


def cuda_versions(nvml=None, torch=None) -> dict[str, str]:
    """The driver's version and the newest CUDA it supports (NVML), torch's version and the CUDA
    it was built for: printed at every GPU worker start."""
    nvml = nvml or load_nvml()
    nvml.nvmlInit()
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        driver_cuda = _cuda_version(int(nvml.nvmlSystemGetCudaDriverVersion()))
    finally:
        nvml.nvmlShutdown()
    if torch is None:
        import torch
    return {"driver": driver, "driver_cuda": driver_cuda, "torch": str(torch.__version__),
            "torch_cuda": str(torch.version.cuda)}


def version_problem(v: dict[str, str]) -> str | None:
    """Why the driver cannot run this torch (None when it can): CUDA keeps compatibility within a
    major version only, so a driver whose CUDA major is older than torch's fails at the first
    CUDA call (torch 2.13/2.14 of vLLM 0.32/0.33 are CUDA 13 builds: driver R580 or newer)."""
    try:
        have = int(v["driver_cuda"].split(".")[0])
        want = int(v["torch_cuda"].split(".")[0])
    except (KeyError, ValueError):
        return f"cannot compare the driver's CUDA with torch's ({v})"
    if have < want:
        return (f"the NVIDIA driver {v['driver']} supports CUDA up to {v['driver_cuda']}, but "
                f"torch {v['torch']} is built for CUDA {v['torch_cuda']}: install a driver for "
                f"CUDA {want} (R580 or newer for CUDA 13)")
    return None


def describe_versions(v: dict[str, str]) -> str:
    """One log line of the driver's and torch's CUDA versions."""
    return (f"NVIDIA driver {v['driver']} (CUDA {v['driver_cuda']}), torch {v['torch']} "
            f"(built for CUDA {v['torch_cuda']})")
