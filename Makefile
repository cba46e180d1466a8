# One entry point for contributors and CI.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup system engine demo test test-fast lint docs bench gpu-wheels

$(BIN)/orch: pyproject.toml
	@echo "setting up $(VENV): pip, torch (CPU), orch with its job and test extras"
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --progress-bar on --upgrade pip
	$(BIN)/pip install --progress-bar on torch==2.13.0
	$(BIN)/pip install --progress-bar on -e '.[job,test]'
	touch $@

setup: $(BIN)/orch

# The main job on this machine: a tiny random Llama, its hidden states extracted on the CPU.
demo: setup
	$(BIN)/orch run extract-hidden-states

# The Debian packages the tests drive for real (sshd, cron, chromium, Slurm, iproute2).
system:
	.ci/system-packages

# The real engine every machine runs: vLLM's CPU build (and speculators) in .engines/vllm, for
# tests/test_vllm_real.py and docs/no-gpu.md.
engine:
	PY=$(PY) .ci/engine-env .engines/vllm

# Four workers on two cores (much of a test is waiting on hosts and processes: with three, a quarter of the
# CPU was idle in the suite's second half), each test file on one of them (a file's module fixtures, the
# Slurm cluster and the browser, stay in one process); each worker has its own sshd fleet on loopback
# addresses of its own.
# The 30 slowest tests are printed at the end: where the time goes, on every run.
test: setup system engine
	$(BIN)/python -m pytest -q -n 4 --dist loadfile --durations=30

# In-process tests only; the plugins of the other tests (hypothesis, anyio) cost more to load than these run.
test-fast: setup
	$(BIN)/python -m pytest -q -p no:hypothesispytest -p no:anyio tests/fast

lint: setup
	$(BIN)/ruff check orchestrator playbooks tests bench
	$(BIN)/mypy orchestrator playbooks
	$(BIN)/lint-imports

# The manual, docs/, built into site/ (ignored by git); --strict fails on a broken link or anchor, a page
# missing from the nav, or a nav entry with no page.
docs: setup
	$(BIN)/mkdocs build --strict --site-dir site

bench: setup engine
	$(BIN)/python bench/detection_lag.py
	$(BIN)/python bench/inspect_log.py
	$(BIN)/python bench/status_startup.py
	$(BIN)/python bench/timeouts.py
	$(BIN)/python bench/real_engine.py

# What a lent GPU machine needs to install orch with no package index, in bench/wheels (docs/development.md).
gpu-wheels: setup
	$(BIN)/python bench/gpu_wheels.py
