"""Launch order: one hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``) makes launch order execution order.

A GPU feeds kernels from a few hardware queues ("connections"). With one queue per stream (the
default "free" below) only each stream's own order binds, and the scheduler chooses the order in
which kernels of different streams start. With ``CUDA_DEVICE_MAX_CONNECTIONS=1``, which
Megatron-LM requires for its tensor-parallel overlap, every stream shares one queue: a kernel
starts only once every kernel launched before it has started, so a collective launched ahead of
the compute it does not depend on, but waiting for compute that ends late, holds that compute
back (head-of-line blocking; Megatron-LM PRs 2719/2730 and 6311 report that it halves the
expert-parallel overlap gain, which their launch reordering wins back).

    LaunchOrder      the typed option (``CompileConfig.launch_order``): "free" (a queue per stream), "program" (one queue, kernels
                     launched in the graph's program order: the eager issue order of a framework
                     that follows the module's code), "megatron-1f1b" (one queue, Megatron-Core's
                     combined-1F1B phases, per phase the collective first, then the compute; a
                     merged micro-batch step only). Its TransformerLayerSchedulePlan.run issues
                     phases 0 and 2 so, but in phase 1 it issues mlp_bwd before dispatch_fwd and
                     mlp_bwd_dw before dispatch_bwd; that order is not modelled (docs/scheduler.md)
    launch_sequence  the task indices in launch order (a topological order of the problem)
    with_launch_order the Problem carrying that sequence (``Problem.launch``): check_solution,
                     the list scheduler (in-order dispatch) and the CP-SAT model
                     (start[a] <= start[b] for consecutive a, b) all obey it

The launch order is fixed by the option, not chosen by the scheduler: with a free choice, any
schedule's own start order is a valid launch order, and one queue would cost nothing.
"""

from __future__ import annotations

import dataclasses
import heapq
import typing

from moegraph.config import LAUNCH_ORDERS, LaunchOrder
from moegraph.microbatch import micro_batch_count
from moegraph.schedules.problem import Problem, ScheduleError

__all__ = ["launch_sequence", "with_launch_order", "follows_launch"]


def launch_sequence(problem: Problem, order: LaunchOrder) -> tuple[int, ...]:
    """Task indices in the order one hardware queue receives them; () for "free"."""
    match order:
        case "free":
            return ()
        case "program":
            return problem.order            # graph order where the precedence edges allow it
        case "megatron-1f1b":
            if micro_batch_count(problem.graph) < 2:
                raise ScheduleError("launch order 'megatron-1f1b' pairs micro-batches: it needs a merged step graph "
                                    "of M >= 2 micro-batches (--micro-batches)")
            from moegraph.schedules.baselines import paired_key
            key = paired_key(problem, "megatron-1f1b")
            return _by_priority(problem, lambda i: (key(problem.tasks[i])[:2],
                                                    problem.tasks[i].kind != "comm", key(problem.tasks[i])))
    raise ValueError(f"launch order {order!r} is not one of {', '.join(LAUNCH_ORDERS)}")


def _by_priority(problem: Problem, prio) -> tuple[int, ...]:
    """A topological order of the tasks taking, at each step, the launchable task (every
    predecessor launched) of least ``prio``: a program issues a kernel after its inputs' kernels."""
    tasks = problem.tasks
    waiting = [len(t.preds) for t in tasks]
    ready = [(prio(t.index), t.index) for t in tasks if not t.preds]
    heapq.heapify(ready)
    out = []
    while ready:
        _, i = heapq.heappop(ready)
        out.append(i)
        for s in tasks[i].succs:
            waiting[s] -= 1
            if waiting[s] == 0:
                heapq.heappush(ready, (prio(s), s))
    if len(out) != len(tasks):
        raise ScheduleError("the problem's precedence edges form a cycle")
    return tuple(out)


def with_launch_order(problem: Problem, order: LaunchOrder) -> Problem:
    """``problem`` whose schedules start their kernels in ``order``'s launch sequence. Tasks that
    take no time (views, the zero-time members of a fused kernel) launch no kernel: left out."""
    seq = launch_sequence(problem, order)
    # the forward's kernels before the backward's (the barrier orders them anyway)
    seq = tuple(sorted((i for i in seq if problem.tasks[i].max_ticks > 0), key=lambda i: problem.tasks[i].side))
    return dataclasses.replace(problem, launch=seq, launch_order=order)


def follows_launch(problem: Problem, start: typing.Sequence[int]) -> str | None:
    """None if ``start`` (ticks per task) starts the tasks in the problem's launch sequence, else
    the first pair out of order, named."""
    seq = problem.launch
    for a, b in zip(seq, seq[1:]):
        if start[b] < start[a]:
            return (f"{problem.tasks[b].name!r} starts before {problem.tasks[a].name!r}, launched ahead of it "
                    f"on the one hardware queue (launch order {problem.launch_order!r})")
    return None
