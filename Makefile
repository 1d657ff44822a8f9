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

test: $(STAMP) $(HVD_STAMP) sysdeps
	$(BIN)/python -m pytest -v -rs --durations=15 tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

clean:
	rm -rf $(VENV) .venv-hvd build *.egg-info
