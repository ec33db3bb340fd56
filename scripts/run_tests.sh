#!/usr/bin/env bash
# Run the whole test suite: single-process tests, then the multi-rank tests under mpiexec at 2
# and 4 ranks (real gloo process groups; 4 ranks oversubscribe a 2-core machine on purpose).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$(./scripts/python_env.sh)}"
BIN_DIR="$("$PYTHON" -c 'import os, sys; print(os.path.dirname(sys.executable))')"
MPIEXEC="${MPIEXEC:-}"
if [ -z "$MPIEXEC" ]; then
    if [ -x "$BIN_DIR/mpiexec" ]; then MPIEXEC="$BIN_DIR/mpiexec"; else MPIEXEC="$(command -v mpiexec)"; fi
fi
export OMP_NUM_THREADS=1
# a hung multi-rank run fails instead of blocking CI forever
export MPIEXEC_TIMEOUT="${MPIEXEC_TIMEOUT:-900}"

echo "== documentation (mkdocs --strict: any warning fails)"
SITE_DIR="$(mktemp -d)/site"
NO_MKDOCS_2_WARNING=1 "$PYTHON" -m mkdocs build --strict --quiet -d "$SITE_DIR"
# tests/unit/test_docs_render.py scans this build instead of building the site a second time
export DIST_CKPT_DOCS_SITE="$SITE_DIR"

echo "== single-process tests"
"$PYTHON" -m pytest tests/unit -q -p no:cacheprovider "$@"

for n in 2 4; do
    echo "== multi-rank tests at $n ranks"
    "$MPIEXEC" -n "$n" "$PYTHON" -m pytest tests/distributed --with-mpi -q -p no:cacheprovider "$@"
done
