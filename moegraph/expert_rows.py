"""The expert-row policy: when the local index map pads its rows, and what padding costs.

``expert_rows`` ('exact' | 'padded', ``moegraph.ir.ExpertRows``) is a runtime choice for the local
index maps of ffn=ep under dispatch=ag-rs (``moegraph.index_map.build_index_map``): exact maps hold
this step's R rows (R read on the host once per map), padded ones the static worst case
C = T * min(k, El). This module says which graphs the choice applies to and the memory padding adds.

Notation: T tokens, k top-k, R expert rows, El experts on this rank, C padded rows.
"""

from __future__ import annotations

import math
from fractions import Fraction

from moegraph.index_map import padded_rows
from moegraph.ir import ExpertRows, Graph, Node, OpKind, check_expert_rows


def local_index_maps(graph: Graph) -> list[Node]:
    """The graph's INDEX_MAP nodes of layout 'local' (ffn=ep under dispatch=ag-rs): the ones
    ``expert_rows`` pads."""
    return [nd for nd in graph.nodes if nd.op is OpKind.INDEX_MAP and nd.typed.layout == "local"]


def expert_rows_refusal(graph: Graph, expert_rows: ExpertRows) -> str | None:
    """Why ``expert_rows`` does not apply to this graph, or None: 'padded' pads local index maps,
    and a graph without one (ffn=tp, or dispatch=a2a) would run exactly as 'exact'."""
    if check_expert_rows(expert_rows) == "padded" and not local_index_maps(graph):
        st = graph.strategy
        return (f"expert_rows='padded' pads the local index map of ffn=ep with dispatch=ag-rs; graph {graph.name!r} "
                f"(ffn={st.ffn}, dispatch={st.dispatch}) has none: use expert_rows='exact'")
    return None


def padded_rows_extra_bytes(graph: Graph) -> int:
    """Bytes a step's routed values (expert rows, ``Value.routed``) hold beyond the graph's planning
    shapes when the local index maps are padded: each one's bytes x (C / R_expected - 1), with
    R_expected its planning rows (the balanced T*k/n) and C = T * min(k, El). Summed over every
    routed value of the step (forward, backward, recompute): an allocation volume, not a peak.
    The scheduler's memory model keeps R_expected; this is what padding adds on top. 0 without a
    local index map."""
    ratios = set()
    for nd in local_index_maps(graph):
        *lead, k = graph.value[nd.inputs[0]].shape                   # [..., k]: T tokens
        T = math.prod(lead)
        expected = graph.value[nd.outputs[0]].shape[0]
        ratios.add(Fraction(padded_rows(T, k, nd.typed.experts_per_rank), expected))
    if not ratios:
        return 0
    if len(ratios) > 1:
        raise ValueError(f"graph {graph.name!r}: local index maps pad by different ratios {sorted(map(str, ratios))}; "
                         "padded_rows_extra_bytes assumes one")
    (ratio,) = ratios
    routed = sum(v.storage_bytes for v in graph.values if v.routed)
    return int(routed * (ratio - 1))
