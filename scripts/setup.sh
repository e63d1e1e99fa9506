#!/usr/bin/env bash
# Creates .venv (if missing) and installs moegraph with pinned torch. Idempotent; the pip log
# goes to .venv/install.log and is shown only if an install fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv" >&2
    "$PY" -m venv .venv
fi
stamp=.venv/.moegraph-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "setup: installing torch==2.13.0 (CPU) and moegraph[test] into .venv" >&2
    log=.venv/install.log
    {
        .venv/bin/python -m pip install --upgrade pip &&
        # torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
        .venv/bin/python -m pip install "torch==2.13.0" &&
        .venv/bin/python -m pip install -e ".[test]"
    } >"$log" 2>&1 || { tail -n 40 "$log" >&2; echo "setup: install failed (full log: $log)" >&2; exit 1; }
    touch "$stamp"
fi
