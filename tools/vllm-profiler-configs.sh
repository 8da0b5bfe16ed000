#!/usr/bin/env bash
# Copies vllm/config/profiler.py out of each supported vLLM wheel into tests/data/vllm_profiler/
# (<version>.py, verbatim), which tests/contract/test_profiler_contract.py loads in isolation: each
# version's own ProfilerConfig without installing five vLLMs; and the start route
# (vllm/entrypoints/serve/profile/api_router.py) into tests/data/vllm_profile_api/<version>.py, with
# the profiler wrapper of a version that takes profiler_kwargs (wrapper-<version>.py; 0.34's is
# byte-identical to 0.33's), for tests/contract/test_start_body_contract.py. Run it when the table
# of versions in sidecar/versions.py grows.
#   tools/vllm-profiler-configs.sh 0.30.0 0.31.0 0.32.0 0.33.0 0.34.0
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/tests/data/vllm_profiler"
API="$ROOT/tests/data/vllm_profile_api"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$OUT" "$API"
for version in "$@"; do
  python3 -m pip download -q --no-deps "vllm==$version" -d "$TMP/$version" 2>&1 | grep -v '^WARNING: Location' >&2 || true
  wheel="$(ls "$TMP/$version"/vllm-*.whl)"
  python3 - "$wheel" "$OUT/${version%.*}.py" "$API" "${version%.*}" <<'PY'
import sys, zipfile
wheel, out, api, line = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    open(out, "wb").write(z.read("vllm/config/profiler.py"))
    names = set(z.namelist())
    if "vllm/entrypoints/serve/profile/api_router.py" in names:
        open(f"{api}/{line}.py", "wb").write(z.read("vllm/entrypoints/serve/profile/api_router.py"))
    wrapper = z.read("vllm/profiler/wrapper.py") if "vllm/profiler/wrapper.py" in names else b""
    if b"set_profiler_kwargs" in wrapper and line == "0.33":
        open(f"{api}/wrapper-{line}.py", "wb").write(wrapper)
PY
  echo "$OUT/${version%.*}.py <- $(basename "$wheel")"
done
