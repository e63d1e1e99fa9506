#!/usr/bin/env bash
# A GPU session, run ON THE DEVICE from the repo root (docs/gpu.md). The default path is one call:
#     bash scripts/gpu_session.sh [all]         # ~133 s on an H200 (2026-11-27); limits sum to 575 s
# within a session's 15 minutes of device time (a 1-2 minute start, then this call of at most 10).
# One part alone (a rerun after a fix, with longer limits): env|tests|bench|calibrate.
# The device is bare and offline: python3 with torch 2.11 (not our 2.13), no ortools. This installs
# the carried wheels (.whl/, made here by scripts/gpu_wheels.sh) and this repo into $SITE with
# --no-deps (torch stays the device's own), then runs the part under `timeout`, its log tee'd to
# $OUT (the device tool brings $OUT back, also after a kill). At most 8 files come back from $OUT:
# `all` writes exactly 8 (env.log tests.log gpu_layer.md gpu_layer.json gpu_overlap.md
# gpu_overlap.json calibrate.log <gpu>-<date>.yaml).
#
# PYTHONSAFEPATH=1: python must not put the repo root (cwd) on sys.path, where the folder
# moegraph/ (the core package alone, without passes/ schedules/ runtime/) would shadow the
# installed package.
set -uo pipefail
cd "$(dirname "$0")/.."

PART=${1:-all}                              # no part: the whole session
case "$PART" in
    env|tests|bench|calibrate|all) ;;
    *) echo "gpu_session.sh: unknown part '${PART}': one of env, tests, bench, calibrate, all" >&2; exit 2 ;;
esac

export PY=${PY:-python3} SITE=${SITE:-/tmp/site}
OUT=${OUT:-$PWD/out/gpu-session}           # the device tool sets OUT; elsewhere a local folder
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PYTHONDONTWRITEBYTECODE=1 MOEGRAPH_SITE="$SITE"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
STAMP=$(date -u +%Y-%m-%d)

# per-part limits (seconds): hang guards, not estimates. The limits of one call's steps, the
# install's included, sum to at most 575 s of a device call's 600 (tests 60+240+240, bench
# 60+360+3x50, calibrate 60+3x(100+30); `all` 30+50+35+100+100+60+50+40+80+30, where the steps
# before the one-queue overlap run measured 4+13+37+33+14+20+12 s on the H200 in the first session
# and 6+17+69+55+23+19+33 s in the fifth: the GPU tests grew with the calibration test's layer
# graph). CAL_BUDGET (calibrate's --time-budget) may be set lower by the caller when device time
# runs short.
if [ "$PART" = all ]; then
    T_INSTALL=50 T_ENV=35 T_TESTS=200 T_LAYER=60 T_OVERLAP=50 T_OVERLAP_1Q=40 CAL_BUDGET=${CAL_BUDGET:-80}
else
    T_INSTALL=60 T_ENV=150 T_TESTS=480 T_LAYER=360 T_OVERLAP=50 T_OVERLAP_1Q=50 CAL_BUDGET=${CAL_BUDGET:-100}   # calibrate: 3 runs
fi
T_CAL=$((CAL_BUDGET + 30))

# step NAME LOG LIMIT CMD...: run CMD under timeout, stdout+stderr tee'd to $OUT/LOG
step() {
    local name=$1 logf=$2 limit=$3; shift 3
    echo "[gpu_session $(date -u +%H:%M:%S)] $name: $* (timeout ${limit}s)" | tee -a "$OUT/$logf"
    timeout --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$OUT/$logf"
    local rc=${PIPESTATUS[0]}
    echo "[gpu_session $(date -u +%H:%M:%S)] $name: rc=$rc$([ "$rc" = 124 ] && echo ' (TIMED OUT)')" | tee -a "$OUT/$logf"
    return "$rc"
}

install_repo() {
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "gpu_session.sh: no wheels in .whl/: run bash scripts/gpu_wheels.sh on the dev machine and pass carry=[\".whl\"]" >&2
        return 2
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl &&
    # the repo itself, non-editable: the package-dir mapping (passes/ -> moegraph.passes, ...) is
    # applied by the build; --no-build-isolation uses the device's setuptools (no network)
    { "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
        --target "$SITE" . ||
      { echo "install: pip could not build the repo offline; copying its packages as pyproject.toml maps them" >&2
        rm -rf "$SITE/moegraph" && "$PY" scripts/gpu_copy_install.py "$SITE"; }; }
}
export -f install_repo                     # `timeout` runs programs, not functions: bash -c install_repo

part_env() {
    step "nvidia-smi" env.log 30 nvidia-smi
    ensure_installed || return $?
    step "probe" env.log "$T_ENV" "$PY" scripts/gpu_env.py
}

part_tests() {
    local rc=0
    # -m gpu: tests/test_runtime_gpu.py (single GPU, the emulated n=2 overlap, NCCL options);
    # then the CPU-run device-mixing and emulated-collective tests, on the device's torch
    step "pytest -m gpu" tests.log "$((T_TESTS / 2))" "$PY" -m pytest tests -m gpu -q -rs -p no:cacheprovider \
        --continue-on-collection-errors -s || rc=$?
    step "pytest fake_device/emulated" tests.log "$((T_TESTS / 2))" "$PY" -m pytest tests -q -rs -p no:cacheprovider \
        --continue-on-collection-errors -k "fake_device or emulated" || rc=$?
    return $rc
}

part_bench() {
    local rc=0
    step "gpu_layer" gpu_layer.md "$T_LAYER" "$PY" benchmarks/gpu_layer.py --json "$OUT/gpu_layer.json" || rc=$?
    step "gpu_overlap" gpu_overlap.md "$T_OVERLAP" "$PY" benchmarks/gpu_overlap.py --json "$OUT/gpu_overlap.json" || rc=$?
    # one hardware queue (issue 29's launch order): the same plans issued in their start order,
    # which the launch-order model says costs them nothing; its log appended (no ninth file). Alone,
    # also the plans scheduled for one queue fed in program order (--launch-order program)
    step "gpu_overlap, one queue" gpu_overlap.md "$T_OVERLAP_1Q" env CUDA_DEVICE_MAX_CONNECTIONS=1 \
        "$PY" benchmarks/gpu_overlap.py || rc=$?
    if [ "$PART" != all ]; then
        step "gpu_overlap, one queue, program order" gpu_overlap.md "$T_OVERLAP_1Q" env CUDA_DEVICE_MAX_CONNECTIONS=1 \
            "$PY" benchmarks/gpu_overlap.py --launch-order program || rc=$?
    fi
    return $rc
}

part_calibrate() {
    local gpu i rc=0
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr 'A-Z ' 'a-z-' | tr -cd 'a-z0-9-')
    # single-GPU curves and the GPU-sized layer graph (n=1: collectives left unmeasured, from the
    # h100 base profile). In `all`, one run (the call returns at most 8 files); alone, three runs
    # that also keep their raw samples, so the profile can be refit from them and from earlier
    # sessions' (calibrate --refit; docs/calibration.md): 2 + 3 + 1 files
    if [ "$PART" = all ]; then
        step "calibrate" calibrate.log "$T_CAL" "$PY" -m moegraph calibrate --device cuda --n 1 \
            --time-budget "$CAL_BUDGET" -o "$OUT/${gpu:-cuda}-$STAMP.yaml"
        return $?
    fi
    for i in 1 2 3; do
        step "calibrate $i" calibrate.log "$T_CAL" "$PY" -m moegraph calibrate --device cuda --n 1 \
            --time-budget "$CAL_BUDGET" -o "$OUT/${gpu:-cuda}-$STAMP.yaml" \
            --samples "$OUT/${gpu:-cuda}-$STAMP-samples-$i.json" || rc=$?
    done
    return $rc
}

# every call: the device tool re-sends the working tree, and a warm machine's $SITE may hold an
# older copy of it (the wheels' part of the install is a no-op then)
ensure_installed() { step "install" env.log "$T_INSTALL" bash -c install_repo; }

rc=0
case "$PART" in
    env) part_env || rc=$? ;;
    tests) ensure_installed && part_tests || rc=$? ;;
    bench) ensure_installed && part_bench || rc=$? ;;
    calibrate) ensure_installed && part_calibrate || rc=$? ;;
    all)
        part_env || rc=$?        # installs
        part_tests || rc=$?
        part_bench || rc=$?
        part_calibrate || rc=$?
        ;;
esac
echo "[gpu_session] part $PART: rc=$rc; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $rc
