"""Baseline schedules on the same Problem and cost model as CP-SAT.

sequential  Megatron-LM without overlap: one node at a time in the graph's order (forward
            first), collectives at their default SM budget (alone: nothing overlaps them),
            compute at full SMs.
greedy      Critical-path list scheduling with asynchronous collectives, as XLA's
            latency-hiding scheduler and inductor's comm reordering do: at every event the
            ready collective with the longest remaining path is issued on its stream at the
            budget chosen for the hardware (below), then the ready compute node with the
            longest remaining path starts in the fastest mode the free SMs allow (slowed while
            collectives hold SMs).
megascale   MegaScale-MoE's hand-made holistic order (§4.1, Fig 8) as fixed priorities on the
            same list scheduler (lower = first; ties by graph order):

              stream   side      class  nodes
              comm     forward   0      every collective, in program order (issued ASAP)
              comm     backward  0      gradient collectives (phase backward, not wgrad)
                                 1      re-communication (phase recompute)
                                 2      weight-gradient collectives (role wgrad)
              compute  forward   0      program order
              compute  backward  0      data-gradient nodes (role dgrad) - the critical path
                                 1      recompute nodes (hidden under gradient collectives)
                                 2      weight-gradient GEMMs (fill the remaining gaps)

Budgets (greedy and megascale): a fixed 16-24 SMs per collective slows compute by up to 1.44x
where SMs are few, so each rule is run with the collectives at their default budgets and
under each allowed budget as a cap (``budget_choices``; 0 = copy engines), and with no
overlap at all ("exclusive"); the shortest schedule is kept, so neither is ever slower than
sequential. Sequential stays the no-overlap reference at the default budgets.

Merged micro-batch step graphs (moegraph.microbatch) get two more, the hand-written orders
that hide one micro-batch's forward collectives under another's backward
(``MICROBATCH_BASELINES``; ``pair_slots`` below):

megatron-1f1b  Megatron-Core's EP-overlap order (combined 1F1B): micro-batch j+1's forward of
               layer l paired with micro-batch j's backward of layer L-1-l, three phases
               per pair, compute || comm:
                 attn_fwd || combine_bwd;
                 mlp_bwd, mlp_bwd_dw, mlp_fwd || dispatch_fwd, dispatch_bwd;
                 attn_bwd || combine_fwd.
dualpipe       DeepSeek-V3's DualPipe chunk pairing (report §3.2.1, Fig 4): the same pairs and
               phases, but every backward split into input and weight gradients, with the
               attention's weight gradients (ATTN(W)) deferred to the end of the pair, after
               the forward's post-combine work.

Both run on the list scheduler with their order as priorities, one pair at a time (a pair's
tasks become eligible once every task of the previous pair has started; warm-up = micro-batch
0's forward, cool-down = the last backward, one layer per slot), under the fair budget choice.

All of them never break a dependency, the barrier, a stream or the SM capacity; they ignore
the memory budget (compile_graph reports when one exceeds it).

warm_starts() adds CP-SAT warm starts that are not baselines: greedy's and megascale's rules
with collectives on copy engines, and, under a memory budget, the list scheduler with a memory
check (a node starts only if the bytes it allocates fit beside what is live) under greedy's,
megascale's and a "lean" rule (least net allocation first); those may fail where the budget
is tight.
"""

from __future__ import annotations

import heapq
from typing import Callable, Literal, Union

from moegraph.edges import edge_layer, is_edge
from moegraph.ir import OpKind, Phase, Role
from moegraph.layers import layer_count
from moegraph.microbatch import micro_batch_count, micro_batch_of
from moegraph.schedules.problem import COMPUTE, Problem, ScheduleError, Task
from moegraph.schedules.solution import Solution, alone_twin, makespan_ticks, settle_alone

__all__ = ["sequential", "greedy", "megascale", "BASELINES", "list_schedule", "warm_starts", "budget_choices",
           "CommMode", "MICROBATCH_BASELINES", "baselines_for", "megatron_1f1b", "dualpipe", "pair_slots", "paired_key"]

Key = Callable[[Task], tuple]


def sequential(problem: Problem) -> Solution:
    order = sorted(problem.tasks, key=lambda t: (t.side, t.index))
    start, mode = [0] * len(order), [0] * len(order)
    now = 0
    ends = [0] * len(order)
    for t in order:
        begin = max([now, *(ends[p] for p in t.preds)])
        k = alone_twin(t, t.default_mode) if t.kind == "comm" else t.default_mode
        start[t.index], mode[t.index] = begin, k
        ends[t.index] = now = begin + t.modes[k].ticks
    return Solution("sequential", tuple(start), tuple(mode))


def bottom_levels(problem: Problem) -> list[int]:
    """Longest path (default-mode ticks) from a task's start to the end of its side."""
    tasks = problem.tasks
    level = [0] * len(tasks)
    for t in reversed(tasks):
        after = max((level[s] for s in t.succs if tasks[s].side == t.side), default=0)
        level[t.index] = t.modes[t.default_mode].ticks + after
    return level


CommMode = Union[Literal["default", "fewest", "exclusive"], int]
"""Which mode a list schedule issues each collective in: its default budget, its fewest SMs
(copy engines where allowed), (an int cap) its fastest mode holding at most that many SMs, or
"exclusive": the default budget with no compute beside it (its alone mode; collectives and
compute then take turns, which is never slower than sequential: nothing idles while a task is
ready, and every task runs at sequential's duration)."""


def _issue_mode(t: Task, comm_mode: CommMode) -> int:
    if t.kind != "comm":
        return t.default_mode
    beside = [k for k, m in enumerate(t.modes) if not m.alone]
    if comm_mode == "default":
        return t.default_mode
    if comm_mode == "exclusive":
        return alone_twin(t, t.default_mode)
    if comm_mode == "fewest":
        return min(beside, key=lambda k: (t.modes[k].sm, t.modes[k].ticks))
    if isinstance(comm_mode, int) and not isinstance(comm_mode, bool) and comm_mode >= 0:
        # no mode within the cap (every budget above it): the fewest SMs
        return min(beside, key=lambda k: (t.modes[k].sm > comm_mode, t.modes[k].ticks, t.modes[k].sm))
    raise ValueError(f"comm_mode={comm_mode!r} is not 'default', 'fewest', 'exclusive' or a non-negative SM cap")


def budget_choices(problem: Problem) -> tuple[CommMode, ...]:
    """The collective budgets a fair baseline tries: the defaults, each budget the collectives
    allow as a cap (fewest SMs first), and last no overlap at all ("exclusive": where no budget
    pays, e.g. the calibrated CPU profile, whose collectives stretch beside compute)."""
    caps = sorted({m.sm for t in problem.tasks if t.kind == "comm" for m in t.modes})
    return ("default", *caps, "exclusive")


def _fair(problem: Problem, method: str, comm_key: Key, compute_key: Key, slots: list[int] | None = None) -> Solution:
    """The rule's list schedule under the collective budget that suits this hardware: tried
    under every choice of ``budget_choices``, the shortest kept (ties: the earlier choice).
    Holding 16-24 SMs per collective slows compute by up to 1.44x where SMs are few (h20: 78),
    which made the default-budget rules lose to sequential in 23 of 54 registry cases. The
    "exclusive" choice makes "never slower than sequential" hold by construction
    (tests/test_schedules_baselines.py, docs/scheduler.md)."""
    best, best_span = None, None
    for choice in budget_choices(problem):
        sol = list_schedule(problem, method, comm_key=comm_key, compute_key=compute_key, comm_mode=choice,
                            slots=slots)
        span = makespan_ticks(problem, sol)
        if best_span is None or span < best_span:
            best, best_span = sol, span
    return best


def greedy(problem: Problem) -> Solution:
    level = bottom_levels(problem)
    key = lambda t: (-level[t.index], t.index)  # noqa: E731
    return _fair(problem, "greedy", key, key)


def _megascale_key(t: Task) -> tuple:
    """The class of the table above (the same rule on both streams), then graph order."""
    if t.side == 0:
        return (0, t.index)
    if t.node.role is Role.WGRAD:
        return (2, t.index)
    return (1 if t.node.phase is Phase.RECOMPUTE else 0, t.index)


def megascale(problem: Problem) -> Solution:
    return _fair(problem, "megascale", _megascale_key, _megascale_key)


BASELINES: dict[str, Callable[[Problem], Solution]] = {
    "sequential": sequential, "greedy": greedy, "megascale": megascale}


# --- micro-batch pairings (merged step graphs) ---------------------------------------------

Stage = int
"""Phase of a forward/backward pair: 0 attention forward || combine backward, 1 MLP || dispatch,
2 attention backward || combine forward."""


def _reach(sources: set[int], members: set[int], succs) -> set[int]:
    """``sources`` and everything reachable from them through ``members`` only."""
    seen, todo = set(sources), list(sources)
    while todo:
        for s in succs[todo.pop()]:
            if s in members and s not in seen:
                seen.add(s)
                todo.append(s)
    return seen


def _pair_parts(problem: Problem) -> tuple[list[int], list[Stage], list[str]]:
    """Per task: its base slot, its stage and its part: 'F' (forward), 'Bd' (backward data
    gradient or other backward work), 'Bw' (weight gradient). Slots: warm-up (micro-batch 0's
    forward, layer by layer), then pairs (micro-batch j+1's forward of layer l, micro-batch j's
    backward of layer L-1-l), then cool-down (the last micro-batch's backward)."""
    tasks = problem.tasks
    M, L = micro_batch_count(problem.graph), layer_count(problem.graph)
    groups: dict[tuple, set[int]] = {}
    for t in tasks:
        j = micro_batch_of(t.node)
        j = M - 1 if j is None else j                    # step-level: the cool-down's
        fwd = t.node.phase is Phase.FORWARD
        # the model's edges beside the layer they follow or start (moegraph.edges.edge_layer): the
        # head's forward after the last layer's, its backward (which makes the seed) and sync
        # opening the last layer's backward slot, the embedding gather with layer 0's backward
        layer = edge_layer(t.node, L) if is_edge(dict(t.node.attrs)) else t.node.layer or 0
        groups.setdefault((j, layer, fwd), set()).add(t.index)
    slot, stage, part = [0] * len(tasks), [0] * len(tasks), [""] * len(tasks)
    succs, preds = [t.succs for t in tasks], [t.preds for t in tasks]
    for (j, layer, fwd), members in groups.items():
        if fwd:
            ffn_gemm = {i for i in members if tasks[i].node.block == "ffn"
                        and tasks[i].node.op in (OpKind.GEMM, OpKind.GROUPED_GEMM)}
            comm = [i for i in members if tasks[i].kind == "comm" and tasks[i].node.block == "ffn"]
            dispatch = {i for i in comm if _reach({i}, members, succs) & ffn_gemm}
            combine = set(comm) - dispatch
            after_d, after_c = _reach(dispatch, members, succs), _reach(combine, members, succs)
            for i in members:
                slot[i] = layer if j == 0 else L + (j - 1) * L + layer
                stage[i] = 2 if i in after_c else 1 if i in after_d else 0
                part[i] = "F"
        else:
            # the gradients of the dispatch and the combine, told apart within the backward itself
            # (a steady-state pair graph holds no forward of this micro-batch): the combine's
            # gradient flows into the experts' GEMMs' backward, the dispatch's out of it
            bgemm = {i for i in members if tasks[i].node.block == "ffn"
                     and tasks[i].node.op in (OpKind.GEMM, OpKind.GROUPED_GEMM)}
            comm = [i for i in members if tasks[i].kind == "comm" and tasks[i].node.phase is Phase.BACKWARD
                    and tasks[i].node.block == "ffn" and tasks[i].node.role is not Role.WGRAD]
            c_bwd = {i for i in comm if _reach({i}, members, succs) & bgemm}
            d_bwd = set(comm) - c_bwd
            after_d, after_c = _reach(d_bwd, members, succs), _reach(c_bwd, members, succs)
            mlp = after_c - after_d
            # work feeding neither collective (recompute, router gradients): with what it feeds
            before_c, before_mlp = _reach(c_bwd, members, preds), _reach(mlp, members, preds)
            for i in members:
                slot[i] = L + j * L + (L - 1 - layer)
                stage[i] = 1 if i in d_bwd else 2 if i in after_d else 0 if i in c_bwd else 1 if i in mlp \
                    else 0 if i in before_c else 1 if i in before_mlp else 2
                part[i] = "Bw" if tasks[i].node.role is Role.WGRAD else "Bd"
    return slot, stage, part


def pair_slots(problem: Problem) -> list[int]:
    """Each task's slot (``_pair_parts``), raised to its predecessors' so that a slot's tasks
    depend only on tasks of the same or earlier slots (so the one-slot-at-a-time gate of
    ``list_schedule`` never deadlocks)."""
    base, _, _ = _pair_parts(problem)
    slot = list(base)
    for t in problem.tasks:                 # tasks are in topological order
        slot[t.index] = max([slot[t.index], *(slot[p] for p in t.preds)])
    return slot


# sub-order within a stage, per stream: lower first
_MEGATRON = {("compute", 0): {"Bd": 0, "Bw": 0, "F": 1}, ("comm", 0): {"Bd": 0, "Bw": 0, "F": 1},
             ("compute", 1): {"Bd": 0, "Bw": 1, "F": 2}, ("comm", 1): {"F": 0, "Bd": 1, "Bw": 1},
             ("compute", 2): {"Bd": 0, "Bw": 0, "F": 1}, ("comm", 2): {"F": 0, "Bd": 1, "Bw": 1}}
_DUALPIPE = {**_MEGATRON, ("compute", 2): {"Bd": 0, "F": 1, "Bw": 2}}


def paired_key(problem: Problem, method: str) -> Key:
    """The priority of a paired baseline's order (``MICROBATCH_BASELINES``): (slot, stage, the
    stage's sub-order of the task's part on its stream, graph order). Also the launch order of
    moegraph.schedules.launch's "megatron-1f1b"."""
    if micro_batch_count(problem.graph) < 2:
        raise ScheduleError(f"the {method} baseline pairs micro-batches: it needs a merged step graph of M >= 2 "
                            f"micro-batches (moegraph.passes.microbatch.merge_microbatches; --micro-batches)")
    order = {"megatron-1f1b": _MEGATRON, "dualpipe": _DUALPIPE}[method]
    _, stage, part = _pair_parts(problem)
    slots = pair_slots(problem)

    def key(t: Task) -> tuple:
        kind = "compute" if t.kind == "compute" else "comm"
        return (slots[t.index], stage[t.index], order[(kind, stage[t.index])][part[t.index]], t.index)
    return key


def _paired(problem: Problem, method: str) -> Solution:
    key = paired_key(problem, method)
    return _fair(problem, method, key, key, slots=pair_slots(problem))


def megatron_1f1b(problem: Problem) -> Solution:
    return _paired(problem, "megatron-1f1b")


def dualpipe(problem: Problem) -> Solution:
    return _paired(problem, "dualpipe")


MICROBATCH_BASELINES: dict[str, Callable[[Problem], Solution]] = {"megatron-1f1b": megatron_1f1b,
                                                                   "dualpipe": dualpipe}


def baselines_for(problem: Problem) -> dict[str, Callable[[Problem], Solution]]:
    """The baselines of ``problem``: BASELINES, plus MICROBATCH_BASELINES on a merged graph."""
    return BASELINES | (MICROBATCH_BASELINES if micro_batch_count(problem.graph) > 1 else {})


def _net_allocation(problem: Problem) -> list[int]:
    """Bytes a task allocates minus bytes it may free at its end (values it is a last user of)."""
    net = [0] * len(problem.tasks)
    for v in problem.mem_values:
        if v.start == "producer":
            net[v.producer] += v.nbytes
        if not v.until_makespan:
            for i in v.ends:
                net[i] -= v.nbytes // len(v.ends)
    return net


def warm_starts(problem: Problem, budget: int | None = None) -> list[Solution]:
    """Extra list schedules for CP-SAT's warm start (not baselines): greedy's and megascale's
    rules with collectives on the fewest SMs (copy engines: slower collectives that never
    slow compute); with a budget, also the plain rules and a "lean" rule (least net
    allocation first), all under the memory check. Schedules that fail it are left out.
    The DP-aware rules built on this module's list scheduler are schedules.dp_order's
    (schedules.api offers both)."""
    level = bottom_levels(problem)
    net = _net_allocation(problem)
    critical: Key = lambda t: (-level[t.index], t.index)  # noqa: E731
    lean: Key = lambda t: (net[t.index], -level[t.index], t.index)  # noqa: E731
    rules = [("greedy", critical, critical), ("megascale", _megascale_key, _megascale_key)]
    if budget is not None:
        rules.append(("lean", lean, lean))
    out = _interleaved(problem, level, budget)
    for name, ck, pk in rules:
        for comm_mode in ("default", "fewest") if budget is not None else ("fewest",):
            label = name + ("+ce" if comm_mode == "fewest" else "") + ("+mem" if budget is not None else "")
            sol = list_schedule(problem, label, comm_key=ck, compute_key=pk, memory_budget=budget,
                                comm_mode=comm_mode)
            if sol is not None:
                out.append(sol)
    return out



def _interleaved(problem: Problem, level: list[int], budget: int | None) -> list[Solution]:
    """Warm starts for a merged micro-batch graph: the critical-path rule within windows of k
    pair slots (``pair_slots``: window w holds slots [w k, (w+1) k)), earlier windows first, for
    k in 1, 2, L and 2L layers (L: layers per micro-batch), with collectives on the fewest SMs,
    at their default budgets, and "+ends" (default budgets in the warm-up and cool-down slots
    only, below); under a memory budget also gated like the paired baselines. A window of L
    slots lets one micro-batch pair's work fill
    any gap of the pair (mixtral-8x7b, 4 layers, M=4 on h800: 86,836 us, against greedy's
    91,635 and 1 slot's 89,587; docs/scheduler.md "Micro-batches")."""
    if micro_batch_count(problem.graph) < 2:
        return []
    slots, L, M = pair_slots(problem), layer_count(problem.graph), micro_batch_count(problem.graph)
    # "ends": copy engines in the paired slots, default budgets in the warm-up (slots < L: only
    # micro-batch 0's forward is there) and the cool-down (slots >= M L: the last backward and the
    # step's gradient all-reduces). With no other micro-batch's compute to hide under,
    # communication is the bottleneck there and the faster budgets pay for the slower compute
    # (DeepSeek-V3, 4 layers, M=4, h800, window L: 187,365 us against 191,674 on copy engines
    # throughout and 201,524 at default budgets; docs/scheduler.md "Micro-batches").
    ends = [_issue_mode(t, "fewest") if L <= slots[t.index] < M * L else t.default_mode for t in problem.tasks]
    out = []
    # under a memory budget also gated (one window at a time, as the paired baselines): fewer
    # micro-batches in flight. At megatron-1f1b's own peak (1.08 GiB) the gated 1-slot rule
    # takes 97,223 us against its 104,795; ungated ones find no schedule within that budget.
    gates = (False, True) if budget is not None else (False,)
    for k in sorted({1, 2, L, 2 * L}):
        key: Key = lambda t, k=k: (slots[t.index] // k, -level[t.index], t.index)  # noqa: E731
        for gated in gates:
            for comm_mode in ("fewest", "default", "ends"):
                label = (f"{'paired' if gated else 'interleave'}{k}"
                         + {"fewest": "+ce", "default": "", "ends": "+ends"}[comm_mode]
                         + ("+mem" if budget is not None else ""))
                sol = list_schedule(problem, label, comm_key=key, compute_key=key, memory_budget=budget,
                                    comm_mode="default" if comm_mode == "ends" else comm_mode,
                                    slots=[x // k for x in slots] if gated else None,
                                    issue_modes=ends if comm_mode == "ends" else None)
                if sol is not None:
                    out.append(sol)
    return out


def list_schedule(problem: Problem, method: str, *, comm_key: Key, compute_key: Key,
                  memory_budget: int | None = None, comm_mode: CommMode = "default",
                  slots: list[int] | None = None, issue_modes: list[int] | None = None) -> Solution | None:
    """Event-driven list scheduling on the tick grid (see the module docstring).

    At each event time: finished tasks release their successors (and, once every forward
    task is done, the backward side); zero-duration tasks run at once; each free comm stream
    takes its best ready collective at the default budget if the free SMs allow; then a free
    compute stream takes its best ready node in the fastest mode that fits the free SMs.
    comm_mode (``CommMode``) picks each collective's issue mode: its default budget, "fewest"
    SMs (copy engines where allowed; they never wait for SMs), or an int cap. With
    ``memory_budget``, a task starts only if the bytes it allocates fit beside the live
    ones (live bytes only grow when a task starts, so the peak stays within the budget); None
    if that leaves nothing able to start, or the seed gradient does not fit at the barrier.
    Collectives are timed beside compute (never in alone modes); those that no compute ended
    up overlapping are then settled into their alone mode (``settle_alone``).
    ``slots`` (per task, each task's predecessors in the same or earlier slots): a task may
    start only once every task of every earlier slot has started (the paired baselines).
    ``issue_modes`` (per task, a mode index, read for collectives only) overrides comm_mode's
    choice collective by collective.
    """
    tasks = problem.tasks
    n = len(tasks)
    issue = list(issue_modes) if issue_modes is not None else [_issue_mode(t, comm_mode) for t in tasks]
    exclusive = comm_mode == "exclusive"
    waiting = [len(t.preds) for t in tasks]
    fwd_left = sum(1 for t in tasks if t.side == 0)
    start: list[int | None] = [None] * n
    mode = [0] * n
    ready: set[int] = {t.index for t in tasks if not t.preds and (t.side == 0 or fwd_left == 0)}
    blocked_by_barrier: set[int] = {t.index for t in tasks if not t.preds and t.side == 1 and fwd_left}
    running: list[tuple[int, int]] = []       # heap of (end tick, task)
    busy_until = {s: 0 for s in problem.streams}
    sm_used, now, scheduled = 0, 0, 0
    alloc = [0] * n
    users_left: dict[str, int] = {}
    frees: list[list] = [[] for _ in range(n)]
    live, seed = 0, 0
    for v in problem.mem_values:
        if not v.ends and not v.until_makespan:
            continue  # an unused graph input: never live
        if v.start == "producer":
            alloc[v.producer] += v.nbytes
        elif v.start == "zero":
            live += v.nbytes
        else:
            seed += v.nbytes
        if not v.until_makespan and v.ends:
            users_left[v.name] = len(v.ends)
            for i in v.ends:
                frees[i].append(v)
    if fwd_left == 0:
        live += seed
    over = memory_budget is not None and live > memory_budget
    unstarted: dict[int, int] = {}
    for i in range(n):
        unstarted[slots[i] if slots else 0] = unstarted.get(slots[i] if slots else 0, 0) + 1
    slot_order = sorted(unstarted)
    open_slot = [slot_order[0] if slot_order else 0, 0]     # the latest eligible slot, its position
    # one hardware queue (problem.launch, moegraph.schedules.launch): only the next task in
    # launch order may start; tasks outside the sequence (no kernel) are not held back
    queue_pos = {i: k for k, i in enumerate(problem.launch)}
    next_launch = [0]

    def eligible(i: int) -> bool:
        if i in queue_pos and queue_pos[i] != next_launch[0]:
            return False
        return slots is None or slots[i] <= open_slot[0]

    def finish(i: int) -> None:
        nonlocal fwd_left, live, over
        for v in frees[i]:
            users_left[v.name] -= 1
            if users_left[v.name] == 0:
                live -= v.nbytes
        if tasks[i].side == 0:
            fwd_left -= 1
            if fwd_left == 0:
                live += seed
                over = over or (memory_budget is not None and live > memory_budget)
                ready.update(blocked_by_barrier)
                blocked_by_barrier.clear()
        for s in tasks[i].succs:
            waiting[s] -= 1
            if waiting[s] == 0:
                (ready if tasks[s].side == 0 or fwd_left == 0 else blocked_by_barrier).add(s)

    def fits(i: int) -> bool:
        return memory_budget is None or live + alloc[i] <= memory_budget

    def launch(i: int, m: int) -> None:
        nonlocal sm_used, scheduled, live
        t = tasks[i]
        live += alloc[i]
        start[i], mode[i] = now, m
        ready.discard(i)
        scheduled += 1
        if i in queue_pos:
            next_launch[0] += 1
        if slots is not None:
            unstarted[slots[i]] -= 1
            while unstarted[open_slot[0]] == 0 and open_slot[1] + 1 < len(slot_order):
                open_slot[1] += 1
                open_slot[0] = slot_order[open_slot[1]]
        ticks = t.modes[m].ticks
        if ticks == 0:
            finish(i)
            return
        busy_until[t.stream] = now + ticks
        sm_used += t.modes[m].sm
        heapq.heappush(running, (now + ticks, i))

    while scheduled < n:
        while running and running[0][0] <= now:
            _, i = heapq.heappop(running)
            sm_used -= tasks[i].modes[mode[i]].sm
            finish(i)
        progress = True
        while progress and not over:
            progress = False
            for i in sorted(i for i in ready if tasks[i].max_ticks == 0):
                if fits(i) and eligible(i):
                    launch(i, 0)
                    progress = True
            for stream in problem.streams[1:]:
                if busy_until[stream] > now or (exclusive and busy_until[COMPUTE] > now):
                    continue
                cands = sorted((i for i in ready if tasks[i].stream == stream and eligible(i)),
                               key=lambda i: comm_key(tasks[i]))
                for i in cands:
                    if tasks[i].modes[issue[i]].sm <= problem.sm_count - sm_used and fits(i):
                        launch(i, issue[i])
                        progress = True
                        break
            if busy_until[COMPUTE] <= now and not (exclusive and any(busy_until[c] > now for c in problem.streams[1:])):
                cands = sorted((i for i in ready if tasks[i].stream == COMPUTE and fits(i) and eligible(i)),
                               key=lambda i: compute_key(tasks[i]))
                if cands:
                    t = tasks[cands[0]]
                    sm_ok = [k for k, m in enumerate(t.modes) if m.sm <= problem.sm_count - sm_used]
                    if sm_ok:  # modes are sorted fastest first
                        launch(t.index, sm_ok[0])
                        progress = True
        if scheduled == n:
            break
        if over or (not running and memory_budget is not None):
            return None
        if not running:
            stuck = sorted(tasks[i].name for i in ready) or sorted(tasks[i].name for i in blocked_by_barrier)
            raise ScheduleError(f"{method}: no task can start at tick {now} (ready: {stuck[:5]})")
        now = running[0][0]
    return settle_alone(problem, Solution(method, tuple(int(s) for s in start), tuple(mode)))
