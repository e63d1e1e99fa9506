"""Today's transformers families through ``moegraph.compile`` on 4 gloo ranks (issue 12, item 3).

Every attn x ffn x dispatch each family allows, all cases in ONE spawn (one process group),
checked against the eager module (fp32, 1e-5 relative: output, input gradient, every parameter
gradient) on every rank. Families (tests/runtime_workers.py): Qwen2MoeDecoderLayer,
OlmoeDecoderLayer, DeepseekV3DecoderLayer and its dense first layer (no router: ffn ep is a
replicated MLP, so only dispatch ag-rs is listed). A benchmark, not a test: on the shared 2-core
machine the spawn takes about 30 s, over the budget of one test (tests/test_families.py checks
two ranks). Exit status 1 if any case misses the tolerance.

    .venv/bin/python benchmarks/families_4ranks.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import runtime_workers as workers  # noqa: E402

from moegraph.runtime.launch import spawn  # noqa: E402

TOL = 1e-5
N = 4
COMBOS = [(attn, ffn, dispatch) for attn in ("tp", "sp")
          for ffn, dispatch in (("ep", "a2a"), ("ep", "ag-rs"), ("tp", "ag-rs"))]
CASES = [dict(attn=a, ffn=f, dispatch=d, model=m)
         for m in ("qwen2_moe", "olmoe", "deepseek_v3") for a, f, d in COMBOS] \
    + [dict(attn=a, ffn=f, dispatch="ag-rs", model="deepseek_v3_dense") for a in ("tp", "sp") for f in ("ep", "tp")]


def main() -> int:
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
