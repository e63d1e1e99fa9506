"""Periodic warm starts for stacked layers: a unit of K layers' schedule tiled across L layers.

A multi-layer graph (``moegraph.passes.stack.stack_layers``) is L copies of one layer graph: layer
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

Mixed stacks (``moegraph.layers.LayerKinds``: GPT-OSS's sliding and full attention layers,
Llama 4's NoPE and dense layers) tile a unit whose K layers are one or two periods of the kinds'
pattern (P = ``LayerKinds.period()``, K in {P, 2P}): layer i = q K + u is then of unit layer u's
kind, so the tile is the stack's. A pattern that does not repeat within the stack (DeepSeek's
dense first layers, then MoE layers: P = L) offers no unit smaller than the stack, and CP-SAT
searches from the list schedules alone (``schedules.api``), as for any unstacked graph.

A model step's edges (``moegraph.edges``: nodes with attr ``edge``, no layer) take a window of
their own: the eager norm and head compute runs one node after another between the last
forward window and the first backward window (its forward nodes, then its backward ones, which
make the layers' seed), each at full SMs, and the forward-phase edge collectives (the router aux
loss's stats all-reduces, ``edges.aux.*``) run there too, each alone; the embedding gradient's
compute (it follows layer 0's backward) runs after the last backward window; the other edges'
collectives (and the edge compute reading them, the gradient buckets' concat) are placed one by
one, each after its inputs, at the earliest end among the gaps the tiled backward leaves on
their stream (tiled or copy-engine mode, SMs permitting) and the end of the step, alone, as the
DP-aware tiling places its tail (below). The head's gradient buckets (moegraph.edges) fit such
gaps where one long all-reduce did not; CP-SAT then searches from there.

Carried buckets (``carry``). The late edge collectives find no room in the tiled backward when
the tile runs compute alone (every SM) wherever its own collectives leave the comm stream free:
at 32 mixtral-8x7b layers on h800 the head's ten gradient buckets (387 us each) then run after
layer 0's backward, 2% of the step exposed. A carrying schedule is the unit's backward with one
such bucket added, solved by CP-SAT (the unit's backward, then the bucket after it, as its warm
start), so its compute makes room for it: one mixtral-8x7b layer's backward 3,943.5 us alone,
3,990.7 us carrying a 387 us bucket. The first backward periods to run (the buckets' inputs are
ready before any) each take the carrying schedule and one of the alike buckets
(``alike_edge_collectives``), their windows B_c long instead of B; the rest run as tiled. Still
feasible by construction: a carrying window is a schedule of the same tasks plus the bucket,
whose inputs (the head's backward) end before the first backward window.

Makespan (L/K) (F + B) (plus the edges' windows). These are warm starts: CP-SAT then searches from the best
(stage 2 of ``cpsat.solve``), never ending worse.

DP-aware tiling (``dp_slide``). With data parallelism the unit's schedule must finish its own
layers' DP gradient sync (``Problem.dp_tail``: the inter-node collectives on DP_STREAM and the
intra-node all-gathers after them) inside its period, although nothing in the step needs it
before the step's end; at mixtral-8x7b sizes with b=8 one layer's sync on the NIC is about as
long as its backward compute, so every period ends with sync exposed or compute slowed. The
DP-aware tiling takes the tail out of the tile: period q's backward window shrinks to B' (the
last end of what stays in it), and the tail tasks, with the edges' collectives, are then
placed one by one (by their tiled start, or by the earliest start their inputs allow:
``SlideOrder``; each after its inputs) at the earliest end among:
their tiled mode wherever their stream is free and the SMs beside them leave room (beside the
compute the tile slowed for them, which later periods repeat); their copy-engine mode (0 SMs,
slower, beside anything) wherever their stream is free; their alone mode after the tile ends.
So a period's sync slides under the following periods' backward on its own stream, and the
LM head's gradient sync under the layers' backward instead of after it. The kept gradients
live longer: the caller checks each candidate's peak against the budget, as for every warm
start. The plain tiling and the DP-aware one in both orders are offered (schedules.api); the
shortest warm-starts CP-SAT. Not
offered when the tail holds compute (``can_slide``: compress=dp-bf16's FP32 local sums after
the all-to-all), which the placement would have to fit into the tile's compute stream.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass
from typing import Literal

from moegraph.edges import EDGE_ATTR, EMBED_ATTR
from moegraph.ir import Graph
from moegraph.layers import layer_count, layer_kinds
from moegraph.schedules.cpsat import sub_problem
from moegraph.schedules.problem import Problem, ScheduleError, Task
from moegraph.schedules.solution import (Solution, alone_twin, barrier_ticks, makespan_ticks, settle_alone,
                                         solution_ends)

__all__ = ["PERIODIC", "SLIDE_ORDERS", "SlideOrder", "Carry", "alike_edge_collectives", "can_slide", "carrying_problem",
           "is_stack", "tile_layers", "twin_mode"]

PERIODIC = "periodic"
"""The warm start's name (``summary.solver.warm_start`` when it is the best one); a unit of K > 1
layers gives ``periodicxK``."""


def is_stack(graph: Graph) -> bool:
    """Whether ``graph`` holds L > 1 layers that are exactly renamed copies of its layer kinds'
    graphs (``layer_kinds``: node ``l{i}.<name>`` for each node ``<name>`` of layer i's kind and
    each i, same op, phase and group), so a unit's schedule can be tiled onto it."""
    layers = layer_count(graph)
    if layers <= 1:
        return False
    kinds = layer_kinds(graph)
    nodes = [n for n in graph.nodes if not n.attr(EDGE_ATTR, False)]     # a model's edges: own windows
    if len(nodes) != sum(len(kinds.graphs[k].nodes) for k in kinds.pattern):
        return False
    by_name = [{n.name: n for n in g.nodes} for g in kinds.graphs]
    for node in nodes:
        i = node.layer
        prefix = f"l{i}."
        base = (by_name[kinds.pattern[i]].get(node.name[len(prefix):])
                if i is not None and 0 <= i < layers and node.name.startswith(prefix) else None)
        if base is None or (base.op, base.phase, base.group) != (node.op, node.phase, node.group):
            return False
    return True


SlideOrder = Literal["tiled", "ready"]
"""The order in which the DP-aware tiling places the tasks it slides (``_place_late``): "tiled",
by the start the tile gives each (the edges' collectives, which have none, first); "ready", by
the earliest start its tiled start and its inputs' placed ends allow. Neither is better on
every step (tests/test_schedules_periodic.py), so both are offered (schedules.api): with the
edges' collectives first, the LM head's gradient sync takes the DP stream ahead of layer
L-1's expert syncs although it waits for its intra-node reduce-scatter on the NVLink stream,
and the NIC idles (mixtral-8x7b, h800, dp=4, b=8, 2 layers: 11 ms idle early in the backward;
"ready" makes the warm start 137,510 -> 135,816 us and CP-SAT's step 133,714 -> 131,024 us at
the default effort), while with a large vocabulary that sync first is the better bet
(benchmarks/RESULTS.md, 2026-11-24 "why CP-SAT leaves DP sync exposed")."""
SLIDE_ORDERS: tuple[SlideOrder, ...] = ("tiled", "ready")


def tile_layers(problem: Problem, unit: Problem, sol: Solution, *, dp_slide: bool = False,
                slide_order: SlideOrder = "tiled", carry: Carry | None = None) -> Solution:
    """``sol`` (a solution of ``unit``: the one-layer graph, or a stack of K of its layers)
    repeated over the layers of ``problem``'s graph (module doc), K layers per period: layer
    i = q K + u runs as the unit's layer u in period q. ``dp_slide``: the DP tail of each
    period (``Problem.dp_tail``) leaves the tile and slides into later periods' backward (module doc,
    "DP-aware tiling"). Raises ScheduleError if the graph is not a stack of the layer
    (``is_stack``), L is not a multiple of K, or a node's mode in the unit has no twin (same
    SMs, alone flag and ticks) in the stacked problem. ``slide_order`` (``SlideOrder``): the
    order the slid tasks are placed in; "tiled" names the result ``periodic+dp``, "ready"
    ``periodic+dp-ready``. ``carry`` (``Carry``; not with ``dp_slide``): the first backward
    periods to run each carry one of its alike edge collectives, on the carrying schedule of the
    unit's backward (module doc, "Carried buckets"); the result is named ``...+carry``."""
    if carry is not None and dp_slide:
        raise ValueError("carry and dp_slide are exclusive: a carrying period has no DP tail to slide")
    if slide_order not in SLIDE_ORDERS:
        raise ValueError(f"slide_order={slide_order!r} is not one of {', '.join(SLIDE_ORDERS)}")
    graph = problem.graph
    if not is_stack(graph):
        raise ScheduleError(f"graph {graph.name!r} is not a stack of its one-layer graph: nothing to tile")
    L, K = layer_count(graph), layer_count(unit.graph)
    if L % K:
        raise ScheduleError(f"{L} layers cannot be tiled by a unit of {K}")
    pattern = layer_kinds(graph).pattern
    if any(pattern[i] != pattern[i % K] for i in range(L)):
        raise ScheduleError(f"graph {graph.name!r}: its layer kinds do not repeat every {K} layers: a unit of {K} "
                            "cannot be tiled over them")
    periods = L // K
    fwd, span = barrier_ticks(unit, sol), makespan_ticks(unit, sol)
    tail = unit.dp_tail if dp_slide else frozenset()
    compute = [unit.tasks[i].name for i in sorted(tail) if unit.tasks[i].kind != "comm"]
    if compute:
        raise ScheduleError(f"compute {compute[0]!r} depends on a DP collective: the DP-aware tiling moves only "
                            f"collectives (can_slide)")
    unit_ends = solution_ends(unit, sol)
    # the period's backward window: up to the last end of what stays in the tile
    bwd = max((unit_ends[t.index] for t in unit.tasks if t.side == 1 and t.index not in tail), default=fwd) - fwd
    if not tail:
        bwd = span - fwd
    carried = carry.tasks[:periods] if carry is not None else ()     # period periods-1-j carries carried[j]
    span_of = [bwd] * periods
    for j in range(len(carried)):
        span_of[periods - 1 - j] = makespan_ticks(carry.unit, carry.solution)
    # backward periods run last first: period q's window starts after those of q + 1 .. periods - 1
    before = [sum(span_of[q + 1:]) for q in range(periods)]
    start, mode = [0] * len(problem.tasks), [0] * len(problem.tasks)
    edges = [t for t in problem.tasks if t.node.attr(EDGE_ATTR, False)]
    # edge compute reading what an edge backward collective made (the bucketed [V, h] syncs'
    # concat, moegraph.edges) runs with the collectives, after them: graph order (topological)
    fed: set[int] = set()
    for t in edges:
        if t.kind == "compute" and t.side == 1 and any(
                p in fed or (problem.tasks[p].kind == "comm" and problem.tasks[p].side == 1
                             and problem.tasks[p].node.attr(EDGE_ATTR, False)) for p in t.preds):
            fed.add(t.index)
    # the embedding gradient's compute (PARTIAL's scatter and its sync's casts, moegraph.edges)
    # follows layer 0's backward: it runs after the backward windows with the edges' collectives
    after = [t for t in edges if t.kind == "compute" and t.node.attr(EMBED_ATTR, False) and t.index not in fed]
    tail_ids = {t.index for t in after}
    # graph order: fwd, bwd; with the forward edge collectives (the aux loss's stats all-reduces,
    # before the barrier: the routers' backward reads them), alone
    edge_compute = [t for t in edges
                    if (t.kind == "compute" and t.index not in tail_ids and t.index not in fed) or t.side == 0]
    mid_mode = {t.index: alone_twin(t, t.default_mode) if t.kind == "comm" else t.default_mode for t in edge_compute}
    ef = sum(t.modes[mid_mode[t.index]].ticks for t in edge_compute if t.side == 0)
    eb = sum(t.modes[mid_mode[t.index]].ticks for t in edge_compute if t.side == 1)
    at = periods * fwd
    for t in edge_compute:                          # between the forward and the backward windows
        start[t.index], mode[t.index] = at, mid_mode[t.index]
        at += t.modes[mid_mode[t.index]].ticks
    at = periods * fwd + sum(span_of) + ef + eb
    for t in after:                                 # before the late collectives that read them
        start[t.index], mode[t.index] = at, t.default_mode
        at += t.modes[t.default_mode].ticks
    late: dict[int, int] = {}                       # a task of a period's DP tail -> where the tile puts it
    for t in problem.tasks:
        if t.node.attr(EDGE_ATTR, False):
            continue
        i = t.node.layer
        q, u = divmod(i, K)
        base = t.name[len(f"l{i}."):]
        if t.side == 1 and periods - 1 - q < len(carried):     # a carrying period: its own schedule
            src = carry.unit.by_name[f"l{u}.{base}"]
            s, m = carry.solution.start[src.index] + fwd, carry.solution.mode[src.index]
        else:
            src = unit.by_name[f"l{u}.{base}" if K > 1 else base]
            s, m = sol.start[src.index], sol.mode[src.index]
        # period q's forward after q earlier ones; backward periods last first, after the
        # last forward ends (periods fwd; s >= fwd for a backward node)
        start[t.index] = s + q * fwd if t.side == 0 else s - fwd + periods * fwd + ef + eb + before[q]
        mode[t.index] = twin_mode(t, src, m)
        if src.index in tail:
            late[t.index] = start[t.index]
    name = PERIODIC if K == 1 else f"{PERIODIC}x{K}"
    carried_task = carry.unit.tasks[carry.carried] if carry is not None else None
    for j, i in enumerate(carried):                 # inside its period's window, as the carrying schedule has it
        start[i] = carry.solution.start[carried_task.index] + periods * fwd + ef + eb + before[periods - 1 - j]
        mode[i] = carry.solution.mode[carried_task.index]
    for t in edges:
        # as soon as its inputs allow, in the gaps the tiled backward leaves on its stream (the
        # head's gradient buckets fit there), else after the layers' backward, alone
        if ((t.kind == "comm" and t.side == 1) or t.index in fed) and t.index not in carried:
            late[t.index], mode[t.index] = 0, t.default_mode
    _place_late(problem, start, mode, late, at, slide_order)
    suffix = ("" if not dp_slide else "+dp" + ("-ready" if slide_order == "ready" else "")) + ("+carry" if carried else "")
    return settle_alone(problem, Solution(name + suffix, tuple(start), tuple(mode)))


def twin_mode(task: Task, src: Task, k: int) -> int:
    """The index of ``task``'s mode like ``src``'s mode ``k`` (same SMs, alone flag and ticks): a
    stacked layer's node and its unit's twin are costed alike. Raises ScheduleError if none is."""
    m = src.modes[k]
    twin = next((j for j, x in enumerate(task.modes) if (x.sm, x.alone, x.ticks) == (m.sm, m.alone, m.ticks)), None)
    if twin is None:
        raise ScheduleError(f"{task.name!r} has no mode like its unit node {src.name!r}'s "
                            f"({m.sm} SMs, {m.ticks} ticks): the layers are not costed alike")
    return twin


def carrying_problem(problem: Problem, unit: Problem, sol: Solution, bucket: int) -> tuple[Problem, Solution, int]:
    """The stacked ``problem``'s backward tasks of layers 0 .. K-1 (K: ``unit``'s layers) and its
    edge collective ``bucket``, as a problem of their own (module doc, "Carried buckets"), with
    its warm start: ``sol``'s backward, moved to 0, then the bucket after it, alone. Returns the
    problem, the warm start and the bucket's index in the problem."""
    K = layer_count(unit.graph)
    keep = sorted([t.index for t in problem.tasks if t.side == 1 and not t.node.attr(EDGE_ATTR, False)
                   and t.node.layer < K] + [bucket])
    carrying = sub_problem(problem, tuple(keep))
    slot, fwd = keep.index(bucket), barrier_ticks(unit, sol)
    start, mode = [0] * len(keep), [0] * len(keep)
    for t in carrying.tasks:
        if t.index == slot:
            start[slot], mode[slot] = makespan_ticks(unit, sol) - fwd, alone_twin(t, t.default_mode)
        else:
            src = unit.by_name[t.name if K > 1 else t.name.split(".", 1)[1]]
            start[t.index], mode[t.index] = sol.start[src.index] - fwd, twin_mode(t, src, sol.mode[src.index])
    return carrying, Solution("carrying", tuple(start), tuple(mode)), slot


def can_slide(unit: Problem) -> bool:
    """Whether the DP-aware tiling applies: the unit has DP collectives and its DP tail holds
    collectives only (moving a compute task would change what the tile's collectives overlap;
    compress=dp-bf16's local sums are compute)."""
    return bool(unit.dp_tail) and all(unit.tasks[i].kind == "comm" for i in unit.dp_tail)


def _place_late(problem: Problem, start: list[int], mode: list[int], late: dict[int, int], end: int,
                order: SlideOrder) -> None:
    """Place the ``late`` tasks (index -> earliest start the tile gives it), in ``order``
    (``SlideOrder``: by that start, or by the earliest start it and the task's placed inputs
    allow), each after its inputs, each at the earliest end among: its tiled mode at the earliest start
    where its stream is free and the SMs in use beside it leave it room (beside compute the tile
    slowed, or where compute is idle); its fastest copy-engine mode (0 SMs: beside anything) at
    the earliest start its stream is free; its alone mode after ``end``, where every tile task
    has ended. ``start``/``mode`` hold every other task already; settle_alone runs after."""
    tasks = problem.tasks
    busy: dict[str, list[tuple[int, int, int]]] = {s: [] for s in problem.streams}
    for t in tasks:
        m = t.modes[mode[t.index]]
        if t.index not in late and m.ticks > 0:
            busy[t.stream].append((start[t.index], start[t.index] + m.ticks, m.sm))
    for v in busy.values():
        v.sort()
    waiting = {i: sum(p in late for p in tasks[i].preds) for i in late}

    def ready_at(i: int) -> int:  # its tiled start, or later where an input (placed already) ends later
        return max([late[i], *(start[p] + tasks[p].modes[mode[p]].ticks for p in tasks[i].preds)])

    def key(i: int) -> int:
        return late[i] if order == "tiled" else ready_at(i)
    queue = [(key(i), i) for i in late if not waiting[i]]
    heapq.heapify(queue)
    while queue:  # in ``order``, each after its late inputs
        _, i = heapq.heappop(queue)
        t = tasks[i]
        ready = ready_at(i)
        # beside compute only modes priced beside it (an alone mode excludes compute)
        tiled = t.modes[mode[i]]
        modes = {k for k, m in enumerate(t.modes) if not m.alone and m.sm == tiled.sm
                 and (k == mode[i] or tiled.alone)}
        copy = [k for k, m in enumerate(t.modes) if m.sm == 0 and not m.alone]
        if copy:
            modes.add(min(copy, key=lambda k: (t.modes[k].ticks, k)))
        options = [(s + t.modes[k].ticks, s, k) for k in sorted(modes)
                   for s in [_earliest(problem, busy, t.stream, ready, t.modes[k].ticks, t.modes[k].sm)]]
        k = alone_twin(t, mode[i])
        s = _earliest(problem, busy, t.stream, max(ready, end), t.modes[k].ticks, t.modes[k].sm)
        options.append((s + t.modes[k].ticks, s, k))
        e, s, k = min(options)
        start[i], mode[i] = s, k
        if e > s:
            bisect.insort(busy[t.stream], (s, e, t.modes[k].sm))
        for c in t.succs:  # once placed: a successor's key reads where its inputs end
            if c in late:
                waiting[c] -= 1
                if not waiting[c]:
                    heapq.heappush(queue, (key(c), c))


def _earliest(problem: Problem, busy: dict[str, list[tuple[int, int, int]]], stream: str, t: int, d: int,
              sm: int) -> int:
    """The earliest s >= t with [s, s + d) clear of ``stream``'s spans (sorted, disjoint) and
    with ``sm`` SMs free beside every span there (each span: start, end, SMs held)."""
    s = t
    if d <= 0:
        return s
    while True:
        s = _free_from(busy[stream], s, d)
        if not sm:
            return s
        beside = [x for v in busy.values() for x in _overlapping(v, s, s + d) if x[2]]
        if not beside:
            return s
        events = sorted([(a, x) for a, _, x in beside] + [(b, -x) for _, b, x in beside])
        used, peak = 0, 0
        for tick, delta in events:  # ends (negative) sort before starts at the same tick
            used += delta
            if max(tick, s) < s + d:
                peak = max(peak, used)
        if peak + sm <= problem.sm_count:
            return s
        s = min(b for _, b, _ in beside)    # the next instant something beside it ends


def _overlapping(spans: list[tuple[int, int, int]], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """The sorted, disjoint ``spans`` that intersect [lo, hi)."""
    out = []
    for x in spans[max(bisect.bisect_right(spans, (lo, lo, 0)) - 1, 0):]:
        if x[0] >= hi:
            break
        if x[1] > lo:
            out.append(x)
    return out


def _free_from(spans: list[tuple[int, int, int]], t: int, d: int) -> int:
    """The earliest s >= t with [s, s + d) clear of the sorted, disjoint ``spans``."""
    s = t
    for a, b, _ in spans[max(bisect.bisect_right(spans, (t, t, 0)) - 1, 0):]:
        if b <= s:
            continue
        if a >= s + d:
            break
        s = b
    return s


@dataclass(frozen=True)
class Carry:
    """A carrying schedule (module doc, "Carried buckets"): ``unit`` is the stacked problem's
    backward tasks of layers 0 .. K-1 (named ``l{u}.<name>``) and one edge collective
    (``carried``, its index in ``unit``), solved as ``solution`` (backward from 0); ``tasks``:
    the stacked problem's alike edge collectives to carry, one per backward period."""

    unit: Problem
    solution: Solution
    carried: int
    tasks: tuple[int, ...]


def alike_edge_collectives(problem: Problem) -> tuple[int, ...]:
    """The largest group (at least two) of the edges' backward collectives with the same stream
    and modes, whose inputs are all edge compute the tiling runs before the backward windows
    (the head's gradient buckets, moegraph.edges); () if none."""
    groups: dict[tuple, list[int]] = {}
    for t in problem.tasks:
        if t.node.attr(EDGE_ATTR, False) and t.kind == "comm" and t.side == 1 and all(
                problem.tasks[p].kind == "compute" and problem.tasks[p].node.attr(EDGE_ATTR, False)
                and not problem.tasks[p].node.attr(EMBED_ATTR, False) for p in t.preds):
            key = (t.stream, *((m.sm, m.alone, m.ticks) for m in t.modes))
            groups.setdefault(key, []).append(t.index)
    best = max(groups.values(), key=len, default=[])          # first of equals: by index
    return tuple(best) if len(best) >= 2 else ()
