"""Errors by class: every failure is a ``SidecarError`` subclass whose ``code`` and
``http_status`` are class attributes, and the API answers with the class's status (MRO), so no
code can fall through to 500."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import pytest

import sidecar
from sidecar import errors
from sidecar.api.errors import status_table
from sidecar.client import error_from_response
from tests.fixtures.sidecar import AppClient, error_of

_BUG = {errors.SidecarError, errors.InternalError}  # the only classes allowed to mean 500


def _load_every_module() -> None:
    for mod in pkgutil.walk_packages(sidecar.__path__, "sidecar."):
        if mod.name.endswith("__main__") or mod.name.startswith(("sidecar.integrations", "sidecar.emulator.worker")):
            continue  # entry points run on import; the others need verl / torch
        importlib.import_module(mod.name)


def test_every_error_class_declares_its_code_and_a_status() -> None:
    _load_every_module()
    classes = errors.error_classes()
    assert len(classes) > 50
    for cls in classes:
        assert "code" in cls.__dict__, f"{cls.__name__} inherits its code: give it its own"
        assert 400 <= cls.http_status < 600, cls


def test_only_a_bug_is_500_in_the_api() -> None:
    five_hundred = {name for status, _, name in status_table() if status == 500}
    assert five_hundred == {c.__name__ for c in _BUG}


def test_no_string_table_is_left() -> None:
    import sidecar.api.errors as api_errors

    assert not hasattr(api_errors, "STATUS_BY_CODE") and not hasattr(api_errors, "status_for")


def test_a_relay_keeps_its_class_status() -> None:
    err = errors.FleetError.relay("stage_unknown", "target a refused stage 7")
    assert (err.code, err.http_status, errors.FleetError.code) == ("stage_unknown", 502, "fleet_failed")


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b'{"duration_s": Infinity}', 422, "duration_invalid"),
        (b'{"lease_s": Infinity}', 422, "lease_invalid"),
        (b'{"stages": [0], "duration_s": 1e308}', 422, "duration_invalid"),
    ],
)
async def test_window_errors_are_422_not_500(
    api: AppClient, fake_omni: Any, body: bytes, status: int, code: str
) -> None:
    client = await api(control={"max_duration_s": 3600})
    reply = await client.post("/v1/captures", content=body, headers={"content-type": "application/json"})
    assert (reply.status_code, error_of(reply)["code"], fake_omni.starts()) == (status, code, [])
    if b"Infinity" in body:  # "must be > 0, got inf" was wrong: inf is above 0
        assert "must be a finite number of seconds" in error_of(reply)["message"], error_of(reply)


async def test_a_plan_probe_above_the_steps_limit_is_refused_by_the_request_before_any_probe(
    api: AppClient, fake_omni: Any
) -> None:
    # the schema says so too: each probe is a steps window (found by schemathesis: 2**65 passed the
    # request model, and the first probe's start refused it)
    client = await api()
    reply = await client.post("/v1/plan", json={"probe_steps": [1, 2**65]})
    err = error_of(reply)
    assert (reply.status_code, err["code"], "64" in err["message"], fake_omni.starts()) == (
        422, "request_invalid", True, [])


async def test_duration_above_the_limit_names_a_real_setting(api: AppClient) -> None:
    client = await api(control={"max_duration_s": 60})
    reply = await client.post("/v1/captures", json={"stages": [0], "duration_s": 600})
    err = error_of(reply)
    assert (reply.status_code, err["code"]) == (422, "duration_invalid")
    assert "--max-duration" not in err["message"] and "OMNI_SIDECAR_MAX_DURATION_S" in err["message"]


async def test_start_during_shutdown_is_503(api: AppClient) -> None:
    client = await api()
    await client.sidecar_app.state.controller.close()
    reply = await client.post("/v1/captures", json={"stages": [0]})
    assert (reply.status_code, error_of(reply)["code"]) == (503, "sidecar_closing")


async def test_the_client_raises_the_class_of_the_code(api: AppClient) -> None:
    client = await api()
    await client.post("/v1/captures", json={"stages": [0]})
    reply = await client.get("/v1/captures/nope/summary")
    err = error_from_response(reply)
    overlap = error_from_response(await client.post("/v1/captures", json={"stages": [0]}))
    assert (type(err), type(overlap)) == (errors.CaptureNotFound, errors.CaptureActive)
