"""Capture journal: one atomic JSON file per capture, history round-trips, recovery data kept
beside the record, corrupt files set aside, secrets scrubbed."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from sidecar.control.journal import CaptureJournal, atomic_write_text
from sidecar.scrub import scrub_secrets
from sidecar.control.models import Capture, CaptureState


def _cap(cid: str = "20261130-120000-abcdef", **kw) -> Capture:
    kw.setdefault("created_at", datetime.now(timezone.utc))
    return Capture(id=cid, upstream="http://127.0.0.1:8000", stages=[0, 2], **kw)


def test_capture_round_trips(tmp_path):
    j = CaptureJournal(tmp_path)
    cap = _cap(state=CaptureState.active, label="x")
    j.write(cap)
    assert [e.capture for e in j.load()] == [cap]


def test_recovery_data_is_kept_beside_the_record(tmp_path):
    j = CaptureJournal(tmp_path)
    j.write(_cap(), {"watches": [{"stage_id": 0}]})
    assert j.load()[0].extra == {"watches": [{"stage_id": 0}]}


def test_one_file_per_capture_and_no_temp_files_left(tmp_path):
    j = CaptureJournal(tmp_path)
    for i in range(3):
        j.write(_cap(f"c{i}"))
        j.write(_cap(f"c{i}", state=CaptureState.completed))
    assert sorted(p.name for p in (tmp_path / "captures").iterdir()) == ["c0.json", "c1.json", "c2.json"]


def test_load_is_oldest_first(tmp_path):
    j = CaptureJournal(tmp_path)
    j.write(_cap("aa-newer"))
    j.write(_cap("zz-older", created_at=datetime(2020, 1, 1, tzinfo=timezone.utc)))
    assert [e.capture.id for e in j.load()] == ["zz-older", "aa-newer"]


@pytest.mark.parametrize("bad", ["{not json", "[]", '{"id": "x"}'])
def test_unreadable_file_is_set_aside(tmp_path, bad):
    j = CaptureJournal(tmp_path)
    j.write(_cap("good"))
    (tmp_path / "captures" / "bad.json").write_text(bad)
    ids = [e.capture.id for e in j.load()]
    assert (ids, (tmp_path / "captures" / "bad.json.corrupt").exists()) == (["good"], True)


@pytest.mark.parametrize("cid", ["../x", "a/b", "", ".hidden"])
def test_ids_that_are_not_file_names_are_refused(tmp_path, cid):
    with pytest.raises(ValueError):
        CaptureJournal(tmp_path).path(cid)


def test_atomic_write_replaces_whole_file(tmp_path):
    p = tmp_path / "f.json"
    atomic_write_text(p, "x" * 1000)
    atomic_write_text(p, "short")
    assert p.read_text() == "short"


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("HF_TOKEN=hf_abcdefghijklmnopqrstu failed", "hf_abcdefghijklmnopqrstu"),
        ("Authorization: Bearer abcdef123456789", "abcdef123456789"),
        ("OPENAI_API_KEY: sk-abcdefghijklmnopqrstuv", "sk-abcdefghijklmnopqrstuv"),
        ('{"password": "hunter2hunter2"}', "hunter2hunter2"),
    ],
)
def test_secrets_are_scrubbed(text, secret):
    assert secret not in scrub_secrets(text)


def test_plain_text_is_left_alone():
    text = "POST http://127.0.0.1:8000/stop_profile answered 500: Failed to stop profiler: stage 2 dead"
    assert scrub_secrets(text) == text


def test_written_file_has_no_secret(tmp_path):
    j = CaptureJournal(tmp_path)
    j.write(_cap(label="token=abcdefghijkl"), {"note": "Bearer abcdefghijklmnop"})
    raw = (tmp_path / "captures" / "20261130-120000-abcdef.json").read_text()
    assert "abcdefghijkl" not in raw and json.loads(raw)["label"] == "token=***"


def test_values_of_secret_env_vars_are_scrubbed(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "plainvalue123456")
    assert scrub_secrets("server said plainvalue123456") == "server said ***"
