"""Schedule-free time estimates the strategy passes compare candidates with.

Both price every node with ``CostModel.node_time_us`` (collectives at their default SM budget)
and neither is the CP-SAT schedule (schedules/): they only have to rank candidates.

serial_time_us   sum of every node's time, forward + backward (+ recompute): what the layer
                 costs when nothing overlaps. ``dispatch=auto`` uses it: the two dispatch
                 modes differ in bytes sent and in router/permute work, not in how much of it
                 can hide behind compute.
overlap_time_us  makespan of a greedy list schedule on two in-order streams, one for compute
                 and one for communication: each step starts, among the nodes whose inputs are
                 ready, the one that can start earliest (ties: graph order). ``chunk=auto``
                 uses it, since chunking pays only through overlap (chunk j's collective beside
                 chunk j+1's GEMMs) and costs a fixed per-kernel and per-collective latency
                 for every extra node (MoNTA's trade-off). It ignores the compute slowdown of
                 SMs held by collectives, so it flatters overlap a little.
"""

from __future__ import annotations

from moegraph.cost import CostModel
from moegraph.ir import Graph


def serial_time_us(graph: Graph, cost: CostModel) -> float:
    """Sum of node times (us): the layer's forward and backward with no overlap."""
    return sum(cost.node_time_us(n) for n in graph.nodes)


def overlap_time_us(graph: Graph, cost: CostModel) -> float:
    """Makespan (us) of a greedy two-stream (compute, comm) list schedule of the whole graph."""
    nodes = graph.nodes
    index = {n.name: i for i, n in enumerate(nodes)}
    preds = [sorted({index[p.name] for p in graph.predecessors(n)}) for n in nodes]
    succs: list[list[int]] = [[] for _ in nodes]
    for i, ps in enumerate(preds):
        for p in ps:
            succs[p].append(i)
    waiting = [len(ps) for ps in preds]
    ready_at = [0.0] * len(nodes)               # when all inputs of node i are produced
    free = {False: 0.0, True: 0.0}              # stream (is_comm) -> when it is next idle
    ready = {i for i, w in enumerate(waiting) if w == 0}
    makespan = 0.0
    while ready:
        i = min(ready, key=lambda j: (max(ready_at[j], free[nodes[j].is_comm]), j))
        ready.remove(i)
        node = nodes[i]
        end = max(ready_at[i], free[node.is_comm]) + cost.node_time_us(node)
        free[node.is_comm] = end
        makespan = max(makespan, end)
        for s in succs[i]:
            ready_at[s] = max(ready_at[s], end)
            waiting[s] -= 1
            if waiting[s] == 0:
                ready.add(s)
    return makespan
