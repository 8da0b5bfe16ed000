"""Every shell and Python block of README.md and docs/*.md runs, as a reader would paste it, against
one emulator and one sidecar shared by the module, so the docs cannot drift from the product.

Blocks are found in the Markdown (```bash / sh / shell / python fences); an HTML comment on the
lines just above a block says how it runs:

- ``<!-- docs-test: skip (needs a GPU) -->``: not run; the reason must say what it needs, and
  ``test_blocks_that_do_not_run_say_why`` lists them by name (they are not pytest skips: under
  CI=true a skip fails its group, and a block that cannot run here is a fact of the docs, not a
  test that did not run);
- ``<!-- docs-test: exit 1 -->``: the exit status the block ends with (default 0);
- ``<!-- docs-test: traffic -->``: chat requests reach the emulator while the block runs (a block
  written for a busy server: a capture of an idle one is ``degraded``);
- ``<!-- docs-test: walkthrough NAME -->``: the blocks of one walkthrough run in order as one shell
  script (a Python block through ``python3 -``), with their own servers on fresh ports.

The docs name the usual ports and paths; the test maps them: ``8091`` → the emulator, ``8092`` →
the sidecar (fresh free ports for a walkthrough), ``/data/perf`` → the emulator's trace dirs,
``/traces`` → a tree of real session folders (``stage<N>/…`` and ``run_a``/``run_b``, two
captures). Blocks run in a scratch folder holding what a reader has at hand: ``deploy.yaml``
(configs/qwen2_5_omni.yaml tracing into ``/data/perf``), ``trainer.yaml`` (a verl config that
profiles rollout), ``trace_rank0.json.gz`` and ``a.json.gz`` (a real CUDA trace), links to the
checkout's ``configs``, ``bench``, ``stage_profiles``, ``tools`` and ``tests``; ``OMNI_SIDECAR_URL``
is the sidecar and ``A``, ``B``, ``ID`` are ids of completed captures on it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml

from sidecar.api.launcher import SidecarProcess, free_port
from sidecar.client import SidecarClient
from tests.fixtures.emulator import EmulatorPool
from tests.test_config_verl import GOOD

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
# the blocks share a module scene (an emulator, a sidecar, two captures): dealt into two groups, so
# two workers run blocks while the third takes the rest of the suite (tests/conftest.py)
XDIST_SPLIT = 2
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(bash|sh|shell|python|py)\s*$")
DIRECTIVE = re.compile(r"<!--\s*docs-test:\s*(skip|exit|walkthrough|traffic)\s*(.*?)\s*-->")
TRACES = re.compile(r"(?<![\w/.-])/traces(?=[/\s'\"]|$)", re.MULTILINE)
BLOCK_TIMEOUT_S = 300


@dataclass
class Block:
    file: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    skip: str | None = None
    exit: int = 0
    walkthrough: str | None = None
    traffic: bool = False

    @property
    def name(self) -> str:
        return f"{self.file.relative_to(ROOT)}:{self.line}"

    @property
    def python(self) -> bool:
        return self.lang in ("python", "py")


def blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").split("\n")
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if lines[i].startswith("```"):  # another language: step over its body
                i += 1
                while i < len(lines) and not lines[i].startswith("```"):
                    i += 1
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        block = Block(path, i + 1, m.group(1), "\n".join(lines[i + 1 : end]) + "\n")
        k = i - 1
        while k >= 0 and lines[k].strip().startswith("<!--"):  # the comments right above the fence
            for kind, arg in DIRECTIVE.findall(lines[k]):
                if kind == "skip":
                    block.skip = arg.strip("()") or "marked skip"
                elif kind == "exit":
                    block.exit = int(arg)
                elif kind == "traffic":
                    block.traffic = True
                else:
                    block.walkthrough = arg
            k -= 1
        found.append(block)
        i = end + 1
    return found


ALL = [b for doc in DOCS for b in blocks(doc)]
NOT_RUN = [b for b in ALL if b.skip]
SINGLE = [b for b in ALL if b.walkthrough is None and not b.skip]
WALKS: dict[str, list[Block]] = {}
for _b in ALL:
    if _b.walkthrough is not None:
        WALKS.setdefault(_b.walkthrough, []).append(_b)
# a walkthrough runs whole or not at all: one step it cannot run leaves it to NOT_RUN's list
WALKS = {name: steps for name, steps in WALKS.items() if not any(b.skip for b in steps)}


@dataclass
class Scene:
    """The scratch folder, the environment and the port map the blocks run with."""

    work: Path
    env: dict[str, str]
    ports: dict[str, str] = field(default_factory=dict)

    def adapt(self, text: str, ports: dict[str, str] | None = None) -> str:
        for usual, port in (ports or self.ports).items():
            text = re.sub(rf"\b{usual}\b", port, text)
        text = text.replace("/data/perf", str(self.work / "perf"))
        return TRACES.sub(str(self.work / "traces"), text)

    emulator: str = ""
    given: tuple[str, ...] = ("configs", "bench", "stage_profiles", "tools", "tests", "deploy.yaml", "trainer.yaml",
                              "trace_rank0.json.gz", "a.json.gz")

    @contextlib.contextmanager
    def traffic(self, on: bool) -> Iterator[None]:
        """Chat requests back to back while the block runs (when ``on``)."""
        done = threading.Event()

        def loop() -> None:
            with httpx.Client(base_url=self.emulator, timeout=60, trust_env=False) as http:
                while not done.is_set():
                    http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                            "max_tokens": 2}).raise_for_status()

        thread = threading.Thread(target=loop, daemon=True)
        if on:
            thread.start()
        try:
            yield
        finally:
            done.set()
            if on:
                thread.join(timeout=120)

    def folder(self, name: str) -> Path:
        """A fresh folder for one block holding what the reader has at hand (files copied, folders
        linked): what one block writes there (``curl -O``, ``-o``) cannot change the next block."""
        where = self.work / "blocks" / re.sub(r"[^A-Za-z0-9]+", "_", name)
        where.mkdir(parents=True)
        for given in self.given:
            src = self.work / given
            if src.is_dir():
                (where / given).symlink_to(src)
            else:
                shutil.copy(src, where / given)
        return where

    def run(self, script: str, name: str) -> subprocess.CompletedProcess[str]:
        cwd = self.folder(name)
        path = cwd / "block.sh"
        # background jobs of a block (a walkthrough's servers) end with it, also when it fails
        path.write_text("set -eo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + script)
        # The output goes to a file, not a pipe: a process the block started and left behind (a
        # server's worker in a session of its own) may hold its stdout open after the block ended,
        # and a pipe read would wait for it; the block is done when bash is.
        log = cwd / "block.log"
        with log.open("w") as out_file:
            proc = subprocess.Popen(["bash", str(path)], cwd=cwd, env=self.env, text=True,
                                    stdout=out_file, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=BLOCK_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                out = log.read_text(errors="replace")
                return subprocess.CompletedProcess(proc.args, -9, out + f"\n[timed out after {BLOCK_TIMEOUT_S}s]")
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # anything the block left running
                except ProcessLookupError:
                    pass
        return subprocess.CompletedProcess(proc.args, proc.returncode, log.read_text(errors="replace"))


def as_shell(block: Block) -> str:
    if block.python:
        return f"python3 - <<'DOCS_TEST_PY'\n{block.text}DOCS_TEST_PY\n"
    return block.text


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory, emulator_pool: EmulatorPool) -> Iterator[Scene]:
    work = tmp_path_factory.mktemp("docs")
    for name in ("configs", "bench", "stage_profiles", "tools", "tests"):
        (work / name).symlink_to(ROOT / name)
    verl = json.loads(json.dumps(GOOD))
    verl["actor_rollout_ref"]["rollout"]["profiler"].update(all_ranks=True, ranks=[])
    (work / "trainer.yaml").write_text(yaml.safe_dump(verl))
    deploy = yaml.safe_load((ROOT / "configs" / "qwen2_5_omni.yaml").read_text())
    for stage in deploy["stages"]:
        cfg = stage.get("profiler_config") or {}
        if cfg.get("torch_profiler_dir"):
            cfg["torch_profiler_dir"] = str(work / "perf" / f"stage{stage['stage_id']}")
    (work / "deploy.yaml").write_text(yaml.safe_dump(deploy, sort_keys=False))
    emu = emulator_pool.get(work / "deploy.yaml", extra_args=["--workers", "thread"], startup_timeout=120)
    with SidecarProcess(emu.url, work / "deploy.yaml", state_dir=work / "sidecar-state") as sc:
        scene = Scene(work, {}, {"8091": str(emu.port), "8092": str(sc.port)}, emulator=emu.url)
        ids = [_capture_into(scene, sc.url, work / "traces" / run) for run in ("run_a", "run_b")]
        for stage in sorted((work / "traces" / "run_a").iterdir()):  # /traces/stage<N>/<session folder>
            session = next(stage.iterdir())
            name = "20261130-120000_stage0_rank0_1764500000" if stage.name == "stage0" else session.name
            shutil.copytree(session, work / "traces" / stage.name / name)
        for name in ("trace_rank0.json.gz", "a.json.gz"):  # a real CUDA trace with ProfilerStep#1..6
            shutil.copy(ROOT / "tests" / "data" / "traces" / "fleet_rank0.json.gz", work / name)
        scene.env = {**os.environ, "OMNI_SIDECAR_URL": sc.url, "XDG_STATE_HOME": str(work / "state"),
                     "A": ids[0], "B": ids[1], "ID": ids[1],
                     "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
                     "COLUMNS": "100", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        yield scene


def _capture_into(scene: Scene, sidecar: str, into: Path) -> str:
    """One completed capture of every profiled stage, its session folders copied to ``into/stage<N>/``."""
    with SidecarClient(sidecar, timeout=120) as client, scene.traffic(True):
        cap = client.start_capture()
        httpx.post(f"{scene.emulator}/v1/chat/completions", timeout=60, trust_env=False,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).raise_for_status()
        cap = client.stop_capture(cap.id, wait=True, timeout=120)
    assert cap.state.value == "completed", cap
    for v in cap.verdicts:
        for session in v.sessions:
            src = Path(session.local_path or session.path)
            shutil.copytree(src, into / f"stage{v.stage_id}" / src.name)
    return cap.id


@pytest.mark.parametrize("block", SINGLE, ids=[b.name for b in SINGLE])
def test_block_runs_as_written(block: Block, scene: Scene) -> None:
    with scene.traffic(block.traffic):
        done = scene.run(scene.adapt(as_shell(block)), block.name)
    assert done.returncode == block.exit, f"{block.name} exited {done.returncode}:\n{done.stdout[-4000:]}"


@pytest.mark.parametrize("name", sorted(WALKS), ids=sorted(WALKS))
def test_walkthrough_runs_as_written(name: str, scene: Scene) -> None:
    steps = WALKS[name]
    ports = {"8091": str(free_port()), "8092": str(free_port())}
    script = "".join(f"# --- {b.name}\n{scene.adapt(as_shell(b), ports)}" for b in steps)
    with scene.traffic(any(b.traffic for b in steps)):
        done = scene.run(script, f"walk-{name}")
    assert done.returncode == steps[-1].exit, f"walkthrough {name} exited {done.returncode}:\n{done.stdout[-4000:]}"


def test_blocks_that_do_not_run_say_why() -> None:
    # each names what it needs (a GPU, another host, a real server, ...) in words a reader can act on
    vague = [b.name for b in NOT_RUN if len(b.skip.strip(" ()")) < 12]
    assert vague == [], "\n".join(f"{b.name}: {b.skip}" for b in NOT_RUN)


def test_every_block_is_found() -> None:
    # a fence the parser misread would silently drop every block after it
    fences = sum(1 for doc in DOCS for ln in doc.read_text().split("\n") if FENCE.match(ln))
    assert (len(ALL), fences > 20) == (fences, True)


def test_the_error_table_lists_every_code() -> None:
    """docs/api.md's table is what ``python -m sidecar.api.errors`` prints (regenerate it there)."""
    made = subprocess.run([sys.executable, "-m", "sidecar.api.errors"], capture_output=True, text=True, check=True,
                          cwd=ROOT).stdout.strip().split("\n")
    doc = (ROOT / "docs" / "api.md").read_text().split("\n")
    start = doc.index(made[0])
    shown = doc[start : start + next(i for i, ln in enumerate(doc[start:]) if not ln.startswith("|"))]
    assert shown == made
