"""SidecarSettings (OMNI_SIDECAR_* environment) and the objects the upstream and control layers
build from it."""

from __future__ import annotations

import pytest

from sidecar.config.settings import SidecarSettings, parse_artifact_root
from sidecar.control.controller import ControlSettings
from sidecar.errors import ConfigError
from sidecar.upstream.server import Flavor, UpstreamServer


def test_defaults_bind_localhost_on_8092():
    s = SidecarSettings()
    assert (s.host, s.port, s.stop_budget_s, s.collect_timeout_s) == ("127.0.0.1", 8092, 1800, 120)


def test_environment_prefix_is_read(monkeypatch):
    monkeypatch.setenv("OMNI_SIDECAR_UPSTREAM_URL", "http://10.0.0.2:8000")
    monkeypatch.setenv("OMNI_SIDECAR_STOP_BUDGET_S", "90")
    s = SidecarSettings()
    assert (s.upstream_url, s.stop_budget_s) == ("http://10.0.0.2:8000", 90)


@pytest.mark.parametrize(
    "env", ['{"/srv/traces": "/mnt/traces", "/a": "/b"}', "/srv/traces=/mnt/traces,/a=/b"]
)
def test_artifact_roots_from_json_or_pairs(monkeypatch, env):
    monkeypatch.setenv("OMNI_SIDECAR_ARTIFACT_ROOTS", env)
    assert SidecarSettings().artifact_roots == {"/srv/traces": "/mnt/traces", "/a": "/b"}


def test_artifact_roots_from_flag_values():
    assert SidecarSettings(artifact_roots=["/srv=/mnt"]).artifact_roots == {"/srv": "/mnt"}


@pytest.mark.parametrize("bad", ["/srv", "=/mnt", "/srv="])
def test_bad_artifact_root_names_the_form(bad):
    with pytest.raises(ConfigError) as err:
        parse_artifact_root(bad)
    assert (err.value.code, "SERVER_PATH=LOCAL_PATH" in err.value.message) == ("artifact_root_invalid", True)


def test_stages_from_the_flag_or_environment(monkeypatch):
    monkeypatch.setenv("OMNI_SIDECAR_STAGES", "0, 1")
    assert (SidecarSettings().stages, SidecarSettings(stages="2").stages) == ([0, 1], [2])
    with pytest.raises(ValueError, match="--stages 'a,1' is not a comma-separated list of stage ids"):
        SidecarSettings(stages="a,1")


def test_token_file_is_read_and_stripped(tmp_path):
    (tmp_path / "t").write_text("s3cret-token\n")
    assert SidecarSettings(token_file=tmp_path / "t").read_token() == "s3cret-token"


def test_missing_token_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError) as err:
        SidecarSettings(token_file=tmp_path / "nope").read_token()
    assert err.value.code == "token_file_unreadable"


async def test_upstream_built_from_settings():
    s = SidecarSettings(upstream_url="http://127.0.0.1:9/", flavor="vllm", stop_budget_s=12, start_timeout_s=7)
    up = UpstreamServer.from_settings(s)
    await up.aclose()
    assert (up.base_url, up.flavor, up.stop_budget_s, up.timeouts.start) == ("http://127.0.0.1:9", Flavor.vllm, 12, 7)


def test_control_settings_built_from_settings():
    s = SidecarSettings(collect_timeout_s=5, artifact_roots={"/a": "/b"}, default_lease_s=30, max_duration_s=60)
    c = ControlSettings.from_settings(s)
    assert (c.collect_timeout_s, c.artifact_roots, c.default_lease_s, c.max_duration_s) == (5, {"/a": "/b"}, 30, 60)


def test_trace_quiet_period_defaults_to_two_seconds_and_reaches_the_controller(monkeypatch):
    monkeypatch.setenv("OMNI_SIDECAR_TRACE_QUIET_S", "7")
    assert (SidecarSettings().trace_quiet_s, ControlSettings.from_settings(SidecarSettings()).trace_quiet_s,
            ControlSettings().trace_quiet_s) == (7, 7, 2.0)
    monkeypatch.delenv("OMNI_SIDECAR_TRACE_QUIET_S")
    assert SidecarSettings().trace_quiet_s == 2.0


def test_a_quiet_period_past_the_collect_bound_is_refused_naming_both_keys():
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as err:
        SidecarSettings(collect_timeout_s=5, trace_quiet_s=10)
    assert ("trace_quiet_s 10 is longer than collect_timeout_s 5" in str(err.value),
            SidecarSettings(collect_timeout_s=1).trace_quiet_s) == (True, 2.0)


def test_settle_s_is_gone(monkeypatch):
    # Completeness is read from the files; the old knob is not a setting any more (an old
    # environment variable is ignored like any unknown one).
    monkeypatch.setenv("OMNI_SIDECAR_SETTLE_S", "0.3")
    assert ("settle_s" in SidecarSettings.model_fields, "settle_s" in ControlSettings.model_fields,
            hasattr(SidecarSettings(), "settle_s")) == (False, False, False)


def test_the_verl_block_still_loads_settle_s_and_warns_once(monkeypatch, caplog):
    import sidecar.integrations.verl as verl_hook

    monkeypatch.setattr(verl_hook, "_WARNED_SETTLE", [])
    configs = [verl_hook.hook_config({"omni_sidecar": {"settle_s": 2}}) for _ in range(2)]
    warnings = [r for r in caplog.records if "settle_s is no longer read" in r.getMessage()]
    assert ([c.collect_timeout_s for c in configs], len(warnings)) == ([120.0, 120.0], 1)
