# Both targets create .venv on first use, so they work on a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-all lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# stage 2: rank 1 is SIGKILLed at step 60; torchrun restarts the job, which resumes from RAM
demo: $(STAMP)
	$(BIN)/shardkit demo
	$(BIN)/shardkit demo --no-preempt --steps 120 --max-restarts 1 --kill-rank 1 --kill-at-step 60

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -q -m "not slow"

# also the tests marked slow (the 4 GiB-per-rank checkpoint scale test)
test-all: lint
	$(BIN)/python -m pytest -q

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
