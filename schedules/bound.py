"""Lower bounds: on the makespan (per side of the barrier, summed) and on peak memory.

Makespan. The barrier splits every schedule into a forward part [0, F) and a backward part
[F, makespan), so makespan >= LB(forward) + LB(backward). Within one side, with each task at
its fastest mode (compute at full SMs, collectives at their fastest budget):
    * critical path:   max over tasks of head + duration + tail (longest chains in the side);
    * stream work:     for each stream, min head + total work + min tail over its tasks
                       (a stream runs one task at a time, none before the earliest head,
                       and the last one still has its tail to run);
    * SM area:         min head + ceil(total SM-ticks / sm_count) + min tail, where a task's
                       SM-ticks is the least over its modes of ticks * SMs held.
The side's bound is the largest of these. All are sound for any schedule of the Problem.

Peak memory (used to explain an infeasible budget). A sound, cheap bound: while a node with a
positive duration runs, its inputs and outputs (their base storage) are all live; and just
before the barrier every forward-produced value still needed after it is live.
"""

from __future__ import annotations

from dataclasses import dataclass

from moegraph.ir import ValueKind
from schedules.problem import Problem, _base

__all__ = ["SideBound", "Bound", "heads_tails", "lower_bound", "memory_lower_bound"]


@dataclass(frozen=True)
class SideBound:
    critical_path: int
    stream_work: dict[str, int]
    sm_area: int

    @property
    def ticks(self) -> int:
        return max(self.critical_path, self.sm_area, *self.stream_work.values(), 0)


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
        busy = [t for t in tasks if t.stream == stream and t.min_ticks > 0]
        if busy:
            work[stream] = (min(head[t.index] for t in busy) + sum(t.min_ticks for t in busy)
                            + min(tail[t.index] for t in busy))
    area_tasks = [t for t in tasks if min(m.ticks * m.sm for m in t.modes) > 0]
    area = 0
    if area_tasks:
        total = sum(min(m.ticks * m.sm for m in t.modes) for t in area_tasks)
        area = (min(head[t.index] for t in area_tasks) + -(-total // problem.sm_count)
                + min(tail[t.index] for t in area_tasks))
    return SideBound(cp, work, area)


def lower_bound(problem: Problem) -> Bound:
    head, tail = heads_tails(problem)
    return Bound(_side(problem, 0, head, tail), _side(problem, 1, head, tail), problem.tick_us)


def memory_lower_bound(problem: Problem) -> tuple[int, str]:
    """(bytes, which argument gave it): no schedule of ``problem`` peaks below this."""
    graph = problem.graph
    counted = {v.name: v.nbytes for v in problem.mem_values}
    best, why = 0, "no live values"
    for t in problem.tasks:
        if t.min_ticks == 0:
            continue
        live = {_base(graph, v) for v in (*t.node.inputs, *t.node.outputs)} & counted.keys()
        total = sum(counted[v] for v in live)
        if total > best:
            best, why = total, f"inputs and outputs of {t.name!r} are live while it runs"
    # Just before the barrier (if the forward side takes any time): values from the forward
    # side, or graph inputs from time 0, still needed after it.
    if any(t.min_ticks > 0 for t in problem.tasks if t.side == 0):
        crossing = 0
        for v in problem.mem_values:
            # A producer that takes time started strictly before the barrier.
            from_fwd = (v.start == "zero" or (v.start == "producer" and problem.tasks[v.producer].side == 0
                                              and problem.tasks[v.producer].min_ticks > 0))
            needed_after = v.until_makespan or any(problem.tasks[i].side == 1 for i in v.ends)
            if from_fwd and needed_after and graph.value[v.name].kind is not ValueKind.GRAD:
                crossing += v.nbytes
        if crossing > best:
            best, why = crossing, "values saved across the forward/backward barrier are live at once"
    return best, why
