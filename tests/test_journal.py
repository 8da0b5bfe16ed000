"""Capture journal: one atomic JSON file per capture, history round-trips, recovery data kept
beside the record, corrupt files set aside, secrets scrubbed."""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone

import pytest

from sidecar.control.journal import CaptureJournal, StateDirLock, atomic_write_text
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
    j.drain()
    assert sorted(p.name for p in (tmp_path / "captures").iterdir()) == ["c0.json", "c1.json", "c2.json"]


def test_load_is_oldest_first(tmp_path):
    j = CaptureJournal(tmp_path)
    j.write(_cap("aa-newer"))
    j.write(_cap("zz-older", created_at=datetime(2020, 1, 1, tzinfo=timezone.utc)))
    assert [e.capture.id for e in j.load()] == ["zz-older", "aa-newer"]


def _good_record(cid: str = "bad") -> dict:
    return _cap(cid).model_dump(mode="json")


_BAD_CONTENT = {
    "not json": "{not json",
    "a list": "[]",
    "no fields": '{"id": "x"}',
    "naive date": json.dumps({**_good_record(), "created_at": "2026-11-30T12:00:00"}),
    "id not the file name": json.dumps(_good_record("other")),
    "bad id": json.dumps({**_good_record(), "id": "../../etc"}),
    "recovery not a mapping": json.dumps({**_good_record(), "_recovery": [1, 2]}),
    "recovery watch malformed": json.dumps({**_good_record(), "_recovery": {"watches": [{"kind": "llm"}]}}),
    "recovery watch bad kind": json.dumps({**_good_record(), "_recovery": {"watches": [{"stage_id": 0, "kind": "?"}]}}),
}


@pytest.mark.parametrize("bad", list(_BAD_CONTENT.values()), ids=list(_BAD_CONTENT))
def test_a_bad_entry_is_quarantined_and_the_rest_loads(tmp_path, bad):
    j = CaptureJournal(tmp_path)
    j.write(_cap("good")).result(timeout=30)
    (tmp_path / "captures" / "bad.json").write_text(bad)
    ids = [e.capture.id for e in j.load()]
    assert (ids, (tmp_path / "captures" / "bad.json.bad").exists(), j.health()["quarantined"]) == (["good"], True, 1)


def test_writes_run_off_the_calling_thread(tmp_path, monkeypatch):
    import threading

    from sidecar.control import journal as journal_mod

    threads = []
    real = journal_mod.atomic_write_text
    monkeypatch.setattr(journal_mod, "atomic_write_text", lambda p, t: (threads.append(threading.current_thread()), real(p, t)))
    j = CaptureJournal(tmp_path)
    j.write(_cap()).result(timeout=30)
    assert threads and threading.current_thread() not in threads


def test_a_failed_write_is_counted_not_raised(tmp_path, monkeypatch):
    from sidecar.control import journal as journal_mod

    def full(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(journal_mod, "atomic_write_text", full)
    j = CaptureJournal(tmp_path)
    j.write(_cap()).result(timeout=30)
    assert (j.health()["write_errors"], "No space" in j.health()["last_write_error"]) == (1, True)


def test_retention_keeps_the_newest_finished_and_every_live_capture(tmp_path):
    from datetime import timedelta

    j = CaptureJournal(tmp_path, keep=2)
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    for i in range(5):
        j.write(_cap(f"c{i}", state=CaptureState.completed, created_at=t0 + timedelta(minutes=i)))
    j.write(_cap("live", state=CaptureState.active, created_at=t0))
    ids = [e.capture.id for e in j.load()]
    j.drain()
    assert (ids, sorted(p.stem for p in (tmp_path / "captures").glob("*.json"))) == (
        ["live", "c3", "c4"], ["c3", "c4", "live"])


def test_retention_deletes_everything_kept_for_a_capture_it_drops(tmp_path):
    # its summaries, and its timeline (tens of MB), one left half-written by a SIGTERM and a summary
    # set aside as unreadable: only "{id}.*json" went, and the state dir grew without bound
    from datetime import timedelta

    j = CaptureJournal(tmp_path, keep=1)
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    kept = tmp_path / "summaries"
    kept.mkdir(parents=True, exist_ok=True)
    names = ["{}.json", "{}.top50.json", "{}.timeline.json.gz", "{}.timeline.json.gz.tmp", "{}.json.bad"]
    for cid in ("old", "new"):
        for name in names:
            (kept / name.format(cid)).write_bytes(b"x")
    j.write(_cap("old", state=CaptureState.completed, created_at=t0))
    j.write(_cap("new", state=CaptureState.completed, created_at=t0 + timedelta(minutes=1)))
    assert [e.capture.id for e in j.load()] == ["new"]
    j.drain()
    assert sorted(p.name for p in kept.iterdir()) == sorted(name.format("new") for name in names)


def test_retention_by_age(tmp_path):
    j = CaptureJournal(tmp_path, keep_days=7)
    old = datetime(2020, 1, 1, tzinfo=timezone.utc)
    j.write(_cap("old", state=CaptureState.failed, created_at=old, finished_at=old))
    j.write(_cap("new", state=CaptureState.completed))
    assert [e.capture.id for e in j.load()] == ["new"]


def test_an_unwritable_state_dir_is_refused_naming_the_fix(tmp_path):
    from sidecar.errors import StateDirUnusable

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(StateDirUnusable) as info:
        CaptureJournal(blocker / "state").check_writable()
    assert str(blocker / "state") in info.value.message and "--state-dir" in info.value.message


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
    j.write(_cap(label="token=abcdefghijkl"), {"note": "Bearer abcdefghijklmnop"}).result(timeout=30)
    raw = (tmp_path / "captures" / "20261130-120000-abcdef.json").read_text()
    assert "abcdefghijkl" not in raw and json.loads(raw)["label"] == "token=***"


def test_values_of_secret_env_vars_are_scrubbed(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "plainvalue123456")
    assert scrub_secrets("server said plainvalue123456") == "server said ***"


def test_many_journals_share_a_few_writer_threads_and_the_newest_state_wins(tmp_path):
    import threading

    journals = [CaptureJournal(tmp_path / f"replica{i}") for i in range(64)]  # a fleet's controllers
    states = [CaptureState.starting, CaptureState.active, CaptureState.stopping, CaptureState.completed]
    for j in journals:
        for state in states:
            j.write(_cap(state=state))
    for j in journals:
        j.drain()
    writers = [t for t in threading.enumerate() if t.name.startswith("journal")]
    assert 1 <= len(writers) <= 4
    assert {j.load()[0].capture.state for j in journals} == {CaptureState.completed}


_HOLD_LOCK = (
    "import sys; from sidecar.control.journal import StateDirLock\n"
    "StateDirLock(sys.argv[1]).acquire(upstream='http://127.0.0.1:8091', port=8092)\n"
    "print('held', flush=True); sys.stdin.read()\n"
)


def test_a_state_dir_held_by_a_live_process_is_refused_naming_its_pid_and_taken_once_it_is_gone(tmp_path):
    import subprocess
    import sys

    from sidecar.control.journal import StateDirLock
    from sidecar.errors import StateDirLocked

    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StateDirLocked) as info:
            StateDirLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    with StateDirLock(tmp_path) as lock:
        owner = lock.owner()
    assert (info.value.details["owner_pid"], "http://127.0.0.1:8091" in info.value.message, owner["pid"]) == (
        holder.pid, True, os.getpid())


def test_taking_a_state_dir_removes_only_what_a_write_killed_midway_left(tmp_path):
    # a fleet's state dir holds one journal per server, a level down
    for folder in ("captures", "summaries", "127.0.0.1_8000/captures"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / ".c0.json.ab_12xyz.tmp").write_text("{")
        (tmp_path / folder / "c0.json").write_text("{}")
    (tmp_path / "captures" / ".probe-77").write_text("ok")
    (tmp_path / "captures" / "c1.json.tmp").write_text("mine")  # not a name the writer makes
    lock = StateDirLock(tmp_path)
    lock.acquire()
    try:
        assert sorted(lock.swept) == ["127.0.0.1_8000/captures/.c0.json.ab_12xyz.tmp", "captures/.c0.json.ab_12xyz.tmp",
                                      "captures/.probe-77", "summaries/.c0.json.ab_12xyz.tmp"]
        left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
        assert left == ["127.0.0.1_8000/captures/c0.json", "captures/c0.json", "captures/c1.json.tmp", "lock", "summaries/c0.json"]
        assert "removed 4 temp files left by a sidecar that died mid-write" in (lock.swept_note() or "")
    finally:
        lock.release()
    again = StateDirLock(tmp_path)
    with again:
        assert again.swept == [] and again.swept_note() is None


def test_a_cache_file_built_for_a_capture_dropped_meanwhile_is_not_adopted(tmp_path):
    # a timeline is built beside the summaries while retention may drop its capture (--keep): a file
    # written after retention deleted the capture's files stayed in summaries/ for good
    j = CaptureJournal(tmp_path, keep=1)
    t0 = datetime(2026, 12, 1, tzinfo=timezone.utc)
    caps = [_cap(f"c{i}", state=CaptureState.completed, created_at=t0.replace(hour=i)) for i in range(2)]
    j.write(caps[0])
    j.drain()
    kept, dropped = j.building("c0", "c0.timeline.json.gz"), j.building("c0", "c0.timeline.json.gz")
    for p in (kept, dropped):
        p.write_bytes(b"gz")
    assert kept.parent != dropped.parent and kept.parent.name.startswith(".building-")
    assert j.adopt("c0", kept) == tmp_path / "summaries" / "c0.timeline.json.gz"
    j.write(caps[1])
    j.expired(caps)  # c0 leaves the history: its record and cached files go
    j.drain()
    assert not (tmp_path / "summaries" / "c0.timeline.json.gz").exists()
    assert j.adopt("c0", dropped) is None and dropped.exists()  # the caller serves it once...
    CaptureJournal.discard(dropped)  # ...then discards it
    assert sorted(p.name for p in (tmp_path / "summaries").iterdir()) == []
    # one left by a crash mid-build goes with the next sidecar's sweep
    (tmp_path / "summaries" / ".building-0a1b2c3d").mkdir()
    (tmp_path / "summaries" / ".building-0a1b2c3d" / "c1.timeline.json.gz").write_bytes(b"gz")
    with StateDirLock(tmp_path) as lock:
        assert lock.swept == ["summaries/.building-0a1b2c3d"]


def test_what_the_journal_keeps_per_file_written_is_bounded(tmp_path):
    # a sidecar's life of captures: one entry per capture ever written grew without end
    from sidecar.control.journal import _WRITTEN_MAX

    j = CaptureJournal(tmp_path)
    for i in range(_WRITTEN_MAX + 50):
        j._note_written(tmp_path / f"c{i}.json", i)
    j.write(_cap("c-last", state=CaptureState.completed))
    j.drain()
    assert len(j._written) == _WRITTEN_MAX and j.path("c-last") in j._written
    assert [e.capture.id for e in j.load()] == ["c-last"]
