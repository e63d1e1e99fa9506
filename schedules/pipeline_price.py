"""Op-level prices of the stage-level schedule's work units (the lower level of the hierarchy).

A pipeline stage runs, per micro-batch, F (its forward), I (the input-gradient backward: what the
previous stage waits for) and W (the weight-gradient GEMMs, which zero-bubble schedules delay),
or B = I and W together; a rank may run one stage's F beside another stage's B as one
overlapped F&B pair (DualPipe, Megatron-Core's EP overlap). Each is priced here by the op-level
scheduler (``moegraph.schedules.compile_graph``, CP-SAT or a list schedule) on the part of a
layer graph it covers, so comm/compute overlap inside the unit is what the op-level schedule
finds; the stage-level schedule (moegraph.schedules.pipeline) then orders the units. Cut points:

    F     the layer's forward nodes
    B     its backward and recompute nodes, without the gradient synchronisation of the step's
          end (moegraph.microbatch's sync chains: they run once per step, on the summed gradient)
    I     B without the weight-gradient nodes (role WGRAD): what the data gradient needs
    W     the weight-gradient nodes alone (the embedding's: its per-micro-batch gradient gather)
    pair  micro-batch 1's forward beside micro-batch 0's B (``pair_graph``: the merged graph's
          layout, each micro-batch's barrier), less its sync: the op-level merged schedule
    sync  the sync chains of the step's end
    gather  their all-gather half alone (the distributed optimizer's parameter all-gather, which
          Megatron overlaps with the next step's forward: ``--overlap-param-gather``)
    held  bytes the forward leaves for the backward (``Graph.activation_bytes``) and, of them,
          what W still reads after I (freed only when W ends)

A stage is the sum of its units (``StagePrice``): layers priced one at a time compose at layer
boundaries without overlap across them (the op-level schedule of a whole stage could hide a
little more); a pair of stages with k_a and k_b layers saves the smaller of their savings
(F + B - pair per layer, summed over the stage).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from moegraph.cost import CostModel
from moegraph.edges import EDGE_ATTR, EMBED_ATTR
from moegraph.ir import Graph, Node, OpKind, Phase, Role, ValueKind
from moegraph.passes.microbatch import _sync_chains, pair_graph
from moegraph.passes.stages import subgraph
from moegraph.schedules.api import compile_graph

__all__ = ["UnitPrice", "price_layer", "price_edges", "EdgePrices", "ZERO"]


@dataclass(frozen=True)
class UnitPrice:
    """One layer's (or edge's) per-micro-batch work, microseconds and bytes (module docstring)."""

    f_us: float
    i_us: float
    w_us: float
    b_us: float
    pair_saving_us: float
    sync_us: float
    held_bytes: int
    held_for_w_bytes: int
    gather_us: float = 0.0

    def __add__(self, o: "UnitPrice") -> "UnitPrice":
        return UnitPrice(*(a + b for a, b in zip(self.astuple(), o.astuple())))

    def astuple(self) -> tuple:
        return (self.f_us, self.i_us, self.w_us, self.b_us, self.pair_saving_us, self.sync_us, self.held_bytes,
                self.held_for_w_bytes, self.gather_us)


ZERO = UnitPrice(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, 0.0)

Pricer = Callable[[Graph], float]


def op_level(cost: CostModel, method: str, time_limit_s: float) -> Pricer:
    """The makespan (us) of a (sub)graph's op-level schedule by ``method`` (compile_graph's)."""
    def price(graph: Graph) -> float:
        if not graph.nodes:
            return 0.0
        return float(compile_graph(graph, cost, method=method, time_limit_s=time_limit_s).schedule.summary["makespan_us"])
    return price


def _sync_names(graph: Graph) -> set[str]:
    """The step-end gradient synchronisation: the layers' sync chains (moegraph.microbatch), and
    the edges' (their partial gradients are no graph parameter's): weight-gradient collectives,
    casts and bucket views reading only parameter gradients."""
    names = {n.name for _, chain in _sync_chains(graph).values() for n in chain}
    for n in graph.nodes:
        if (n.role is Role.WGRAD and (n.is_comm or n.op in (OpKind.CAST, OpKind.SPLIT)) and n.inputs
                and all(graph.value[v].kind is ValueKind.PARAM_GRAD for v in n.inputs)):
            names.add(n.name)
    return names


def _held_for_w(graph: Graph, nodes: Iterable[Node], held: Iterable[str]) -> int:
    """Bytes of the ``held`` values that weight-gradient compute among ``nodes`` reads."""
    read = {graph.base_of(v) for n in nodes if n.role is Role.WGRAD and not n.is_comm for v in n.inputs}
    return sum(graph.value[v].storage_bytes for v in read & set(held))


def _units(graph: Graph, part: Sequence[Node], price: Pricer) -> tuple[float, float, float, float, float, float]:
    """(F, I, W, B, sync, gather) makespans of the nodes ``part`` of ``graph``."""
    sync = _sync_names(graph)
    fwd = [n for n in part if n.phase is Phase.FORWARD]
    back = [n for n in part if n.phase is not Phase.FORWARD and n.name not in sync]
    wgrad = [n for n in back if n.role is Role.WGRAD]
    data = [n for n in back if n not in wgrad]
    syncs = [n for n in part if n.name in sync]

    def ms(nodes: list[Node], tag: str) -> float:
        return price(subgraph(graph, nodes, f"{graph.name}.{tag}")) if nodes else 0.0
    gathers = [n for n in syncs if n.op is OpKind.ALL_GATHER]
    return ms(fwd, "F"), ms(data, "I"), ms(wgrad, "W"), ms(back, "B"), ms(syncs, "sync"), ms(gathers, "gather")


def steady_pair(graph: Graph) -> Graph:
    """One layer's F&B pair (``pair_graph``: micro-batch 1's forward beside micro-batch 0's
    backward) less the step-end sync, which runs once per step: the pipeline's steady-state unit."""
    pair = pair_graph(graph)
    sync = _sync_names(pair)
    return subgraph(pair, [n for n in pair.nodes if n.name not in sync], pair.name)


def price_layer(graph: Graph, cost: CostModel, *, method: str = "greedy", time_limit_s: float = 2.0) -> UnitPrice:
    """The units of one layer graph (passes applied; not merged), priced by the op-level
    schedule ``method`` with CP-SAT effort ``time_limit_s`` (module docstring)."""
    price = op_level(cost, method, time_limit_s)
    f, i, w, b, sync, gather = _units(graph, graph.nodes, price)
    together = price(steady_pair(graph))
    return UnitPrice(f, i, w, b, max(0.0, f + b - together), sync, graph.activation_bytes(),
                     _held_for_w(graph, graph.nodes, graph.saved), gather)


@dataclass(frozen=True)
class EdgePrices:
    """The embedding's units (first stage) and the final norm's and head's (last stage)."""

    embedding: UnitPrice
    head: UnitPrice


def price_edges(step: Graph, cost: CostModel, *, method: str = "greedy", time_limit_s: float = 2.0) -> EdgePrices:
    """The edges' units from a model step graph (a stack with ``moegraph.edges``; one micro-batch):
    the head's F, I, W from its eager nodes, its held bytes the values its backward reads
    (``moegraph.memory.edge_held_values``); the embedding's gradient gather or scatter as
    its W. Edges pair with nothing (no saving)."""
    from moegraph.memory import edge_held_values
    if not any(n.attr(EDGE_ATTR, False) for n in step.nodes):
        raise ValueError(f"graph {step.name!r} has no edges: price a model step graph (moegraph.edges.add_edges)")
    price = op_level(cost, method, time_limit_s)
    out = []
    for embed in (True, False):
        part = [n for n in step.nodes if n.attr(EDGE_ATTR, False) and bool(n.attr(EMBED_ATTR, False)) == embed]
        f, i, w, b, sync, gather = _units(step, part, price)
        held = frozenset() if embed else edge_held_values(step)
        out.append(UnitPrice(f, i, w, b, 0.0, sync, sum(step.value[v].storage_bytes for v in held),
                             _held_for_w(step, part, held), gather))
    return EdgePrices(*out)


def ticks(us: float, tick_us: float) -> int:
    """Whole ticks covering ``us`` (rounded up, so a tick schedule never undercuts the cost model)."""
    return int(math.ceil(us / tick_us - 1e-9)) if us > 0 else 0
