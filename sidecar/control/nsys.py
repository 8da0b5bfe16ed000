"""nsys captures: ``profiler: cuda`` stages only open and close CUDA capture ranges; the report is
written by an ``nsys profile`` wrapper around the server. This says which wrapper and where its
report lands, for the stage's ``unverified`` verdict.
"""

from __future__ import annotations


def nsys_command(profiler_dir: str | None = None) -> str:
    """The wrapper a server must run under for ``profiler: cuda`` stages to produce a report.
    (Private stand-in for ``sidecar.config.profiles.nsys_command`` until the config layer has it.)"""
    out = f"{profiler_dir.rstrip('/')}/omni-%p" if profiler_dir else "./omni-%p"
    return (f"nsys profile --trace=cuda,nvtx,osrt --capture-range=cudaProfilerApi --capture-range-end=repeat "
            f"-o {out} vllm serve <model> --omni ...")


def nsys_hint(stage_id: int, profiler_dir: str | None) -> str:
    cmd = nsys_command(profiler_dir)
    where = f"{profiler_dir.rstrip('/')}/omni-<pid>*.nsys-rep" if profiler_dir else "omni-<pid>*.nsys-rep"
    return (
        f"nsys capture: stage {stage_id} (profiler: cuda) only opens and closes a CUDA capture range; the "
        f"report is written by nsys, which the server must run under: `{cmd}`. With "
        "--capture-range-end=repeat nsys writes one numbered report per start/stop window, here "
        f"{where} on the server's host (without -o: report<N>.nsys-rep in the server's working "
        "directory); the sidecar cannot check it. A server not run under nsys records nothing"
    )


__all__ = ["nsys_command", "nsys_hint"]
