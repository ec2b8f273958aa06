"""Unit tier: tensor-parallel pools go to workers of their card count only (a GPU worker without
pools leaves out those of another count, one asked for such a pool does not start, the
reconcile lends a pool only to a worker of its size), and docs/operations.md's registry
entries for real models run as the doc says. What vLLM receives on each platform:
tests/test_engine_platforms.py."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from app.requests.engine_defaults import worker_concurrency
from app.requests.models import ModelSpec, load_registry
from app.settings import SettingsError, load_settings
from tests.cuda_plans import H200, cuda_plan
from tests.fake_nvml import FakeCard, FakeNvml
from workers.engine.memory import GiB, probe_memory
from workers.engine.vllm_args import engine_args


# -- tensor-parallel pools go to workers of their size only ----------------------------------------
TP_MODELS = [{"name": "big", "path": "/x", "engine_args": {"tensor_parallel_size": 2}}]


def _gpu_start(tmp_path, monkeypatch, models, n_cards):
    """`vigil worker --gpu ...` up to its exec, over `n_cards` faked H200s and a registry of
    `models` (plus the built-in tiny-llama); returns what it execs (a list, empty when it did
    not) and `run(argv)`: the CLI's exit status, each run in the environment the test began
    with."""
    import os

    from app.ops import cli, worker_start
    from app.requests import models as models_mod

    f = tmp_path / "models.json"
    f.write_text(json.dumps({"models": models}))
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)

    def run(argv):
        monkeypatch.setattr(os, "environ", dict(env))
        return cli.main(argv)

    cards = FakeNvml([FakeCard(139 * GiB, **H200) for _ in range(n_cards)])
    monkeypatch.setattr(worker_start, "get_settings", lambda: load_settings(models_file=f))
    monkeypatch.setattr(worker_start, "get_registry",
                        lambda: models_mod.load_registry(load_settings(models_file=f)))
    monkeypatch.setattr(worker_start, "check_gpus", lambda entries: (
        list(probe_memory("cuda", entries, cards).cards),
        {"driver": "580", "driver_cuda": "13.0", "torch": "2.13.0", "torch_cuda": "13.0"}))
    monkeypatch.setattr(worker_start, "preflight", lambda s: None)
    execs = []
    monkeypatch.setattr(cli.os, "execv", lambda path, argv: execs.append(argv))
    return execs, run


def _queues(argv) -> list[str]:
    return argv[argv.index("-Q") + 1].split(",")


def test_a_gpu_worker_without_pools_leaves_out_those_of_another_card_count(tmp_path, monkeypatch,
                                                                           capsys):
    """Before: every GPU worker consumed every pool, and a one-card worker failed the 2-card
    model's requests for good (invalid_model_config)."""
    import os

    execs, run = _gpu_start(tmp_path, monkeypatch, TP_MODELS, 2)
    assert run(["worker", "--gpu", "0"]) == 0
    assert _queues(execs[-1]) == ["vigil.housekeeping", "vigil.pool.tiny-llama"]
    err = capsys.readouterr().err
    assert "not consuming pool big: model big asks for tensor_parallel_size 2, but this worker " \
           "has 1 card(s)" in err
    assert run(["worker", "--gpu", "0-1"]) == 0
    assert _queues(execs[-1]) == ["vigil.housekeeping", "vigil.pool.big", "vigil.pool.tiny-llama"]
    assert "VIGIL_POOLS" not in os.environ  # nothing preloaded that was not asked for


def test_a_gpu_worker_asked_for_a_pool_of_another_card_count_does_not_start(tmp_path,
                                                                            monkeypatch, capsys):
    execs, run = _gpu_start(tmp_path, monkeypatch, TP_MODELS, 2)
    assert run(["worker", "--gpu", "0", "--pools", "tiny-llama,big"]) == 2
    assert execs == []
    assert "model big asks for tensor_parallel_size 2, but this worker has 1 card" in \
        capsys.readouterr().err
    assert run(["worker", "--gpu", "0,1", "--pools", "big"]) == 0
    assert _queues(execs[-1]) == ["vigil.housekeeping", "vigil.pool.big"]


def test_a_gpu_worker_that_can_run_no_pool_does_not_start(capsys):
    from app.ops.worker_start import gpu_pools
    from app.requests.models import ModelRegistry

    reg = ModelRegistry([ModelSpec(name="big", engine_args={"tensor_parallel_size": 4}),
                         ModelSpec(name="mid", engine_args={"tensor_parallel_size": 2})])
    assert gpu_pools(reg, [], 1) is None
    assert "no registered pool runs on 1 card(s)" in capsys.readouterr().err
    assert gpu_pools(reg, [], 2) == ["mid"] and gpu_pools(reg, [], 4) == ["big"]
    assert reg.split_by_cards(["big", "mid"], 4) == (["big"], {"mid": reg.get("mid")
                                                               .card_problem(4)})


def test_the_workers_own_list_of_its_pools_leaves_them_out_too(monkeypatch):
    """The runtime's configured pools (heartbeat, quarantine, the reconcile's lending) match the
    queues `vigil worker` consumes."""
    import os

    from app.requests.models import ModelRegistry
    from tests.unit_helpers import RecordingPorts
    from workers.runtime import WorkerRuntime

    monkeypatch.setattr(os, "environ", dict(os.environ))
    reg = ModelRegistry([ModelSpec(name="a"),
                         ModelSpec(name="big", engine_args={"tensor_parallel_size": 2})])

    def runtime(visible):
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
        return WorkerRuntime(load_settings(redis_url="redis://127.0.0.1:9/0"), "w",
                             engine="instant", guard=False, ports=RecordingPorts(), registry=reg)

    assert runtime("0").configured_pools == ["a"]
    assert runtime("0,1").configured_pools == ["a", "big"]
    assert runtime(None).configured_pools == ["a", "big"]  # the CPU: vLLM's own business


def test_the_reconcile_lends_a_tensor_parallel_pool_only_to_a_worker_of_its_size():
    from app.fleet.reconcile import fits
    from app.requests.models import ModelRegistry
    from app.state.registry import WorkerEntry

    reg = ModelRegistry([ModelSpec(name="a", memory_gib=2),
                         ModelSpec(name="big", memory_gib=20,
                                   engine_args={"tensor_parallel_size": 2})])

    def entry(device, cards):
        fields = {"name": "w", "device": device, "device_free_bytes": str(200 * GiB)}
        if cards:
            fields["device_cards"] = ",".join(f"{i}:{100 * GiB}:{141 * GiB}" for i in range(cards))
        return WorkerEntry.parse("1", 0.0, fields, None)

    assert entry("cuda", 2).cards == 2 and entry("cpu", 0).cards == 0
    assert not fits(entry("cuda", 1), reg, "big") and fits(entry("cuda", 1), reg, "a")
    assert fits(entry("cuda", 2), reg, "big")
    assert fits(entry("cpu", 0), reg, "big")  # a CPU worker: vLLM's own business


@pytest.mark.parametrize("bad", ["2", 0, -1, 1.5, True])
def test_a_tensor_parallel_size_that_is_not_a_card_count_is_refused_at_load(tmp_path, bad):
    f = tmp_path / "models.json"
    f.write_text(json.dumps({"models": [{"name": "m", "path": "/x",
                                         "engine_args": {"tensor_parallel_size": bad}}]}))
    with pytest.raises(SettingsError, match="model m: engine_args.tensor_parallel_size must be a "
                       "whole number of cards"):
        load_registry(load_settings(models_file=f))


# -- docs/operations.md's registry entries for real models, read from the doc -----------------------
def _doc_section() -> str:
    text = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    start = text.index("### Registry entries for real models")
    return text[start:text.index("\n### ", start + 1)]


def _doc_registry(tmp_path):
    import re

    blob = re.search(r"```json\n(.*?)```", _doc_section(), re.S).group(1)
    f = tmp_path / "models.json"
    f.write_text(blob)
    return load_registry(load_settings(models_file=f))  # the real loader: SettingsError if bad


H100 = dict(total=80 * GiB, name="NVIDIA H100 80GB HBM3")


@pytest.mark.parametrize("card", [H100, H200], ids=["h100", "h200"])
def test_the_docs_8b_entry_runs_on_one_card_as_the_doc_says(tmp_path, card):
    spec = _doc_registry(tmp_path).get("llama-8b")
    plan = cuda_plan(spec, n=1, free=card["total"] - GiB, **card)
    assert not plan.sized_down  # an idle card grants the whole 90%
    args = engine_args(spec, plan)
    assert args["dtype"] == "bfloat16" and args["max_model_len"] == 8192
    assert args["max_num_seqs"] == 256 and args["gpu_memory_utilization"] == 0.9
    assert args["enable_prefix_caching"] is True and "tensor_parallel_size" not in args
    assert args["enable_lora"] is True and args["max_loras"] == 4
    # the worker's threads follow the entry's max_num_seqs ("256 threads" in the doc)
    assert worker_concurrency(128, [spec.engine_args], "cuda", card["total"], card["name"]) == 256


@pytest.mark.parametrize("card", [H100, H200], ids=["h100", "h200"])
def test_the_docs_70b_entry_runs_on_four_cards_only(tmp_path, card, capsys):
    from app.ops.worker_start import gpu_pools

    reg = _doc_registry(tmp_path)
    spec = reg.get("llama-70b")
    plan = cuda_plan(spec, n=4, free=card["total"] - GiB, **card)
    assert not plan.sized_down and plan.floor == math.ceil((150 + 40) * GiB / 4)
    args = engine_args(spec, plan)
    assert args["tensor_parallel_size"] == 4 and args["dtype"] == "bfloat16"
    assert "enable_lora" not in args and args["max_num_seqs"] == 256
    assert gpu_pools(reg, [], 1) == ["llama-8b", "tiny-llama"]  # a one-card worker leaves it out
    assert "not consuming pool llama-70b" in capsys.readouterr().err


def test_the_docs_worker_commands_serve_the_docs_pools(tmp_path):
    import re
    import shlex

    from app.ops.cli import build_parser

    reg = _doc_registry(tmp_path)
    block = re.search(r"```sh\n(.*?)```", _doc_section(), re.S).group(1)
    commands = [shlex.split(ln.split("#")[0]) for ln in block.splitlines() if ln.strip()]
    assert [c[:2] for c in commands] == [["vigil", "worker"]] * 2
    for argv in commands:
        args = build_parser().parse_args(argv[1:])
        for pool in args.pools.split(","):
            assert reg.get(pool).card_problem(len(args.gpu)) is None, (argv, pool)
