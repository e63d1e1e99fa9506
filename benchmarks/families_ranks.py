"""Today's transformers families through ``moegraph.compile`` on 2 or 4 gloo ranks (issue 12, item 3).

Every attn x ffn x dispatch each family allows, all cases in ONE spawn (one process group),
checked against the eager module (fp32, 1e-5 relative: output, input gradient, every parameter
gradient) on every rank. Families (tests/runtime_workers.py): Qwen2MoeDecoderLayer,
OlmoeDecoderLayer, DeepseekV3DecoderLayer and its dense first layer (no router: ffn ep is a
replicated MLP, so only dispatch ag-rs is listed). A benchmark, not a test: on the shared 2-core
machine the spawn takes about 30 s, over the budget of one test (tests/test_families.py checks
one case per family on two ranks). Exit status 1 if any case misses the tolerance.

    .venv/bin/python benchmarks/families_ranks.py            # 4 ranks
    .venv/bin/python benchmarks/families_ranks.py --n 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import runtime_workers as workers  # noqa: E402

from moegraph.runtime.launch import spawn  # noqa: E402

TOL = 1e-5
CASES = workers.FAMILY_CASES


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4, choices=(2, 4), help="gloo ranks (default %(default)s)")
    N = p.parse_args(argv).n
    seed = int.from_bytes(os.urandom(3), "little")
    t0 = time.perf_counter()
    per_rank = spawn(workers.check_cases, N, args=(CASES, seed), timeout_s=600)
    wall = time.perf_counter() - t0
    print(f"{len(CASES)} cases on {N} gloo ranks, seed {seed}, one spawn: {wall:.1f} s wall, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| family | attn | ffn | dispatch | max rel err output | max rel err grads | s (rank 0) |")
    print("|---|---|---|---|---:|---:|---:|")
    bad = 0
    for i, case in enumerate(CASES):
        out = max(r[i]["max_rel_err_output"] for r in per_rank)
        grads = max(r[i]["max_rel_err_grads"] for r in per_rank)
        bad += not (out < TOL and grads < TOL)
        print(f"| {case['model']} | {case['attn']} | {case['ffn']} | {case['dispatch']} | {out:.2e} | {grads:.2e} "
              f"| {per_rank[0][i]['seconds']:.2f} |")
    print(f"{len(CASES) - bad}/{len(CASES)} cases within {TOL:g} on every rank")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
