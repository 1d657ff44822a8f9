# keras-smp: two entry points for a fresh machine.
#   make demo   trains a digit classifier on 2 local worker processes, each
#               running a 2-stage pipeline (data x pipeline parallel)
#   make test   runs the whole test suite (including slow multi-process tests
#               and the Horovod lane, whose environment it builds first)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The Horovod lane: a second environment (TF 2.15.1 + horovod 0.28.1, Gloo).
HVD_STAMP := .venv-hvd/.installed

.PHONY: demo test test-fast install clean sysdeps

install: $(STAMP)

$(STAMP): setup.cfg setup.py requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/keras-smp launch -n 2 --timeout 600 -- $(BIN)/python examples/digits_pipeline.py

$(HVD_STAMP): scripts/horovod-env.sh requirements-hvd.txt
	PYTHON=$(PYTHON) bash scripts/horovod-env.sh

# iproute2 (ip, tc): the all-reduce benchmark's emulated hosts.
sysdeps:
	@command -v ip >/dev/null && command -v tc >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && DEBIAN_FRONTEND=noninteractive apt-get update -q && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2; } || \
	  echo "note: iproute2 (ip, tc) missing and not root: the all-reduce benchmark test will skip"

# Two pytest processes, each taking whole test files (a file's module-scoped
# runs, e.g. the model zoo's one job per mode, stay in one process). Run one
# by one, the files kept 1.37 of 2 cores busy on average (one-process tracing
# and TensorFlow's import); in 2 processes 1.79 (80 -> 59 min, slow AMD EPYC).
# `make test PYTEST_PARALLEL=` runs them one by one.
PYTEST_PARALLEL ?= -n 2 --dist loadfile

test: $(STAMP) $(HVD_STAMP) sysdeps
	$(BIN)/python -m pytest -v -rs --durations=15 $(PYTEST_PARALLEL) tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_PARALLEL) tests

clean:
	rm -rf $(VENV) .venv-hvd build *.egg-info
