"""Bad values given to the CLI are usage errors that name the option or say the fix, before anything
is sent or started: floats that are not finite, empty capture ids, a URL without its scheme, a log
level uvicorn has not, stage ids a deploy does not have, and labels that would drive the terminal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sidecar.cli._layout import printable
from sidecar._process import free_port
from tests.fixtures.sidecar import AppClient  # noqa: F401  (the `api` fixture is a plugin)
from tests.test_cli_help import COMMANDS

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "configs" / "qwen2_5_omni.yaml"

FLOAT_OPTIONS = [(name, p.opts[0]) for name, cmd in COMMANDS.items() for p in cmd.params
                 if getattr(getattr(p, "type_descriptor", None), "annotation", None) is float]


def _usage_error(name: str, args: list[str]) -> Any:
    """What parsing ``args`` for command ``name`` raises, as the CLI parses them (every option's
    conversion and check), without running the command: None where nothing was refused."""
    try:
        COMMANDS[name].make_context(name, args)
    except Exception as err:  # click's UsageError / BadParameter (typer vendors click: duck-typed)
        return err
    return None


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sidecar", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT), **(env or {})})


def test_every_float_option_is_found() -> None:
    """The sweep below covers every command's float options: the ones this file was written for."""
    found = set(FLOAT_OPTIONS)
    assert {("start", "--duration"), ("capture", "--lease"), ("plan", "--budget-mb"), ("serve", "--keep-days"),
            ("emulate", "--gzip-delay"), ("fleet capture", "--stop-budget"), ("slim", "--max-mb")} <= found, found


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999"])
@pytest.mark.parametrize(("name", "option"), FLOAT_OPTIONS, ids=[f"{n} {o}" for n, o in FLOAT_OPTIONS])
def test_no_float_option_takes_a_number_that_is_not_finite(name: str, option: str, value: str) -> None:
    """inf or nan reached JSON encoding (a traceback), a fleet target's 'internal error', or a
    deadline that never comes: each is refused as its option's bad value."""
    err = _usage_error(name, [option, value])
    assert err is not None and getattr(err, "exit_code", None) == 2, (name, option, value, err)
    assert option in err.format_message() or getattr(getattr(err, "param", None), "opts", [None])[0] == option, err


@pytest.mark.parametrize("name", ["stop", "capture", "fleet stop", "fleet capture"])
def test_a_negative_timeout_is_refused_as_its_options_bad_value(name: str) -> None:
    # --timeout -1 read as "do not wait" and exited 3 (not checked yet)
    err = _usage_error(name, ["--timeout", "-1"])
    assert err is not None and getattr(err, "exit_code", None) == 2, (name, err)


def test_a_float_the_cli_refuses_is_said_once_in_a_real_run() -> None:
    port = free_port()  # nothing listens there: the run must end before any request
    done = cli("start", "--duration", "inf", "--sidecar", f"http://127.0.0.1:{port}")
    said = " ".join(done.stderr.split())
    assert (done.returncode, "'--duration'" in said, "inf is not a finite number" in said, "Traceback" in said) == (
        2, True, True, False), done.stderr


@pytest.mark.parametrize("command", [["status", ""], ["stop", " "]])
def test_an_empty_capture_id_is_refused_not_read_as_every_id_or_the_active_one(command: list[str]) -> None:
    port = free_port()
    done = cli(*command, "--sidecar", f"http://127.0.0.1:{port}")
    said = " ".join(done.stderr.split())
    assert (done.returncode, "an empty capture id" in said, "Traceback" in said) == (2, True, False), done.stderr


def test_the_client_refuses_an_empty_id_prefix() -> None:
    from sidecar.client import match_capture_id
    from sidecar.errors import CaptureNotFound

    with pytest.raises(CaptureNotFound, match="an empty capture id"):
        match_capture_id("", ["20261206-100000-aaaaaa", "20261206-100001-bbbbbb"])


@pytest.mark.parametrize("url", ["127.0.0.1:8092", "localhost", "ftp://127.0.0.1:8092", "http://"])
def test_a_sidecar_url_without_its_scheme_says_so_not_unreachable(url: str) -> None:
    done = cli("list", "--sidecar", url)
    said = " ".join(done.stderr.split())
    assert (done.returncode, "error[setting_invalid]" in said, "is not an http(s) URL" in said, "unreachable" in said,
            "Traceback" in said) == (1, True, True, False, False), done.stderr


@pytest.mark.parametrize("url", ["127.0.0.1:8092", "http://", "http://[::1:80"])
def test_one_url_rule_for_the_client_the_sidecar_settings_and_fleet_targets(url: str) -> None:
    from pydantic import ValidationError

    from sidecar.client import SidecarClient
    from sidecar.config.settings import SidecarSettings
    from sidecar.errors import SettingInvalid, TargetInvalid
    from sidecar.fleet import Target

    with pytest.raises(SettingInvalid):
        SidecarClient(url)
    with pytest.raises(ValidationError, match="is not an http"):
        SidecarSettings(upstream_url=url)
    with pytest.raises(TargetInvalid):
        Target.sidecar(url)


def test_uvicorns_log_levels_are_the_ones_serve_takes() -> None:
    from uvicorn.config import LOG_LEVELS as UVICORN

    from sidecar.cli.serve import LOG_LEVELS

    assert set(LOG_LEVELS) == set(UVICORN)
    err = _usage_error("serve", ["--log-level", "bogus"])
    assert err is not None and "not a log level" in err.format_message() and "warning" in err.format_message()
    assert _usage_error("serve", ["--log-level", "WARNING", "--upstream", "http://127.0.0.1:1"]) is None


@pytest.mark.parametrize(("option", "value"), [("--diffusion-stages", "9"), ("--fault-dead-stage", "42"),
                                               ("--fault-die-after-start", "7"), ("--idle-after-request", "5=1")])
def test_the_emulator_refuses_a_stage_its_deploy_does_not_have(option: str, value: str) -> None:
    """Else the option does nothing, and a test that relies on it proves nothing. Refused before
    any worker starts or any port is bound."""
    done = cli("emulate", "--deploy-config", str(DEPLOY), "--workers", "thread", "--port", str(free_port()),
               option, value)
    said = " ".join(done.stderr.split())
    assert (done.returncode, "error[stage_unknown]" in said, f"{option} names stage" in said, "its stages: 0, 1, 2" in said,
            "Traceback" in said) == (1, True, True, True, False), done.stderr


def test_an_emulator_option_out_of_range_is_named_as_the_cli_spells_it() -> None:
    err = _usage_error("emulate", ["--gzip-delay", "-1"])
    assert err is not None and "'--gzip-delay'" in err.format_message(), err


def test_control_characters_in_a_value_are_shown_as_escapes() -> None:
    assert printable("run\x1b[31m red\x07\r\x9b\n\tend") == "run\\x1b[31m red\\x07\\x0d\\x9b\n\tend"
    assert printable("plain — ünïcode") == "plain — ünïcode"


async def test_the_api_refuses_a_label_with_control_characters(api: Any) -> None:  # noqa: F811
    client = await api()
    reply = await client.post("/v1/captures", json={"stages": [0], "label": "step 3\x1b]0;owned\x07"})
    err = reply.json()["error"]
    assert (reply.status_code, err["code"], "control character ('\\x1b' at 6)" in err["message"]) == (
        422, "request_invalid", True), err
    listed = (await client.get("/v1/captures")).json()["captures"]
    assert listed == []  # nothing started


@pytest.mark.parametrize(("value", "why"), [("0,,2", "a stray comma"), ("0,", "a stray comma"), ("", "no stage ids"),
                                            ("zero", "got 'zero'")])
def test_a_stage_list_with_an_empty_or_odd_item_is_refused_not_shortened(value: str, why: str) -> None:
    """'0,,2' was read as [0, 2] and '' as no list: a typo chose the stages."""
    done = cli("start", "--stages", value, "--sidecar", f"http://127.0.0.1:{free_port()}")
    said = " ".join(done.stderr.replace("│", " ").split())
    assert (done.returncode, "'--stages'" in said, why in said, "Traceback" in said) == (2, True, True, False), done.stderr


@pytest.mark.parametrize(("command", "flag"), [
    (["serve"], "--upstream"),
    (["validate"], "--server"),
    (["fleet", "start"], "--targets"),
    (["list"], "--sidecar"),
])  # fmt: skip
def test_a_url_with_a_query_or_fragment_is_refused_naming_the_address_alone(command: list[str], flag: str) -> None:
    # every call appends its route to the URL: "host:port?x=1/start_profile" reaches nothing, and was
    # reported as a server or sidecar that does not answer (or not the sidecar)
    port = free_port()
    url = f"http://127.0.0.1:{port}/?token=x#top"
    done = cli(*command, flag, f"sidecar={url}" if flag == "--targets" else url)
    said = " ".join(done.stderr.split())
    fix = ("" if flag in ("--targets", "--sidecar") else f"{flag} ") + f"http://127.0.0.1:{port}"
    assert ("has a query or a fragment" in said, f"e.g. {fix}" in said, f"e.g. {fix}/" in said, "Traceback" in said,
            "unreachable" in said, done.returncode) == (True, True, False, False, False, 1), done.stderr
