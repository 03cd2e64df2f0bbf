PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow lint bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: any looser spec would pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	# ...and held there while the rest installs, so that no requirement can pull another torch
	$(BIN)/pip install -q -e '.[dev]' torch==2.13.0
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/swarm demo

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -q --durations=12 -m "not slow"

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q --durations=12 -m slow

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV) runs
