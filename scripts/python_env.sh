#!/usr/bin/env bash
# Print the Python interpreter that `make demo` / `make test` install into and run with, creating
# the project virtual environment .venv when the current Python should not be touched.
#
# The rule, in order:
#   1. $PYTHON, when set (e.g. `make test PYTHON=/opt/py/bin/python`): used as is.
#   2. An active virtual environment ($VIRTUAL_ENV, or a python3 whose sys.prefix differs from
#      sys.base_prefix) or conda environment ($CONDA_PREFIX): its python3, used as is.
#   3. .venv/bin/python, when this script created .venv before.
#   4. A python3 that already has torch and is not externally managed (PEP 668): used as is,
#      so a machine set up for training keeps its torch and packages.
#   5. Otherwise (an externally managed system Python such as Debian's, or a plain Python
#      without torch): create .venv with `python3 -m venv` and use it. When that python3 has
#      torch (an externally managed one may, from the distribution), the venv sees the system
#      site-packages, so that torch is used instead of installing another.
# Messages go to stderr; the interpreter's path is the only line on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv

if [ -n "${PYTHON:-}" ]; then
    command -v "$PYTHON"
    exit 0
fi
BASE="$(command -v python3 || true)"
if [ -z "$BASE" ]; then
    echo "python_env: no python3 on PATH; install Python 3.10 or newer" >&2
    exit 1
fi
if [ -n "${VIRTUAL_ENV:-}" ] || [ -n "${CONDA_PREFIX:-}" ] \
        || "$BASE" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
    echo "$BASE"
    exit 0
fi
if [ -x "$VENV/bin/python" ]; then
    echo "$PWD/$VENV/bin/python"
    exit 0
fi
# shellcheck disable=SC2016
MANAGED="$("$BASE" -c 'import os, sysconfig; print(int(os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))))')"
HAS_TORCH=0
if "$BASE" -c "import torch" 2>/dev/null; then HAS_TORCH=1; fi
if [ "$MANAGED" = 0 ] && [ "$HAS_TORCH" = 1 ]; then
    echo "$BASE"
    exit 0
fi
VENV_ARGS=()
why="it has no torch and is not a virtual environment"
if [ "$MANAGED" = 1 ]; then why="it is externally managed (PEP 668)"; fi
if [ "$HAS_TORCH" = 1 ]; then VENV_ARGS+=(--system-site-packages); fi
echo "python_env: not installing into $BASE: $why; creating the project virtual environment $VENV" >&2
if ! "$BASE" -m venv "${VENV_ARGS[@]}" "$VENV" >&2; then
    rm -rf "$VENV"
    echo "python_env: '$BASE -m venv' failed; on Debian/Ubuntu: apt-get install python3-venv" >&2
    exit 1
fi
echo "$PWD/$VENV/bin/python"
