#!/usr/bin/env bash
# Downloads (HERE, with network) the wheels the GPU device machine lacks into .whl/ at the repo
# root, for `run(..., carry=[".whl"])`; docs/gpu.md. The device (python 3.12, x86-64, no network)
# has torch, numpy, pandas, protobuf, absl-py, typing-extensions, pyyaml, matplotlib, but not
# ortools nor immutabledict. protobuf travels too: ortools pins a narrow protobuf range and the
# device's version is not ours (a mismatch fails at `import ortools`), so we carry the one our
# venv runs with. transformers (pure Python) travels so GPU sessions lower the families with
# the version CI tests (the device image has its own, 5.17 on 2026-11-27), with regex: its
# import-time check wants regex>=2025.10.22 and the device's regex version is unknown.
# Versions are the ones in .venv (bash scripts/setup.sh). Every non-extra Requires-Dist of every
# wheel must be carried or on the device, and satisfied by the device's version where that is
# known (DEVICE_VERSIONS), else this fails naming it. Prints the total size (the tree that
# travels is capped at 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "gpu_wheels: no .venv here: run bash scripts/setup.sh first" >&2; exit 2; }

CARRY=(ortools immutabledict protobuf transformers regex)
# on the device image (/work/.library/device/KINDS.md, "Python packages already there")
DEVICE_HAS=(absl-py numpy pandas protobuf typing-extensions typing_extensions pyyaml matplotlib python-dateutil six
            huggingface-hub tokenizers safetensors tqdm packaging filelock typer)
# the device's versions where KINDS.md's pip list gives them (2026-11)
DEVICE_VERSIONS="huggingface-hub==1.33.0 tokenizers==0.23.2 safetensors==0.8.0"

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"

specs=()
for name in "${CARRY[@]}"; do
    version=$("$PY" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
    [ -n "$version" ] || { echo "gpu_wheels: $name is not installed in .venv" >&2; exit 1; }
    specs+=("$name==$version")
done

mkdir -p .whl
rm -f .whl/*.whl                      # one version of each: two stop the device's install
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "${specs[@]}"

# every requirement of every wheel: carried, or on the device
carried=$(for w in .whl/*.whl; do basename "$w" | cut -d- -f1 | tr '_A-Z' '-a-z'; done)
missing=()
for w in .whl/*.whl; do
    while read -r req; do
        name=$(echo "$req" | sed -E 's/^Requires-Dist: *([A-Za-z0-9_.-]+).*/\1/' | tr '_A-Z' '-a-z')
        if ! grep -qxF "$name" <<<"$carried" && ! printf '%s\n' "${DEVICE_HAS[@]}" | tr '_A-Z' '-a-z' | grep -qxF "$name"; then
            missing+=("$name (needed by $(basename "$w"))")
        fi
    done < <(unzip -p "$w" '*.dist-info/METADATA' | grep '^Requires-Dist:' | grep -v 'extra ==' || true)
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "gpu_wheels: neither carried nor on the device: ${missing[*]}" >&2
    exit 1
fi
# every requirement on a package whose device version is known: that version satisfies it
for w in .whl/*.whl; do
    reqs=$(unzip -p "$w" '*.dist-info/METADATA' | grep '^Requires-Dist:' | grep -v 'extra ==' || true)
    printf '%s\n' "$reqs" | "$PY" -c '
import sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
device = dict(p.split("==") for p in sys.argv[2].split())
bad = []
for line in filter(str.strip, sys.stdin):
    req = Requirement(line.split(":", 1)[1].strip())
    have = device.get(canonicalize_name(req.name))
    if have is not None and not req.specifier.contains(have, prereleases=True):
        bad.append(f"{req} (the device has {have}; needed by {sys.argv[1]})")
if bad:
    sys.exit("gpu_wheels: the device version does not fit: " + "; ".join(bad))
' "$(basename "$w")" "$DEVICE_VERSIONS"
done
ls -l .whl/*.whl | awk '{printf "%10d  %s\n", $5, $9}'
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "gpu_wheels: $(ls .whl/*.whl | wc -l) wheels, $((total / 1024)) KiB in .whl/ (limit of the travelling tree: 64 MiB)"
