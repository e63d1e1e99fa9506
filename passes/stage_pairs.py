"""The overlapped F&B pair of two pipeline stages on one rank (a V-shape's turn).

Notation (moegraph.ir): b micro-batch, s sequence, h hidden, n ranks of a stage's group.

A V-shape placement puts stages k and 2P-1-k on rank k (moegraph.passes.stages): at its turn a
rank runs stage k's forward of micro-batch a beside stage 2P-1-k's backward of micro-batch m
(torch's ``OVERLAP_F_B`` of two stages; DualPipeV's overlapped chunks). ``cross_pair_graph``
is that pair as one graph, in the layout of ``pair_graph`` (moegraph.passes.microbatch: the
forward as ``mb1``, the backward, its recompute and its own gradient synchronisation included,
as ``mb0``; meta ``micro_batches`` 2, so the op-level schedule interleaves the two) except that
the two stages hold different parameters: every value of the forward stage's graph is named
``mb1.<name>``, every value of the backward stage's ``mb0.<name>``, parameters included.

Inputs: ``mb1.<x>``, ``mb0.<seed>``, the values the backward reads of its forward
(``mb0.<v>``), both stages' parameters (``mb1.<p>``, ``mb0.<p>``); outputs: ``mb1.<y>`` and the
values micro-batch a's backward will read, ``mb0.<dx>`` and the backward stage's synchronised
parameter gradients (``grads``, of its ``mb0.<p>``).
"""

from __future__ import annotations

import dataclasses

from moegraph.ir import Graph, GraphError, Phase, freeze_attrs
from moegraph.microbatch import mb_name, micro_batch_count, micro_batch_of
from moegraph.passes.microbatch import _renamed
from moegraph.passes.stages import subgraph

__all__ = ["cross_pair_graph"]


def cross_pair_graph(forward: Graph, backward: Graph) -> Graph:
    """The F&B pair of ``forward``'s forward beside ``backward``'s backward (module docstring):
    two stages' graphs (one layer or a stack each, passes applied, not merged, one strategy and
    dims); verified."""
    for g in (forward, backward):
        if micro_batch_count(g) != 1 or any(micro_batch_of(n) is not None for n in g.nodes):
            raise GraphError(f"graph {g.name!r} is a merged step graph; pair stage graphs of one micro-batch")
    if (forward.dims, forward.strategy) != (backward.dims, backward.strategy):
        raise GraphError(f"stage graphs {forward.name!r} and {backward.name!r} differ in dims or strategy: one "
                         "pair runs one shape on one group")

    def rename(j: int, name: str) -> str:
        return mb_name(j, name)

    parts = ((1, forward), (0, backward))
    values = tuple(dataclasses.replace(v, name=mb_name(j, v.name),
                                       alias_of=None if v.alias_of is None else mb_name(j, v.alias_of))
                   for j, g in parts for v in g.values)
    both = dataclasses.replace(
        forward, name=f"{forward.name}.F&{backward.name}.B", values=values,
        nodes=tuple(_renamed(n, j, rename) for j, g in parts for n in g.nodes),
        inputs=tuple(mb_name(j, v) for j, g in parts for v in g.inputs),
        outputs=tuple(mb_name(j, v) for j, g in parts for v in g.outputs),
        params=tuple((mb_name(j, p), spec) for j, g in parts for p, spec in g.params),
        saved=frozenset(mb_name(j, v) for j, g in parts for v in g.saved),
        grads=tuple((mb_name(0, p), mb_name(0, g)) for p, g in backward.grads),
        meta=freeze_attrs(dict(forward.meta) | {"micro_batches": 2, "mb_graph": forward}))
    keep = [n for n in both.nodes if (micro_batch_of(n) == 1) == (n.phase is Phase.FORWARD)]
    return subgraph(both, keep, both.name)
