"""The ``-m verl`` group: against the real verl 0.9.1 wheel, in its own venv
(``tools/verl-env.sh``). Without verl in this interpreter only ``test_in_venv.py`` runs: it builds
the venv (cached) and runs this folder there.

``verl_config(*overrides)`` composes verl's own Hydra config (``ppo_trainer``) with overrides as a
user passes them; ``ray_cluster`` is one small local Ray cluster per module (4 logical CPUs, 127.0.0.1,
no dashboard), shut down at the end.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
HAVE_VERL = importlib.util.find_spec("verl") is not None

# In the venv the group runs directly, so the test that runs it there is not collected (a skip
# would fail the CI gate); elsewhere only that test is.
collect_ignore = (["test_in_venv.py"] if HAVE_VERL else
                  [p.name for p in Path(__file__).parent.glob("test_*.py") if p.name != "test_in_venv.py"])
collect_ignore.append("_standin.py")

FQN = "sidecar.integrations.verl.SidecarAgentLoopManager"


def docs_recipe() -> list[str]:
    """The overrides of docs/rl.md's recipe block (``<!-- recipe: verl -->``), as a shell passes them."""
    import re
    import shlex

    text = (ROOT / "docs" / "rl.md").read_text()
    block = re.search(r"<!-- recipe: verl -->\s*```bash\n(.*?)```", text, re.DOTALL).group(1)  # type: ignore[union-attr]
    return [w for w in shlex.split(block.replace("<your usual overrides>", "")) if "=" in w]


def recipe(save_path: Path | str, steps: str = "[1,3]", **extra: str) -> list[str]:
    """docs/rl.md's recipe, pasted, with this test's ``save_path`` (and ``steps``)."""
    out = []
    for o in docs_recipe():
        key = o.split("=", 1)[0]
        if key == "global_profiler.save_path":
            o = f"{key}={save_path}"
        elif key == "global_profiler.steps":
            o = f"{key}={steps}"
        out.append(o)
    return out + [f"{k}={v}" for k, v in extra.items()]


def compose(*overrides: str) -> Any:
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=list(overrides))


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    import ray

    # 4 logical CPUs (scheduling only): TransferQueue's controller and storage unit take one each
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})  # the actors import sidecar and tests/
    try:
        yield ray
    finally:
        ray.shutdown()
