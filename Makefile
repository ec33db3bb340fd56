# The two commands of the README's Quickstart. Both install what they need (scripts/install.sh:
# torch only if missing, as a CPU build) into the Python that scripts/python_env.sh picks: the
# active virtual environment, or a Python that already has torch and is not externally managed
# (PEP 668); otherwise the project virtual environment .venv, created on first use.
# `make test PYTHON=/path/to/python` overrides the choice.
ifndef PYTHON
PYTHON := $(shell ./scripts/python_env.sh)
ifeq ($(PYTHON),)
$(error scripts/python_env.sh found no Python to use (see its message above))
endif
endif
export PYTHON

# What each target installs (scripts/install.sh's DIST_CKPT_EXTRAS): the demo needs the library
# alone; the tests and the static checks every backend, the test tools and the docs toolchain.
DEMO_EXTRAS :=
TEST_EXTRAS := all,test,docs

.PHONY: install install-demo demo test check

install:
	@echo "make: using $(PYTHON)"
	DIST_CKPT_EXTRAS="$(TEST_EXTRAS)" ./scripts/install.sh

install-demo:
	@echo "make: using $(PYTHON)"
	DIST_CKPT_EXTRAS="$(DEMO_EXTRAS)" ./scripts/install.sh

demo: install-demo
	"$(PYTHON)" -m dist_ckpt demo

test: install
	./scripts/run_tests.sh

# Static checks CI runs beside the tests: lint and formatting (ruff, line length 120), mypy --strict
# and the import layers (scripts/check_layers.py: no import up a layer or between backends, no cycle).
check: install
	$(PYTHON) scripts/check_layers.py
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy
