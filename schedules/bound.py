"""Lower bounds: on the makespan (per side of the barrier, summed) and on peak memory.

Makespan. The barrier splits every schedule into a forward part [0, F) and a backward part
[F, makespan), so makespan >= LB(forward) + LB(backward). Within one side, with each task at
its fastest mode (compute at full SMs, collectives at their fastest budget), and the heads and
tails of ``strong_heads_tails`` (below):
    * critical path:   max over tasks of head + duration + tail;
    * stream:          for each stream, the preemptive one-machine bound with heads and
                       tails (Jackson's preemptive schedule, exact for 1|r_j,pmtn,q_j|Cmax):
                       a stream runs one task at a time, none before its head, and each
                       still has its tail to run after it; this is at least
                       min head + total work + min tail;
    * SM area:         the same preemptive bound on the SM pool as one machine of speed
                       sm_count (the fully elastic relaxation of the SM cumulative), a task's
                       work being its least SM-ticks over its modes (ticks * SMs held).
The side's bound is the largest of these. All are sound for any schedule of the Problem.

Heads and tails (``strong_heads_tails``). A task j cannot start before every ancestor a (in
its side) has ended and the longest dependency path q(a, j) from a's end to j's start has
run. So start(j) >= max_a (end(a) + q(a, j)) over its ancestors; restricted to the ancestors
on one stream (or to their SM-ticks on the SM pool) that is a one-machine problem with
releases head(a), works and tails q(a, j), whose preemptive optimum (Jackson) is a lower bound
on it: head(j) >= Jackson(ancestors of j on stream r) for every stream r and the SM pool.
Heads are computed in topological order from the ancestors' (already strengthened) heads, so
every one is a lower bound on the start of its task in every schedule (induction); tails
are the mirror image over descendants (time reversed: a schedule read backwards is a
schedule of the reversed problem, with the same streams and SMs). The plain longest-path
heads (``heads_tails``) are the case of one ancestor at a time. This captures what the
longest path misses: parallel branches that share a stream (fc1 and fc3, the weight-gradient
GEMMs beside the data-gradient chain), and in stacked layers the idle compute a collective
between two layers forces, accumulated layer after layer (each layer's compute is released
only after the previous layer's exposed collective).

Peak memory (used to explain an infeasible budget): values that every schedule holds at
once while some node runs (see memory_lower_bound).
"""

from __future__ import annotations

import heapq
import weakref
from dataclasses import dataclass

from moegraph.schedules.problem import Problem, topological

__all__ = ["SideBound", "Bound", "heads_tails", "strong_heads_tails", "jackson_preemptive", "lower_bound", "dp_sync_exposure_bound",
           "memory_lower_bound"]


@dataclass(frozen=True)
class SideBound:
    critical_path: int
    stream: dict[str, int]
    sm_area: int

    @property
    def ticks(self) -> int:
        return max(self.critical_path, self.sm_area, *self.stream.values(), 0)


@dataclass(frozen=True)
class Bound:
    forward: SideBound
    backward: SideBound
    tick_us: float

    @property
    def ticks(self) -> int:
        return self.forward.ticks + self.backward.ticks

    @property
    def us(self) -> float:
        return self.ticks * self.tick_us


def heads_tails(problem: Problem) -> tuple[list[int], list[int]]:
    """Per task: earliest start after its side begins (head) and least time from its end to the
    side's end (tail), along dependencies inside the side at fastest modes."""
    tasks = problem.tasks
    head = [0] * len(tasks)
    tail = [0] * len(tasks)
    for t in tasks:  # tasks are in topological order
        for p in t.preds:
            if tasks[p].side == t.side:
                head[t.index] = max(head[t.index], head[p] + tasks[p].min_ticks)
    for t in reversed(tasks):
        for s in t.succs:
            if tasks[s].side == t.side:
                tail[t.index] = max(tail[t.index], tasks[s].min_ticks + tail[s])
    return head, tail


def _sm_work(t) -> int:
    """Least SM-ticks of a task over its modes (0: it can run on copy engines or takes no time)."""
    return min(m.ticks * m.sm for m in t.modes)


ANCESTOR_WINDOW = 64
"""The latest (in topological order) this many ancestors of a task enter the Jackson bounds
that raise its head; descendants and tails likewise. Measured (h800, docs/scheduler.md): 32
stacked mixtral layers give the same bound as with all ancestors (201,447.7 us) in 5 s instead
of 21 s; chunk=4/8 layers lose nothing either. A window of 80 topological *positions* (not
ancestors) lost 2% on chunk=8, whose chunks interleave many non-ancestors."""


class _Resources:
    """Per task, its work on each resource: its stream (fastest ticks) and the SM pool (least
    SM-ticks, on a machine of speed sm_count). Precomputed: the bounds run Jackson's rule
    O(n) times per side."""

    def __init__(self, problem: Problem):
        self.names = list(problem.streams)
        self.S = problem.sm_count
        self.stream = [self.names.index(t.stream) for t in problem.tasks]
        self.ticks = [t.min_ticks for t in problem.tasks]
        self.area = [_sm_work(t) for t in problem.tasks]

    def bounds(self, ids, head: list[int], tail) -> list[tuple[str, int]]:
        """Per resource (each stream, then the SM pool 'sm'), the bound of Jackson's
        preemptive schedule of the tasks ``ids`` with the given heads and tails (``tail``
        indexable by task); SM-pool times are scaled by sm_count, the result rounded up."""
        return self._bounds(ids, head, tail, -1)

    def _bounds(self, ids, head, tail, floor: int) -> list[tuple[str, int]]:
        """``bounds``, with resources whose bound cannot exceed ``floor`` skipped (as 0)."""
        S = self.S
        per = [[] for _ in self.names]
        area = []
        for i in ids:
            if self.ticks[i]:
                per[self.stream[i]].append((head[i], self.ticks[i], tail[i]))
            if self.area[i]:
                area.append((head[i] * S, self.area[i], tail[i] * S))
        out = []
        for name, jobs in zip(self.names, per):
            if jobs:
                # Jackson <= last release + total work + largest tail: skip what cannot help
                top = max(r for r, _, _ in jobs) + sum(p for _, p, _ in jobs) + max(q for _, _, q in jobs)
                out.append((name, jackson_preemptive(jobs) if top > floor else 0))
        if area:
            top = max(r for r, _, _ in area) + sum(p for _, p, _ in area) + max(q for _, _, q in area)
            out.append(("sm", -(-jackson_preemptive(area) // S) if -(-top // S) > floor else 0))
        return out


def _side(problem: Problem, side: int, head: list[int], tail: list[int]) -> SideBound:
    ids = [t.index for t in problem.tasks if t.side == side]
    tasks = problem.tasks
    cp = max((head[i] + tasks[i].min_ticks + tail[i] for i in ids), default=0)
    res = dict(_Resources(problem).bounds(ids, head, tail))
    area = res.pop("sm", 0)
    return SideBound(cp, res, area)


def _strengthen(res: _Resources, order: list[int], before: dict[int, list[int]], after: dict[int, list[int]],
                head: list[int]) -> None:
    """Raise ``head`` (in place) to the Jackson bound over each task's ancestors, per resource
    (module doc). ``order``: tasks topologically sorted along ``before`` (predecessors in the
    side) / ``after`` (successors in the side); in the reversed problem this computes tails."""
    ticks = res.ticks
    pos = {i: k for k, i in enumerate(order)}
    anc: dict[int, int] = {}
    for j in order:
        mask = 0
        for p in before[j]:
            mask |= anc[p] | (1 << pos[p])
        anc[j] = mask
        if not mask:
            continue
        # the last ANCESTOR_WINDOW ancestors only (a subset of the jobs is still a relaxation,
        # and a path from a kept ancestor to j runs through later, so kept, ones): earlier
        # ones act through their descendants' heads; keeps this O(n W log W)
        members = []
        k = pos[j] - 1
        while k >= 0 and len(members) < ANCESTOR_WINDOW:
            if mask >> k & 1:
                members.append(order[k])
            k -= 1
        members.reverse()
        # q[a]: longest path from a's end to j's start, through ancestors of j (every member
        # has a successor on its path to j that is j or a later member)
        q = {}
        for a in reversed(members):
            q[a] = max((0 if s == j else ticks[s] + q[s]) for s in after[a] if s == j or s in q)
        for _, value in res._bounds(members, head, q, head[j]):
            if value > head[j]:
                head[j] = value


def strong_heads_tails(problem: Problem) -> tuple[list[int], list[int]]:
    """``heads_tails`` raised by the per-resource Jackson bounds over each task's ancestors
    (heads) and descendants (tails) in its side (module doc). Sound; O(n W log W) per side,
    cached per Problem object (copies: callers may not change them)."""
    head, tail, _ = _analysis(problem)
    return list(head), list(tail)


def _strong_heads_tails(problem: Problem) -> tuple[list[int], list[int]]:
    head, tail = heads_tails(problem)
    tasks = problem.tasks
    res = _Resources(problem)
    for side in (0, 1):
        ids = [t.index for t in tasks if t.side == side]
        preds = {i: [p for p in tasks[i].preds if tasks[p].side == side] for i in ids}
        succs = {i: [s for s in tasks[i].succs if tasks[s].side == side] for i in ids}
        order = topological(ids, preds, succs)
        _strengthen(res, order, preds, succs, head)
        _strengthen(res, order[::-1], succs, preds, tail)
    return head, tail


def jackson_preemptive(jobs: list[tuple[int, int, int]]) -> int:
    """Optimal makespan of one machine, preemption allowed, jobs (release, work, tail): at
    every moment run the released job with the longest tail (Jackson's rule)."""
    jobs = sorted(jobs)
    avail: list[tuple[int, int]] = []  # (-tail, remaining work)
    t, i, best = 0, 0, 0
    while i < len(jobs) or avail:
        if not avail:
            t = max(t, jobs[i][0])
        while i < len(jobs) and jobs[i][0] <= t:
            r, p, q = jobs[i]
            heapq.heappush(avail, (-q, p))
            i += 1
        neg_q, rem = heapq.heappop(avail)
        run = rem if i == len(jobs) else min(rem, jobs[i][0] - t)
        t += run
        if run == rem:
            best = max(best, t - neg_q)
        else:
            heapq.heappush(avail, (neg_q, rem - run))
    return best


def lower_bound(problem: Problem) -> Bound:
    """The makespan bound of the module doc (cached per Problem object)."""
    return _analysis(problem)[2]


def _analysis(problem: Problem) -> tuple[tuple[int, ...], tuple[int, ...], Bound]:
    """(heads, tails, bound), computed once per Problem object: the model builder, the effort
    split and compile_problem all ask, and 32 stacked layers take seconds."""
    key = id(problem)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is problem:
        return hit[1]
    head, tail = _strong_heads_tails(problem)
    bound = Bound(_side(problem, 0, head, tail), _side(problem, 1, head, tail), problem.tick_us)
    value = (tuple(head), tuple(tail), bound)
    _CACHE[key] = (weakref.ref(problem, lambda _, key=key: _CACHE.pop(key, None)), value)
    return value


_CACHE: dict[int, tuple[weakref.ref, tuple]] = {}


def memory_lower_bound(problem: Problem) -> tuple[int, str]:
    """(bytes, why): no schedule of ``problem`` peaks below this.

    While a task t that takes time runs, a value is certainly live if it was allocated before
    t starts (its producer is t or runs before t: a precedence ancestor, or any forward task
    when t is backward; or it is a graph input from time 0; or the seed gradient and t is
    backward) and it is freed no earlier than t ends (an output, or one of its users is t or
    runs after t: a descendant, or any backward task when t is forward). The bound is the
    largest such sum over tasks.
    """
    tasks = problem.tasks
    n = len(tasks)
    side_mask = [0, 0]
    for t in tasks:
        side_mask[t.side] |= 1 << t.index
    anc = [0] * n
    for t in tasks:  # topological order
        for p in t.preds:
            anc[t.index] |= anc[p] | (1 << p)
    desc = [0] * n
    for t in reversed(tasks):
        for c in t.succs:
            desc[t.index] |= desc[c] | (1 << c)
    best, why = 0, "no live values"
    for t in tasks:
        if t.min_ticks == 0:
            continue
        before = anc[t.index] | (1 << t.index) | (side_mask[0] if t.side == 1 else 0)
        after = desc[t.index] | (1 << t.index) | (side_mask[1] if t.side == 0 else 0)
        total = 0
        for v in problem.mem_values:
            born = ((v.start == "producer" and before >> v.producer & 1) or v.start == "zero"
                    or (v.start == "barrier" and t.side == 1))
            alive = v.until_makespan or any(after >> e & 1 for e in v.ends)
            if born and alive:
                total += v.nbytes
        if total > best:
            best, why = total, f"values that must be live while {t.name!r} runs"
    return best, why


def dp_sync_exposure_bound(problem: Problem) -> float:
    """Least time, in us, that any schedule of ``problem`` runs data-parallel gradient sync
    (collectives with attr dp=True) with no compute beside it (the schedule_file
    ``exposed_dp_sync_us`` of every schedule is at least this).

    A stream runs one task at a time, each at least its fastest mode (overlap stretch only
    lengthens a collective). Take a set T of DP collectives on one stream: they cover at least
    the sum of their fastest durations, and the only compute that can run beside any of them
    is a compute task that is neither an ancestor of every member of T (it ends before all of
    them start) nor a descendant of every member (it starts after all of them end), nor on an
    earlier side of the barrier than every member; such compute is busy for at most the sum of
    its slowest modes. Whatever the order, T's time not covered by compute is at least the
    difference. The bound is the largest difference over the sets tried, per stream: all of
    the stream's DP collectives (beside all later-side compute), and for each DP collective j,
    the collectives whose ancestors include all of j's (so the compute ancestors of j are out).
    The second family is what makes it tight on a stack of layers: the first layer's sync is
    ready only when nearly the whole backward has run, so almost nothing is left to hide it.
    0 without DP sync."""
    tasks = problem.tasks
    dp = [t.index for t in tasks if t.kind == "comm" and t.node.attr("dp", False)]
    if not dp:
        return 0.0
    anc = [0] * len(tasks)
    for j in problem.order:
        for p in tasks[j].preds:
            anc[j] |= anc[p] | (1 << p)
    desc = [0] * len(tasks)
    for j in reversed(problem.order):
        for c in tasks[j].succs:
            desc[j] |= desc[c] | (1 << c)
    compute = [(t.index, t.side, max(m.ticks for m in t.modes)) for t in tasks if t.kind == "compute"]
    fastest = {j: tasks[j].min_ticks for j in dp}
    by_stream: dict[str, list[int]] = {}
    for j in dp:
        by_stream.setdefault(tasks[j].stream, []).append(j)

    def uncovered(members: list[int]) -> int:
        side = min(tasks[k].side for k in members)
        before, after = -1, -1                     # masks: ancestors / descendants of every member
        for k in members:
            before &= anc[k]
            after &= desc[k]
        cover = sum(ticks for c, c_side, ticks in compute
                    if c_side >= side and not (before >> c & 1) and not (after >> c & 1))
        return sum(fastest[k] for k in members) - cover

    best = 0
    for members in by_stream.values():
        best = max(best, uncovered(members))
        for j in members:
            best = max(best, uncovered([k for k in members if anc[k] & anc[j] == anc[j]]))
    return best * problem.tick_us
