#!/usr/bin/env bash
# Copies vllm/config/profiler.py out of each supported vLLM wheel into tests/data/vllm_profiler/
# (<version>.py, verbatim), which tests/contract/test_profiler_versions.py loads in isolation: each
# version's own ProfilerConfig without installing five vLLMs. Run it when the table of versions in
# sidecar/versions.py grows.
#   tools/vllm-profiler-configs.sh 0.30.0 0.31.0 0.32.0 0.33.0 0.34.0
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/tests/data/vllm_profiler"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$OUT"
for version in "$@"; do
  python3 -m pip download -q --no-deps "vllm==$version" -d "$TMP/$version" 2>&1 | grep -v '^WARNING: Location' >&2 || true
  wheel="$(ls "$TMP/$version"/vllm-*.whl)"
  python3 - "$wheel" "$OUT/${version%.*}.py" <<'PY'
import sys, zipfile
wheel, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    data = z.read("vllm/config/profiler.py")
open(out, "wb").write(data)
PY
  echo "$OUT/${version%.*}.py <- $(basename "$wheel")"
done
