"""SidecarClient / AsyncSidecarClient against a real sidecar and emulator (module-scoped: each
test leaves no capture running). Error replies must come back as typed SidecarErrors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sidecar.api.launcher import SidecarProcess, free_port
from sidecar.client import AsyncSidecarClient, SidecarClient, SidecarUnreachable, WaitTimeout
from sidecar.errors import CaptureActive, CaptureNotFound, SidecarError, StageSelectionError
from tests.fixtures.emulator import EmulatorPool, make_deploy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def urls(tmp_path_factory: pytest.TempPathFactory, emulator_pool: EmulatorPool) -> Iterator[tuple[str, str]]:
    """(sidecar url, emulator url)."""
    root = tmp_path_factory.mktemp("client")
    deploy = make_deploy(root, {0: {"profiler": "torch"}, 1: None, 2: {"profiler": "torch"}})
    # thread workers: the client's round trips and the summary's shape, not real torch ops
    emu = emulator_pool.get(deploy, extra_args=["--workers", "thread"], startup_timeout=120)
    with SidecarProcess(emu.url, deploy, state_dir=root / "state", env={}) as sc:
        yield sc.url, emu.url


@pytest.fixture(scope="module")
def sidecar_url(urls: tuple[str, str]) -> str:
    return urls[0]


_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _request(emu_url: str) -> None:
    """One chat request through every stage: the window records work (an idle one is ``empty``)."""
    httpx.post(f"{emu_url}/v1/chat/completions", json=_CHAT, timeout=60, trust_env=False).raise_for_status()


@pytest.fixture
def client(sidecar_url: str) -> Iterator[SidecarClient]:
    with SidecarClient(sidecar_url) as c:
        yield c
        for cap in c.list_captures():  # never leave a capture running for the next test
            if not cap.terminal:
                c.stop_capture(cap.id, wait=True, timeout=60)


def test_capture_round_trip_completes(client: SidecarClient, urls: tuple[str, str]) -> None:
    cap = client.start_capture([0, 2], label="round-trip")
    _request(urls[1])
    final = client.stop_capture(cap.id, wait=True, timeout=60)
    assert (final.id, final.label, final.state.value, [v.verdict.value for v in final.verdicts if v.verdict]) == (
        cap.id, "round-trip", "completed", ["ok", "ok"]
    )


async def test_async_client_round_trip_completes(urls: tuple[str, str]) -> None:
    sidecar_url, emu_url = urls
    async with AsyncSidecarClient(sidecar_url) as client, httpx.AsyncClient(timeout=60, trust_env=False) as emu:
        cap = await client.start_capture([2])
        (await emu.post(f"{emu_url}/v1/chat/completions", json=_CHAT)).raise_for_status()
        await client.heartbeat(cap.id)
        final = await client.stop_capture(cap.id, wait=True, timeout=60)
        fetched = await client.get_capture(cap.id)
    assert (final.state.value, fetched.state.value) == ("completed", "completed")


def test_overlap_raises_capture_active_with_the_active_id(client: SidecarClient) -> None:
    cap = client.start_capture([0])
    with pytest.raises(CaptureActive) as err:
        client.start_capture([2])
    assert err.value.details["active_id"] == cap.id


@pytest.mark.parametrize(("stages", "code"), [([], "stages_empty"), ([1], "stage_not_profiled")])
def test_bad_stages_raise_stage_selection_error(client: SidecarClient, stages: list[int], code: str) -> None:
    with pytest.raises(StageSelectionError) as err:
        client.start_capture(stages)
    assert (err.value.code, err.value.details["status"]) == (code, 422)


def test_unknown_capture_raises_not_found(client: SidecarClient) -> None:
    with pytest.raises(CaptureNotFound):
        client.get_capture("nope")


def test_wait_timeout_while_active(client: SidecarClient) -> None:
    cap = client.start_capture([0])
    with pytest.raises(WaitTimeout) as err:
        client.wait_capture(cap.id, timeout=0.3, poll_s=0.1)
    assert err.value.details["state"] == "active"


def test_list_is_newest_first(client: SidecarClient) -> None:
    first = client.stop_capture(client.start_capture([0]).id, wait=True, timeout=60)
    second = client.stop_capture(client.start_capture([2]).id, wait=True, timeout=60)
    ids = [c.id for c in client.list_captures()]
    assert ids.index(second.id) < ids.index(first.id)


def test_health_ready_and_stages(client: SidecarClient) -> None:
    assert client.healthz()["status"] == "ok"
    assert client.readyz()["status"] == "ready"
    assert [s["stage_id"] for s in client.stages()["stages"]] == [0, 1, 2]


def test_summary_has_top_ops_per_stage(client: SidecarClient, urls: tuple[str, str]) -> None:
    analysis = pytest.importorskip("sidecar.analysis")
    if not hasattr(analysis, "summarize_paths"):
        pytest.skip("sidecar.analysis.summarize_paths not available")
    cap = client.start_capture([0, 2])
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    httpx.post(f"{urls[1]}/v1/chat/completions", json=chat, timeout=60).raise_for_status()
    final = client.stop_capture(cap.id, wait=True, timeout=60)
    summary = client.summary(final.id, top=5)  # a model, like every other reply
    assert {s.stage_id for s in summary.stages} == {0, 2}
    assert all(0 < len(s.cpu_ops) <= 5 for s in summary.stages)


def test_unreachable_sidecar_raises_a_typed_error() -> None:
    with SidecarClient(f"http://127.0.0.1:{free_port()}", timeout=2) as client, pytest.raises(SidecarUnreachable):
        client.healthz()


async def test_async_unreachable_sidecar_raises_a_typed_error() -> None:
    async with AsyncSidecarClient(f"http://127.0.0.1:{free_port()}", timeout=2) as client:
        with pytest.raises(SidecarUnreachable):
            await client.healthz()


def test_values_print_as_words(client: SidecarClient, urls: tuple[str, str]) -> None:
    cap = client.start_capture([0])
    final = client.stop_capture(cap.id, wait=True, timeout=60)
    printed = " ".join(map(str, (final.state, final.stop_reason, final.verdicts[0].verdict, final.kind)))  # as print() does
    assert printed == f"{final.state.value} explicit {final.verdicts[0].verdict.value} torch"


class _DropsFirstConnection:
    """A socket server on 127.0.0.1 that reads the first connection's request and closes it
    unanswered (a kept-alive connection closed by the server as the request went out), then
    answers every later one with ``{"status": "ok"}``; it records each request line."""

    def __init__(self) -> None:
        import socket
        import threading

        self.lines: list[str] = []
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen()
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        body = b'{"status": "ok"}'
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                self.lines.append(data.split(b"\r\n", 1)[0].decode())
                if len(self.lines) > 1:
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(body), body))

    def close(self) -> None:
        import socket

        self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() (a close alone does not)
        self._sock.close()
        self._thread.join(5)


@pytest.fixture
def drops_first() -> Iterator[_DropsFirstConnection]:
    server = _DropsFirstConnection()
    try:
        yield server
    finally:
        server.close()


def test_a_read_whose_connection_was_dropped_unanswered_goes_once_more(drops_first: _DropsFirstConnection) -> None:
    with SidecarClient(drops_first.url, timeout=10) as client:
        assert client.healthz() == {"status": "ok"}
    assert [line.split()[0:2] for line in drops_first.lines] == [["GET", "/healthz"]] * 2


async def test_the_async_client_resends_a_dropped_read_too(drops_first: _DropsFirstConnection) -> None:
    async with AsyncSidecarClient(drops_first.url, timeout=10) as client:
        assert await client.healthz() == {"status": "ok"}
    assert len(drops_first.lines) == 2, drops_first.lines


def test_a_write_whose_connection_was_dropped_is_not_resent(drops_first: _DropsFirstConnection) -> None:
    with SidecarClient(drops_first.url, timeout=10) as client, pytest.raises(SidecarUnreachable):
        client.start_capture([0])
    assert [line.split()[0] for line in drops_first.lines] == ["POST"], drops_first.lines


@pytest.mark.parametrize("suffix", ["#x", "?until=started", "/../{id}"])
def test_an_id_with_url_characters_addresses_no_other_capture(client: SidecarClient, suffix: str) -> None:
    cap = client.start_capture([0])  # sent as it was, `<id>#x` and `other/../<id>` reached this capture
    asked = f"other{suffix.format(id=cap.id)}" if "{id}" in suffix else cap.id + suffix
    with pytest.raises(CaptureNotFound):
        client.stop_capture(asked)
    assert client.get_capture(cap.id).state.value == "active"


def test_the_sync_and_async_clients_have_the_same_calls() -> None:
    # "Sync twin": the sync client had no record_clock, so a script keeping a clock measurement
    # with its capture had to open an event loop for it
    def calls(cls: type) -> set[str]:
        return {m for m in dir(cls) if not m.startswith("_")} - {"close", "aclose"}

    assert calls(SidecarClient) == calls(AsyncSidecarClient)
    api = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    assert not {m for m in calls(SidecarClient) if f"`{m}(" not in api}, "client calls docs/api.md does not name"


def test_a_clock_record_is_kept_with_the_capture_by_the_sync_client(client: SidecarClient) -> None:
    cap = client.start_capture([0])
    kept = client.record_clock(cap.id, {"phase": "start", "offset_ns": 1500, "error_ns": 200, "at_ns": 7})
    assert [(c.phase, c.offset_ns, c.error_ns) for c in kept.clocks] == [("start", 1500, 200)], kept.clocks
    with pytest.raises(SidecarError) as refused:  # the sidecar's rule, raised as its typed error
        client.record_clock(cap.id, {"phase": "middle", "offset_ns": 0, "error_ns": 0, "at_ns": 0})
    assert refused.value.code == "request_invalid", refused.value
