#!/usr/bin/env bash
# Install dist_ckpt, editable, with the extras DIST_CKPT_EXTRAS names (default: every optional
# backend, the test tools and the docs toolchain, "all,test,docs"; empty: the library alone, which
# is what `make demo` installs) into the Python that scripts/python_env.sh picks (or $PYTHON): an
# active venv, a Python that has torch and is not externally managed, or else the project venv .venv.
#
# The editable install uses setuptools' "compat" mode (a path entry): type checkers such as mypy
# follow it, whereas they cannot see through the default mode's import hook, so `import dist_ckpt`
# in a user's script would type-check as missing.
#
# torch is installed first, and only if it is missing: an unpinned "torch" requirement on a
# machine without torch pulls several GB of CUDA packages, and a user who already has torch
# keeps theirs. Override the torch requirement (e.g. a CUDA build) with DIST_CKPT_TORCH_SPEC
# and extra pip arguments for it with DIST_CKPT_TORCH_PIP_ARGS
# (e.g. "--index-url https://download.pytorch.org/whl/cpu").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$(./scripts/python_env.sh)}"
TORCH_SPEC="${DIST_CKPT_TORCH_SPEC:-torch==2.13.0}"
EXTRAS="${DIST_CKPT_EXTRAS-all,test,docs}"

if "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "install: keeping the installed torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
else
    echo "install: torch is missing; installing $TORCH_SPEC"
    # shellcheck disable=SC2086
    "$PYTHON" -m pip install --disable-pip-version-check ${DIST_CKPT_TORCH_PIP_ARGS:-} "$TORCH_SPEC"
fi
"$PYTHON" -m pip install --disable-pip-version-check --config-settings editable_mode=compat -e ".${EXTRAS:+[$EXTRAS]}"
