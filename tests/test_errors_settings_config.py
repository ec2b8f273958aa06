"""Unit tier: the error taxonomy, its JSON transport, settings validation, Celery configuration."""
from __future__ import annotations

import subprocess
import sys

import pytest

from app.celery_app import create_app
from app.errors import (RequestError, TerminalError, TransientError, WorkerFatalError,
                        error_from_record)
from app.requests.models import get_registry
from app.settings import SettingsError, load_settings
from app.state.queues import HOUSEKEEPING_QUEUE, declared_queues


@pytest.mark.parametrize("cls", [RequestError, TransientError, WorkerFatalError, TerminalError])
def test_errors_survive_celerys_json_exception_transport(cls):
    app = create_app(load_settings())
    err = cls.of("some_code", "what to change")
    wire = app.backend.prepare_exception(err, "json")
    back = app.backend.exception_to_python(wire)
    assert type(back) is cls and str(back) == "some_code: what to change"
    assert back.code == "some_code" and back.detail == "what to change"


def test_the_generate_task_declares_its_retry_policy_in_celerys_terms(monkeypatch):
    """autoretry_for / dont_autoretry_for on the task (derived from app/retry_policy.py's table),
    no bound on Celery's own count of retries (the record counts attempts), the autoretry
    wrapper installed; Celery's own backoff is off (the delay is the decision's)."""
    from tasks.inference import generate

    assert set(generate.autoretry_for) == {TransientError, WorkerFatalError}
    assert set(generate.dont_autoretry_for) == {RequestError, TerminalError}
    assert hasattr(generate, "_orig_run") and not getattr(generate, "retry_backoff", False)
    assert generate.max_retries is None


def test_stored_errors_are_rebuilt_with_their_class():
    e = error_from_record("RequestError", "prompt_too_long: 600 > 512")
    assert isinstance(e, RequestError) and e.code == "prompt_too_long"


def test_invalid_setting_names_the_environment_variable(monkeypatch):
    monkeypatch.setenv("VIGIL_MAX_ATTEMPTS", "zero")
    with pytest.raises(SettingsError, match="VIGIL_MAX_ATTEMPTS"):
        load_settings()


def test_an_unknown_drill_fault_stops_the_process_at_start_naming_it(monkeypatch):
    """A drill that silently does nothing would prove nothing, and a worker that fails every
    engine start for it would fail requests (issue 14): the setting is refused at start."""
    monkeypatch.setenv("VIGIL_DRILL", "poison=X,explode_now")
    with pytest.raises(SettingsError, match="VIGIL_DRILL: .*unknown fault 'explode_now'"):
        load_settings()
    for good in ("black_hole", "slow_start=2.5,slow_step=1", "poison=P,die_on_start"):
        monkeypatch.setenv("VIGIL_DRILL", good)
        assert load_settings().drill == good


def test_a_gpu_worker_on_a_host_without_cuda_refuses_to_start_naming_the_fix(capsys):
    """`vigil worker --gpu 0` where CUDA is not usable must not join the fleet (it would take
    requests it can never run): it exits 2 naming the cause and the fixes."""
    import torch

    from app.ops.cli import main

    if torch.cuda.is_available():
        pytest.skip("this host has a usable GPU")
    assert main(["worker", "--gpu", "0"]) == 2
    err = capsys.readouterr().err
    assert "cannot use GPU 0" in err and "--cpu" in err and "CUDA_VISIBLE_DEVICES" in err
    assert "not compiled with CUDA" in err or "no NVIDIA driver" in err


@pytest.mark.parametrize("argv", [["-c", "from app import app"],
                                  ["-m", "app.ops.cli", "worker", "--cpu"]])
def test_invalid_redis_url_fails_at_start_naming_the_variable(argv):
    proc = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=60,
        env={"VIGIL_REDIS_URL": "http://nope", "PATH": "/usr/bin:/bin"}, cwd=".")
    assert proc.returncode != 0
    assert "VIGIL_REDIS_URL: " in proc.stderr and "redis://" in proc.stderr


def test_pools_are_read_as_a_comma_list(monkeypatch):
    monkeypatch.setenv("VIGIL_POOLS", "tiny-llama, other")
    assert load_settings().pools == ["tiny-llama", "other"]


def test_visibility_timeout_exceeds_the_longest_request_plus_backoff():
    s = load_settings(request_timeout=100, retry_backoff_max=30)
    assert s.visibility_timeout > 130


def test_celery_is_configured_for_json_late_acks_and_declared_queues_only():
    s = load_settings()
    c = create_app(s).conf
    assert c.task_serializer == c.result_serializer == "json"
    assert c.accept_content == ["json"] and c.result_accept_content == ["json"]
    assert c.task_acks_late and c.task_reject_on_worker_lost
    assert c.task_create_missing_queues is False
    assert c.broker_transport_options["visibility_timeout"] == s.visibility_timeout
    assert c.broker_transport_options["unacked_restore_throttle"] == 1
    assert [q.name for q in c.task_queues] == declared_queues(get_registry().names())
    assert HOUSEKEEPING_QUEUE in declared_queues(get_registry().names())
    assert c.task_track_started is False  # Vigil's record holds RUNNING; one less write per task
    assert c.worker_send_task_events is False  # Flower enables events while it runs
    assert create_app(load_settings(task_events=True)).conf.worker_send_task_events


def test_redis_pools_hold_a_connection_per_task_thread():
    """A whole batch of task threads finishes in one engine step; redis-py's default pool cap
    (100) made finished requests fail with 'Too many connections' at concurrency 160."""
    import redis

    from app.state.conn import connect

    s = load_settings(worker_concurrency=160)
    pool = connect(s).connection_pool
    assert isinstance(pool, redis.BlockingConnectionPool) and pool.max_connections > 160
    assert create_app(s).conf.redis_max_connections > 160


def test_vigil_worker_gpu_pins_names_and_uses_the_threads_pool():
    from app.ops.cli import build_parser
    from app.ops.worker_start import worker_argv

    args = build_parser().parse_args(["worker", "--gpu", "1"])
    argv = worker_argv(args, 128)
    assert argv[argv.index("-P") + 1] == "threads"
    assert argv[argv.index("-n") + 1] == "gpu1@%h"
    assert argv[argv.index("-c") + 1] == "128"
    args = build_parser().parse_args(["worker", "--cpu", "--name", "a@%h", "--pools", "tiny-llama"])
    argv = worker_argv(args, 8)
    assert argv[argv.index("-n") + 1] == "a@%h"
    assert argv[argv.index("-Q") + 1] == f"{HOUSEKEEPING_QUEUE},vigil.pool.tiny-llama"
    # No mingle: a second saved at every start; Vigil has no revoked-task list to sync.
    assert "--without-mingle" in argv


def test_worker_refuses_both_or_neither_device_flag():
    from app.ops.cli import build_parser

    for argv in (["worker"], ["worker", "--gpu", "0", "--cpu"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
