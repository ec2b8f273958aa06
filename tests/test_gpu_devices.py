"""Unit tier: the GPU side of a worker without a GPU (faked NVML cards, tests/fake_nvml.py):
`--gpu` specs and node names, CUDA_VISIBLE_DEVICES (an inherited one wins), NVML as the only
memory source (no torch fallback), every card of a tensor-parallel worker probed and planned,
a lost card, the headroom checked against vLLM's own start-up rule, the driver/torch CUDA check.
"""
from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import pytest

from app.devices import (GpuSpecError, NvmlMissing, cuda_versions, gpu_label, node_name,
                         parse_gpu_spec, read_cards, version_problem, visible_devices)
from app.errors import TransientError, WorkerFatalError
from app.requests.models import ModelSpec
from app.settings_defaults import DEFAULT_GPU_HEADROOM_MIB
from tests.fake_nvml import FakeCard, FakeNvml
from workers.engine.memory import GiB, MiB, plan_memory, probe_memory, worker_device
from workers.heartbeat import device_fields

SPEC = ModelSpec(name="m", memory_gib=16, kv_cache_floor_gib=4,
                 engine_args={"gpu_memory_utilization": 0.9})


@pytest.mark.parametrize("text, want, label", [
    ("0", (0,), "0"), ("3", (3,), "3"), ("0,1", (0, 1), "0-1"), ("0-3", (0, 1, 2, 3), "0-3"),
    ("1,0", (0, 1), "0-1"), ("0-1,4", (0, 1, 4), "0-1_4"), ("0,2", (0, 2), "0_2"),
    (" 2 - 3 ", (2, 3), "2-3"),
])
def test_gpu_specs_name_cards_and_workers(text, want, label):
    assert parse_gpu_spec(text) == want
    assert gpu_label(want) == label and node_name(want) == f"gpu{label}@%h"


@pytest.mark.parametrize("bad", ["", "a", "0,", "3-1", "-1", "0;1", "1.5"])
def test_a_gpu_spec_that_names_no_card_is_refused(bad):
    with pytest.raises(GpuSpecError):
        parse_gpu_spec(bad)


def test_an_inherited_cuda_visible_devices_wins_and_is_only_narrowed():
    assert visible_devices((0, 1), None) == "0,1"
    assert visible_devices((0,), "") == "0"
    # Slurm gave the job cards 2 and 3: --gpu 0 is card 2, --gpu 1 card 3, --gpu 0-1 both.
    assert visible_devices((0,), "2,3") == "2"
    assert visible_devices((1,), "2,3") == "3"
    assert visible_devices((0, 1), "2, 3") == "2,3"
    assert visible_devices((0,), "GPU-aaaa,GPU-bbbb") == "GPU-aaaa"
    with pytest.raises(GpuSpecError, match="inherited CUDA_VISIBLE_DEVICES=2,3 shows 2 card"):
        visible_devices((2,), "2,3")  # never widened past what the job was given


def test_the_worker_device_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert worker_device() == ("cuda", ("2", "3"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa")
    assert worker_device() == ("cuda", ("GPU-aaaa",))  # before: a UUID made it a CPU worker
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert worker_device()[0] == "cpu"


def test_nvml_reads_each_card_by_index_or_uuid_and_always_shuts_down():
    nvml = FakeNvml([FakeCard(70 * GiB), FakeCard(60 * GiB), FakeCard(10 * GiB)])
    cards = read_cards(("2", nvml.cards[0].uuid), nvml)
    assert [(c.entry, c.free) for c in cards] == [("2", 10 * GiB), (nvml.cards[0].uuid, 70 * GiB)]
    assert nvml.open == 0 and nvml.inits == 1


def test_without_nvidia_ml_py_the_probe_refuses_and_never_touches_torch(monkeypatch):
    """The torch fallback created a CUDA context (~0.5 GiB) in the Celery process for its whole
    life: refused, naming the fix."""
    import torch

    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError

    def no_context(*a, **k):
        raise AssertionError("the probe created a CUDA context")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_context)
    with pytest.raises(NvmlMissing, match="nvidia-ml-py is not installed.*torch fallback"):
        probe_memory("cuda", ("0",))


def test_a_tensor_parallel_probe_reads_every_card_and_the_smallest_bounds_it():
    nvml = FakeNvml([FakeCard(70 * GiB), FakeCard(40 * GiB)])
    p = probe_memory("cuda", ("0", "1"), nvml)
    assert p.free == 2 * 40 * GiB and p.total == 160 * GiB and len(p.cards) == 2
    fields = p.heartbeat_fields()
    assert fields["device_cards"] == f"0:{70 * GiB}:{80 * GiB},1:{40 * GiB}:{80 * GiB}"
    assert fields["device_free_bytes"] == 80 * GiB
    plan = plan_memory(SPEC, p)
    # One utilization for every rank, set by the fuller card: (40 GiB - headroom) / 80 GiB.
    util = plan.engine_args["gpu_memory_utilization"]
    assert util <= (40 * GiB - DEFAULT_GPU_HEADROOM_MIB * MiB) / (80 * GiB)
    assert util > (40 * GiB - DEFAULT_GPU_HEADROOM_MIB * MiB) / (80 * GiB) - 1e-4
    assert plan.sized_down and plan.floor == (16 + 4) * GiB // 2  # the floor split over 2 cards


def test_on_two_idle_cards_the_full_budget_is_granted_and_the_floor_is_per_card():
    p = probe_memory("cuda", ("0", "1"), FakeNvml([FakeCard(79 * GiB), FakeCard(79 * GiB)]))
    plan = plan_memory(SPEC, p)
    assert not plan.sized_down and plan.engine_args == {}
    # 20 GiB of model on one 12 GiB-free card is refused; on two cards (10 GiB each) it starts.
    one = probe_memory("cuda", ("0",), FakeNvml([FakeCard(12 * GiB)]))
    with pytest.raises(TransientError, match="^memory_pressure: "):
        plan_memory(SPEC, one)
    two = probe_memory("cuda", ("0", "1"), FakeNvml([FakeCard(12 * GiB), FakeCard(12 * GiB)]))
    assert plan_memory(SPEC, two).sized_down


def test_a_card_lost_under_the_worker_is_worker_fatal_and_the_heartbeat_reports_it():
    nvml = FakeNvml([FakeCard(70 * GiB), FakeCard(70 * GiB, lost=True)])
    with pytest.raises(WorkerFatalError, match="^cuda_context_lost: GPU 1 is lost"):
        probe_memory("cuda", ("0", "1"), nvml)
    assert nvml.open == 0
    lost = []
    fields = device_fields(lambda: probe_memory("cuda", ("0", "1"), nvml), lost.append)
    assert fields["device_free_bytes"] is None and len(lost) == 1
    assert lost[0].code == "cuda_context_lost"
    # A card that vanished (NVML no longer finds its UUID) is lost too.
    with pytest.raises(WorkerFatalError):
        read_cards(("GPU-gone",), nvml)


def test_a_card_lost_under_a_running_worker_makes_it_leave_once(monkeypatch):
    """The wiring in the runtime, without a worker process: its heartbeat's fields probe every
    card, and a lost one makes the worker leave (workers/held.py `leave`), off the heartbeat
    thread, once however many heartbeats see it."""
    import os
    import threading

    from app.settings import load_settings
    from tests.unit_helpers import RecordingPorts, wait_until
    from workers import runtime as runtime_mod

    monkeypatch.setattr(os, "environ", {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"})
    nvml = FakeNvml([FakeCard(70 * GiB), FakeCard(70 * GiB, lost=True)])
    monkeypatch.setattr(runtime_mod, "probe_memory",
                        lambda device, where: probe_memory(device, where, nvml))
    rt = runtime_mod.WorkerRuntime(load_settings(redis_url="redis://127.0.0.1:9/0"), "gpu0-1@h",
                                   engine="instant", guard=False, ports=RecordingPorts())
    left = []

    def leave(err):
        left.append((err, threading.current_thread().name))
        rt.held.leaving = err

    rt.held.leave = leave
    fields = rt._heartbeat_fields()
    assert fields["device_free_bytes"] is None
    wait_until(lambda: left)
    err, thread = left[0]
    assert isinstance(err, WorkerFatalError) and err.code == "cuda_context_lost"
    assert "GPU 1 is lost" in str(err) and thread == "vigil-card-lost"
    rt._heartbeat_fields()  # the next heartbeat: already leaving
    time.sleep(0.2)
    assert len(left) == 1 and rt.leaving is err


def test_a_probe_that_merely_fails_leaves_the_fields_empty_and_the_worker_in_place():
    nvml = FakeNvml([FakeCard(70 * GiB)])
    nvml.nvmlDeviceGetMemoryInfo = lambda h: (_ for _ in ()).throw(nvml.NVMLError(999))
    lost = []
    fields = device_fields(lambda: probe_memory("cuda", ("0",), nvml), lost.append)
    assert fields["device"] is None and lost == []


def _vllm_start_check(free_after_context: int, total: int, util: float) -> None:
    """vLLM's own start-up rule (vllm/v1/worker/utils.py `request_memory`), run on the numbers
    EngineCore would see after making its CUDA context."""
    from vllm.v1.worker.utils import request_memory

    request_memory(SimpleNamespace(free_memory=free_after_context, total_memory=total,
                                   device_="cuda:0"),
                   SimpleNamespace(gpu_memory_utilization=util))


# What EngineCore's CUDA context with cuBLAS loaded is taken to cost here, fixed (not the
# setting): PyTorch measured a bare torch context at 667 MB with eager module loading and 287 MB
# lazy (pytorch/pytorch#86509; lazy is CUDA 12.2+'s default), a process start with libraries
# loaded was reported at 781 MB (pytorch/pytorch#34323), and cuBLAS/cuBLASLt workspaces add tens
# of MiB. Not measured here (no GPU): bench/gpu_check.py measures it on a GPU host.
CUDA_CONTEXT_COST = 900 * MiB


@pytest.mark.parametrize("cotenant_fraction", [0.8, 0.5, 0.3])
def test_a_sized_down_start_passes_vllms_own_check_after_a_cuda_context(cotenant_fraction):
    """Behind a co-tenant, the plan (with the worker's default headroom) lowers the utilization;
    EngineCore then makes its CUDA context (CUDA_CONTEXT_COST) and vLLM checks free >=
    ceil(util x total): it must pass. With the old 512 MiB default it fails."""
    from app.settings import load_settings

    headroom = load_settings().gpu_headroom_mib * MiB  # what the worker plans with
    assert headroom == DEFAULT_GPU_HEADROOM_MIB * MiB
    total = 141 * GiB  # an H200
    free = int(total * (1 - cotenant_fraction))
    spec = ModelSpec(name="m", memory_gib=10, kv_cache_floor_gib=1)
    probe = probe_memory("cuda", ("0",), FakeNvml([FakeCard(free, total)]))
    for plan in (plan_memory(spec, probe, headroom), plan_memory(spec, probe)):
        assert plan.sized_down
        _vllm_start_check(free - CUDA_CONTEXT_COST, total,
                          plan.engine_args["gpu_memory_utilization"])


def test_the_old_half_gib_headroom_failed_vllms_check_behind_a_gib_context():
    """The defect: 512 MiB kept free, a context costing 1 GiB: vLLM refuses the start, and every
    retry in the memory-pressure window plans the same."""
    total, free = 80 * GiB, 16 * GiB
    spec = ModelSpec(name="m", memory_gib=10, kv_cache_floor_gib=1)
    probe = probe_memory("cuda", ("0",), FakeNvml([FakeCard(free, total)]))
    old = plan_memory(spec, probe, headroom=512 * MiB)
    with pytest.raises(ValueError, match="Free memory on device"):
        _vllm_start_check(free - 1 * GiB, total, old.engine_args["gpu_memory_utilization"])
    new = plan_memory(spec, probe, headroom=1 * GiB)
    _vllm_start_check(free - 1 * GiB, total, new.engine_args["gpu_memory_utilization"])


def test_the_driver_must_support_the_cuda_torch_was_built_for():
    torch = SimpleNamespace(__version__="2.13.0", version=SimpleNamespace(cuda="13.0"))
    v = cuda_versions(FakeNvml([], driver="580.82.07", cuda_driver_version=13000), torch)
    assert v == {"driver": "580.82.07", "driver_cuda": "13.0", "torch": "2.13.0",
                 "torch_cuda": "13.0"}
    assert version_problem(v) is None
    old = cuda_versions(FakeNvml([], driver="570.86.15", cuda_driver_version=12080), torch)
    assert old["driver_cuda"] == "12.8"
    assert "R580 or newer" in version_problem(old)


# -- `vigil worker --gpu`: the checks before it execs Celery --------------------------------------
def _torch(cuda="13.0"):
    return SimpleNamespace(__version__="2.13.0", version=SimpleNamespace(cuda=cuda))


def test_vigil_worker_gpu_sets_pci_bus_order_and_narrows_an_inherited_list():
    from app.ops.worker_start import gpu_worker_env

    assert gpu_worker_env((0, 1), {}) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                                          "CUDA_VISIBLE_DEVICES": "0,1"}
    env = gpu_worker_env((1,), {"CUDA_VISIBLE_DEVICES": "4,5", "CUDA_DEVICE_ORDER": "FASTEST_FIRST"})
    assert env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "5"}


def test_the_gpu_checks_read_nvml_and_refuse_what_cannot_work():
    from app.ops.worker_start import GpuProblem, check_gpus

    nvml = FakeNvml([FakeCard(70 * GiB), FakeCard(70 * GiB)])
    cards, versions = check_gpus(("0", "1"), nvml, _torch())
    assert [c.entry for c in cards] == ["0", "1"] and versions["driver_cuda"] == "13.0"
    with pytest.raises(GpuProblem, match="CPU build"):
        check_gpus(("0",), nvml, _torch(cuda=None))
    with pytest.raises(GpuProblem, match=r"there is no GPU 2 \(this host shows 2\)"):
        check_gpus(("0", "2"), nvml, _torch())
    with pytest.raises(GpuProblem, match="R580"):
        check_gpus(("0",), FakeNvml([FakeCard(70 * GiB)], cuda_driver_version=12040), _torch())

    class NoDriver(FakeNvml):
        def nvmlInit(self):
            raise self.NVMLError(9)  # NVML_ERROR_DRIVER_NOT_LOADED

    with pytest.raises(GpuProblem, match="no NVIDIA driver"):
        check_gpus(("0",), NoDriver([]), _torch())


def test_the_gpu_checks_refuse_a_host_without_nvidia_ml_py(monkeypatch):
    from app.ops.worker_start import GpuProblem, check_gpus

    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(GpuProblem, match="nvidia-ml-py is not installed"):
        check_gpus(("0",), None, _torch())


def test_a_tensor_parallel_worker_is_named_after_its_cards():
    from app.ops.cli import build_parser
    from app.ops.worker_start import worker_argv

    for spec, name in (("0,1", "gpu0-1@%h"), ("0-3", "gpu0-3@%h"), ("2", "gpu2@%h")):
        argv = worker_argv(build_parser().parse_args(["worker", "--gpu", spec]), 8)
        assert argv[argv.index("-n") + 1] == name
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--gpu", "3-1"])
