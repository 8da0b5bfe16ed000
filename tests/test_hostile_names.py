"""A file name that is not UTF-8, planted in a capture's session folder (issue 20, item 8), through a
real ``omni-sidecar serve`` over a socket and a restart on the same journal: stop, one capture, the
listing, the web page, a download and the next start all answer; the name round-trips as its
bytes (``name_quoted``, the percent-encoded form a download URL uses) and shows as ``\\xNN``."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.emulator import EmulatorPool, make_deploy
from tests.fixtures.sidecar import ModuleSidecar

pytestmark = pytest.mark.slow

STAGES = {0: {"profiler": "torch"}}
THREAD = ["--workers", "thread"]
FAST = {"OMNI_SIDECAR_COLLECT_TIMEOUT_S": "5", "OMNI_SIDECAR_CLOSE_TIMEOUT_S": "20"}
WAIT = 90
BAD = b"notes-\xff\xfe.txt"  # not UTF-8: the OS hands Python "notes-\udcff\udcfe.txt"
SHOWN = "notes-\\xff\\xfe.txt"
QUOTED = "notes-%FF%FE.txt"


@pytest.fixture(scope="module")
def _shared(tmp_path_factory: pytest.TempPathFactory, emulator_pool: EmulatorPool) -> Iterator[ModuleSidecar]:
    root = tmp_path_factory.mktemp("names")
    deploy = make_deploy(root, STAGES)
    yield from ModuleSidecar.for_module(emulator_pool, deploy, emulator_args=THREAD, timeout=WAIT,
                                        state_dir=root / "state", env=FAST)  # fmt: skip


@pytest.fixture
def shared(_shared: ModuleSidecar) -> Iterator[ModuleSidecar]:
    yield from _shared.each_test(settle_timeout=WAIT)


def _plant(session: Path) -> Path:
    path = os.path.join(os.fsencode(session), BAD)
    with open(path, "wb") as f:
        f.write(b"planted")
    return Path(os.fsdecode(path))


def _session_of(shared: ModuleSidecar, cid: str) -> Path:
    traces = shared.deploy.parent / "traces" / "stage0"

    def found() -> list[Path]:
        return [p for p in traces.iterdir() if p.is_dir()] if traces.is_dir() else []

    from tests.fixtures.waits import poll

    assert poll(lambda: found())
    return max(found(), key=lambda p: p.stat().st_mtime)


def _get(url: str, **kw: Any) -> httpx.Response:
    return httpx.get(url, timeout=WAIT, **kw)


def test_a_non_utf8_name_in_a_session_folder_round_trips_and_survives_a_restart(shared: ModuleSidecar) -> None:
    url = shared.url
    start = httpx.post(f"{url}/v1/captures", json={"stages": [0]}, timeout=WAIT)
    assert start.status_code == 201, start.text
    cid = start.json()["id"]
    session = _session_of(shared, cid)
    planted = _plant(session)
    try:
        stop = httpx.post(f"{url}/v1/captures/{cid}/stop", params={"wait": "true"}, timeout=WAIT)
        one = _get(f"{url}/v1/captures/{cid}")
        listing = _get(f"{url}/v1/captures")
        page = _get(f"{url}/captures/{cid}")
        assert [r.status_code for r in (stop, one, listing, page)] == [200, 200, 200, 200], stop.text
        files = {f["name"]: f for s in one.json()["verdicts"][0]["sessions"] for f in s["files"]}
        assert files[SHOWN]["name_quoted"] == QUOTED  # display form + the bytes, percent-encoded
        assert all(f.get("name_quoted") is None for n, f in files.items() if n != SHOWN)
        download = _get(f"{url}/v1/captures/{cid}/files/{session.name}/{QUOTED}")
        assert (download.status_code, download.content) == (200, b"planted")
        # the Python client: the name as Capture holds it (the OS's), and the download by it
        with shared.client() as client:
            cap = client.get_capture(cid)
            name = next(f.name for s in cap.verdicts[0].sessions for f in s.files if f.name.startswith("notes-"))
            assert (name, client.download(cid, f"{session.name}/{name}")) == (os.fsdecode(BAD), b"planted")
        # the journal is plain UTF-8 JSON again
        journal = shared.sidecar.state_dir / "captures" / f"{cid}.json"
        json.loads(journal.read_bytes().decode("utf-8"))
        assert "\\udc" not in journal.read_text()

        shared.restart()
        url = shared.url
        again = _get(f"{url}/v1/captures/{cid}")
        after = {f["name"]: f for s in again.json()["verdicts"][0]["sessions"] for f in s["files"]}
        assert (again.status_code, after[SHOWN]["name_quoted"]) == (200, QUOTED)
        assert _get(f"{url}/v1/captures/{cid}/files/{session.name}/{QUOTED}").content == b"planted"
        nxt = httpx.post(f"{url}/v1/captures", json={"stages": [0]}, timeout=WAIT)
        assert nxt.status_code == 201, nxt.text
    finally:
        planted.unlink(missing_ok=True)


def test_a_journal_written_before_the_fix_loads(shared: ModuleSidecar) -> None:
    # what the old code wrote: json.dumps' default escapes the name's lone surrogates ("\udcff")
    state = shared.sidecar.state_dir / "captures"
    model = next(iter(sorted(state.glob("*.json"))), None)
    if model is None:  # a capture first, so there is a journal file to copy the shape of
        cid = httpx.post(f"{shared.url}/v1/captures", json={"stages": [0]}, timeout=WAIT).json()["id"]
        httpx.post(f"{shared.url}/v1/captures/{cid}/stop", params={"wait": "true"}, timeout=WAIT)
        model = state / f"{cid}.json"
    data = json.loads(model.read_text())
    old_id = "old-" + data["id"][-20:]
    data["id"] = old_id
    data["verdicts"][0]["sessions"][0]["files"].append({"name": os.fsdecode(BAD), "size": 7})
    data["verdicts"][0]["sessions"][0]["files"][-1].pop("name_quoted", None)
    (state / f"{old_id}.json").write_text(json.dumps(data))
    shared.restart()
    one = _get(f"{shared.url}/v1/captures/{old_id}")
    listing = _get(f"{shared.url}/v1/captures")
    assert (one.status_code, listing.status_code) == (200, 200), one.text
    names = {f["name"]: f.get("name_quoted") for s in one.json()["verdicts"][0]["sessions"] for f in s["files"]}
    assert names[SHOWN] == QUOTED
    assert old_id in {c["id"] for c in listing.json()["captures"]}
    assert _get(f"{shared.url}/healthz").json()["journal"]["quarantined"] == 0


def test_a_non_utf8_folder_name_does_not_stop_the_next_start(shared: ModuleSidecar) -> None:
    # the start's snapshot digests every fresh session folder of the stage: a planted sub-folder
    # with a non-UTF-8 name must not break it
    cid = httpx.post(f"{shared.url}/v1/captures", json={"stages": [0]}, timeout=WAIT).json()["id"]
    session = _session_of(shared, cid)
    sub = os.path.join(os.fsencode(session), b"d\xff")
    os.mkdir(sub)
    with open(os.path.join(sub, b"x\xfe"), "wb") as f:
        f.write(b"x")
    try:
        stop = httpx.post(f"{shared.url}/v1/captures/{cid}/stop", params={"wait": "true"}, timeout=WAIT)
        nxt = httpx.post(f"{shared.url}/v1/captures", json={"stages": [0]}, timeout=WAIT)
        assert (stop.status_code, nxt.status_code) == (200, 201), stop.text + nxt.text
        names = {f["name"] for s in stop.json()["verdicts"][0]["sessions"] for f in s["files"]}
        assert "d\\xff/x\\xfe" in names
    finally:
        shutil.rmtree(os.fsdecode(sub), ignore_errors=True)


def test_the_web_page_shows_the_name_and_downloads_the_file(web_stack: Any, open_page: Any) -> None:
    from tests.fixtures.waits import poll

    cap = httpx.post(f"{web_stack.url}/v1/captures", json={"stages": [0]}, timeout=WAIT).json()
    traces = web_stack.deploy.parent / "traces" / "stage0"
    assert poll(lambda: traces.is_dir() and any(p.is_dir() for p in traces.iterdir()))
    session = max((p for p in traces.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    planted = _plant(session)
    try:
        web_stack.chat(1)
        done = httpx.post(f"{web_stack.url}/v1/captures/{cap['id']}/stop", params={"wait": "true"}, timeout=WAIT).json()
        assert done["state"] in ("completed", "degraded"), done
        page = open_page(web_stack.url)
        page.goto(f"/captures/{cap['id']}")
        css_value = SHOWN.replace("\\", "\\\\")  # a backslash escapes in a CSS string
        link = page.locator(f'#capture-stages .stage-block[data-stage="0"] a.download[download="{css_value}"]')
        link.wait_for()
        assert link.get_attribute("href") == f"v1/captures/{cap['id']}/files/{session.name}/{QUOTED}"
        assert SHOWN in page.locator('#capture-stages .stage-block[data-stage="0"]').inner_text()
        with page.expect_download() as info:
            link.click()
        assert Path(info.value.path()).read_bytes() == b"planted"
    finally:
        planted.unlink(missing_ok=True)
