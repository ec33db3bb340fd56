# The two commands of the README's Quickstart. Both install what they need into the current
# Python (see scripts/install.sh: torch is installed only if missing, as a CPU build).
PYTHON ?= python3
export PYTHON

.PHONY: install demo test check

install:
	./scripts/install.sh

demo: install
	$(PYTHON) -m dist_ckpt demo

test: install
	./scripts/run_tests.sh

# Static checks CI runs beside the tests: lint and formatting (ruff, line length 120) and mypy --strict.
check: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy
