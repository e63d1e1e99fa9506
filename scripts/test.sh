#!/usr/bin/env bash
# The test command: set-up from scratch (venv, pinned installs), then the whole suite (CI runs this).
# Extra arguments go to pytest: `bash scripts/test.sh -m "not slow"` is the fast tier (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
