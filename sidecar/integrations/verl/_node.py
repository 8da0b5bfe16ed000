"""What runs on a rollout replica's node: :class:`ReplicaProfiler`, the sidecar's own capture
controller for one server, placed there by Ray (node affinity to the replica's server actor), so
the trace folder is checked where it is written and only the capture (verdicts, folders) and a
short summary (top ops per stage) travel back. No verl import: it runs wherever the sidecar does.

Every method answers a plain dict (``{"ok": true, ...}`` or ``{"ok": false, "error": {code,
message}}``): a failure is data for the step's result, never an exception crossing Ray.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import yaml

from sidecar.errors import SidecarError

__all__ = ["ReplicaProfiler", "deploy_for_server"]

# Ops reported per stage in a step's result.
TOP_OPS = 5


def deploy_for_server(profiler_config: dict[str, Any], stages: list[int] | None) -> dict[str, Any]:
    """The deploy the sidecar checks a verl-launched server against. verl gives the server one
    server-wide ``--profiler-config``: a plain vLLM server is one implicit stage 0; a vLLM-Omni
    server (verl-omni) applies it to every stage (``stages``), all writing to the same folder."""
    ids = stages if stages else [0]
    return {"stages": [{"stage_id": sid, "profiler_config": dict(profiler_config)} for sid in ids]}


def _error(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, SidecarError):
        return {"ok": False, "error": {"code": exc.code, "message": exc.message}}
    return {"ok": False, "error": {"code": "internal_error", "message": f"{type(exc).__name__}: {exc}"}}


def _top_ops(summary: dict[str, Any], top: int) -> dict[str, list[dict[str, Any]]]:
    """Per stage: the ``top`` device kernels by time, else the CPU ops (a CPU-only trace)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for stage in summary.get("stages") or []:
        rows = stage.get("kernels") or stage.get("cpu_ops") or []
        out[str(stage.get("stage_id"))] = [
            {"name": r.get("name"), "count": r.get("count"), "total_us": r.get("total_us")} for r in rows[:top]
        ]
    return out


class ReplicaProfiler:
    """One verl rollout server, driven by a :class:`~sidecar.control.controller.CaptureController`
    on the server's node. Used as a Ray async actor (``ray.remote(ReplicaProfiler)``)."""

    def __init__(self, url: str, deploy: dict[str, Any] | str, *, flavor: str = "vllm",
                 stop_budget_s: float = 1800.0, control: dict[str, Any] | None = None) -> None:
        self.url = url
        self.deploy = deploy  # a mapping (written here), or the path of a deploy YAML on this node
        self.flavor = flavor
        self.stop_budget_s = stop_budget_s
        self.control = control or {}
        self._controller: Any = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    async def open(self) -> dict[str, Any]:
        try:
            from sidecar.config.deploy import load_deploy_config
            from sidecar.control.controller import CaptureController, ControlSettings
            from sidecar.upstream.server import Flavor, UpstreamServer

            if isinstance(self.deploy, str):
                path = Path(self.deploy)
            else:
                self._dir = tempfile.TemporaryDirectory(prefix="omni-sidecar-verl-")
                path = Path(self._dir.name) / "deploy.yaml"
                path.write_text(yaml.safe_dump(self.deploy, sort_keys=False))
            deploy = load_deploy_config(path)
            upstream = UpstreamServer(self.url, flavor=Flavor(self.flavor), stop_budget_s=self.stop_budget_s)
            self._controller = CaptureController(upstream, deploy, settings=ControlSettings(**self.control))
            await self._controller.open()
            return {"ok": True, "stages": [s.stage_id for s in deploy.stages]}
        except Exception as exc:
            return _error(exc)

    async def start(self, stages: list[int] | None, label: str, lease_s: float | None) -> dict[str, Any]:
        try:
            cap = await self._controller.start(stages, label=label, lease_s=lease_s)
            return {"ok": True, "capture": cap.model_dump(mode="json")}
        except Exception as exc:
            return _error(exc)

    async def heartbeat(self, capture_id: str) -> dict[str, Any]:
        try:
            await self._controller.heartbeat(capture_id)
            return {"ok": True}
        except Exception as exc:
            return _error(exc)

    async def stop(self, capture_id: str) -> dict[str, Any]:
        """Returns once the server answered stop (the artifact check goes on: :meth:`finish`)."""
        import asyncio

        from sidecar.control.models import CaptureState

        try:
            cap = await self._controller.stop(capture_id)
            while cap.state in (CaptureState.starting, CaptureState.active, CaptureState.stopping):
                await asyncio.sleep(0.1)
                cap = self._controller.get(capture_id)
            return {"ok": True, "capture": cap.model_dump(mode="json")}
        except Exception as exc:
            return _error(exc)

    async def finish(self, capture_id: str, timeout_s: float | None, top: int = TOP_OPS) -> dict[str, Any]:
        """Wait for the artifact check; the capture with its verdicts and the top ops per stage."""
        try:
            cap = await self._controller.wait(capture_id, timeout=timeout_s)
            out: dict[str, Any] = {"ok": True, "capture": cap.model_dump(mode="json"), "top_ops": {}}
            if cap.terminal and any(v.verdict is not None and v.verdict.value == "ok" for v in cap.verdicts):
                try:
                    summary = await self._controller.summarize(capture_id, top=top)
                    out["top_ops"] = _top_ops(summary, top)
                except Exception as exc:  # a summary never changes the verdict
                    out["summary_error"] = str(exc)
            return out
        except Exception as exc:
            return _error(exc)

    async def close(self) -> None:
        if self._controller is not None:
            try:
                await self._controller.close()  # stops a live capture (reason: shutdown)
            finally:
                await self._controller.upstream.aclose()
        if self._dir is not None:
            self._dir.cleanup()
