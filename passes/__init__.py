"""Graph -> graph rewrites of one MoE layer, and the pass manager that runs them.

    from moegraph.passes import run_pipeline
    graph, report = run_pipeline(graph, "sar=paper,gate-reorder,dispatch=auto,chunk=auto", cost=cost)

Passes (each a function Graph -> PassResult, built from its argument and the cost model):
    gate-reorder[=before-fc2|after-fc2]   strategy.py  routing weights before/after FC2
    dispatch[=auto|a2a|ag-rs]             strategy.py  token dispatch, chosen on predicted time
    chunk[=auto|N]                        strategy.py  token chunks for comm/compute overlap
    compress=dp-bf16|tp-fp8               compress.py  cast-once all-to-all reductions
    sar[=paper|none|budget:<bytes>]       sar.py       selective activation rematerialization
    fuse[=auto|all|none]                  fuse.py      tile-level fused comm+compute kernels (variants)

A whole typed ``moegraph.ir.Strategy`` becomes its graph with ``lower_strategy`` (what tune
does, and run --schedule FILE with the file's strategy), or a graph lowered for it is rewritten
with ``rewrite_as`` (``passes_for``: the typed passes): no pipeline string in between. The
run order is fixed by each pass's stage (manager.py has the table); docs/passes.md describes
each pass, its invariant and its report.
"""

from moegraph.passes.manager import (PASSES, Pass, PassError, PassResult, PassSpec, parse_pipeline, run_passes,
                                     run_pipeline)
from moegraph.passes.strategy import chunk, dispatch, gate_reorder, lower_strategy, passes_for, rewrite_as
from moegraph.passes.compress import compress
from moegraph.passes.sar import KeepSearchTimeout, remat_pass, sar
from moegraph.passes.fuse import fuse

__all__ = ["run_pipeline", "parse_pipeline", "PassError", "PassResult", "PassSpec", "Pass", "PASSES",
           "sar", "remat_pass", "KeepSearchTimeout", "gate_reorder", "dispatch", "chunk", "compress", "fuse",
           "lower_strategy", "passes_for", "rewrite_as", "run_passes"]
