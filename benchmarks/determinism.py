"""Same inputs, same schedule file: compile K times on an idle machine and K times beside two busy
processes, and compare the files' bytes (issue 14's determinism acceptance for large graphs;
tests/test_determinism_load.py does the same for a small one).

    .venv/bin/python benchmarks/determinism.py [--runs 2] [--case chunk4|layers32 ...]

Prints one row per case: hashes seen idle and busy, wall seconds, and whether the wall-clock
safety cap was hit (a hit could change the answer; it is reported, never hidden).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = {
    "chunk4": ["--model", "mixtral-8x7b", "--hardware", "h800", "--passes", "gate-reorder,sar=paper,chunk=4"],
    "chunk8": ["--model", "internal-352b", "--hardware", "h20", "--passes", "gate-reorder,sar=paper,chunk=8"],
    "layers32": ["--model", "mixtral-8x7b", "--hardware", "h800", "--layers", "32"],
}


def _spin(stop) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def compile_once(case: list[str], out: Path) -> tuple[str, float, bool]:
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "moegraph", "compile", *case, "-o", str(out), "--json"],
                         capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    cap = json.loads(res.stdout)["solver"]["wall_cap_hit"]
    return hashlib.sha256(out.read_bytes()).hexdigest()[:12], wall, cap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2, help="runs idle and runs busy, each (default %(default)s)")
    ap.add_argument("--case", nargs="+", default=["chunk4"], choices=sorted(CASES))
    args = ap.parse_args()
    print(f"host {os.uname().nodename}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}\n")
    print("| case | idle hashes | busy hashes | identical | idle wall s | busy wall s | wall cap hit |")
    print("|---|---|---|---|---|---|---|")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.case:
            idle = [compile_once(CASES[name], Path(tmp) / f"{name}-idle{i}.json") for i in range(args.runs)]
            stop = ctx.Event()
            spinners = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(2)]
            for p in spinners:
                p.start()
            try:
                busy = [compile_once(CASES[name], Path(tmp) / f"{name}-busy{i}.json") for i in range(args.runs)]
            finally:
                stop.set()
                for p in spinners:
                    p.join(timeout=10)
            hashes_idle, hashes_busy = sorted({h for h, _, _ in idle}), sorted({h for h, _, _ in busy})
            print(f"| {name} | {', '.join(hashes_idle)} | {', '.join(hashes_busy)} "
                  f"| {'yes' if hashes_idle == hashes_busy and len(hashes_idle) == 1 else 'NO'} "
                  f"| {', '.join(f'{w:.0f}' for _, w, _ in idle)} | {', '.join(f'{w:.0f}' for _, w, _ in busy)} "
                  f"| {any(c for *_, c in idle + busy)} |", flush=True)


if __name__ == "__main__":
    main()
