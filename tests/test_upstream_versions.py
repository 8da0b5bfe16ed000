"""The server known at connect (sidecar/versions.py's dialect of it): plain vLLM by its version
route, vLLM-Omni by a route only it serves, a server without a version route as the oldest; and
``validate`` checking a config for a version, or for the server it reads live. FakeOmni on a real
socket, set to plain vLLM 0.32's surface (``version``); tests/live and tests/omni run the real ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.upstream.server import Flavor, UpstreamServer
from tests.fixtures.control import FakeOmni

# --- the server, known at connect -------------------------------------------------------------


async def test_a_plain_vllm_server_is_known_by_its_version_route(control_deploy) -> None:
    with FakeOmni(control_deploy) as fake:
        fake.flat, fake.version = True, "0.32.0"
        async with UpstreamServer(fake.url, flavor=Flavor.vllm) as up:
            version = await up.identify()
    assert (version.kind, str(version.vllm), version.per_capture_prefix) == ("vllm", "0.32.0", True)


async def test_vllm_omni_is_told_apart_by_a_route_only_it_serves(control_deploy) -> None:
    with FakeOmni(control_deploy) as fake:
        fake.version = "0.30.0"  # vLLM-Omni answers vLLM's version there, not its own
        async with UpstreamServer(fake.url, flavor=Flavor.vllm) as up:
            version = await up.identify()
    assert (version.kind, str(version.vllm), str(version.omni), version.omni_told) == ("omni", "0.30.0", "0.30.0",
                                                                                       False)


async def test_a_server_that_serves_no_version_is_treated_as_the_oldest(control_deploy) -> None:
    with FakeOmni(control_deploy) as fake:
        fake.flat = True
        async with UpstreamServer(fake.url, flavor=Flavor.vllm) as up:
            version = await up.identify()
    assert (version.vllm, version.per_capture_prefix, [w["code"] for w in version.warnings()]) == (
        None, False, ["version_unknown"])


# --- validate: a deploy checked for a version, the server's read live -----------------------------


def _validate(*args: str) -> tuple[int, str, dict]:
    import json

    from typer.testing import CliRunner

    from sidecar.cli import app

    result = CliRunner().invoke(app, ["validate", *args, "--json"])
    return result.exit_code, result.output, json.loads(result.output) if result.output.strip() else {}


ACTIVITIES = '{"profiler": "torch", "torch_profiler_dir": "/tmp/p", "torch_profiler_activities": ["CUDA"]}'


def test_validate_accepts_activities_by_default_and_refuses_them_for_vllm_0_30() -> None:
    newest, _, report = _validate("--profiler-config", ACTIVITIES)
    oldest, _, refused = _validate("--profiler-config", ACTIVITIES, "--vllm-version", "0.30.0")
    (error,) = [f for f in refused["findings"] if f["severity"] == "error"]
    assert (newest, report["server"]["vllm"], oldest, error["code"]) == (0, "0.34.0", 1, "profiler_config_version")
    assert "vLLM 0.31 brought it" in error["message"]


@pytest.mark.parametrize(("flat", "version", "summary"), [
    (True, "0.32.0", "vLLM 0.32.0: per-capture bounds, file prefixes over HTTP"),
    (False, "0.32.0", "vLLM-Omni 0.32.0rc1 on vLLM 0.32.0: per-capture bounds not available over HTTP; the deploy's max_iterations caps bound a steps window"),
])
def test_validate_server_prints_what_the_server_is(control_deploy, flat: bool, version: str, summary: str) -> None:
    with FakeOmni(control_deploy) as fake:
        fake.flat, fake.version = flat, version
        code, output, report = _validate("--server", fake.url)
    assert (code, report["server"]["summary"], report["server"]["warnings"]) == (0, summary, []), output


def test_validate_server_names_a_mismatched_pair_with_its_fix(control_deploy) -> None:
    with FakeOmni(control_deploy) as fake:
        fake.version = "0.34.0"  # vLLM-Omni installed over a vLLM no vLLM-Omni is made for
        code, output, report = _validate("--server", fake.url)
    (warning,) = report["server"]["warnings"]
    assert (code, warning["code"], warning["fix"].split(" (")[0]) == (
        0, "version_mismatch", "pip install 'vllm==0.32.*' --pre 'vllm-omni==0.32.0rc1'"), output


def test_vllm_omnis_own_families_are_in_the_windows_server_metrics() -> None:
    # two real vLLM-Omni 0.30.0 replies (tests/data/metrics): its vllm_omni:* families per stage and
    # per hand-over (not the vllm:omni_* its doc names), beside the engines' vllm: ones
    from sidecar.upstream.metrics import parse_metrics, window_metrics

    data = Path(__file__).parent / "data" / "metrics"
    window = window_metrics(*(parse_metrics((data / f"omni-0.30-cpu-{i}.prom").read_text()) for i in (0, 2)))
    seen = {short: {where: lat.count for where, lat in by.items()} for short, by in window.omni.items()}
    assert seen == {"stage_gen": {"1": 5}, "transfer_tx": {"0->1": 5}, "e2e": {"": 5}}, seen
    assert sorted((e.stage, e.replica) for e in window.engines) == [("0", "0"), ("1", "0")]


@pytest.mark.parametrize("flat", [True, False])
def test_validate_server_says_when_the_server_serves_no_profiler_routes(control_deploy, flat: bool) -> None:
    # a CI gate of `validate --server` passed in silence against a server no capture can run on
    with FakeOmni(control_deploy) as fake:
        fake.flat, fake.version, fake.mounted = flat, "0.32.0", False
        code, output, report = _validate("--server", fake.url)
    (warning,) = report["server"]["warnings"]
    assert (code, warning["code"]) == (0, "profiler_not_mounted"), output
    assert ("--profiler-config" if flat else "profiler_config.profiler") in warning["why"], warning
