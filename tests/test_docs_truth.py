"""What the user-facing docs name exists in the product: every CLI flag a documented command line
uses is one its command takes, every ``OMNI_SIDECAR_*`` variable is read, docs/api.md's route table
is the running sidecar's ``/openapi.json``, and every error class of the table is raised somewhere.

tests/test_docs.py runs the docs' code blocks; these checks cover the names in their prose too.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from sidecar.api.launcher import SidecarProcess
from sidecar.config.settings import SidecarSettings
from sidecar.emulator.launcher import EmulatorProcess

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *(ROOT / "docs" / f"{name}.md" for name in
                              ("api", "captures", "config", "fleet", "rl", "web", "summaries"))]
# every option of every command, from the CLI's own click tree (one process, not one per --help)
CLI_TREE = r"""
import json, typer
from sidecar.cli import app
def walk(cmd, path, out):
    out[" ".join(path)] = sorted(o for p in cmd.params for o in (*p.opts, *p.secondary_opts))
    for name, sub in getattr(cmd, "commands", {}).items():
        walk(sub, [*path, name], out)
out = {}
walk(typer.main.get_command(app), [], out)
print(json.dumps(out))
"""


def doc_lines(path: Path) -> Iterator[tuple[int, str]]:
    """Each line, a shell continuation (``\\`` at the end) joined to the lines it continues onto."""
    lines = path.read_text(encoding="utf-8").split("\n")
    i = 0
    while i < len(lines):
        line, start = lines[i], i
        while line.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i]
        yield start + 1, line
        i += 1


@pytest.fixture(scope="module")
def cli_options() -> dict[str, list[str]]:
    done = subprocess.run([sys.executable, "-c", CLI_TREE], capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(done.stdout)


def test_every_flag_a_documented_command_line_uses_is_one_its_command_takes(cli_options: dict[str, list[str]]) -> None:
    command = re.compile(r"omni-sidecar ((?:fleet )?[a-z]+)((?:[^`#|;&\n])*)")
    wrong = []
    for doc in DOCS:
        for n, line in doc_lines(doc):
            for m in command.finditer(line):
                name, rest = m.group(1), m.group(2)
                if name not in cli_options:
                    if name.split()[0] == "fleet":  # `fleet capture`: a fleet command we do not have
                        wrong.append(f"{doc.name}:{n}: no command `omni-sidecar {name}`")
                    continue
                for flag in re.findall(r"(?<![\w/.=-])(--?[a-zA-Z][\w-]*)", rest):
                    if flag not in cli_options[name]:
                        wrong.append(f"{doc.name}:{n}: `omni-sidecar {name}` takes no {flag}")
    assert wrong == []


# Variables that are no sidecar setting: read by the CLI / client, the test fixtures or the tools' scripts
NOT_SETTINGS = {"OMNI_SIDECAR_URL", "OMNI_SIDECAR_TOKEN", "OMNI_SIDECAR_CACHE", "OMNI_SIDECAR_CHROMIUM",
                "OMNI_SIDECAR_SCREENSHOT_DIR", "OMNI_SIDECAR_LOG_LEVEL"}  # serve's --log-level: not a setting


def test_every_environment_variable_the_docs_name_is_read() -> None:
    named = {v for doc in DOCS for v in re.findall(r"OMNI_SIDECAR_[A-Z0-9_]*[A-Z0-9]", doc.read_text())}
    settings = {f"OMNI_SIDECAR_{field.upper()}" for field in SidecarSettings.model_fields}
    sources = "\n".join(p.read_text(errors="replace") for folder in ("sidecar", "tests", "tools")
                        for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh") and p.is_file())
    unread = sorted(v for v in named - settings if v not in NOT_SETTINGS or v not in sources)
    assert unread == []


def test_every_error_class_is_raised_somewhere() -> None:
    """docs/api.md's table lists every class (tests/test_docs.py); none of them is a code no path raises."""
    import inspect

    import sidecar.errors as errors

    classes = [c for c in vars(errors).values() if inspect.isclass(c) and issubclass(c, errors.SidecarError)]
    code = "\n".join(p.read_text() for p in (ROOT / "sidecar").rglob("*.py") if p != ROOT / "sidecar" / "errors.py")
    # made (``Name(``) or the class an HTTP status maps to (``404: RouteNotFound``, sidecar/api/errors.py)
    unraised = sorted(c.__name__ for c in classes
                      if not c.__subclasses__() and not re.search(rf"\b{c.__name__}\(|\d: {c.__name__}\b", code))
    assert unraised == []


@pytest.fixture(scope="module")
def sidecar_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("docs-truth")
    deploy = tmp / "deploy.yaml"
    deploy.write_text(yaml.safe_dump({"stages": [
        {"stage_id": 0, "profiler_config": {"profiler": "torch", "torch_profiler_dir": str(tmp / "stage0"),
                                            "torch_profiler_with_stack": False, "max_iterations": 32}},
        {"stage_id": 1},
    ]}))
    emu = EmulatorProcess(deploy, extra_args=["--workers", "thread"]).start()
    try:
        side = SidecarProcess(emu.url, deploy, state_dir=tmp / "state").start()
        try:
            yield side.url
        finally:
            side.stop(grace=15)
    finally:
        emu.stop()


def api_table_routes() -> set[tuple[str, str]]:
    text = (ROOT / "docs" / "api.md").read_text()
    table = text[text.index("## Routes"):text.index("**Metrics.**")]
    rows = re.findall(r"^\| `(GET|POST) (/[^`?\s]*)", table, re.MULTILINE)
    return {(method, re.sub(r"\{[^}]*\}", "{}", path)) for method, path in rows}


def test_the_route_table_is_the_openapi_document(sidecar_url: str) -> None:
    served = httpx.get(f"{sidecar_url}/openapi.json").json()["paths"]
    routes = {(method.upper(), re.sub(r"\{[^}]*\}", "{}", path))
              for path, ops in served.items() for method in ops if method in ("get", "post")}
    # one documented row, `files/{folder}/{file}`, is the route's `files/{relpath}`
    documented = {(m, p.replace("files/{}/{}", "files/{}")) for m, p in api_table_routes()}
    assert (sorted(documented - routes), sorted(routes - documented)) == ([], [])


def test_the_plan_route_before_any_plan_answers_as_documented(sidecar_url: str) -> None:
    reply = httpx.get(f"{sidecar_url}/v1/plan", params={"steps": 20})
    assert (reply.status_code, reply.json()) == (200, {"plan": None, "prediction": None})


def test_a_documented_plan_bound_below_the_minimum_is_request_invalid(sidecar_url: str) -> None:
    reply = httpx.post(f"{sidecar_url}/v1/plan", json={"stages": [0], "budget_mb": 0.001})
    assert (reply.status_code, reply.json()["error"]["code"]) == (422, "request_invalid")


def test_an_environment_twin_sets_its_flag(tmp_path: Path, sidecar_url: str) -> None:
    """``OMNI_SIDECAR_ALLOWED_HOSTS`` is ``--allowed-host``'s twin (docs/api.md, Docker)."""
    upstream = httpx.get(f"{sidecar_url}/readyz").json()["upstream"]
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(yaml.safe_dump({"stages": [{"stage_id": 0, "profiler_config": {
        "profiler": "torch", "torch_profiler_dir": str(tmp_path / "stage0"), "max_iterations": 32}}]}))
    side = SidecarProcess(upstream, deploy, state_dir=tmp_path / "state",
                          env={"OMNI_SIDECAR_ALLOWED_HOSTS": "sidecar"}).start()
    try:
        assert httpx.get(f"{side.url}/healthz", headers={"Host": "sidecar"}).status_code == 200
    finally:
        side.stop(grace=15)
