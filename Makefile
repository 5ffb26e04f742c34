# Both targets create .venv on first use, so they work on a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup bytecode demo test test-all lint format bench clean

setup: $(STAMP)

# Every test, demo and example run starts fresh interpreters that import shardkit. An
# editable install has no bytecode, and with PYTHONDONTWRITEBYTECODE=1 (set on this
# machine) Python compiles shardkit again in each of them: 0.3 s of CPU a process. Python
# reads .pyc files whatever that variable says; compileall rebuilds only what changed.
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q shardkit

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# stage 2: rank 1 is SIGKILLed at step 60; torchrun restarts the job, which resumes from RAM
demo: bytecode
	$(BIN)/shardkit demo
	$(BIN)/shardkit demo --no-preempt --steps 120 --max-restarts 1 --kill-rank 1 --kill-at-step 60

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint bytecode
	$(BIN)/python -m pytest -q -m "not slow"

# also the tests marked slow (the 4 GiB-per-rank checkpoint scale test)
test-all: lint bytecode
	$(BIN)/python -m pytest -q

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Every benchmark, one after another (BENCH_ARGS=--quick for a smoke run). The A/B one
# compares this tree with an exported earlier one, so it runs only when BEFORE names it.
bench: $(STAMP)
	for b in benchmarks/bench_*.py; do \
		case $$b in \
		*/bench_full_save_ab.py) \
			if [ -z "$(BEFORE)" ]; then \
				echo "skipping $$b: it needs an earlier tree, make bench BEFORE=DIR (see its docstring)"; \
				continue; \
			fi; \
			$(BIN)/python $$b --before "$(BEFORE)" $(BENCH_ARGS) || exit 1;; \
		*) $(BIN)/python $$b $(BENCH_ARGS) || exit 1;; \
		esac; \
	done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
