# keras-smp: two entry points for a fresh machine.
#   make demo   trains a digit classifier on 2 local worker processes, each
#               running a 2-stage pipeline (data x pipeline parallel)
#   make test   runs the whole test suite (including slow multi-process tests)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast install clean

install: $(STAMP)

$(STAMP): setup.cfg setup.py requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/keras-smp launch -n 2 --timeout 600 -- $(BIN)/python examples/digits_pipeline.py

test: $(STAMP)
	$(BIN)/python -m pytest -v -rs --durations=15 tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

clean:
	rm -rf $(VENV) build *.egg-info
