"""Unit tier: `vigil flower` (app/ops/cli.py) and its settings. The real Flower process is in
tests/test_flower_e2e.py (worker tier) and tests/test_procfile_honcho_e2e.py."""
from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from app.local.embedded import vigil_env
from app.ops.cli import DEFAULT_FLOWER_PORT, FlowerAuthMissing, build_parser, flower_command
from app.settings import SettingsError, load_settings

SECRET = "s3cret:pass-word"


def _args(*argv: str):
    return build_parser().parse_args(["flower", *argv])


def test_credentials_go_to_flower_in_its_environment_never_on_the_command_line():
    s = load_settings(flower_user="ops", flower_password=SECRET)
    argv, env = flower_command(_args("--port", "6001"), s)
    assert argv[1:] == ["-m", "celery", "-A", "app", "flower", "--port=6001"]
    assert env == {"FLOWER_BASIC_AUTH": f"ops:{SECRET}"}
    assert not any(SECRET in a for a in argv)


def test_default_port_and_an_explicit_address():
    s = load_settings(flower_user="ops", flower_password=SECRET)
    argv, _ = flower_command(_args("--address", "10.1.2.3"), s)
    assert f"--port={DEFAULT_FLOWER_PORT}" in argv and "--address=10.1.2.3" in argv


@pytest.mark.parametrize("user,password,missing", [
    ("", "", "set VIGIL_FLOWER_USER and VIGIL_FLOWER_PASSWORD"),
    ("ops", "", "set VIGIL_FLOWER_PASSWORD "),
    ("", SECRET, "set VIGIL_FLOWER_USER "),
])
def test_without_both_credentials_it_refuses_and_names_the_variables(user, password, missing):
    s = load_settings(flower_user=user, flower_password=password)
    with pytest.raises(FlowerAuthMissing) as ei:
        flower_command(_args(), s)
    assert missing in str(ei.value) and "VIGIL_FLOWER_AUTH_DISABLED" in str(ei.value)
    assert SECRET not in str(ei.value)


def test_auth_disabled_runs_without_auth_on_loopback_unless_told_otherwise():
    s = load_settings(flower_auth_disabled=True, flower_user="", flower_password="")
    argv, env = flower_command(_args(), s)
    assert env == {} and "--address=127.0.0.1" in argv
    argv, _ = flower_command(_args("--address", "0.0.0.0"), s)
    assert "--address=0.0.0.0" in argv
    # Half a configuration is a mistake, disabled or not: it never silently drops the auth.
    with pytest.raises(FlowerAuthMissing):
        flower_command(_args(), load_settings(flower_auth_disabled=True, flower_user="ops",
                                                     flower_password=""))


def test_the_password_never_shows_in_the_settings_repr_or_a_settings_error():
    s = load_settings(flower_user="ops", flower_password=SECRET)
    assert SECRET not in repr(s) and SECRET not in str(s)
    with pytest.raises(SettingsError) as ei:
        load_settings(flower_user="ops", flower_password="a,b" + SECRET)
    assert "VIGIL_FLOWER_PASSWORD" in str(ei.value) and SECRET not in str(ei.value)
    with pytest.raises(SettingsError, match="VIGIL_FLOWER_USER"):
        load_settings(flower_user="a:b")


def test_vigil_flower_without_credentials_exits_2_with_a_message_naming_the_variables(
        redis_server):
    """Given no VIGIL_FLOWER_* settings, when `vigil flower` runs, then it exits 2 before starting
    Flower, saying which variables to set."""
    env = vigil_env(redis_server.url)
    for k in ("VIGIL_FLOWER_USER", "VIGIL_FLOWER_PASSWORD", "VIGIL_FLOWER_AUTH_DISABLED"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, "-m", "app.ops.cli", "flower", "--port", "1"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "VIGIL_FLOWER_USER and VIGIL_FLOWER_PASSWORD" in out.stderr and out.stdout == ""


def test_a_bad_password_setting_exits_2_without_printing_it(redis_server):
    env = vigil_env(redis_server.url, VIGIL_FLOWER_USER="ops",
                    VIGIL_FLOWER_PASSWORD="x," + SECRET)
    out = subprocess.run([sys.executable, "-m", "app.ops.cli", "flower"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "VIGIL_FLOWER_PASSWORD" in out.stderr
    assert SECRET not in out.stderr + out.stdout


def test_a_retried_message_still_shows_model_and_job_but_not_the_prompt(monkeypatch):
    """Given a request Celery publishes again for a retry (`self.retry` goes through
    apply_async with `retries`), then its argsrepr/kwargsrepr, which Flower and the worker's events
    show, name model and job only, as the first publish does."""
    from app import app
    from tasks.inference import generate

    sent = {}

    def capture(self, name, args=None, kwargs=None, **options):
        sent.update(kwargs=kwargs, **options)
        return self.AsyncResult(options["task_id"])

    monkeypatch.setattr(type(app), "send_task", capture)
    generate.apply_async((), {"model": "tiny-llama", "prompt": "secret prompt", "job": "j9"},
                         task_id=f"retry-repr-{uuid.uuid4()}", retries=2,
                         queue="vigil.pool.tiny-llama")  # database 0 is shared: an id of its own
    assert sent["kwargs"]["prompt"] == "secret prompt"  # the message itself is unchanged
    assert sent["argsrepr"] == "()" and sent["kwargsrepr"] == "{model: 'tiny-llama', job: 'j9'}"
