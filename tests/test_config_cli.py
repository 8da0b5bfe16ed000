"""`omni-sidecar validate` and `render` as a user runs them: a real process, exit codes, output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.test_config_verl import GOOD


def run(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )


def test_every_example_validates_clean(example_deploys: list[Path]) -> None:
    for path in example_deploys:
        proc = run("validate", path)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_table_lists_stages(qwen25_deploy: Path) -> None:
    out = run("validate", qwen25_deploy).stdout
    assert "/tmp/omni-sidecar/perf/stage2" in out and "0 error(s)" in out


def test_broken_file_exits_1_with_file_line_col(deploy_data: Path) -> None:
    proc = run("validate", deploy_data / "unknown_key.yaml")
    assert proc.returncode == 1
    assert f"{deploy_data / 'unknown_key.yaml'}:6:7: error[profiler_config_invalid]" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_serve_refuses_a_broken_deploy_naming_the_error_code(deploy_data: Path) -> None:
    # the shared CLI error path (cli_errors/print_error): the [code] must survive rich markup
    proc = run("serve", "--upstream", "http://127.0.0.1:9", "--deploy-config", deploy_data / "unknown_key.yaml")
    assert proc.returncode == 1
    assert "error[profiler_config_invalid]" in proc.stderr and "Traceback" not in proc.stderr


def test_unreadable_file_exits_2(deploy_data: Path) -> None:
    proc = run("validate", deploy_data / "not_yaml.yaml")
    assert (proc.returncode, "Traceback" in proc.stderr) == (2, False)
    assert "yaml_invalid" in proc.stderr


def test_missing_file_exits_2(tmp_path: Path) -> None:
    assert run("validate", tmp_path / "absent.yaml").returncode == 2


def test_stage_not_torch_exits_1(deploy_data: Path) -> None:
    proc = run("validate", deploy_data / "mixed.yaml", "--stages", "1")
    assert proc.returncode == 1 and "stage_not_torch" in proc.stdout


def test_warnings_still_exit_0(deploy_data: Path) -> None:
    proc = run("validate", deploy_data / "mixed.yaml", "--stages", "0")
    assert proc.returncode == 0 and "stack_enabled" in proc.stdout


def test_bad_stage_list_is_a_usage_error(qwen25_deploy: Path) -> None:
    proc = run("validate", qwen25_deploy, "--stages", "0,x")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_json_report(deploy_data: Path) -> None:
    proc = run("validate", deploy_data / "mixed.yaml", "--json")
    report = json.loads(proc.stdout)
    assert (report["ok"], [s["stage_id"] for s in report["stages"]]) == (True, [0, 1, 2])
    assert {f["code"] for f in report["findings"]} == {"stack_enabled", "max_iterations_unbounded"}


def test_json_error_report(deploy_data: Path) -> None:
    proc = run("validate", deploy_data / "dup_stage.yaml", "--json")
    report = json.loads(proc.stdout)
    assert (proc.returncode, report["error"]["code"], report["error"]["details"]["line"]) == (1, "stage_id_duplicate", 4)


def test_verl_config_not_discrete_exits_1(qwen25_deploy: Path, tmp_path: Path) -> None:
    cfg = yaml.safe_load(yaml.safe_dump(GOOD))
    cfg["actor_rollout_ref"]["rollout"]["profiler"]["tool_config"]["torch"]["discrete"] = False
    verl = tmp_path / "ppo.yaml"
    verl.write_text(yaml.safe_dump(cfg))
    proc = run("validate", qwen25_deploy, "--verl-config", verl)
    assert proc.returncode == 1 and "verl_not_discrete" in proc.stdout


def test_render_writes_an_overlay_that_validates(qwen25_deploy: Path, tmp_path: Path) -> None:
    out = tmp_path / "o" / "overlay.yaml"
    proc = run("render", qwen25_deploy, "--profile", "light", "--stages", "0,2", "--dir", tmp_path / "perf", "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert run("validate", out).returncode == 0


def test_render_stage_overrides_prints_json(qwen25_deploy: Path) -> None:
    proc = run("render", qwen25_deploy, "--profile", "stacks", "--stages", "1", "--stage-overrides")
    assert json.loads(proc.stdout)["1"]["profiler_config"]["torch_profiler_with_stack"] is True


@pytest.mark.parametrize("stages", ["", "0,0", "9"])
def test_render_bad_stages_exit_1(qwen25_deploy: Path, stages: str) -> None:
    proc = run("render", qwen25_deploy, "--profile", "light", "--stages", stages, "--stage-overrides")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
