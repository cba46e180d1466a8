# One entry point for contributors and CI.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint bench

$(BIN)/orch: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[job,test]'
	touch $@

setup: $(BIN)/orch

# The main job on this machine: a tiny random Llama, its hidden states extracted on the CPU.
demo: setup
	$(BIN)/orch run extract-hidden-states

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check orchestrator playbooks
	$(BIN)/mypy orchestrator playbooks
	$(BIN)/lint-imports

bench: setup
	$(BIN)/python bench/detection_lag.py
	$(BIN)/python bench/inspect_log.py
	$(BIN)/python bench/status_startup.py
