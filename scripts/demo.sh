#!/usr/bin/env bash
# The main job on the built-in default: trace and compile the Mixtral-8x7B layer, show its schedule.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/moegraph demo "$@"
