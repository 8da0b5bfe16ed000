"""Hostile inputs to `validate`, `render` and the config reader, through `python -m sidecar` as a user
runs it: every one is a typed error (code, message naming the fix, the config exit code), never a
traceback or a crash, and `render` never destroys or half-writes a file."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "configs" / "qwen2_5_omni.yaml"
LIGHT = ROOT / "sidecar" / "_data" / "stage_profiles" / "light.yaml"


def cli(*args: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_SIDECAR_")}
    # the timeout only guards the suite against the old reader, which never ended on a device
    return subprocess.run([sys.executable, "-m", "sidecar", *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env={**env, "COLUMNS": "200", "PYTHONPATH": str(ROOT)})


def refused(proc: subprocess.CompletedProcess[str], code: str, rc: int) -> str:
    """The error line of a refusal with ``code``; its output carries no traceback."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == rc, out
    assert f"error[{code}]" in out and "Traceback" not in out, out
    return out


@pytest.fixture
def deploy(tmp_path: Path) -> Path:
    path = tmp_path / "d2.yaml"
    path.write_bytes(DEPLOY.read_bytes())
    return path


# --- render -o ----------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["same", "dot-slash", "symlink", "base_config", "profile"])
def test_render_refuses_to_write_onto_a_file_it_reads(deploy: Path, tmp_path: Path, spelling: str) -> None:
    """`-o` naming the deploy file (however spelt), a base_config of it or the profile is refused
    before anything is written: every input keeps its bytes."""
    profile = tmp_path / "mine.yaml"
    profile.write_bytes(LIGHT.read_bytes())
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(f"base_config: {deploy.name}\nstages: []\n")
    (tmp_path / "link.yaml").symlink_to(deploy.name)
    source, out = {"same": (deploy, deploy.name), "dot-slash": (deploy, f"./{deploy.name}"),
                   "symlink": (deploy, "link.yaml"), "base_config": (overlay, deploy.name),
                   "profile": (deploy, profile.name)}[spelling]
    before = {p: p.read_bytes() for p in (deploy, overlay, profile)}
    proc = cli("render", source, "--profile", profile, "--dir", tmp_path / "t", "-o", out, cwd=tmp_path)
    assert "write the overlay to another file" in refused(proc, "setting_invalid", 1)
    assert {p: p.read_bytes() for p in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d2.yaml", "link.yaml", "mine.yaml", "overlay.yaml"]


@pytest.mark.parametrize("out, words", [
    ("sub", "is a folder, not a file"),
    ("", "-o is empty"),
    ("/dev/null", "is a character device, not a file"),
    ("d2.yaml/x.yaml", "cannot write there"),
])
def test_render_refuses_an_output_that_is_no_file(deploy: Path, tmp_path: Path, out: str, words: str) -> None:
    (tmp_path / "sub").mkdir()
    proc = cli("render", deploy, "--profile", "light", "--dir", tmp_path / "t", "-o", out, cwd=tmp_path)
    assert words in refused(proc, "setting_invalid", 1)
    assert list((tmp_path / "sub").iterdir()) == []


def test_render_replaces_an_old_overlay_whole(deploy: Path, tmp_path: Path) -> None:
    """The overlay is renamed into place: a reader holding the old one still reads it whole, and
    nothing but the overlay is left beside it."""
    out = tmp_path / "overlay.yaml"
    out.write_text("# the old overlay\n" * 100)
    with out.open() as held:
        proc = cli("render", deploy, "--profile", "light", "--dir", tmp_path / "t", "-o", out)
        assert proc.returncode == 0, proc.stderr
        assert held.read() == "# the old overlay\n" * 100
    assert out.read_text().count("stage_id:") == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d2.yaml", "overlay.yaml"]


# --- what the reader reads --------------------------------------------------------------------


def _fifo(tmp_path: Path) -> Path:
    os.mkfifo(tmp_path / "pipe.yaml")
    return tmp_path / "pipe.yaml"


@pytest.mark.parametrize("surface", ["validate", "render --profile", "validate --verl-config", "serve --deploy-config"])
def test_a_device_is_refused_on_every_surface_that_reads_yaml(deploy: Path, tmp_path: Path, surface: str) -> None:
    args = {"validate": ["validate", "/dev/zero"],
            "render --profile": ["render", deploy, "--profile", "/dev/zero", "--dir", tmp_path / "t"],
            "validate --verl-config": ["validate", deploy, "--verl-config", "/dev/zero"],
            "serve --deploy-config": ["serve", "--upstream", "http://127.0.0.1:1", "--deploy-config", "/dev/zero",
                                      "--state-dir", tmp_path / "state"]}[surface]
    assert "/dev/zero is a character device, not a YAML file" in refused(cli(*args), "file_unreadable", 2)


@pytest.mark.parametrize("make, kind", [(lambda t: t, "a folder"), (_fifo, "a FIFO")])
def test_a_folder_or_fifo_is_named_for_what_it_is(tmp_path: Path, make, kind: str) -> None:  # type: ignore[no-untyped-def]
    path = make(tmp_path)
    assert f"is {kind}, not a YAML file" in refused(cli("validate", path), "file_unreadable", 2)


def test_a_yaml_file_past_the_size_cap_is_refused_unread(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    with big.open("wb") as fh:
        fh.truncate(16 * 1024 * 1024 + 1)  # sparse: no disk is used
    assert "larger than 16 MB" in refused(cli("validate", big), "file_unreadable", 2)


@pytest.mark.parametrize("base, kind", [("/dev/zero", "a character device"), (".", "a folder")])
def test_a_base_config_that_is_no_file_says_what_it_is(tmp_path: Path, base: str, kind: str) -> None:
    path = tmp_path / "over.yaml"
    path.write_text(f"base_config: {base}\nstages: []\n")
    out = refused(cli("validate", path), "base_config_invalid", 1)
    assert f"base_config '{base}' is {kind}" in out and "not found" not in out


# --- nesting ------------------------------------------------------------------------------------

DEEP = {
    "flow lists": "[" * 100_000 + "]" * 100_000,
    "flow mappings": "{a: " * 100_000 + "1" + "}" * 100_000,
    "block mappings": "".join("  " * i + f"k{i}:\n" for i in range(1000)) + "  " * 1000 + "x: 1\n",
}


@pytest.mark.parametrize("shape", DEEP)
def test_deep_nesting_is_refused_before_it_is_built(tmp_path: Path, shape: str) -> None:
    """Once a segfault (rc 139) or a RecursionError: now yaml_invalid, naming the limit."""
    path = tmp_path / "deep.yaml"
    path.write_text(DEEP[shape])
    assert "nesting deeper than 64 levels" in refused(cli("validate", path), "yaml_invalid", 2)


@pytest.mark.parametrize("surface", ["render --profile", "validate --verl-config"])
def test_deep_nesting_is_refused_on_the_other_readers(deploy: Path, tmp_path: Path, surface: str) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text(DEEP["flow lists"])
    args = {"render --profile": ["render", deploy, "--profile", path, "--dir", tmp_path / "t"],
            "validate --verl-config": ["validate", deploy, "--verl-config", path]}[surface]
    assert "nesting deeper than 64 levels" in refused(cli(*args), "yaml_invalid", 2)


# --- validate's words ------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", [["--vllm-version", "99.0"], ["--omni-version", "0.1"]])
def test_the_footer_counts_every_warning_printed(flag: list[str]) -> None:
    proc = cli("validate", DEPLOY, *flag)
    assert proc.returncode == 0, proc.stderr
    printed = len(re.findall(r"warning\[\w+\]", proc.stdout))
    assert printed >= 2
    assert proc.stdout.rstrip().endswith(f"0 error(s), {printed} warning(s)")


def test_validate_without_input_names_what_validate_takes() -> None:
    out = refused(cli("validate"), "deploy_config_missing", 1)
    assert "omni-sidecar validate DEPLOY" in out and "--profiler-config" in out
    assert "--deploy-config" not in out and "--flavor" not in out


@pytest.mark.parametrize("url, fixed", [("127.0.0.1:8091", "http://127.0.0.1:8091"), ("notaurl", "http://notaurl")])
def test_a_server_without_its_scheme_is_refused_not_invented(url: str, fixed: str) -> None:
    out = refused(cli("validate", "--server", url), "setting_invalid", 1)
    assert "is not an http(s) URL" in out and f"--server {fixed}" in out and "treated as" not in out


def test_a_type_error_names_the_yaml_kind_not_a_class(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("stages:\n  - stage_id: 0\n    engine_args: [1]\n")
    out = refused(cli("validate", path), "stage_invalid", 1)
    assert "`engine_args` must be a mapping, got a list" in out and "Marked" not in out


# --- render's options ----------------------------------------------------------------------------


@pytest.mark.parametrize("value, code, words", [
    ("", "profile_dir_missing", "--dir is empty"),
    ("/data/{replica", "dir_placeholder_unknown", "the supported ones are {replica}, {host}"),
    ("/data/{0}", "dir_placeholder_unknown", "the supported ones are {replica}, {host}"),
])
def test_render_refuses_a_dir_it_would_write_literally(deploy: Path, tmp_path: Path, value: str, code: str,
                                                       words: str) -> None:
    out = tmp_path / "overlay.yaml"
    proc = cli("render", deploy, "--profile", "light", "--dir", value, "--replica", "1", "-o", out)
    assert words in refused(proc, code, 1)
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--steps", "--delay-steps"])
def test_render_caps_the_steps_at_the_engine_steps_bound(deploy: Path, tmp_path: Path, flag: str) -> None:
    proc = cli("render", deploy, "--profile", "light", "--dir", tmp_path / "t", flag, "9" * 21)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert flag in proc.stderr and "1000000" in proc.stderr and "9" * 21 not in proc.stdout
