#!/usr/bin/env bash
# Run the whole test suite: the documentation build, single-process tests, then the multi-rank
# tests under mpiexec at 2 and 4 ranks (real gloo process groups; 4 ranks oversubscribe a 2-core
# machine on purpose). Every stage runs even when an earlier one failed (a failure in one stage says
# nothing about the others), a summary of each stage's result closes the output, and the script
# exits non-zero if any stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$(./scripts/python_env.sh)}"
BIN_DIR="$("$PYTHON" -c 'import os, sys; print(os.path.dirname(sys.executable))')" || exit 1
MPIEXEC="${MPIEXEC:-}"
if [ -z "$MPIEXEC" ]; then
    if [ -x "$BIN_DIR/mpiexec" ]; then MPIEXEC="$BIN_DIR/mpiexec"; else MPIEXEC="$(command -v mpiexec)"; fi
fi
export OMP_NUM_THREADS=1
# a hung multi-rank run fails instead of blocking CI forever
export MPIEXEC_TIMEOUT="${MPIEXEC_TIMEOUT:-900}"

LOG_DIR="$(mktemp -d)"
SUMMARY=()
FAILED=0

# stage NAME COMMAND...: run one stage with its output shown as it comes and kept in a log, and
# record its result with its last line of pytest's closing summary ("N passed in ...").
stage() {
    local name="$1" log
    shift
    log="$LOG_DIR/${#SUMMARY[@]}.log"
    echo "== $name"
    "$@" 2>&1 | tee "$log"
    local rc="${PIPESTATUS[0]}"
    local closing
    closing="$(grep -E ' (passed|failed|errors?|skipped|no tests ran)\b.* in [0-9.]+s' "$log" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')"
    if [ "$rc" -eq 0 ]; then
        SUMMARY+=("ok      $name${closing:+: $closing}")
    else
        SUMMARY+=("FAILED  $name (exit $rc)${closing:+: $closing}")
        FAILED=1
    fi
}

# mkdocs --strict fails on any warning; --quiet would also hide the warnings that make it fail, so
# the build shows them
SITE_DIR="$LOG_DIR/site"
NO_MKDOCS_2_WARNING=1 stage "documentation (mkdocs --strict: any warning fails)" \
    "$PYTHON" -m mkdocs build --strict -d "$SITE_DIR"
# tests/unit/test_docs_render.py scans this build instead of building the site a second time
if [ -f "$SITE_DIR/index.html" ]; then export DIST_CKPT_DOCS_SITE="$SITE_DIR"; fi

stage "single-process tests" "$PYTHON" -m pytest tests/unit -q -p no:cacheprovider "$@"

for n in 2 4; do
    stage "multi-rank tests at $n ranks" \
        "$MPIEXEC" -n "$n" "$PYTHON" -m pytest tests/distributed --with-mpi -q -p no:cacheprovider "$@"
done

echo "== summary"
printf '%s\n' "${SUMMARY[@]}"
rm -rf "$LOG_DIR"
exit "$FAILED"
