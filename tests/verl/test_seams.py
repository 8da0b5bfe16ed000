"""The seams the hook depends on, checked on verl 0.9.1's own classes (not copies): every
attribute the hook reads (``sidecar/integrations/verl/_hook.py`` ``*_READS``) is set or defined by
the real trainer, ``LLMServerManager``, ``RolloutReplica``, ``vLLMHttpServer`` and its profiler;
and each GPU-free stand-in of tests/verl/_standin.py has what the real class it stands in for has.
``vLLMHttpServer`` needs vLLM on GPUs to build, so its ``__init__`` is read (the attributes it
assigns); the profiler is built with verl's own ``build_rollout_dist_profiler``."""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

import pytest

from sidecar.integrations.verl import _hook

pytestmark = pytest.mark.verl


def _assigned(cls: type, method: str = "__init__") -> set[str]:
    """The ``self.X`` a method of ``cls`` assigns, read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(cls, method))))
    out = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                    out.add(el.attr)
    return out


def _has(cls: type, name: str, assigned: set[str]) -> bool:
    return name in assigned or hasattr(cls, name)


def _assigned_in_file(relpath: str, cls_name: str, method: str = "__init__") -> set[str]:
    """``_assigned`` for a class whose module cannot be imported here (it needs vLLM)."""
    import importlib.util
    from pathlib import Path

    root = Path(importlib.util.find_spec("verl").submodule_search_locations[0])  # type: ignore[index, union-attr]
    tree = ast.parse((root / relpath).read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls_name)
    fn = next(n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == method)
    return {el.attr for node in ast.walk(fn) if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            for el in (t.elts if isinstance(t, ast.Tuple) else [t])
            if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self"}


def test_vllm_http_server_sets_what_the_hook_reads_inside_its_actor():
    # its module imports vLLM (GPU builds only): read the class's __init__ from verl's own file
    assigned = _assigned_in_file("workers/rollout/vllm_rollout/vllm_async_server.py", "vLLMHttpServer")
    assert [a for a in _hook.SERVER_READS if a not in assigned] == []


def test_verls_rollout_profiler_has_what_the_hook_reads():
    from verl.utils.profiler import build_rollout_dist_profiler

    ctl = build_rollout_dist_profiler(0, 1, config=None, tool_config=None)
    assert [a for a in _hook.PROFILER_READS if not hasattr(ctl, a)] == []


def test_rollout_replica_and_llm_server_manager_have_what_the_hook_reads():
    from verl.workers.rollout.llm_server import LLMServerManager
    from verl.workers.rollout.replica import RolloutReplica

    replica = _assigned(RolloutReplica)
    assert [a for a in _hook.REPLICA_READS if not _has(RolloutReplica, a, replica)] == []
    assert isinstance(inspect.getattr_static(RolloutReplica, "server_address"), property)
    assert [a for a in _hook.MANAGER_READS if not callable(getattr(LLMServerManager, a, None))] == []


@pytest.mark.parametrize("which", ["v0", "v1"])
def test_both_trainers_hold_what_the_hook_reads(which: str):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    cls: Any = RayPPOTrainer if which == "v0" else PPOTrainer
    # any method of the class (v0 sets them in init_workers, v1 in _setup)
    methods = [m for m, v in vars(cls).items() if inspect.isfunction(v)]
    assigned = set().union(*(_assigned(cls, m) for m in methods))
    assert [a for a in _hook.TRAINER_READS if not _has(cls, a, assigned)] == []
    if which == "v1":
        assert callable(getattr(cls, "_rollout_server_managers", None))


def test_v1_task_runner_hands_its_trainer_over_as_self_trainer():
    from verl.trainer.main_ppo import TaskRunnerV1

    runner = TaskRunnerV1.__ray_metadata__.modified_class
    assert "trainer" in _assigned(runner)
    source = inspect.getsource(runner.init_agent_loop_manager)
    assert "agent_loop_manager_class" in source and ".create(" in source


def test_the_standins_have_what_the_real_classes_have():
    from verl.utils.profiler import build_rollout_dist_profiler
    from verl.workers.rollout.replica import RolloutReplica

    import tests.verl._standin as standin

    # vLLMHttpServer → EmulatedServer: the attributes the hook reads, and verl's own profiler in it
    assigned = _assigned(standin.EmulatedServer)
    assert [a for a in _hook.SERVER_READS if a not in assigned] == []
    real_ctl = type(build_rollout_dist_profiler(0, 1, config=None, tool_config=None))
    source = inspect.getsource(standin.EmulatedServer.__init__)
    assert "build_rollout_dist_profiler(" in source and real_ctl.__name__ == "DistProfiler"
    # RolloutReplica → EmulatedReplica: a real subclass; only the launch is its own
    assert issubclass(standin.EmulatedReplica, RolloutReplica)
    own = {k for k in vars(standin.EmulatedReplica) if not k.startswith("_")}
    assert own <= {"launch_servers", "sleep"} and all(hasattr(RolloutReplica, k) for k in own)


def _dispatch(fn: Any) -> Any:
    """A registered worker method's dispatch as comparable data (verl's ``register`` attrs; the
    nd-compute modes are partials over the mesh name)."""
    from verl.single_controller.base.decorator import MAGIC_ATTR

    attrs = dict(getattr(fn, MAGIC_ATTR))
    mode = attrs["dispatch_mode"]
    if isinstance(mode, dict):
        attrs["dispatch_mode"] = {k: (f.func.__name__, f.args) for k, f in mode.items()}
    return attrs


def test_the_v0_worker_standin_registers_what_verls_worker_registers():
    """tests/verl/_standin.py ``ActorRolloutRefWorker`` → verl's (FSDP + vLLM on GPUs): every method
    the stand-in registers is a registered method of the real worker, with the same dispatch,
    execute mode and blocking (so verl's RayWorkerGroup binds and calls it the same way)."""
    from verl.single_controller.base.decorator import MAGIC_ATTR
    from verl.workers.engine_workers import ActorRolloutRefWorker

    import tests.verl._standin as standin

    own = {n: f for n, f in vars(standin.ActorRolloutRefWorker).items() if hasattr(f, MAGIC_ATTR)}
    assert {"init_model", "compute_log_prob", "update_actor", "update_weights"} <= set(own)
    for name, fn in own.items():
        if name == "get_profile_calls":
            continue  # the test's own reader
        real = getattr(ActorRolloutRefWorker, name, None)
        assert real is not None and hasattr(real, MAGIC_ATTR), name
        assert _dispatch(fn) == _dispatch(real), name
        assert inspect.iscoroutinefunction(fn) == inspect.iscoroutinefunction(real), name


def test_the_server_standin_generates_with_verls_signature():
    """``EmulatedServer.generate`` takes what verl's agent loop passes ``vLLMHttpServer.generate``
    (read from verl's file: the module needs vLLM)."""
    import importlib.util
    from pathlib import Path

    import tests.verl._standin as standin

    root = Path(importlib.util.find_spec("verl").submodule_search_locations[0])  # type: ignore[index, union-attr]
    tree = ast.parse((root / "workers/rollout/vllm_rollout/vllm_async_server.py").read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "vLLMHttpServer")
    fn = next(n for n in cls.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "generate")
    real = [a.arg for a in fn.args.args]
    # ray.remote adds its tracing context to a class's methods in place (ray.util.tracing
    # _inject_tracing_into_class), once another test has made the stand-in an actor: not verl's
    params = [p for p in inspect.signature(standin.EmulatedServer.generate).parameters if p != "_ray_trace_ctx"]
    assert params == real
    assert inspect.iscoroutinefunction(standin.EmulatedServer.generate)
