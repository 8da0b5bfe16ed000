"""UpstreamServer: probe, explicit stage lists, flavors, error types and retries, over real sockets
(FakeOmni: slow answers, dropped connections, 4xx/5xx, a port that refuses and then serves again)."""

from __future__ import annotations

import json
import socket
import ssl

import httpx
import pytest

from sidecar.errors import MetricsUnavailable, StageSelectionError, UpstreamError, UpstreamTimeout, UpstreamUnreachable
from sidecar.upstream.server import Flavor, UpstreamServer, UpstreamTimeouts
from sidecar.upstream.transport import AiohttpTransport, NotHttp, TlsRefused



class _Key:  # aiohttp's ConnectionKey, as much of it as ClientConnectorError's message reads
    host, port, ssl, is_ssl = "127.0.0.1", 1, False, False


class _Request:  # aiohttp's RequestInfo, as much of it as ClientResponseError's message reads
    real_url = "http://127.0.0.1:1/start_profile"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_probe_reports_mounted_profiler(fake_omni):
    async with UpstreamServer(fake_omni.url) as up:
        result = await up.probe()
    assert (result.healthy, result.profiler_mounted, result.ready) == (True, True, True)


async def test_probe_reports_unmounted_profiler_with_fix(fake_omni):
    fake_omni.mounted = False
    async with UpstreamServer(fake_omni.url) as up:
        result = await up.probe()
    assert result.profiler_mounted is False and "profiler_config.profiler" in result.reason


async def test_probe_changes_nothing_upstream(fake_omni):
    async with UpstreamServer(fake_omni.url) as up:
        await up.probe()
    assert fake_omni.calls == []


async def test_probe_of_dead_server_is_unhealthy():
    async with UpstreamServer(f"http://127.0.0.1:{_free_port()}") as up:
        result = await up.probe()
    assert not result.healthy and "not reachable" in result.reason


async def test_probe_of_dead_server_is_unreachable():
    async with UpstreamServer(f"http://127.0.0.1:{_free_port()}") as up:
        result = await up.probe()
    assert result.reachable is False


async def test_probe_of_a_server_too_busy_to_answer_is_reachable(fake_omni):
    # A server flushing a long stop may not answer /health in time: not gone.
    fake_omni.health_delay = 2
    async with UpstreamServer(fake_omni.url, timeouts=UpstreamTimeouts(probe=0.3)) as up:
        result = await up.probe()
    assert (result.healthy, result.reachable) == (False, True)


async def test_start_sends_explicit_stage_list(fake_omni):
    async with UpstreamServer(fake_omni.url) as up:
        await up.start_profile([0, 2])
    assert [c["stages"] for c in fake_omni.calls] == [[0, 2]]


@pytest.mark.parametrize("method", ["start_profile", "stop_profile"])
async def test_empty_stage_list_is_refused_before_any_call(fake_omni, method):
    async with UpstreamServer(fake_omni.url) as up:
        with pytest.raises(StageSelectionError) as err:
            await getattr(up, method)([])
    assert (err.value.code, fake_omni.calls) == ("stages_empty", [])


async def test_vllm_flavor_sends_no_body(fake_omni):
    async with UpstreamServer(fake_omni.url, flavor=Flavor.vllm) as up:
        await up.start_profile([0])
    assert [c["raw"] for c in fake_omni.starts()] == [b""]


async def test_omni_flavor_body_is_stage_json(fake_omni):
    async with UpstreamServer(fake_omni.url) as up:
        await up.stop_profile([1, 3])
    assert [json.loads(c["raw"]) for c in fake_omni.stops()] == [{"stages": [1, 3]}]


async def test_start_500_is_upstream_error_with_status_and_body(fake_omni):
    fake_omni.start_status = 500
    async with UpstreamServer(fake_omni.url) as up:
        with pytest.raises(UpstreamError) as err:
            await up.start_profile([0])
    assert err.value.details["status"] == 500 and "boom" in err.value.details["body"]


async def test_start_to_closed_port_is_unreachable():
    async with UpstreamServer(f"http://127.0.0.1:{_free_port()}", start_attempts=2) as up:
        with pytest.raises(UpstreamUnreachable):
            await up.start_profile([0])


async def test_start_retries_only_undelivered_requests(fake_omni):
    # refused on the first attempt (the server is down), accepted on the next (it is back)
    class BackAfterRefusal(AiohttpTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            try:
                return await super().handle_async_request(request)
            except httpx.ConnectError:
                fake_omni.revive()
                raise

    fake_omni.crash()
    async with UpstreamServer(fake_omni.url, retry_wait_max_s=0.01, transport=BackAfterRefusal()) as up:
        await up.start_profile([0])
    assert len(fake_omni.starts()) == 1


async def test_start_dropped_after_it_was_read_is_ambiguous_and_not_sent_again(fake_omni):
    # delivered, then the connection went: the server may be recording, a second start would be a second window
    fake_omni.drop_starts = 1
    async with UpstreamServer(fake_omni.url, retry_wait_max_s=0.01, start_attempts=3) as up:
        with pytest.raises(UpstreamTimeout, match="effect is unknown"):
            await up.start_profile([0])
    assert len(fake_omni.starts()) == 1


async def test_a_start_after_the_server_closed_an_idle_connection_is_sent_once_on_a_fresh_one(fake_omni):
    # The server closes a pooled connection while this loop is busy (a sidecar reading traces
    # after a stop): the start that comes next must not go out on it, where it would be lost with
    # its effect unknown (a plan's probe start on a real vLLM-Omni 0.32rc1, in CI). The close is
    # made while the loop cannot run, so the client has not seen it when the start is sent.
    async def released() -> None:  # a fan-out's release: the held start's last byte goes now
        pass

    async with UpstreamServer(fake_omni.url) as up:
        for held in (None, released):  # a sidecar's start, a fleet's start held to its last byte
            await up.stop_profile([0])  # its connection is pooled, idle
            fake_omni.close_idle()
            await up.start_profile([0], before_send=held)
    assert [c["path"] for c in fake_omni.calls] == ["/stop_profile", "/start_profile"] * 2


@pytest.mark.parametrize(("error", "as_httpx"), [
    (lambda a: a.ConnectionTimeoutError("connect"), httpx.ConnectTimeout),
    (lambda a: a.ClientConnectorError(_Key(), ConnectionRefusedError(111, "refused")), httpx.ConnectError),
    (lambda a: a.SocketTimeoutError("read"), httpx.ReadTimeout),
    (lambda a: a.ServerDisconnectedError(), httpx.RemoteProtocolError),
    (lambda a: a.ClientOSError(104, "reset"), httpx.RemoteProtocolError),
    (lambda a: a.ClientPayloadError("cut"), httpx.ReadError),
    (lambda a: a.ClientResponseError(_Request(), (), status=400, message="Bad status line"), NotHttp),  # another service
    (lambda a: a.ClientConnectorCertificateError(_Key(), ssl.SSLCertVerificationError(1, "self-signed")), TlsRefused),
    (lambda a: a.ClientConnectorSSLError(_Key(), ssl.SSLError(1, "wrong version number")), TlsRefused),
])
def test_aiohttp_errors_become_httpx_errors_by_what_they_say_of_delivery(error, as_httpx):
    import aiohttp

    from sidecar.upstream.transport import _httpx_error

    assert type(_httpx_error(error(aiohttp))) is as_httpx


async def test_start_read_timeout_is_ambiguous_and_not_retried(fake_omni):
    fake_omni.start_delay = 2  # delivered, unanswered: the server may be recording
    async with UpstreamServer(fake_omni.url, timeouts=UpstreamTimeouts(start=0.3)) as up:
        with pytest.raises(UpstreamTimeout):
            await up.start_profile([0])
    assert len(fake_omni.starts()) == 1


async def test_start_5xx_is_not_retried(fake_omni):
    fake_omni.start_status = 500
    async with UpstreamServer(fake_omni.url, retry_wait_max_s=0.01) as up:
        with pytest.raises(UpstreamError):
            await up.start_profile([0])
    assert len(fake_omni.starts()) == 1


async def test_stop_retries_5xx_until_success(fake_omni):
    fake_omni.stop_fail_times = 2
    async with UpstreamServer(fake_omni.url, retry_wait_max_s=0.01) as up:
        await up.stop_profile([0])
    assert len(fake_omni.stops()) == 3


async def test_stop_does_not_retry_4xx(fake_omni):
    fake_omni.stop_status = 422
    async with UpstreamServer(fake_omni.url, retry_wait_max_s=0.01) as up:
        with pytest.raises(UpstreamError) as err:
            await up.stop_profile([0])
    assert (err.value.details["status"], len(fake_omni.stops())) == (422, 1)


async def test_hung_stop_ends_as_timeout_within_budget(fake_omni):
    fake_omni.stop_delay = 30
    async with UpstreamServer(fake_omni.url, stop_budget_s=0.5) as up:
        with pytest.raises(UpstreamTimeout):
            await up.stop_profile([0])


async def test_stop_budget_gives_up_on_dead_server():
    async with UpstreamServer(f"http://127.0.0.1:{_free_port()}", stop_budget_s=0.5, retry_wait_max_s=0.05) as up:
        with pytest.raises(UpstreamUnreachable):
            await up.stop_profile([0])



async def test_persistent_5xx_on_stop_gives_up_before_the_budget(fake_omni):
    fake_omni.stop_status = 500
    async with UpstreamServer(fake_omni.url, stop_budget_s=600, stop_5xx_attempts=3, retry_wait_max_s=0.01) as up:
        with pytest.raises(UpstreamError):
            await up.stop_profile([0])
    assert len(fake_omni.stops()) == 3


async def test_stop_retries_a_dropped_connection(fake_omni):
    fake_omni.drop_stops = 1
    async with UpstreamServer(fake_omni.url, retry_wait_max_s=0.01) as up:
        await up.stop_profile([0])
    assert len(fake_omni.stops()) == 2


async def test_stop_retries_after_a_read_timeout_within_budget(fake_omni):
    fake_omni.stop_delays = [2.0]  # the first attempt outlives its read timeout, the second answers
    timeouts = UpstreamTimeouts(stop=0.3)
    async with UpstreamServer(fake_omni.url, timeouts=timeouts, stop_budget_s=30, retry_wait_max_s=0.01) as up:
        await up.stop_profile([0])
    assert len(fake_omni.stops()) == 2


async def test_a_server_without_metrics_keeps_its_connection_for_the_next_call(fake_omni):
    # A 404 on /metrics read to its end: its keep-alive connection serves the stop after it (one
    # left unread is closed, and a fleet of servers without /metrics opened a connection per stop)
    async with UpstreamServer(fake_omni.url) as server:
        with pytest.raises(MetricsUnavailable, match="answered 404"):
            await server.metrics()
        await server.stop_profile([0])
        await server.stop_profile([0])
        assert fake_omni.connections == 1, fake_omni.connections
        await server.start_profile([0])  # a start goes on a connection of its own, always
    assert fake_omni.connections == 2, fake_omni.connections
