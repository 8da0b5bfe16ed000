"""``python -m sidecar.emulator ...``: the same as ``omni-sidecar emulate ...``."""

if __name__ == "__main__":  # spawn re-imports this module in every worker: run nothing there
    from sidecar.cli.emulate import run_standalone

    run_standalone()
