"""The table of what each vLLM / vLLM-Omni version does (sidecar/versions.py): the dialect a
version gets, what a server of it takes and is worded as, and a deploy checked for a version
(ProfilerConfig by version with vLLM's own messages, deploy keys by vLLM-Omni release).
tests/test_upstream_versions.py asks it through a server; tests/contract diffs the per-version
ProfilerConfig against each wheel's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.config.deploy import load_deploy_config, version_findings
from sidecar.config.profiler import check_for_version
from sidecar.versions import (
    NEWEST_VLLM,
    OMNI_DIALECTS,
    VLLM_DIALECTS,
    Release,
    ServerVersion,
    omni_dialect,
    prefix_ok,
    profile_prefix,
    profiler_kwargs,
    vllm_dialect,
)

V = {f"{d.line[0]}.{d.line[1]}": d for d in VLLM_DIALECTS}


# --- the table ------------------------------------------------------------------------------


def test_releases_order_as_their_packages_name_them() -> None:
    names = ["0.30.0", "0.31.0rc1", "0.31.0", "0.32.0rc1", "0.32.0", "0.32.1", "0.34.0"]
    parsed = [Release.parse(n) for n in names]
    assert sorted([parsed[i] for i in (3, 0, 6, 2, 5, 1, 4)]) == parsed  # type: ignore[type-var]
    assert [str(p) for p in parsed] == names
    assert (Release.parse("0.30.0+cpu").line, Release.parse("dev"), Release.parse(None)) == ((0, 30), None, None)


@pytest.mark.parametrize(("version", "dialect"), [("0.30.0", "0.30"), ("0.32.0rc1", "0.32"), ("0.34.2", "0.34"),
                                                  ("0.40.0", "0.34"), ("0.20.0", "0.30")])
def test_a_version_gets_its_own_dialect_or_the_nearest_known(version: str, dialect: str) -> None:
    assert vllm_dialect(Release.parse(version)) is V[dialect]


def test_a_newer_version_than_known_is_warned_about_by_name() -> None:
    (warning,) = ServerVersion.of("vllm", "0.40.1").warnings()
    assert (warning["code"], warning["version"], warning["assumed"]) == ("version_unknown", "0.40.1", "vLLM 0.34")


def test_what_each_plain_vllm_takes_in_its_start_body() -> None:
    takes = {name: (d.per_capture_bounds, d.per_capture_prefix, d.per_capture_kwargs, d.conflict_on_second_start)
             for name, d in V.items()}
    assert takes == {"0.30": (False,) * 4, "0.31": (False,) * 4, "0.32": (True, True, False, True),
                     "0.33": (True,) * 4, "0.34": (True,) * 4}


def test_vllm_omni_takes_no_per_capture_option_over_http_on_any_vllm() -> None:
    for vllm in ("0.30.0", "0.32.0", "0.34.0"):
        version = ServerVersion.of("omni", vllm)
        assert (version.start_body, version.per_capture_bounds, version.conflict_on_second_start) == (
            ("stages",), False, False), vllm


def test_the_server_line_says_which_way_a_window_is_bounded() -> None:
    assert ServerVersion.of("omni", "0.32.0").describe() == (
        "vLLM-Omni 0.32.0rc1 on vLLM 0.32.0: per-capture bounds not available over HTTP; the deploy's max_iterations caps bound a steps window")
    assert ServerVersion.of("vllm", "0.32.0").describe().startswith("vLLM 0.32.0: per-capture bounds")


@pytest.mark.parametrize(("vllm", "omni", "fix"), [
    ("0.34.0", None, "pip install 'vllm==0.32.*' --pre 'vllm-omni==0.32.0rc1'"),
    ("0.32.0", "0.30.0", "pip install --pre 'vllm-omni==0.32.0rc1'"),
])
def test_a_mismatched_pair_is_named_with_its_fix(vllm: str, omni: str | None, fix: str) -> None:
    (warning,) = ServerVersion.of("omni", vllm, omni).warnings()
    assert (warning["code"], warning["fix"].startswith(fix)) == ("version_mismatch", True), warning


def test_a_matched_pair_says_nothing() -> None:
    assert ServerVersion.of("omni", "0.31.0", "0.31.0rc1").warnings() == []


def test_a_capture_prefix_is_one_vllm_accepts() -> None:
    assert all(prefix_ok(profile_prefix(cid)) for cid in ("20261205-081500-a1b2c3", "x" * 300, "../weird id"))
    assert not prefix_ok("-starts-badly") and not prefix_ok("")


def test_a_preset_gives_profiler_kwargs_of_known_torch_keys_only() -> None:
    preset = {"profiler": "torch", "torch_profiler_record_shapes": True, "torch_profiler_with_stack": False,
              "max_iterations": 16}
    assert profiler_kwargs(preset) == {"record_shapes": True, "with_stack": False}


# --- a deploy for a version -------------------------------------------------------------------


def test_torch_profiler_activities_is_refused_by_0_30_only_and_names_the_version_that_brought_it() -> None:
    values = {"profiler": "torch", "torch_profiler_dir": "/p", "torch_profiler_activities": ["CUDA"]}
    verdicts = {name: check_for_version(values, d) for name, d in V.items()}
    key, message = verdicts.pop("0.30")  # type: ignore[misc]
    assert (key, "vLLM 0.31 brought it" in message, set(verdicts.values())) == (
        "torch_profiler_activities", True, {None}), message


def test_activities_are_checked_with_vllms_own_message() -> None:
    bad = {"profiler": "cuda", "torch_profiler_activities": ["CUDA"]}
    assert check_for_version(bad, NEWEST_VLLM) == (
        "torch_profiler_activities", "torch_profiler_activities is only applicable when profiler is set to 'torch'")


def _deploy(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    return path


def test_a_0_32_deploy_loads_with_activities_and_is_checked_by_version(tmp_path: Path) -> None:
    path = _deploy(tmp_path, """\
stages:
  - stage_id: 0
    attention_backend: FLASH_ATTN
    profiler_config: {profiler: torch, torch_profiler_dir: /tmp/p, torch_profiler_activities: [CPU]}
weight_transfer_config: {backend: nccl}
""")
    deploy = load_deploy_config(path)  # the newest known rules: no refusal here
    newest = version_findings(deploy, V["0.32"], omni_dialect(Release.parse("0.32.0rc1")))
    oldest = version_findings(deploy, V["0.30"], omni_dialect(Release.parse("0.30.0")))
    assert [f.code for f in newest] == ["activities_ignored"]
    assert sorted((f.code, f.key, f.where.line if f.where else None) for f in oldest) == [
        ("deploy_key_version", "attention_backend", 2),
        ("deploy_key_version", "weight_transfer_config", 5),
        ("profiler_config_version", "profiler_config.torch_profiler_activities", 4),
    ], oldest


def test_capture_torch_profiler_is_a_no_op_warning_on_0_34(tmp_path: Path) -> None:
    path = _deploy(tmp_path, """\
stages:
  - stage_id: 0
    profiler_config: {profiler: torch, torch_profiler_dir: /tmp/p, capture_torch_profiler: true}
""")
    deploy = load_deploy_config(path)
    assert [f.code for f in version_findings(deploy, V["0.34"], None)] == ["capture_torch_profiler_noop"]
    assert version_findings(deploy, V["0.33"], None) == []


def test_every_known_omni_release_pairs_with_a_known_vllm() -> None:
    assert {d.vllm_line for d in OMNI_DIALECTS} <= {d.line for d in VLLM_DIALECTS}


@pytest.mark.parametrize(("name", "version"), [
    ("0a1b2c-rank-0.1796459577500557026.pt.trace.json.gz", "0.30"),  # vLLM 0.30's CPU worker
    ("cap-20261205-083319-78233c_rank0.1796459599597695455.pt.trace.json.gz", "0.32"),  # 0.32's CPU worker, as written
    ("dp0_pp0_tp0_dcp0_ep0_rank0.1796459599597695455.pt.trace.json.gz", "0.31"),  # the GPU worker's name
])
def test_each_versions_worker_trace_name_is_its_own(name: str, version: str) -> None:
    assert {v for v, d in V.items() if d.trace_pattern().match(name)} == (
        {"0.30"} if version == "0.30" else {"0.31", "0.32", "0.33", "0.34"})


def test_both_table_names_are_tables_and_the_front_ends_is_not_a_worker_trace() -> None:
    from sidecar.versions import is_table_file

    assert all(map(is_table_file, ["profiler_out_0.txt", "cap-x_rank0.profiler_out.txt", "h_1.async_llm.profiler_out.txt"]))
    assert not any(d.trace_pattern().match("cap-x_vm_20326.async_llm.1796459599896141107.pt.trace.json.gz")
                   for d in VLLM_DIALECTS)
