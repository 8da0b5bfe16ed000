"""Clock offsets, start skew, the common window and the Perfetto archive of a fleet capture
(docs/fleet-clocks.md). The clock endpoint and the exchange run over the real app; the skewed
replicas run under libfaketime (real emulator + sidecar processes at known offsets)."""

from __future__ import annotations

import time

from sidecar.fleet._clocks import ClockOffset, exchange
from tests.fixtures.sidecar import AppClient


async def test_the_clock_route_answers_both_clocks_and_the_exchange_bounds_its_error(api: AppClient) -> None:
    client = await api(token=True)  # read-only: no token needed

    async def read() -> tuple[int, int]:
        body = (await client.get("/v1/clock")).json()
        return body["realtime_ns"], body["monotonic_ns"]

    before = time.time_ns()
    clock = await exchange(read, samples=4)
    after = time.time_ns()
    assert clock.method == "exchange" and clock.samples == 4
    # the app runs in this process: the true offset is 0, so the bound must hold it
    assert abs(clock.offset_ns) <= clock.error_ns and clock.error_ns * 2 >= clock.rtt_ns
    assert before <= clock.at_ns <= after and clock.target_monotonic_ns is not None
    assert ClockOffset.in_process().method == "in_process" and ClockOffset.in_process().offset_ns == 0
