"""Stand-ins for what needs a GPU, each built on verl's own classes and functions:

- ``EmulatedServer`` stands in for verl's ``vLLMHttpServer`` (a vLLM engine on GPUs): it builds
  its profiler rule exactly as that class does (``build_rollout_dist_profiler`` with
  ``replica_world_size = tp*dp*pp``), launches an ``omni-sidecar emulate --flavor vllm`` server
  with the ``--profiler-config`` verl's ``build_vllm_profiler_args`` gives (trace dir
  ``<save_path>/agent_loop_rollout_replica_<rank>``), only on the replicas that rule selects, and
  its ``start_profile``/``stop_profile`` (verl's engine-level calls) are recorded and forwarded.
- ``EmulatedReplica`` is a real ``verl.workers.rollout.replica.RolloutReplica`` whose
  ``launch_servers`` starts that server on this node (registered as rollout name ``emulator``).
- ``ActorRolloutRefWorker`` stands in for verl's FSDP training worker (an FSDP model and a vLLM
  engine on a GPU per rank): the same registered methods and dispatch; nothing is trained.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

import httpx
import ray
import yaml
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.profiler import build_rollout_dist_profiler, build_vllm_profiler_args
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry


class EmulatedServer:
    def __init__(self, config: Any, replica_rank: int) -> None:
        self.config = config
        self.replica_rank = replica_rank
        profiler_config = config.profiler
        tool_config = None
        if profiler_config is not None and profiler_config.tool in ("torch", "npu"):
            tool_config = omega_conf_to_dataclass((profiler_config.tool_config or {}).get(profiler_config.tool))
        else:
            profiler_config = None
        self.replica_world_size = (
            config.tensor_model_parallel_size * config.data_parallel_size * config.pipeline_model_parallel_size
        )
        self.profiler_controller = build_rollout_dist_profiler(
            replica_rank, self.replica_world_size, config=profiler_config, tool_config=tool_config
        )
        self.engine_calls: list[str] = []
        self.emulator: Any = None

    def _should_profile(self) -> bool:
        c = self.profiler_controller
        return c.check_enable() and c.check_this_rank() and c.is_discrete_mode()

    def launch_server(self) -> str:
        from sidecar.emulator.launcher import EmulatorProcess

        stage: dict[str, Any] = {"stage_id": 0}
        if self._should_profile():
            args = build_vllm_profiler_args(self.profiler_controller.config, self.profiler_controller.tool_config,
                                            self.replica_rank, legacy_env=False)
            stage["profiler_config"] = json.loads(args["profiler_config"])
        folder = Path(tempfile.mkdtemp(prefix=f"verl-replica{self.replica_rank}-"))
        deploy = folder / "deploy.yaml"
        deploy.write_text(yaml.safe_dump({"stages": [stage]}))
        self.emulator = EmulatorProcess(deploy, flavor="vllm", startup_timeout=300).start()
        return f"127.0.0.1:{self.emulator.port}"

    async def start_profile(self, **kwargs: Any) -> None:  # verl's engine.start_profile()
        self.engine_calls.append("start")
        if self._should_profile():
            async with httpx.AsyncClient(timeout=120) as c:
                await c.post(f"{self.emulator.url}/start_profile")

    async def stop_profile(self) -> None:  # verl's engine.stop_profile()
        self.engine_calls.append("stop")
        if self._should_profile():
            async with httpx.AsyncClient(timeout=600) as c:
                await c.post(f"{self.emulator.url}/stop_profile")

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data: Any = None, video_data: Any = None, audio_data: Any = None,
                       mm_processor_kwargs: Any = None, priority: int = 0, kv_transfer_params: Any = None) -> Any:
        """verl's token-in/token-out generation: one chat request to the emulator (the engine's
        work, which its trace records) and that many response tokens back."""
        from verl.workers.rollout.replica import TokenOutput

        n = max(1, min(int(sampling_params.get("max_tokens") or 4), 4))
        async with httpx.AsyncClient(timeout=120) as c:
            r = await c.post(f"{self.emulator.url}/v1/chat/completions",
                             json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": n})
            r.raise_for_status()
        return TokenOutput(token_ids=[5] * n, log_probs=[0.0] * n, stop_reason="completed")

    def sleep(self) -> None:
        return None

    def wake_up(self, tags: Any = None) -> None:
        return None

    def get_engine_calls(self) -> list[str]:
        return list(self.engine_calls)

    def calls(self) -> list[dict[str, Any]]:
        return httpx.get(f"{self.emulator.url}/emulator/state", timeout=30).json()["calls"]

    def shutdown(self) -> None:
        if self.emulator is not None:
            self.emulator.stop()
            self.emulator = None


LAUNCHED: list[Any] = []  # every server actor launched in this process (a test shuts them down)


class EmulatedReplica(RolloutReplica):
    async def launch_servers(self) -> None:
        node = ray.get_runtime_context().get_node_id()
        server = ray.remote(num_cpus=0)(EmulatedServer).options(
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id=node, soft=False),
        ).remote(self.config, self.replica_rank)
        self._server_address = await server.launch_server.remote()
        self._server_handle = server
        self.servers = [server]
        LAUNCHED.append(server)

    async def sleep(self) -> None:
        await asyncio.gather(*[s.sleep.remote() for s in self.servers])


RolloutReplicaRegistry.register("emulator", lambda: EmulatedReplica)




def posts(server: Any) -> list[str]:
    """The profiler and generation POSTs one emulated server received, in order."""
    calls = ray.get(server.calls.remote(), timeout=60)
    short = {"/start_profile": "start", "/stop_profile": "stop", "/v1/chat/completions": "gen"}
    return [short[c["path"]] for c in calls if c["method"] == "POST" and c["path"] in short]


def generate(address: str, max_tokens: int = 4) -> None:
    """One chat request (what verl's agent-loop workers send a rollout server)."""
    r = httpx.post(f"http://{address}/v1/chat/completions", timeout=120,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens})
    r.raise_for_status()


# --- the v0 trainer's GPU worker group ------------------------------------------------------

from verl.single_controller.base import Worker  # noqa: E402
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register  # noqa: E402


class ActorRolloutRefWorker(Worker):
    """Stands in for ``verl.workers.engine_workers.ActorRolloutRefWorker`` (an FSDP model and a
    vLLM engine on a GPU per rank): the same registered methods with verl's dispatch modes, the
    same ``actor`` mesh, and outputs of the shapes verl's fit loop reads (zero log-probs over
    each sequence's tokens, the metrics keys it renames). Nothing is trained."""

    def __init__(self, config: Any, role: str, distillation_config: Any = None, **kwargs: Any) -> None:
        Worker.__init__(self)
        self.config, self.role = config, role
        self.profile_calls: list[tuple[str, Any]] = []

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.set_dispatch_collect(mesh_name="actor", dispatch_dp_rank={"actor": self.rank},
                                  collect_dp_rank={"actor": True})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_loss_fn(self, loss_fn: Any) -> None:
        return None

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_log_prob(self, data: Any) -> Any:
        import torch
        from verl.utils import tensordict_utils as tu

        ids = data["input_ids"]
        zeros = torch.nested.nested_tensor([torch.zeros(len(x)) for x in ids.unbind()], layout=torch.jagged)
        return tu.get_tensordict({"log_probs": zeros, "entropy": zeros.clone()}, non_tensor_dict={"metrics": {"mfu": 0.0}})

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def update_actor(self, data: Any) -> Any:
        from verl.utils import tensordict_utils as tu

        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {"mfu": [0.0], "pg_loss": [0.0]}})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> None:
        return None  # the weight sync into the rollout engine on the same GPU

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def start_profile(self, **kwargs: Any) -> None:
        self.profile_calls.append(("start", kwargs.get("profile_step")))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stop_profile(self, **kwargs: Any) -> None:
        self.profile_calls.append(("stop", None))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_profile_calls(self) -> list[tuple[str, Any]]:
        return list(self.profile_calls)
