"""Reading verl / verl-omni trainer configs and refusing what verl would silently skip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sidecar.config import read_verl_config, verl_findings
from sidecar.errors import ConfigError, ConfigUnreadable

GOOD = {
    "trainer": {"resume_mode": "disable"},
    "global_profiler": {"tool": "torch", "steps": [1, 3], "save_path": "/tmp/prof"},
    "actor_rollout_ref": {
        "rollout": {
            "profiler": {
                "tool": "${oc.select:global_profiler.tool,null}",
                "enable": True,
                "all_ranks": False,
                "ranks": [1],
                "save_path": "${oc.select:global_profiler.save_path,null}",
                "tool_config": {"torch": {"discrete": True, "contents": ["cpu", "cuda"]}},
            }
        }
    },
    "reward": {"reward_model": {"rollout": {"profiler": {"enable": False, "tool_config": {"torch": {"discrete": True}}}}}},
}


def test_rollout_plan_resolves_interpolations() -> None:
    plan = read_verl_config(GOOD)
    assert (plan.steps, plan.tool, plan.discrete, plan.enable, plan.save_path) == ([1, 3], "torch", True, True, "/tmp/prof")


def test_good_rollout_plan_has_no_findings() -> None:
    assert verl_findings(read_verl_config(GOOD)) == []


@pytest.mark.parametrize(
    ("all_ranks", "ranks", "expected"), [(True, [1], [0, 1, 2, 3]), (False, [3, 1], [1, 3]), (False, [], [0])]
)
def test_replica_ranks_mirror_verl(all_ranks: bool, ranks: list[int], expected: list[int]) -> None:
    cfg = yaml.safe_load(yaml.safe_dump(GOOD))
    cfg["actor_rollout_ref"]["rollout"]["profiler"].update(all_ranks=all_ranks, ranks=ranks)
    assert read_verl_config(cfg).replica_ranks(4) == expected


@pytest.mark.parametrize(
    ("path", "value", "code"),
    [
        (("global_profiler", "tool"), "nsys", "verl_tool_not_torch"),
        (("global_profiler", "steps"), None, "verl_steps_empty"),
        (("actor_rollout_ref", "rollout", "profiler", "enable"), False, "verl_profiler_disabled"),
        (("actor_rollout_ref", "rollout", "profiler", "tool_config", "torch", "discrete"), False, "verl_not_discrete"),
    ],
)
def test_silent_skips_are_refused(path: tuple[str, ...], value: object, code: str) -> None:
    cfg = yaml.safe_load(yaml.safe_dump(GOOD))
    node = cfg
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    findings = verl_findings(read_verl_config(cfg))
    assert [(f.code, f.is_error) for f in findings] == [(code, True)]


def test_resume_mode_auto_warns() -> None:
    cfg = yaml.safe_load(yaml.safe_dump(GOOD))
    del cfg["trainer"]
    (f,) = verl_findings(read_verl_config(cfg))
    assert (f.code, f.is_error) == ("verl_resume_enabled", False)


def test_a_profiled_step_that_verls_rollout_skip_may_serve_from_its_cache_is_warned() -> None:
    # verl's skip.rollout loads a step's rollout from a cache dump when one is there: no request
    # reaches the servers, and the window was found `empty` only after the run
    cfg = yaml.safe_load(yaml.safe_dump(GOOD))
    cfg["global_profiler"]["steps"] = [1, 3]
    cfg["skip"] = {"rollout": {"enable": True, "steps": [3, 4]}, "async_rollout": {"enable": False, "steps": [1]}}
    findings = verl_findings(read_verl_config(cfg))
    (f,) = [f for f in findings if f.code == "verl_steps_rollout_skipped"]
    assert (f.is_error, f.key, "[3]" in f.message, "skip.rollout.enable=False" in f.message) == (
        False, "skip.rollout.steps", True, True), f
    cfg["skip"]["rollout"]["enable"] = False  # off: nothing skipped, nothing said
    assert "verl_steps_rollout_skipped" not in [f.code for f in verl_findings(read_verl_config(cfg))]


def test_validate_warns_of_a_profiled_step_the_rollout_skip_may_serve(qwen25_deploy: Path, tmp_path: Path) -> None:
    from tests.test_config_cli import run

    data = yaml.safe_load(yaml.safe_dump(GOOD))
    data["global_profiler"]["steps"] = [2]
    data["skip"] = {"rollout_tq": {"enable": True, "steps": [2]}}
    cfg = tmp_path / "ppo.yaml"
    cfg.write_text(yaml.safe_dump(data))
    report = json.loads(run("validate", qwen25_deploy, "--verl-config", cfg, "--json").stdout)
    assert "verl_steps_rollout_skipped" in json.dumps(report), report


def test_reward_role_reads_its_own_block_and_dir() -> None:
    plan = read_verl_config(GOOD, role="reward")
    assert (plan.enable, plan.tool, plan.trace_dir) == (False, "torch", "/tmp/prof/reward_model")
    assert "verl_profiler_disabled" in [f.code for f in verl_findings(plan)]


def test_file_findings_carry_lines(tmp_path: Path) -> None:
    cfg = yaml.safe_load(yaml.safe_dump(GOOD))
    cfg["actor_rollout_ref"]["rollout"]["profiler"]["tool_config"]["torch"]["discrete"] = False
    path = tmp_path / "ppo.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    (f,) = verl_findings(read_verl_config(path))
    text = path.read_text().splitlines()
    assert f.where.file == str(path) and "discrete: false" in text[f.where.line - 1]


def test_omegaconf_object_is_accepted() -> None:
    omegaconf = pytest.importorskip("omegaconf")
    plan = read_verl_config(omegaconf.OmegaConf.create(GOOD))
    assert (plan.tool, plan.ranks) == ("torch", [1])


def test_steps_of_wrong_type_are_an_error() -> None:
    cfg = yaml.safe_load(yaml.safe_dump(GOOD))
    cfg["global_profiler"]["steps"] = "one"
    with pytest.raises(ConfigError) as info:
        read_verl_config(cfg)
    assert info.value.key == "global_profiler.steps"


def test_non_mapping_file_is_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "v.yaml"
    path.write_text("- 1\n")
    with pytest.raises(ConfigUnreadable):
        read_verl_config(path)


def test_ranks_past_the_replicas_are_refused_not_dropped() -> None:
    cfg = yaml.safe_load(yaml.safe_dump(GOOD))
    cfg["actor_rollout_ref"]["rollout"]["profiler"]["ranks"] = [1, 9]
    with pytest.raises(ConfigError) as info:
        read_verl_config(cfg).replica_ranks(4)
    assert info.value.code == "verl_ranks_past_replicas"


def test_ranks_past_the_replica_count_of_the_config_are_a_finding() -> None:
    cfg = yaml.safe_load(yaml.safe_dump(GOOD))
    cfg["trainer"].update(n_gpus_per_node=8, nnodes=1)
    cfg["actor_rollout_ref"]["rollout"].update(tensor_model_parallel_size=4)
    cfg["actor_rollout_ref"]["rollout"]["profiler"]["ranks"] = [4, 8]  # replicas 1 and 2 of 2
    assert [f.code for f in verl_findings(read_verl_config(cfg))] == ["verl_ranks_past_replicas"]


def test_a_trainer_without_step_profiling_is_refused() -> None:
    cfg = yaml.safe_load(yaml.safe_dump(GOOD))
    cfg["omni_sidecar"] = {"trainer": "verl_omni.trainer.main_diffusion_v1"}
    assert [f.code for f in verl_findings(read_verl_config(cfg))] == ["verl_no_step_profiling"]


# --- the installed verl: its version, and the rule applied -----------------------------------


def _fake_verl(root: Path, version: str, *, global_rule: bool) -> Path:
    """A verl distribution on disk as pip leaves one (package + dist-info), never imported."""
    pkg = root / "verl" / "utils" / "profiler"
    pkg.mkdir(parents=True)
    (root / "verl" / "__init__.py").write_text("raise ImportError('importing verl is slow; the sidecar must not')\n")
    (pkg / "profile.py").write_text("def build_rollout_dist_profiler(): ...\n" if global_rule else "def other(): ...\n")
    info = root / f"verl-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: verl\nVersion: {version}\n")
    return root


@pytest.fixture
def verl_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def install(version: str, *, global_rule: bool = True) -> None:
        monkeypatch.syspath_prepend(str(_fake_verl(tmp_path / version, version, global_rule=global_rule)))

    return install


def test_no_verl_assumes_the_0_9_1_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar.config import verl as verl_cfg

    monkeypatch.setattr(verl_cfg, "_verl_root", lambda: [])
    support = verl_cfg.installed_verl()
    assert (support.version, support.rank_mode) == (None, "global")
    assert support.describe().startswith("verl not installed: assumed the 0.9.1 rule")


def test_a_checked_verl_uses_its_table_entry(verl_on_path) -> None:
    from sidecar.config.verl import KNOWN_VERL, installed_verl

    verl_on_path("0.9.1", global_rule=False)  # the table wins over the source
    support = installed_verl()
    assert (support.version, support.known, support.seams) == ("0.9.1", True, KNOWN_VERL["0.9.1"])
    assert "verl 0.9.1: the global rank rule" in support.describe()


def test_an_unchecked_verl_is_refused_in_strict_mode(verl_on_path) -> None:
    from sidecar.config.verl import checked_verl
    from sidecar.errors import VerlVersionUnknown

    verl_on_path("0.8.2", global_rule=False)
    with pytest.raises(VerlVersionUnknown) as err:
        checked_verl(strict=True)
    assert "verl 0.8.2 is not a version omni-sidecar was checked against (0.9.1)" in err.value.message
    assert "assumed the replica rank rule" in err.value.message


def test_an_unchecked_verl_is_warned_once_naming_what_was_assumed(verl_on_path, caplog) -> None:
    from sidecar.config.verl import checked_verl

    verl_on_path("0.10.0", global_rule=True)
    with caplog.at_level("WARNING"):
        first = checked_verl()
        checked_verl()
    assert first.rank_mode == "global" and not first.known
    lines = [r.getMessage() for r in caplog.records if "0.10.0" in r.getMessage()]
    assert len(lines) == 1 and "assumed the global rank rule" in lines[0] and "build_rollout_dist_profiler" in lines[0]


def test_validate_prints_the_verl_version_and_rule(verl_on_path, qwen25_deploy: Path, tmp_path: Path) -> None:
    from tests.test_config_cli import run

    verl_on_path("0.8.2", global_rule=False)
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    data["actor_rollout_ref"]["rollout"]["tensor_model_parallel_size"] = 2  # global rule: rank 1 is replica 0
    cfg = tmp_path / "ppo.yaml"
    cfg.write_text(yaml.safe_dump(data))
    proc = run("validate", qwen25_deploy, "--verl-config", cfg)
    said = " ".join(proc.stdout.split())  # rich wraps the note at the terminal's width
    assert "verl 0.8.2 is not a version omni-sidecar was checked against" in said
    assert "assumed the replica rank rule" in said
    assert "rollout replicas profiled: 1\n" in proc.stdout  # ranks [1] read as a replica index, not rank // 2
    report = json.loads(run("validate", qwen25_deploy, "--verl-config", cfg, "--json").stdout)
    assert (report["verl_version"]["version"], report["verl_version"]["seams"]["rank_mode"]) == ("0.8.2", "replica")
