#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv, installs sparta, runs the demo or the tests.
#   bash dev.sh demo    # the main demo (CPU when no GPU is present)
#   bash dev.sh test    # the test suite
set -euo pipefail
cd "$(dirname "$0")"
VENV=${SPARTA_VENV:-.venv}
PY=${PYTHON:-python3}

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        "$PY" -m venv "$VENV"
    fi
    local pip="$VENV/bin/python -m pip"
    $pip install -q --upgrade pip
    # torch first, pinned to the release this project is tested with (a CPU wheel where one is on disk)
    "$VENV/bin/python" -c "import torch" 2>/dev/null || $pip install -q "torch==${SPARTA_TORCH:-2.13.0}"
    $pip install -q -e ".[dev]"
}

case "${1:-}" in
    demo)
        setup
        shift
        exec "$VENV/bin/python" examples/demo.py "$@"
        ;;
    test)
        setup
        shift
        set +e
        "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
        rc=$?
        # exit 5: no tests collected -- that is a failure, not a pass
        [ "$rc" -eq 5 ] && { echo "pytest collected no tests" >&2; exit 1; }
        exit "$rc"
        ;;
    *)
        echo "usage: bash dev.sh demo|test [args]" >&2
        exit 2
        ;;
esac
