"""The emulator (sidecar/emulator/) beside the real ``vllm serve --omni`` on CPU, request by request:
both get the same deploy (the ``two_stage`` server's, each its own trace dirs) and the same
requests, and must agree on what the sidecar reads of a server: the probe and identify answers,
the profile endpoints' statuses and reply bodies (an error's type, param and code; its wording
is vLLM's and the sidecar only shows it), the session folders and files each stage writes, and
the ``/metrics`` families a window's summary is made of (sidecar/upstream/metrics.py).

Files that depend on the server's environment, not on the server, are left out: ``ops_rank0.xlsx``
(written where pandas and openpyxl are importable: the real venv has them, the sidecar's may not).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from sidecar.emulator.launcher import EmulatorProcess
from sidecar.upstream.metrics import window_metrics
from sidecar.upstream.server import UpstreamServer
from tests.fixtures.waits import poll
from tests.omni.conftest import Setup

ENV_ONLY = {"ops_rank0.xlsx"}
TIMEOUT = 300.0  # a real stop with the xlsx takes seconds on two busy cores


@dataclass
class Side:
    """One server of the pair: where it listens and where its stages write."""

    name: str
    url: str
    dirs: dict[int, Path]
    last_start: int = -1

    def post(self, path: str, body: Any = None, *, content: str | None = None) -> httpx.Response:
        if content is not None:
            return httpx.post(self.url + path, content=content, headers={"content-type": "application/json"},
                              timeout=TIMEOUT)  # fmt: skip
        return httpx.post(self.url + path, json=body, timeout=TIMEOUT) if body is not None else httpx.post(
            self.url + path, timeout=TIMEOUT)

    def start(self, body: Any = None) -> httpx.Response:
        # a folder name has one-second resolution: a start in a second no earlier start used opens new ones
        assert poll(lambda: int(time.time()) != self.last_start)
        r = self.post("/start_profile", body)
        self.last_start = int(time.time())
        return r

    def chat(self) -> None:
        r = httpx.post(self.url + "/v1/chat/completions", timeout=TIMEOUT,
                       json={"model": self.model(), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200, (self.name, r.text)

    def model(self) -> str:
        return httpx.get(self.url + "/v1/models", timeout=30).json()["data"][0]["id"]

    def folders(self) -> dict[int, set[str]]:
        return {sid: {p.name for p in d.iterdir()} if d.is_dir() else set() for sid, d in self.dirs.items()}

    def written(self, before: dict[int, set[str]]) -> dict[int, list[tuple[str, list[str]]]]:
        """The folders made since ``before`` (in time order, names without their time), each with
        its files once no trace is still being gzipped."""
        def new() -> dict[int, list[tuple[str, list[str]]]]:
            now = self.folders()
            return {sid: [(_shape(n), sorted(f.name for f in (self.dirs[sid] / n).iterdir() if f.name not in ENV_ONLY))
                          for n in sorted(now[sid] - before[sid])] for sid in now}  # fmt: skip

        assert poll(lambda: not any(f.endswith(".json") for v in new().values() for _, fs in v for f in fs),
                    timeout=TIMEOUT), (self.name, new())  # fmt: skip
        return new()


def _shape(folder: str) -> str:
    return re.sub(r"_\d+$", "_<epoch>", re.sub(r"^\d{8}-\d{6}_", "<ts>_", folder))


def _reply(r: httpx.Response) -> tuple[int, Any]:
    """What the sidecar reads of a reply: the status and the body, an error's wording aside."""
    try:
        body = r.json()
    except ValueError:
        return r.status_code, r.text
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        body = {"error": {k: v for k, v in body["error"].items() if k != "message"}}
    return r.status_code, body


@pytest.fixture(scope="module")
def pair(two_stage: Setup, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Side, Side]]:
    """The real two-stage server and an emulator started with the same deploy (its own dirs), as
    vLLM-Omni on vLLM's CPU platform, gzip before the reply (small traces, as the real one's)."""
    assert two_stage.deploy is not None
    root = tmp_path_factory.mktemp("emulator-fidelity")
    doc = yaml.safe_load(two_stage.deploy.read_text())
    dirs = {}
    for stage in doc["stages"]:
        pc = stage.get("profiler_config")
        if pc and pc.get("profiler"):
            dirs[stage["stage_id"]] = pc["torch_profiler_dir"] = str(root / f"stage{stage['stage_id']}")
    deploy = root / "deploy.yaml"
    deploy.write_text(yaml.safe_dump(doc, sort_keys=False))
    args = ["--platform", "cpu", "--workers", "thread", "--step-ms", "1", "--gzip-delay", "0"]
    with EmulatorProcess(deploy, extra_args=args) as emu:
        real = Side("real", two_stage.url, dict(two_stage.dirs))
        fake = Side("emulator", emu.url, {sid: Path(d) for sid, d in dirs.items()})
        try:
            yield real, fake
        finally:
            for side in (real, fake):  # nothing left recording for the group's next test
                side.post("/stop_profile")


def _both(pair: tuple[Side, Side], step: Any) -> tuple[Any, Any]:
    return step(pair[0]), step(pair[1])


def test_the_sidecars_probe_and_identify_agree(pair: tuple[Side, Side]) -> None:
    async def ask(side: Side) -> tuple[Any, ...]:
        async with UpstreamServer(side.url) as up:
            probe = await up.probe()
            found = await up.identify()
        return probe.model_dump(), found.kind

    real, emu = _both(pair, lambda s: asyncio.run(ask(s)))
    assert real == emu
    for path in ("/health", "/start_profile", "/stop_profile", "/v1/omni/sleep", "/version"):
        real, emu = _both(pair, lambda s: httpx.get(s.url + path, timeout=30))
        assert (real.status_code, real.headers.get("allow"), sorted(real.json())) == (
            emu.status_code, emu.headers.get("allow"), sorted(emu.json())), path


# Every body the endpoints may meet: all stages, none, unknown ids, repeats, order, keys other
# releases read; the stop gets the same body as the start.
BODIES: list[Any] = [None, {}, {"stages": None}, {"stages": []}, {"stages": [7]}, {"stages": [-1]},
                     {"stages": [0, 0]}, {"stages": [1, 0]}, {"stages": [0, 7]},
                     {"stages": [0], "max_iterations": 3, "profile_prefix": "x"}]  # fmt: skip
BAD = ['{"stages": "0"}', '{"stages": [0.5]}', "stages=0", "[0]"]


def test_profile_replies_and_session_folders_agree(pair: tuple[Side, Side]) -> None:
    def window(side: Side, body: Any) -> tuple[Any, ...]:
        before = side.folders()
        start = _reply(side.start(body))
        stop = _reply(side.post("/stop_profile", body))
        return start, stop, side.written(before)

    for body in BODIES:
        real, emu = _both(pair, lambda s: window(s, body))
        assert real == emu, body
    for content in BAD:
        real, emu = _both(pair, lambda s: (_reply(s.post("/start_profile", content=content)),
                                           _reply(s.post("/stop_profile", content=content))))
        assert real == emu and real[0][0] == 400, content


def test_repeated_and_partial_calls_agree(pair: tuple[Side, Side]) -> None:
    def sequence(side: Side) -> list[Any]:
        out: list[Any] = []
        out += [_reply(side.post("/stop_profile", {"stages": [0]})) for _ in range(2)]  # stop while stopped
        before = side.folders()
        out += [_reply(side.start({"stages": [0]})), _reply(side.start({"stages": [0]}))]  # start while started
        side.chat()
        out += [_reply(side.post("/stop_profile", {"stages": [0]})), side.written(before)]
        before = side.folders()
        out.append(_reply(side.start({"stages": [0, 1]})))
        side.chat()
        out += [_reply(side.post("/stop_profile", {"stages": [0]})), side.written(before)]  # stage 1 records on
        out += [_reply(side.post("/stop_profile", {"stages": [1]})), side.written(before)]
        return out

    real, emu = _both(pair, sequence)
    assert real == emu


def test_the_metrics_a_window_reads_agree(pair: tuple[Side, Side]) -> None:
    """One request through both stages, read as the sidecar reads a window: the same engines,
    steps, finished requests, latency families with their counts, and vLLM-Omni's own families."""
    async def scrape(side: Side) -> Any:
        async with UpstreamServer(side.url) as up:
            return await up.metrics()

    def window(side: Side) -> tuple[Any, ...]:
        side.chat()  # a family first seen at a request (a stage's, a hand-over's) is there on both
        before = asyncio.run(scrape(side))
        idle = window_metrics(before, asyncio.run(scrape(side)))
        side.chat()
        busy = window_metrics(before, asyncio.run(scrape(side)))
        return tuple(
            ([(e.stage, e.replica, e.engine, e.engine_steps, e.requests_finished,
               {k: v.count for k, v in e.latency.items()}) for e in wm.engines],
             {short: {where: lat.count for where, lat in by.items()} for short, by in wm.omni.items()},
             wm.unavailable)
            for wm in (idle, busy))  # fmt: skip

    real, emu = _both(pair, window)
    assert real == emu
