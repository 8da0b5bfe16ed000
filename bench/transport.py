"""The upstream client's transport: httpcore (httpx's own) against aiohttp (``sidecar/upstream/transport.py``),
side by side in one run, through ``UpstreamServer.stop_profile`` as a fleet worker sends its stops:
``--clients`` servers at once (128: one worker's share of 1,024 targets), ``--rounds`` rounds each,
alternated. The server is a minimal HTTP/1.1 responder in a child process (its CPU is not counted),
answering every POST with ``{}`` at once, so what is measured is the client's CPU per request and
the wall time of one round. Ratios are printed, never asserted.

    python bench/transport.py [--clients 128] [--rounds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import socket
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sidecar.upstream.server import UpstreamServer  # noqa: E402
from sidecar.upstream.transport import AiohttpTransport  # noqa: E402


class _Reply(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, rest = self.buf.split(b"\r\n\r\n", 1)
            length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")), 0)
            if len(rest) < length:
                return
            self.buf = rest[length:]
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")  # type: ignore[attr-defined]


def _serve(sock: socket.socket) -> None:
    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(_Reply, sock=sock)
        await server.serve_forever()

    asyncio.run(main())


async def _rounds(url: str, transport: str, clients: int, rounds: int) -> tuple[list[float], list[float]]:
    def make() -> httpx.AsyncBaseTransport:
        return httpx.AsyncHTTPTransport() if transport == "httpcore" else AiohttpTransport()

    servers = [UpstreamServer(url, transport=make()) for _ in range(clients)]
    try:
        await asyncio.gather(*(s.stop_profile([0]) for s in servers))  # connections open, out of the count
        cpu, wall = [], []
        for _ in range(rounds):
            c0, w0 = time.process_time(), time.perf_counter()
            await asyncio.gather(*(s.stop_profile([0]) for s in servers))
            cpu.append((time.process_time() - c0) / clients * 1e3)
            wall.append((time.perf_counter() - w0) * 1e3)
        return cpu, wall
    finally:
        await asyncio.gather(*(s.aclose() for s in servers))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--turns", type=int, default=3, help="alternations of the two transports")
    args = ap.parse_args()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    child = multiprocessing.get_context("fork").Process(target=_serve, args=(sock,), daemon=True)
    child.start()
    try:
        got: dict[str, tuple[list[float], list[float]]] = {"httpcore": ([], []), "aiohttp": ([], [])}
        for _ in range(args.turns):
            for name in got:
                cpu, wall = asyncio.run(_rounds(url, name, args.clients, args.rounds))
                got[name][0].extend(cpu)
                got[name][1].extend(wall)
    finally:
        child.terminate()
        child.join()
        sock.close()
    print(f"{args.clients} UpstreamServer.stop_profile at once, {args.rounds} rounds x {args.turns} turns per transport")
    print(f"{'transport':10} {'CPU ms/request p50':>20} {'min':>6} {'round ms p50':>14}")
    for name, (cpu, wall) in got.items():
        print(f"{name:10} {statistics.median(cpu):20.3f} {min(cpu):6.3f} {statistics.median(wall):14.1f}")
    ratio = statistics.median(got["aiohttp"][0]) / statistics.median(got["httpcore"][0])
    wall_ratio = statistics.median(got["aiohttp"][1]) / statistics.median(got["httpcore"][1])
    print(f"aiohttp / httpcore: CPU per request {ratio:.2f}x, round {wall_ratio:.2f}x")


if __name__ == "__main__":
    main()
