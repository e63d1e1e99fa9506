#!/usr/bin/env bash
# The test command: set-up from scratch (venv, pinned installs), then the whole suite (CI runs this).
# Extra arguments go to pytest: `bash scripts/test.sh -m "not slow"` is the fast tier (docs/testing.md).
#
# The suite runs as two pytest processes side by side, one torch thread each (tests/sharding.py:
# whole files, balanced by tests/shard_weights.json), sharing one test seed; each one's output is
# printed when both are done, and the command fails if either does. MOEGRAPH_TEST_SHARDS=1 runs
# one process instead.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
shards=${MOEGRAPH_TEST_SHARDS:-2}
if [ "$shards" = 1 ]; then
    exec .venv/bin/python -m pytest "$@"
fi
if [ "$shards" != 2 ]; then
    echo "scripts/test.sh: MOEGRAPH_TEST_SHARDS=$shards: 1 or 2" >&2
    exit 2
fi
export MOEGRAPH_TEST_SEED=${MOEGRAPH_TEST_SEED:-$(.venv/bin/python -c "import random; print(random.randrange(1, 2**31))")}
export MOEGRAPH_TEST_THREADS=1
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
.venv/bin/python -m pytest --shard 0/2 "$@" >"$logs/0" 2>&1 & p0=$!
.venv/bin/python -m pytest --shard 1/2 "$@" >"$logs/1" 2>&1 & p1=$!
rc0=0; wait "$p0" || rc0=$?
rc1=0; wait "$p1" || rc1=$?
for k in 0 1; do
    echo "===== shard $k/2 (MOEGRAPH_TEST_SEED=$MOEGRAPH_TEST_SEED) ====="
    cat "$logs/$k"
done
# 5: a shard that the arguments left without tests (the other one ran them)
if [ "$rc0" = 5 ] && [ "$rc1" = 5 ]; then exit 5; fi
[ "$rc0" = 5 ] && rc0=0
[ "$rc1" = 5 ] && rc1=0
echo "===== shards: exit $rc0 and $rc1 ====="
[ "$rc0" = 0 ] && [ "$rc1" = 0 ]
