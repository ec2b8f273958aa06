"""docs/configuration.md is generated from the settings object (app/ops/config_doc.py); these tests
fail when it is out of date or when a setting is undocumented."""
from __future__ import annotations

from app.local.embedded import REPO
from app.ops.config_doc import COMMAND, field_rows, render
from app.settings import VigilSettings
from app.settings_defaults import ENV_PREFIX


def test_the_configuration_reference_is_up_to_date_with_the_settings_object():
    on_disk = (REPO / "docs" / "configuration.md").read_text()
    assert on_disk == render(), f"docs/configuration.md is out of date: run `{COMMAND}`"


def test_every_setting_is_listed_once_with_a_description():
    rows = field_rows()
    assert [r["variable"] for r in rows] == [f"`{ENV_PREFIX}{n.upper()}`"
                                             for n in VigilSettings.model_fields]
    undocumented = [r["variable"] for r in rows if not r["description"]]
    assert not undocumented, ("give these settings a Field(description=...) or a comment on "
                              f"their DEFAULT_* constant: {undocumented}")


def test_the_reference_shows_bounds_secrets_and_defaults_without_the_environment(monkeypatch):
    """The reference is the same whatever the environment says (it documents defaults)."""
    monkeypatch.setenv("VIGIL_MAX_ATTEMPTS", "7")
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere/else")
    rows = {r["variable"].strip("`"): r for r in field_rows()}
    assert rows["VIGIL_MAX_ATTEMPTS"]["default"] == "`3`"
    assert rows["VIGIL_MAX_ATTEMPTS"]["bounds"] == ">= 1, <= 20"
    assert "secret" in rows["VIGIL_FLOWER_PASSWORD"]["type"]
    assert "secret" in rows["VIGIL_REDIS_SENTINEL_PASSWORD"]["type"]
    assert rows["VIGIL_CACHE_DIR"]["default"] == "`$XDG_CACHE_HOME/vigil`, else `~/.cache/vigil`."
    assert rows["VIGIL_REQUEST_TIMEOUT"]["type"] == "seconds"
