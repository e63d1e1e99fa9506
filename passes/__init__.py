"""Graph -> graph rewrites and the pass manager that runs them.

    from moegraph.passes import run_pipeline
    graph, report = run_pipeline(graph, (GateReorder(), Sar("paper")), cost=cost)   # or "gate-reorder,sar=paper"

The user's passes (each a function Graph -> PassResult, built from its typed step in
``moegraph.pass_steps`` and the cost model), scope: one decoder layer:
    gate-reorder[=before-fc2|after-fc2]   strategy.py  routing weights before/after FC2
    dispatch[=auto|a2a|ag-rs]             strategy.py  token dispatch, chosen on predicted time
    chunk[=auto|N]                        strategy.py  token chunks for comm/compute overlap
    compress=dp-bf16|tp-fp8               compress.py  cast-once all-to-all reductions
    sar[=paper|none|budget:<bytes>]       sar.py       selective activation rematerialization
    fuse[=auto|all|none]                  fuse.py      tile-level fused comm+compute kernels (variants)
The model-level rewrites the driver adds from ``CompileConfig``, scope: the whole step graph:
    StackLayers(L)                        stack.py     L identical layers, chained
    MergeMicroBatches(M)                  microbatch.py  M micro-batches, gradients accumulated
    AddEdges(V)                           edges.py     a causal LM's embedding, norm, head and their syncs
    SplitStages(layout)                   stages.py    the pipeline's stages, with P2P nodes at their boundaries

A graph lowered for a whole typed ``moegraph.ir.Strategy`` (``lowering_strategy``) is rewritten
as it records with ``rewrite_as`` (``passes_for``: the typed passes), no pipeline string in
between: how the driver rebuilds a schedule file's graph (``CompileConfig(passes=RECORDED)``). The run order is fixed by each
pass's stage (manager.py has the table); docs/passes.md describes each pass, its invariant and
its report.
"""

from moegraph.pass_steps import PassError
from moegraph.passes.manager import (MODEL_PASSES, PASSES, BuiltPass, Pass, PassResult, PassSpec, Scope, build_pass,
                                     run_passes, run_pipeline, staged)
from moegraph.passes.stack import StackLayers, stack_layers
from moegraph.passes.strategy import chunk, dispatch, gate_reorder, lowering_strategy, passes_for, rewrite_as
from moegraph.passes.compress import compress
from moegraph.passes.sar import KeepSearchTimeout, remat_pass, sar
from moegraph.passes.fuse import fuse
from moegraph.passes.microbatch import MergeMicroBatches, merge_microbatches
from moegraph.passes.edges import AddEdges, add_edges
from moegraph.passes.stages import SplitStages, split_stages

__all__ = ["run_pipeline", "run_passes", "staged", "build_pass", "PassError", "PassResult", "PassSpec", "BuiltPass",
           "Pass", "Scope", "PASSES", "MODEL_PASSES", "sar", "remat_pass", "KeepSearchTimeout", "gate_reorder",
           "dispatch", "chunk", "compress", "fuse", "lowering_strategy", "passes_for", "rewrite_as", "StackLayers",
           "stack_layers", "MergeMicroBatches", "merge_microbatches", "AddEdges", "add_edges",
           "SplitStages", "split_stages"]
