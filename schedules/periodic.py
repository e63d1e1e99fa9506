"""Periodic warm starts for stacked layers: a unit of K layers' schedule tiled across L layers.

A multi-layer graph (``moegraph.layers.stack_layers``) is L copies of one layer graph: layer
i's node ``l{i}.<name>`` is the layer graph's ``<name>``, costed identically. CP-SAT gets
nowhere on the whole (2,144 nodes for 32 mixtral layers: it returned the megascale list
schedule, 223,268 us on h800), yet one layer (67 nodes) solves to optimality in seconds, and
two layers (where a layer's tail can overlap the next one's head) near-optimally. So the
schedule of a unit of K layers (the one-layer graph, or ``stack_layers`` of it), with forward
span F (its barrier) and backward span B, is repeated L / K times; layer i = q K + u runs as
the unit's layer u in period q:

    forward:   start = s + q * F                              (period 0 first)
    backward:  start = s + (L/K - 1) * F + (L/K - 1 - q) * B  (last period first; s >= F)

Feasible by construction: period q's forward occupies the window [q F, (q+1) F) and its
backward [(L/K) F + (L/K-1-q) B, (L/K) F + (L/K-q) B), so no two periods share a stream, an SM
or an instant (half-open intervals), and every collective overlaps exactly the compute it
overlapped in the unit's schedule (the alone/beside rule is unchanged). The only edges between
periods go from a period's last layer's output to the next period's forward and from a
period's first layer's input gradient to the previous period's backward; both hold because a
window starts where the window it depends on ends. Every backward window starts at (L/K) F,
after every forward node (the barrier). ``check_solution`` re-checks the result; the memory
budget is not considered (the caller compares each candidate's peak with it, as for every
warm start).

A model step's edges (``moegraph.edges``: nodes with attr ``edge``, no layer) take a window of
their own: the eager norm and head compute runs one node after another between the last
forward window and the first backward window (its forward nodes, then its backward ones, which
make the layers' seed), each at full SMs; the edges' collectives run after the last backward
window, one after another, each alone. CP-SAT then moves them under the layers' backward.

Makespan (L/K) (F + B) (plus the edges' windows). These are warm starts: CP-SAT then searches from the best
(stage 2 of ``cpsat.solve``), never ending worse.
"""

from __future__ import annotations

from moegraph.edges import EDGE_ATTR
from moegraph.ir import Graph
from moegraph.layers import layer_count, layer_graph
from moegraph.schedules.problem import Problem, ScheduleError
from moegraph.schedules.solution import Solution, alone_twin, barrier_ticks, makespan_ticks

__all__ = ["PERIODIC", "is_stack", "tile_layers"]

PERIODIC = "periodic"
"""The warm start's name (``summary.solver.warm_start`` when it is the best one); a unit of K > 1
layers gives ``periodicxK``."""


def is_stack(graph: Graph) -> bool:
    """Whether ``graph`` holds L > 1 layers that are exactly renamed copies of its
    ``layer_graph`` (node ``l{i}.<name>`` for each layer node ``<name>`` and each i, same op,
    phase and group), so a one-layer schedule can be tiled onto it."""
    layers = layer_count(graph)
    if layers <= 1:
        return False
    one = layer_graph(graph)
    nodes = [n for n in graph.nodes if not n.attr(EDGE_ATTR, False)]     # a model's edges: own windows
    if len(nodes) != layers * len(one.nodes):
        return False
    by_name = {n.name: n for n in one.nodes}
    for node in nodes:
        i = node.layer
        prefix = f"l{i}."
        base = by_name.get(node.name[len(prefix):]) if i is not None and node.name.startswith(prefix) else None
        if base is None or (base.op, base.phase, base.group) != (node.op, node.phase, node.group):
            return False
    return True


def tile_layers(problem: Problem, unit: Problem, sol: Solution) -> Solution:
    """``sol`` (a solution of ``unit``: the one-layer graph, or a stack of K of its layers)
    repeated over the layers of ``problem``'s graph (module doc), K layers per period: layer
    i = q K + u runs as the unit's layer u in period q. Raises ScheduleError if the graph is
    not a stack of the layer (``is_stack``), L is not a multiple of K, or a node's mode in the
    unit has no twin (same SMs, alone flag and ticks) in the stacked problem."""
    graph = problem.graph
    if not is_stack(graph):
        raise ScheduleError(f"graph {graph.name!r} is not a stack of its one-layer graph: nothing to tile")
    L, K = layer_count(graph), layer_count(unit.graph)
    if L % K:
        raise ScheduleError(f"{L} layers cannot be tiled by a unit of {K}")
    periods = L // K
    fwd, span = barrier_ticks(unit, sol), makespan_ticks(unit, sol)
    bwd = span - fwd
    start, mode = [0] * len(problem.tasks), [0] * len(problem.tasks)
    edges = [t for t in problem.tasks if t.node.attr(EDGE_ATTR, False)]
    edge_compute = [t for t in edges if t.kind == "compute"]        # graph order: forward, then backward
    ef = sum(t.modes[t.default_mode].ticks for t in edge_compute if t.side == 0)
    eb = sum(t.modes[t.default_mode].ticks for t in edge_compute if t.side == 1)
    at = periods * fwd
    for t in edge_compute:                          # between the forward and the backward windows
        start[t.index], mode[t.index] = at, t.default_mode
        at += t.modes[t.default_mode].ticks
    at = periods * (fwd + bwd) + ef + eb
    for t in edges:
        if t.kind == "comm":                        # after the layers' backward, one after another, alone
            start[t.index], mode[t.index] = at, alone_twin(t, t.default_mode)
            at += t.modes[mode[t.index]].ticks
    for t in problem.tasks:
        if t.node.attr(EDGE_ATTR, False):
            continue
        i = t.node.layer
        q, u = divmod(i, K)
        base = t.name[len(f"l{i}."):]
        src = unit.by_name[f"l{u}.{base}" if K > 1 else base]
        s = sol.start[src.index]
        # period q's forward after q earlier ones; backward periods last first, after the
        # last forward ends ((periods - 1) fwd + fwd; s >= fwd for a backward node)
        start[t.index] = s + q * fwd if t.side == 0 else s + (periods - 1) * fwd + ef + eb + (periods - 1 - q) * bwd
        m = src.modes[sol.mode[src.index]]
        k = next((k for k, x in enumerate(t.modes) if (x.sm, x.alone, x.ticks) == (m.sm, m.alone, m.ticks)), None)
        if k is None:
            raise ScheduleError(f"{t.name!r} has no mode like its unit node {src.name!r}'s "
                                f"({m.sm} SMs, {m.ticks} ticks): the layers are not costed alike")
        mode[t.index] = k
    return Solution(PERIODIC if K == 1 else f"{PERIODIC}x{K}", tuple(start), tuple(mode))
