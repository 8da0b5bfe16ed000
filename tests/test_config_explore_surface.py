"""`validate` and `render` through `python -m sidecar` against what the real server reads: YAML merge
keys as OmegaConf reads them, vLLM's delay/max iteration semantics, the deploy keys each vLLM-Omni
release has, OmegaConf interpolations, and `render --idle` values that are no share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "configs" / "qwen2_5_omni.yaml"
PC = "profiler: torch, torch_profiler_with_stack: false, max_iterations: 4, ignore_frontend: true"


def cli(*args: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_SIDECAR_")}
    return subprocess.run([sys.executable, "-m", "sidecar", *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env={**env, "COLUMNS": "200", "PYTHONPATH": str(ROOT)})


def report(proc: subprocess.CompletedProcess[str]) -> dict:
    assert "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout)


def test_a_key_written_beside_a_merge_key_overrides_it(tmp_path: Path) -> None:
    """`<<: *anchor` then a key of its own: YAML's merge rule (and OmegaConf, which vLLM-Omni reads
    deploy files with) lets the written key win; it is no duplicate."""
    path = tmp_path / "anchors.yaml"
    path.write_text(
        "stages:\n"
        "  - stage_id: 0\n"
        f"    profiler_config: &pc {{{PC}, torch_profiler_dir: /tmp/anchors/s0}}\n"
        "  - stage_id: 1\n"
        "    profiler_config:\n"
        "      <<: *pc\n"
        "      torch_profiler_dir: /tmp/anchors/s1\n"
    )
    proc = cli("validate", path, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [s["dir"] for s in report(proc)["stages"]] == ["/tmp/anchors/s0", "/tmp/anchors/s1"]


def test_a_key_written_twice_beside_a_merge_key_is_still_a_duplicate(tmp_path: Path) -> None:
    path = tmp_path / "twice.yaml"
    path.write_text(
        "base: &pc {profiler: torch, torch_profiler_dir: /tmp/t}\n"
        "stages:\n"
        "  - stage_id: 0\n"
        "    profiler_config:\n"
        "      <<: *pc\n"
        "      max_iterations: 4\n"
        "      max_iterations: 5\n"
    )
    proc = cli("validate", path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{path}:7:7: error[yaml_invalid]" in proc.stderr and "duplicate key 'max_iterations'" in proc.stderr


def test_a_delay_longer_than_max_iterations_is_a_window_not_a_warning(tmp_path: Path) -> None:
    """vLLM counts max_iterations from the end of the delay (recording starts at iteration
    delay_iterations): `render --steps 8 --delay-steps 10` traces iterations 10 to 20, and validating
    what render wrote warns of nothing about the delay."""
    out = tmp_path / "delayed.yaml"
    proc = cli("render", DEPLOY, "--profile", "light", "--dir", tmp_path / "t", "--steps", "8", "--delay-steps", "10",
               "-o", out)
    assert proc.returncode == 0, proc.stderr
    proc = cli("validate", out, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [f["code"] for f in report(proc)["findings"]] == []


def test_a_stage_key_a_release_dropped_is_refused_for_that_release(tmp_path: Path) -> None:
    """`auxiliary_text_encoder` is a stage key up to vLLM-Omni 0.31.0rc1; 0.32.0rc1 has it nowhere
    and refuses it at start-up as an unknown key."""
    path = tmp_path / "aux.yaml"
    path.write_text(f"stages:\n  - stage_id: 0\n    auxiliary_text_encoder: t5\n"
                    f"    profiler_config: {{{PC}, torch_profiler_dir: /tmp/aux}}\n")
    older = cli("validate", path, "--omni-version", "0.31.0rc1")
    assert older.returncode == 0, older.stdout + older.stderr
    newer = cli("validate", path, "--omni-version", "0.32.0rc1", "--json")
    assert newer.returncode == 1, newer.stdout + newer.stderr
    (finding,) = report(newer)["findings"]
    assert (finding["code"], finding["key"], finding["stage_id"]) == ("deploy_key_version", "auxiliary_text_encoder", 0)
    assert "drop it" in finding["message"]


def test_an_interpolated_trace_dir_is_named_for_what_it_is(tmp_path: Path) -> None:
    """vLLM-Omni resolves `${...}` in the server's environment: the dir is not relative, it is unknown."""
    path = tmp_path / "interp.yaml"
    path.write_text("stages:\n  - stage_id: 0\n"
                    f"    profiler_config: {{{PC}, torch_profiler_dir: '${{oc.env:PERF_DIR}}/s0'}}\n")
    proc = cli("validate", path, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (finding,) = report(proc)["findings"]
    assert (finding["code"], finding["severity"]) == ("profiler_dir_interpolation", "warning")
    assert "write the path itself" in finding["message"]


@pytest.mark.parametrize("idle", ["0=-1/5", "0=1/-5", "0=-0.2", "0=nan", "0=6/5"])
def test_render_idle_that_is_no_share_names_the_form(tmp_path: Path, idle: str) -> None:
    proc = cli("render", DEPLOY, "--profile", "light", "--stages", "0", "--dir", tmp_path / "t", "--steps", "20",
               "--idle", idle)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "a count from 0 up to the iterations, or a share from 0 to 1" in proc.stderr
    assert "idling more" not in proc.stderr


def test_a_trace_dir_holding_a_nul_byte_is_refused(tmp_path: Path) -> None:
    # no path holds a NUL: the worker could make no folder and would write no trace; it validated clean
    path = tmp_path / "nul.yaml"
    path.write_text(f'stages:\n  - stage_id: 0\n    profiler_config: {{{PC}, torch_profiler_dir: "/tmp/p\\0x"}}\n')
    proc = cli("validate", path, "--json")
    codes = [f["code"] for f in report(proc)["findings"]]
    assert (proc.returncode, "profiler_dir_invalid" in codes) == (1, True), (proc.returncode, codes)


@pytest.mark.parametrize(("written", "said"), [
    ("${oc.env:PERF_DIR}/s0", "holds an OmegaConf interpolation"),
    ("/tmp/{0}/s0", "stage 0's torch_profiler_dir"),
])
def test_render_names_the_kept_dir_it_cannot_use_not_a_dir_option_never_given(tmp_path: Path, written: str,
                                                                              said: str) -> None:
    # without --dir each stage keeps its own dir; one render cannot use was blamed on "--dir"
    path = tmp_path / "kept.yaml"
    path.write_text(f'stages:\n  - stage_id: 0\n    profiler_config: {{{PC}, torch_profiler_dir: "{written}"}}\n')
    proc = cli("render", path, "--profile", "light", "-o", tmp_path / "out.yaml")
    said_all = " ".join(proc.stderr.split())
    assert (proc.returncode, said in said_all, "--dir '" in said_all, "Traceback" in proc.stderr,
            (tmp_path / "out.yaml").exists()) == (1, True, False, False, False), proc.stderr


def test_the_front_end_warning_is_for_plain_vllm_only(tmp_path: Path) -> None:
    # vLLM-Omni's start reaches its stages alone and never reads ignore_frontend: the advice to set
    # it was noise on every Omni deploy with iteration bounds; plain `vllm serve` profiles its front end
    pc = "profiler: torch, torch_profiler_with_stack: false, max_iterations: 4, torch_profiler_dir: /tmp/fe"
    path = tmp_path / "omni.yaml"
    path.write_text(f"stages:\n  - stage_id: 0\n    profiler_config: {{{pc}}}\n")
    omni = [f["code"] for f in report(cli("validate", path, "--json"))["findings"]]
    plain = [f["code"] for f in report(cli("validate", "--profiler-config", json.dumps(
        {"profiler": "torch", "torch_profiler_dir": "/tmp/fe", "max_iterations": 4,
         "torch_profiler_with_stack": False}), "--json"))["findings"]]
    assert ("frontend_overhead" in omni, "frontend_overhead" in plain) == (False, True), (omni, plain)


def test_a_vllm_omni_newer_than_the_table_is_checked_on_the_vllm_of_its_own_line() -> None:
    # --omni-version 0.33.0 was checked on vLLM 0.32 (the nearest known Omni's) and then called a
    # mismatched pair: a newer vLLM-Omni runs on the vLLM of its own major.minor
    proc = cli("validate", DEPLOY, "--omni-version", "0.33.0", "--json")
    body = report(proc)
    codes = [w["code"] for w in body["server"]["warnings"]]
    assert (body["server"]["vllm"], "version_mismatch" in codes, "version_unknown" in codes) == (
        "0.33.0", False, True), body["server"]
