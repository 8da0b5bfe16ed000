"""`omni-sidecar validate` and `render` as a user runs them: the typer app in process (exit codes,
stdout, stderr as the console writes them), and ``serve`` as a real process where a test needs one
listening."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from sidecar.cli import app
from tests.test_config_verl import GOOD

runner = CliRunner()


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def run(*args: str | Path) -> Ran:
    """``omni-sidecar ARGS`` in process, with no ``OMNI_SIDECAR_*`` setting from the caller's
    environment. An exception that escaped the command is raised here: in a terminal it would be
    a traceback, which every command promises never to print."""
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("OMNI_SIDECAR_")}
    result = runner.invoke(app, [str(a) for a in args], env={**env, "COLUMNS": "200"})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Ran(result.exit_code, result.stdout, result.stderr)


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


def test_serve_refuses_a_broken_deploy_naming_the_error_code_and_key(deploy_data: Path, tmp_path: Path) -> None:
    # a real process, as a user runs it: the console entry point, its exit status and stderr; the
    # shared CLI error path (cli_errors/print_error): the [code] must survive rich markup
    proc = subprocess.run(
        [sys.executable, "-m", "sidecar", "serve", "--upstream", "http://127.0.0.1:9",
         "--deploy-config", str(deploy_data / "unknown_key.yaml"), "--state-dir", str(tmp_path / "state")],
        check=False, capture_output=True, text=True, timeout=120,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )  # fmt: skip
    assert proc.returncode == 1
    assert "error[profiler_config_invalid]" in proc.stderr and "torch_profiler_with_stak" in proc.stderr
    assert "Traceback" not in proc.stderr


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


def test_render_steps_caps_each_window_at_the_steps_plus_its_idle_iterations(qwen25_deploy: Path, tmp_path: Path) -> None:
    # vLLM counts idle iterations towards max_iterations (on the real vLLM-Omni server 20 held 17-18
    # steps): --steps 20 writes 22, and a steps window of 20 on the rendered server is one it caps.
    from sidecar.config.deploy import load_deploy_config
    from sidecar.config.rules import capped_by_server

    out = tmp_path / "overlay.yaml"
    proc = run("render", qwen25_deploy, "--profile", "light", "--stages", "0,2", "--dir", tmp_path / "perf",
               "--steps", "20", "--delay-steps", "5", "-o", out)
    assert proc.returncode == 0, proc.stderr
    deploy = load_deploy_config(out)
    got = {s.stage_id: (s.profiler_config.max_iterations, s.profiler_config.delay_iterations)
           for s in deploy.stages if s.stage_id in (0, 2) and s.profiler_config}
    assert got == {0: (22, 5), 2: (22, 5)}, got
    assert capped_by_server(deploy, [0, 2], 27) and not capped_by_server(deploy, [0, 2], 24)


def test_render_idle_gives_a_fed_stage_the_iterations_it_idles(qwen25_deploy: Path, tmp_path: Path) -> None:
    # a capture's note gives the share of its iterations a stage idled (4 of 22 on the real
    # vLLM-Omni server's stage 1): that stage is capped at 20 plus the idle iterations that share
    # adds (25), the others at 22, and a window of 20 on the rendered server is still one it caps
    from sidecar.config.deploy import load_deploy_config
    from sidecar.config.rules import capped_by_server
    from sidecar.control.budget import server_cap_steps

    out = tmp_path / "overlay.yaml"
    proc = run("render", qwen25_deploy, "--profile", "light", "--stages", "0,1,2", "--dir", tmp_path / "perf",
               "--steps", "20", "--idle", "1=4/22", "--idle", "2=0.25", "-o", out)
    assert proc.returncode == 0, proc.stderr
    deploy = load_deploy_config(out)
    got = {s.stage_id: s.profiler_config.max_iterations for s in deploy.stages if s.profiler_config}
    assert got == {0: 22, 1: 25, 2: 27}, got
    assert capped_by_server(deploy, [0, 1, 2], 20) and server_cap_steps(deploy, [0, 1, 2]) == 20
    # the same per stage in the --stage-overrides JSON
    proc = run("render", qwen25_deploy, "--profile", "light", "--stages", "0,1", "--dir", tmp_path / "perf",
               "--steps", "20", "--idle", "1=5/22", "--stage-overrides")
    caps = {k: v["profiler_config"]["max_iterations"] for k, v in json.loads(proc.stdout).items()}
    assert caps == {"0": 22, "1": 26}, proc.stdout


@pytest.mark.parametrize(("args", "said"), [
    (["--idle", "1=4/22"], "add --steps"),
    (["--steps", "20", "--idle", "1"], "--idle takes STAGE=IDLE/ITERATIONS, e.g. 1=5/22"),
    (["--steps", "20", "--idle", "1=4/0"], "--idle takes STAGE=IDLE/ITERATIONS"),
    (["--steps", "20", "--idle", "x=1/2"], "--idle takes STAGE=IDLE/ITERATIONS"),
    (["--steps", "20", "--idle", "2=4/22"], "stage 2 is not one this renders"),
    (["--steps", "20", "--idle", "1=9/22"], "a cap allows for at most 0.33"),
    (["--steps", "20", "--idle", "1=-1/22"], "a count from 0 up to the iterations, or a share from 0 to 1"),
])
def test_render_idle_refuses_what_it_cannot_use_and_names_the_form(
    qwen25_deploy: Path, tmp_path: Path, args: list[str], said: str
) -> None:
    out = tmp_path / "overlay.yaml"
    proc = run("render", qwen25_deploy, "--profile", "light", "--stages", "0,1", "--dir", tmp_path / "perf", *args,
               "-o", out)
    text = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2 and said in text and not out.exists(), text
    assert "Traceback" not in text


def test_render_stage_overrides_prints_json(qwen25_deploy: Path) -> None:
    proc = run("render", qwen25_deploy, "--profile", "stacks", "--stages", "1", "--stage-overrides")
    assert json.loads(proc.stdout)["1"]["profiler_config"]["torch_profiler_with_stack"] is True


@pytest.mark.parametrize("stages, rc", [("", 2), ("0,0", 1), ("9", 1)])  # "": a usage error (parse_stage_list)
def test_render_bad_stages_exit_1(qwen25_deploy: Path, stages: str, rc: int) -> None:
    proc = run("render", qwen25_deploy, "--profile", "light", "--stages", stages, "--stage-overrides")
    assert proc.returncode == rc and "Traceback" not in proc.stderr


# --- the server's command line, plain vLLM, legacy files, platforms, placeholders, nsys --------


def test_validate_legacy_file_exits_1_with_the_migration(deploy_data: Path) -> None:
    proc = run("validate", deploy_data / "legacy_stage_args.yaml")
    assert proc.returncode == 1
    assert "error[legacy_schema]" in proc.stderr and "rename the top-level `stage_args:` key to `stages:`" in proc.stderr


def test_validate_legacy_file_with_allow_legacy_exits_0_with_the_warning(deploy_data: Path) -> None:
    proc = run("validate", deploy_data / "legacy_stage_args.yaml", "--allow-legacy")
    assert proc.returncode == 0 and "warning[legacy_schema]" in proc.stdout


def test_validate_plain_vllm_from_profiler_config_alone() -> None:
    proc = run("validate", "--json", "--profiler-config", '{"profiler": "torch", "torch_profiler_dir": "/srv/v", "max_iterations": 4}')
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["file"], [(s["stage_id"], s["dir"]) for s in report["stages"]]) == (None, [(0, "/srv/v")])


def test_validate_applies_stage_overrides(qwen25_deploy: Path) -> None:
    proc = run("validate", qwen25_deploy, "--json", "--stage-overrides", '{"1": {"profiler_config": {"torch_profiler_dir": "/elsewhere"}}}')
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["stages"][1]["dir"] == "/elsewhere"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--stage-overrides", "{0: 1}"), "--stage-overrides is not valid JSON"),
        (("--stage-overrides", '{"5": {}}'), "names stages [5]"),
        (("--stage-overrides", '{"0": {"profiler_config": {"max_iterations": "many"}}}'), "max_iterations"),
        (("--profiler-config", '{"profiler": "nsys"}'), "--profiler-config"),
        (("--platform", "cdua"), "cuda, rocm, npu, xpu, musa"),
    ],
    ids=["not_json", "unknown_stage", "bad_value", "bad_global", "platform_typo"],
)
def test_validate_bad_command_line_exits_1_naming_the_key(qwen25_deploy: Path, args: tuple[str, ...], needle: str) -> None:
    proc = run("validate", qwen25_deploy, *args)
    assert proc.returncode == 1 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_validate_accepts_an_all_cuda_deploy(tmp_path: Path) -> None:
    path = tmp_path / "nsys.yaml"
    path.write_text("stages:\n  - {stage_id: 0, profiler_config: {profiler: cuda}}\n")
    assert run("validate", path).returncode == 0


def test_validate_refuses_an_unexpanded_dir_placeholder(tmp_path: Path) -> None:
    path = tmp_path / "d.yaml"
    path.write_text("stages:\n  - {stage_id: 0, profiler_config: {profiler: torch, torch_profiler_dir: '/p/replica{replica}'}}\n")
    proc = run("validate", path)
    assert proc.returncode == 1 and "error[profiler_dir_placeholder]" in proc.stdout


def test_render_expands_replica_and_host(qwen25_deploy: Path) -> None:
    proc = run("render", qwen25_deploy, "--profile", "light", "--stages", "2", "--stage-overrides",
               "--dir", "/data/perf/{host}/replica{replica}", "--replica", "1", "--host", "node7")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["2"]["profiler_config"]["torch_profiler_dir"] == "/data/perf/node7/replica1/stage2"


def test_render_placeholder_without_replica_exits_1(qwen25_deploy: Path) -> None:
    proc = run("render", qwen25_deploy, "--profile", "light", "--dir", "/data/perf/replica{replica}")
    assert proc.returncode == 1 and "--replica N" in proc.stderr


def test_render_nsys_prints_the_wrapper(qwen25_deploy: Path) -> None:
    proc = run("render", qwen25_deploy, "--profile", "nsys", "--stages", "1", "--stage-overrides")
    assert proc.returncode == 0, proc.stderr
    json.loads(proc.stdout)  # stdout stays the pasteable JSON
    assert "nsys profile" in proc.stderr and "--capture-range=cudaProfilerApi" in proc.stderr
    assert ".nsys-rep" in proc.stderr


def test_serve_refuses_legacy_and_bad_overrides(deploy_data: Path, qwen25_deploy: Path) -> None:
    legacy = run("serve", "--upstream", "http://127.0.0.1:9", "--deploy-config", deploy_data / "legacy_stage_args.yaml")
    assert legacy.returncode == 1 and "error[legacy_schema]" in legacy.stderr
    bad = run("serve", "--upstream", "http://127.0.0.1:9", "--deploy-config", qwen25_deploy, "--stage-overrides", '{"9": {}}')
    assert bad.returncode == 1 and "error[stage_overrides_invalid]" in bad.stderr


def test_serve_without_config_says_how_to_describe_the_server() -> None:
    proc = run("serve", "--upstream", "http://127.0.0.1:9")
    assert proc.returncode == 1 and "--profiler-config" in proc.stderr


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--profiler-config", '{"profiler": "torch", "torch_profiler_dir": "/p"}'], "name the server's stages with --stages"),
        (["--stages", "0", "--deploy-config", "QWEN"], "error[stages_flag_misplaced]"),
        (["--stages", "0,x", "--profiler-config", '{"profiler": "torch", "torch_profiler_dir": "/p"}'],
         "not a comma-separated list of stage ids"),
    ],
)  # fmt: skip
def test_serve_without_a_deploy_file_needs_the_omni_stages(args: list[str], words: str, qwen25_deploy: Path,
                                                            tmp_path: Path) -> None:  # fmt: skip
    from typer.testing import CliRunner

    from sidecar.cli import app

    args = [str(qwen25_deploy) if a == "QWEN" else a for a in args]
    result = CliRunner().invoke(app, ["serve", "--upstream", "http://127.0.0.1:9", "--state-dir", str(tmp_path), *args])
    assert result.exit_code == 1 and words in " ".join(result.stderr.split()), result.output


@pytest.fixture
def serve_process(tmp_path: Path):
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> tuple[subprocess.Popen[str], int]:
        from sidecar._process import listening_socket

        # held from the pick (the child gets the socket): no other test's server can answer on it
        with listening_socket() as sock:
            port, fd = sock.getsockname()[1], sock.fileno()
            log = open(tmp_path / f"serve-{port}.log", "w")  # noqa: SIM115
            proc = subprocess.Popen(
                [sys.executable, "-m", "sidecar", "serve", "--port", str(port), "--fd", str(fd),
                 "--state-dir", str(tmp_path / f"state-{port}"), *args],
                stdout=log, stderr=subprocess.STDOUT, text=True, pass_fds=(fd,),
                env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
            )  # fmt: skip
        procs.append(proc)
        return proc, port

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def _stages_of(proc: subprocess.Popen[str], port: int) -> list[dict] | None:
    import time

    import httpx

    deadline = time.monotonic() + 120
    stages = None
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            resp = httpx.get(f"http://127.0.0.1:{port}/v1/stages", timeout=30)
            if resp.status_code == 200:
                stages = resp.json()["stages"]
                break
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    assert proc.poll() is None, "serve exited"
    return stages


def test_serve_builds_its_stages_from_the_command_line_alone_or_an_all_cuda_deploy(serve_process, tmp_path: Path) -> None:
    # two real servers started side by side: plain vLLM from --profiler-config with no deploy YAML,
    # and a deploy whose every stage is `cuda` (nsys)
    nsys = tmp_path / "nsys.yaml"
    nsys.write_text("stages:\n  - {stage_id: 0, profiler_config: {profiler: cuda}}\n")
    plain = serve_process("--upstream", "http://127.0.0.1:9", "--flavor", "vllm",
                          "--profiler-config", '{"profiler": "torch", "torch_profiler_dir": "/srv/vllm-traces"}')  # fmt: skip
    cuda = serve_process("--upstream", "http://127.0.0.1:9", "--deploy-config", str(nsys))
    plain_stages, cuda_stages = _stages_of(*plain), _stages_of(*cuda)
    assert plain_stages is not None and [(s["stage_id"], s["profiler_dir"]) for s in plain_stages] == [(0, "/srv/vllm-traces")]
    assert cuda_stages is not None and [s["profiler"] for s in cuda_stages] == ["cuda"]


def test_emulate_refuses_bad_stage_overrides_before_starting(qwen25_deploy: Path) -> None:
    proc = run("emulate", "--deploy-config", qwen25_deploy, "--stage-overrides", '{"9": {}}')
    assert proc.returncode == 1 and "stage_overrides_invalid" in proc.stderr


def test_serve_reads_the_server_command_line_from_the_environment(tmp_path: Path, monkeypatch) -> None:
    from sidecar.config.settings import SidecarSettings

    monkeypatch.setenv("OMNI_SIDECAR_PROFILER_CONFIG", '{"profiler": "cuda"}')
    monkeypatch.setenv("OMNI_SIDECAR_STAGE_OVERRIDES", '{"0": {"profiler_config": {"profiler": "cuda"}}}')
    settings = SidecarSettings()
    assert (settings.profiler_config, settings.stage_overrides) == (
        '{"profiler": "cuda"}',
        '{"0": {"profiler_config": {"profiler": "cuda"}}}',
    )


def test_serve_without_an_upstream_is_refused_naming_both_usual_urls(tmp_path):
    result = CliRunner().invoke(app, ["serve", "--port", "0", "--state-dir", str(tmp_path / "s")],
                                env={"OMNI_SIDECAR_UPSTREAM_URL": ""})
    err = " ".join(result.stderr.split())
    assert (result.exit_code, "--upstream" in err, "8000" in err, "8091" in err) == (1, True, True, True)
