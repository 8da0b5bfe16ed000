#!/usr/bin/env bash
# Build (once) the venv the `-m verl` test group runs in: the real verl 0.9.1 wheel with what it
# needs and does not declare (cachetools, TransferQueue), CPU torch 2.13.0, Ray, and this checkout
# installed editable with its test extra. Its own venv: verl pins transformers<5.11, the vllm extra
# of the system Python needs a newer one.
#   tools/verl-env.sh            # builds or reuses; prints the venv's python on the last line
#   OMNI_SIDECAR_CACHE=/ci/cache tools/verl-env.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${OMNI_SIDECAR_CACHE:-$HOME/.cache/omni-sidecar}"
VENV="$CACHE/venvs/verl-0.9.1"
PY="${PY:-python3}"
# The whole recipe: a change here rebuilds the venv (the stamp holds it).
REQS="verl==0.9.1 cachetools TransferQueue torch==2.13.0 ray[default]"
STAMP="$VENV/.omni-sidecar-recipe"

if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$REQS" ]; then
  # Reuse: only (re)point the editable sidecar at this checkout, without touching dependencies.
  if ! "$VENV/bin/python" - "$ROOT" <<'PY' >/dev/null 2>&1
import os, sys, sidecar
sys.exit(0 if os.path.dirname(os.path.dirname(os.path.abspath(sidecar.__file__))) == sys.argv[1] else 1)
PY
  then
    "$VENV/bin/python" -m pip install -q --no-deps -e "$ROOT" >&2
  fi
  echo "$VENV/bin/python"
  exit 0
fi

rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >&2
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install -q $REQS -e "$ROOT[emulator,test]" >&2
# Registry builds of these are CUDA builds that break imports beside CPU torch.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
"$VENV/bin/python" -c "import verl, ray, torch, transfer_queue, cachetools, sidecar" >&2
echo "$REQS" > "$STAMP"
echo "$VENV/bin/python"
