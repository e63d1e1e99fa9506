"""Lower bounds: on the makespan (per side of the barrier, summed) and on peak memory.

Makespan. The barrier splits every schedule into a forward part [0, F) and a backward part
[F, makespan), so makespan >= LB(forward) + LB(backward). Within one side, with each task at
its fastest mode (compute at full SMs, collectives at their fastest budget):
    * critical path:   max over tasks of head + duration + tail (longest chains in the side);
    * stream:          for each stream, the preemptive one-machine bound with heads and
                       tails (Jackson's preemptive schedule, exact for 1|r_j,pmtn,q_j|Cmax):
                       a stream runs one task at a time, none before its head, and each
                       still has its tail to run after it; this is at least
                       min head + total work + min tail;
    * SM area:         min head + ceil(total SM-ticks / sm_count) + min tail, where a task's
                       SM-ticks is the least over its modes of ticks * SMs held.
The side's bound is the largest of these. All are sound for any schedule of the Problem.

Peak memory (used to explain an infeasible budget): values that every schedule holds at
once while some node runs (see memory_lower_bound).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from moegraph.schedules.problem import Problem

__all__ = ["SideBound", "Bound", "heads_tails", "jackson_preemptive", "lower_bound", "memory_lower_bound"]


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


def _side(problem: Problem, side: int, head: list[int], tail: list[int]) -> SideBound:
    tasks = [t for t in problem.tasks if t.side == side]
    cp = max((head[t.index] + t.min_ticks + tail[t.index] for t in tasks), default=0)
    work = {}
    for stream in problem.streams:
        busy = [(head[t.index], t.min_ticks, tail[t.index]) for t in tasks
                if t.stream == stream and t.min_ticks > 0]
        if busy:
            work[stream] = jackson_preemptive(busy)
    area_tasks = [t for t in tasks if min(m.ticks * m.sm for m in t.modes) > 0]
    area = 0
    if area_tasks:
        total = sum(min(m.ticks * m.sm for m in t.modes) for t in area_tasks)
        area = (min(head[t.index] for t in area_tasks) + -(-total // problem.sm_count)
                + min(tail[t.index] for t in area_tasks))
    return SideBound(cp, work, area)


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
    head, tail = heads_tails(problem)
    return Bound(_side(problem, 0, head, tail), _side(problem, 1, head, tail), problem.tick_us)


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
