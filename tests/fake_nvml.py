"""A stand-in for nvidia-ml-py's `pynvml`, for unit tests on machines without a GPU: the same
function names, return shapes and error type (an NVMLError carrying NVML's return code in
`.value`), over a list of cards the test sets up. Unit tier only (docs/testing.md)."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

GiB = 1 << 30


class NVMLError(Exception):
    """pynvml.NVMLError: `value` is NVML's return code (nvml.h)."""

    def __init__(self, value: int):
        super().__init__({6: "Not Found", 15: "GPU is lost", 999: "Unknown Error"}.get(
            value, f"NVML error {value}"))
        self.value = value


@dataclass
class FakeCard:
    free: int
    total: int = 80 * GiB
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = ""
    lost: bool = False


@dataclass
class FakeNvml:
    cards: list[FakeCard] = field(default_factory=list)
    driver: str = "580.82.07"
    cuda_driver_version: int = 13000
    NVMLError = NVMLError
    inits: int = 0
    open: int = 0

    def __post_init__(self):
        for i, c in enumerate(self.cards):
            c.uuid = c.uuid or f"GPU-{i:08d}-0000-0000-0000-000000000000"

    def nvmlInit(self):
        self.inits += 1
        self.open += 1

    def nvmlShutdown(self):
        self.open -= 1

    def nvmlDeviceGetHandleByIndex(self, i: int):
        if i >= len(self.cards):
            raise NVMLError(2)  # NVML_ERROR_INVALID_ARGUMENT: no such index
        return self.cards[i]

    def nvmlDeviceGetHandleByUUID(self, uuid: str):
        for c in self.cards:
            if c.uuid == uuid:
                return c
        raise NVMLError(6)

    def nvmlDeviceGetMemoryInfo(self, card: FakeCard):
        if card.lost:
            raise NVMLError(15)
        return SimpleNamespace(free=card.free, total=card.total, used=card.total - card.free)

    def nvmlDeviceGetName(self, card: FakeCard):
        return card.name

    def nvmlDeviceGetUUID(self, card: FakeCard):
        return card.uuid

    def nvmlDeviceGetCount(self):
        return len(self.cards)

    def nvmlSystemGetDriverVersion(self):
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self):
        return self.cuda_driver_version
