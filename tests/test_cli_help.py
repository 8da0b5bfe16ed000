"""The CLI's help and vocabulary: ``--version``, every option has help, no literal reST, flags
show no value type, the options several commands share mean and default the same, and each help
text shows as written with the defaults a run takes (no template left unrendered or eaten)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from sidecar import __version__
from sidecar.cli import app

ROOT = typer.main.get_command(app)


def _commands(group: Any = ROOT, prefix: str = "") -> dict[str, Any]:
    """Every command by its full name (typer 0.29 vendors click: duck-typed, not isinstance)."""
    found: dict[str, Any] = {}
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            found.update(_commands(cmd, f"{prefix}{name} "))
        else:
            found[f"{prefix}{name}"] = cmd
    return found


def _option(param: Any) -> bool:
    return param.param_type_name == "option"


COMMANDS = _commands()
SHARED = ("--stages", "--wait", "--timeout", "--duration", "--lease", "--label", "--json", "--sidecar", "--token-file")


def test_version():
    result = CliRunner().invoke(app, ["--version"])
    assert (result.exit_code, result.stdout.strip()) == (0, f"omni-sidecar {__version__}")


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_has_help_and_no_rest(name):
    cmd = COMMANDS[name]
    missing = [p.opts[0] for p in cmd.params if _option(p) and not (p.help or "").strip()]
    texts = [cmd.help or ""] + [p.help or "" for p in cmd.params if _option(p)]
    assert (missing, [t for t in texts if "``" in t]) == ([], [])


def test_flags_show_no_value_type():
    result = CliRunner().invoke(app, ["stop", "--help"], env={"COLUMNS": "120"})
    assert ("--wait" in result.stdout, "<bool>" in result.stdout) == (True, False)


def test_shared_options_mean_and_default_the_same_everywhere():
    seen: dict[str, set[tuple[str, str]]] = {}
    for cmd in ("start", "stop", "capture", "fleet start", "fleet stop", "fleet capture"):
        for p in COMMANDS[cmd].params:
            if _option(p) and p.opts[0] in ("--stages", "--wait", "--timeout"):
                seen.setdefault(p.opts[0], set()).add((p.help or "", repr(p.default)))
    assert {k: len(v) for k, v in seen.items()} == {"--stages": 1, "--wait": 1, "--timeout": 1}, seen


def test_the_windows_of_capture_and_fleet_capture_agree():
    def window(cmd: str) -> tuple[str, object]:
        (p,) = [p for p in COMMANDS[cmd].params if p.opts[0] == "--duration"]
        return p.help or "", p.default

    assert window("capture") == window("fleet capture")


def test_help_paragraphs_reflow_to_the_terminal():
    # capture's docstring breaks "... so a" / "killed CLI ..." across source lines; help joins them
    result = CliRunner().invoke(app, ["capture", "--help"], env={"COLUMNS": "200"})
    assert "so a killed CLI leaves nothing recording" in result.stdout, result.stdout


_REGISTERS = """
import json, sys, typer.main
from sidecar.cli import COMMANDS
from sidecar.cli._app import app
seen, order = {}, []
for module in COMMANDS:
    before = set(typer.main.get_command(app).commands)
    __import__(f"sidecar.cli.{module}")
    seen[module] = sorted(set(typer.main.get_command(app).commands) - before)
order = list(typer.main.get_command(app).commands)
print(json.dumps({"seen": seen, "order": order}))
"""


def test_the_lazy_map_names_what_each_module_registers():
    # a command missing from COMMANDS would run only after a full load; one in the wrong module
    # would answer "No such command" when run alone
    import json
    import subprocess
    import sys

    from sidecar.cli import COMMANDS as MAP

    out = subprocess.run([sys.executable, "-c", _REGISTERS], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)
    assert got["seen"] == {m: sorted(c) for m, c in MAP.items()}
    assert got["order"] == [c for cs in MAP.values() for c in cs]


def test_one_command_imports_only_its_module():
    import subprocess
    import sys

    code = (
        "import sys\nsys.argv = ['omni-sidecar', 'stop', '--help']\nfrom sidecar.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('sidecar.cli.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = out.stdout.strip().splitlines()[-1]
    assert "'sidecar.cli.capture'" in loaded and "'sidecar.cli.fleet'" not in loaded, loaded
    assert "'sidecar.cli.serve'" not in loaded, loaded


def _help(name: str, env: dict[str, str] | None = None) -> str:
    """``omni-sidecar NAME --help`` as a terminal wide enough to give each text one line."""
    return CliRunner().invoke(app, [*name.split(), "--help"], env={"COLUMNS": "3000", **(env or {})}).stdout


def _words(text: str) -> str:
    """``text`` as words: the panels' borders and the code spans' backticks aside."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).replace("`", "").split())


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_help_text_shows_as_written(name):
    # the help is Markdown: `<upstream host>` outside a code span is an HTML tag to it, and vanished
    # (serve's state dir read `omni-sidecar/_-`)
    cmd = COMMANDS[name]
    texts = [cmd.help or ""] + [p.help or "" for p in cmd.params if not getattr(p, "hidden", False)]
    shown = _words(_help(name))
    assert [t for t in texts if _words(t) not in shown] == []


# a template rendered wrong (`_-`), a default that is None, an empty one, an f-string left as text
MALFORMED = re.compile(r"_-|\bNone\b|default:?\s*[),;\]]|\{[A-Za-z_][^{}\s]*\}|<\s*>")
PLACEHOLDERS = {"{replica}", "{host}"}  # what `render --dir` takes, expanded by render itself


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_no_help_shows_a_malformed_default(name):
    lines = [ln for ln in _help(name).splitlines() if not ln.strip().startswith("Usage:")]  # {ARG}: required
    assert [m.group() for ln in lines for m in MALFORMED.finditer(ln) if m.group() not in PLACEHOLDERS] == []


def test_serve_help_gives_the_defaults_a_sidecar_starts_with(monkeypatch):
    from sidecar.config.settings import SidecarSettings

    for key in [k for k in os.environ if k.startswith("OMNI_SIDECAR_")]:
        monkeypatch.delenv(key)
    settings = SidecarSettings()
    said = {p.name: m.group(1) for p in COMMANDS["serve"].params
            if (m := re.search(r"\(default (\S+)\)$", p.help or ""))}
    assert said == {name: str(getattr(settings, name)) for name in ("host", "port", "flavor", "platform", "keep")}


def test_serve_help_gives_the_state_dir_a_sidecar_takes(tmp_path):
    # the default is computed from the environment: the help shows it for this one
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path), "COLUMNS": "3000"}
    shown = _words(subprocess.run([sys.executable, "-m", "sidecar", "serve", "--help"], capture_output=True,
                                  text=True, env=env, check=True).stdout)
    pattern = re.search(r"default: (\S+<upstream host>_<upstream port>-<sidecar port>)", shown)
    code = "from sidecar.config.settings import default_state_dir as d; print(d('http://vllm-host:8000', 8093))"
    taken = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    described = pattern and pattern.group(1).replace("<upstream host>", "vllm-host").replace(
        "<upstream port>", "8000").replace("<sidecar port>", "8093")
    assert (described, taken.strip()) == (str(tmp_path / "omni-sidecar" / "vllm-host_8000-8093"),) * 2, shown
