"""Two pytest processes side by side on the 2-core CI machine (scripts/test.sh): which test files
each runs.

Whole files, so that a module's fixtures are built once; every file whose tests take the shared
``rank_results`` spawn (conftest.py) goes to shard 0 together, so that the spawn runs once. The
files are balanced by their measured seconds (tests/shard_weights.json, from a whole-suite
``--durations=0`` run; a file it does not list counts DEFAULT_S), heaviest first onto the lighter
shard: deterministic, whatever the order pytest collected them in.
"""

from __future__ import annotations

import json
from pathlib import Path

WEIGHTS = Path(__file__).with_name("shard_weights.json")
DEFAULT_S = 2.0
SHARED = "rank_results"


def parse(spec: str) -> tuple[int, int]:
    """'K/N' -> (K, N); ValueError naming the spec."""
    try:
        k, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"--shard {spec!r}: expected K/N, e.g. 0/2") from None
    if not 0 <= k < n:
        raise ValueError(f"--shard {spec!r}: K must be in 0..N-1")
    return k, n


def shard_of(items: list, spec: str) -> set:
    """The items of shard K of N (``spec`` 'K/N')."""
    k, n = parse(spec)
    weights = json.loads(WEIGHTS.read_text())
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    units: dict[str, list[str]] = {}            # unit -> its files; the shared spawn's files are one unit
    for f, its in files.items():
        units.setdefault(SHARED if any(SHARED in i.fixturenames for i in its) else f, []).append(f)
    load = [0.0] * n
    owner: dict[str, int] = {}
    if SHARED in units:
        owner[SHARED] = 0
        load[0] += sum(weights.get(f, DEFAULT_S) for f in units[SHARED])
    for unit in sorted((u for u in units if u != SHARED), key=lambda u: (-sum(weights.get(f, DEFAULT_S)
                                                                               for f in units[u]), u)):
        owner[unit] = min(range(n), key=lambda s: (load[s], s))
        load[owner[unit]] += sum(weights.get(f, DEFAULT_S) for f in units[unit])
    return {i for u, fs in units.items() if owner[u] == k for f in fs for i in files[f]}


def weights_from_durations(text: str) -> dict[str, float]:
    """Seconds per test file from pytest's ``--durations=0`` report (setup, call and teardown)."""
    import re
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([\d.]+)s (?:call|setup|teardown)\s+(tests/[^:]+)::", line)
        if m:
            out[m.group(2)] = out.get(m.group(2), 0.0) + float(m.group(1))
    return {f: round(s, 1) for f, s in sorted(out.items())}


if __name__ == "__main__":          # python tests/sharding.py durations.txt: rewrite shard_weights.json
    import sys
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/sharding.py DURATIONS.txt (pytest --durations=0 output)")
    found = weights_from_durations(Path(sys.argv[1]).read_text())
    if not found:
        sys.exit(f"{sys.argv[1]}: no '--durations=0' lines (NN.NNs call tests/file.py::test)")
    WEIGHTS.write_text(json.dumps(found, indent=0) + "\n")
    print(f"{WEIGHTS}: {len(found)} files, {sum(found.values()):.0f} s")
