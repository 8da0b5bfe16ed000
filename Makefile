# The two set-up commands of the README. Both work on a fresh clone (they install what they need).
PY ?= python3
# torch is pinned: 2.13.0 is a CPU build here; a plain `torch` pulls a multi-GB CUDA build.
TORCH = torch==2.13.0

.PHONY: demo test install-demo install-test

install-demo:
	$(PY) -m pip install -q $(TORCH) -e '.[emulator]'

demo: install-demo
	$(PY) -m sidecar demo  # = `omni-sidecar demo`, without relying on PATH

# vllm + vllm-omni are installed for the contract tests; their registry builds of torchvision,
# torchaudio and torchcodec are CUDA builds that break imports beside CPU torch, so they go.
install-test:
	$(PY) -m pip install -q $(TORCH) -e '.[emulator,test,vllm]'
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	[ -x /usr/bin/chromium ] || { [ "$$(id -u)" = 0 ] && apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } || echo "no chromium: tests/test_web.py will skip"

test: install-test
	$(PY) -m pytest -q -p no:cacheprovider
