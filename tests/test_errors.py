"""Errors as data between processes (``error_to_wire`` / ``error_from_wire``, the one codec of the
analysis worker, the fleet's worker processes and its Ray actors): a ``SidecarError`` arrives as
the same class with its code, message and details; each case the receiving side cannot rebuild
arrives as its fallback class, still reporting the code and message."""

from __future__ import annotations

import pickle

import pytest

from sidecar import errors
from sidecar.errors import (
    FleetError,
    SidecarError,
    StageNotProfiled,
    TraceTooLarge,
    error_from_wire,
    error_to_wire,
)
from sidecar.fleet._wire import failure, raise_reply


def _crossed(exc: BaseException, **fallback: type[SidecarError]) -> SidecarError:
    """``exc`` as the other side of a process boundary rebuilds it (the data pickled on the way)."""
    return error_from_wire(pickle.loads(pickle.dumps(error_to_wire(exc))), **fallback)


def test_a_sidecar_error_arrives_as_its_class_with_its_code_message_and_details() -> None:
    err = _crossed(TraceTooLarge("trace.json.gz: 9 GB decompressed", details={"limit_bytes": 8 << 30}))
    assert (type(err), err.code, err.http_status, err.message, err.details) == (
        TraceTooLarge, "trace_too_large", 422, "trace.json.gz: 9 GB decompressed", {"limit_bytes": 8 << 30})


def test_a_relayed_code_crosses_with_its_class() -> None:
    err = _crossed(FleetError.relay("stage_not_profiled", "replica 1: stage 2 has no profiler"))
    assert (type(err), err.code, err.http_status) == (FleetError, "stage_not_profiled", 502)


def test_an_unknown_class_name_arrives_as_the_fallback_reporting_its_code() -> None:
    # a class the other side defines and this side lacks (another version, another module)
    err = error_from_wire(("StageGone", "stage_gone", "stage 3 is gone", {"stage": 3}), fallback=FleetError)
    assert (type(err), err.code, err.http_status, err.message, err.details) == (
        FleetError, "stage_gone", 502, "stage 3 is gone", {"stage": 3})


class _BuiltOtherwise(SidecarError):
    code = "built_otherwise"

    def __init__(self, capture_id: str) -> None:
        super().__init__(f"capture {capture_id} is built otherwise")


def test_a_class_built_with_other_arguments_arrives_as_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(errors, "_BuiltOtherwise", _BuiltOtherwise, raising=False)  # known to this side
    err = _crossed(_BuiltOtherwise("20261203-1"), fallback=FleetError)
    assert (type(err), err.code, err.message) == (FleetError, "built_otherwise", "capture 20261203-1 is built otherwise")


def test_a_failure_that_is_no_sidecar_error_arrives_as_the_fallback_naming_its_type() -> None:
    assert error_to_wire(KeyError("stage")) == (None, "internal_error", "KeyError: 'stage'", {})
    err = _crossed(KeyError("stage"))  # the default fallback: the base class
    assert (type(err), err.code, err.http_status, err.message) == (SidecarError, "internal_error", 500, "KeyError: 'stage'")


def test_a_name_of_the_module_that_is_no_error_class_is_not_taken_for_one() -> None:
    # a foreign exception of the same name as something sidecar.errors holds must not become it
    err = error_from_wire(("BaseModel", "internal_error", "BaseModel: x", {}), fallback=FleetError)
    assert type(err) is FleetError


def test_the_fleet_wire_uses_the_codec_with_fleet_error_as_its_fallback() -> None:
    with pytest.raises(StageNotProfiled) as known:
        raise_reply(failure(StageNotProfiled("stage 2 has no profiler_config")))
    with pytest.raises(FleetError) as bug:
        raise_reply(failure(ZeroDivisionError("division by zero")))
    assert (known.value.code, bug.value.code, bug.value.message) == (
        "stage_not_profiled", "internal_error", "ZeroDivisionError: division by zero")
