"""DP-aware list-schedule priorities: warm starts that hide data-parallel gradient sync.

Why: with ``--dp D`` every layer's weight gradients are synchronised over the replicas
(moegraph.autodiff._dp_sync; inter-node stages on their own stream, problem.DP_STREAM). At
mixtral-8x7b sizes one layer's sync is ~30 ms on the NIC, about as long as the layer's whole
backward compute at b=8, so the DP stream, not compute, bounds the backward. The critical-path
rule (baselines.greedy) runs weight-gradient GEMMs late (they have the shortest remaining
path), so each layer's sync becomes ready only at the end of its backward; the tiled periodic
warm start keeps every layer's sync inside its own period. Both leave the DP stream idle early
and busy after the last compute. MegaScale-MoE (§5) issues each layer's sync as soon as its
gradients exist, under the lower layers' backward.

Rules (compute key; collectives on the DP stream by layer, highest first, then graph order:
the order their gradients become ready in the backward; other collectives by remaining path):
    dp-first     compute nodes that feed a DP collective of their own layer through weight-
                 gradient work (role WGRAD: the wgrad GEMMs and their fp32 casts) first, then
                 by remaining path: each layer's sync is ready as early as its data allows.
    dp-critical  remaining path where a task's path also counts the DP work it releases in
                 its layer (sum of the fastest DP-collective ticks downstream): a longest-path
                 rule that sees the DP stream's backlog.
Each runs with collectives at their default budgets (on the fewest SMs, copy engines, the
slower DP collectives left the DP stream longer busy: 5-30% longer on every case tried).
These are warm starts only (CP-SAT keeps the shortest); they never break a dependency, the
barrier, a stream or the SM capacity (list_schedule).
"""

from __future__ import annotations

from moegraph.edges import edge_layer, is_edge
from moegraph.ir import Role
from moegraph.layers import layer_count
from moegraph.schedules.baselines import Key, bottom_levels, list_schedule
from moegraph.schedules.problem import DP_STREAM, Problem, Task
from moegraph.schedules.solution import Solution

__all__ = ["dp_warm_starts", "dp_feeders", "dp_released_ticks"]


def _is_dp(t: Task) -> bool:
    return t.kind == "comm" and bool(t.node.attr("dp", False))


def dp_feeders(problem: Problem) -> set[int]:
    """Compute tasks of role WGRAD with a DP collective of their own layer downstream (through
    tasks of that layer only)."""
    tasks = problem.tasks
    feeds = [False] * len(tasks)
    for t in reversed([tasks[i] for i in problem.order]):
        feeds[t.index] = any((_is_dp(tasks[s]) or feeds[s]) and tasks[s].node.layer == t.node.layer for s in t.succs)
    return {t.index for t in tasks if feeds[t.index] and t.kind == "compute" and t.node.role is Role.WGRAD}


def dp_released_ticks(problem: Problem) -> list[int]:
    """Per task, the fastest ticks of the DP collectives of its own layer downstream of it."""
    tasks = problem.tasks
    below: list[set[int]] = [set() for _ in tasks]
    for t in reversed([tasks[i] for i in problem.order]):
        for s in t.succs:
            if tasks[s].node.layer == t.node.layer:
                below[t.index] |= below[s] | ({s} if _is_dp(tasks[s]) else set())
    return [sum(tasks[i].min_ticks for i in below[t.index]) for t in tasks]


def dp_warm_starts(problem: Problem, budget: int | None = None) -> list[Solution]:
    """The rules of the module doc, as list schedules (none without DP collectives; under a
    memory budget the memory-checked list schedule, left out where it fails)."""
    if not any(_is_dp(t) for t in problem.tasks):
        return []
    level = bottom_levels(problem)
    boosted = [a + b for a, b in zip(level, dp_released_ticks(problem))]
    feeders = dp_feeders(problem)
    # the DP stream in reverse layer order (the order the backward makes its gradients); other
    # streams, which carry the backward's own collectives too, by remaining path
    # the model's edges by the layer they sit beside (moegraph.edges.edge_layer): the head and norm
    # sync with the last layer, ahead of its own (their partials exist before any layer's
    # backward), the embedding gather with layer 0
    L = layer_count(problem.graph)

    def position(t: Task) -> tuple[int, int]:
        if is_edge(dict(t.node.attrs)):
            return edge_layer(t.node, L), 1
        return t.node.layer or 0, 0
    comm: Key = lambda t: ((*(-p for p in position(t)), t.index) if t.stream == DP_STREAM  # noqa: E731
                           else (-level[t.index], t.index, 0))
    rules: list[tuple[str, Key]] = [
        ("dp-first", lambda t: (t.index not in feeders, -level[t.index], t.index)),
        ("dp-critical", lambda t: (-boosted[t.index], t.index)),
    ]
    out = []
    for name, compute in rules:
        sol = list_schedule(problem, name + ("+mem" if budget is not None else ""), comm_key=comm,
                            compute_key=compute, memory_budget=budget)
        if sol is not None:
            out.append(sol)
    return out

