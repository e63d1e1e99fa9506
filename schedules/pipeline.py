"""The stage-level schedule of a pipeline step: its problem, per-rank action orders, their timeline.

Notation: P pipeline ranks, V stages per rank (S = P*V stages, ``passes.stages.StageLayout``),
M micro-batches per step; times in integer ticks of ``tick_us``.

Work (``StageWork``, priced by the op-level schedule: moegraph.schedules.pipeline_price): per
stage and micro-batch F (forward), I (input-gradient backward), W (weight-gradient backward), B
(I and W run as one unit: the op-level schedule hides more under it than under I and W apart),
and the step's end: each stage's gradient sync, then each rank's optimizer step.

An order (``Orders``) lists, per rank, its items: an ``Action`` (kind F, I, W or B; stage;
micro-batch) or a ``Pair`` (one stage's F beside another stage's B on the same rank, torch's
OVERLAP_F_B: priced F + B minus the smaller of the two stages' op-level pair savings).
``simulate`` gives an order its timeline under these rules, which the CP-SAT model
(moegraph.schedules.pipeline_cpsat) states as constraints:

  * a rank runs its items one at a time, in its order, each as early as its inputs allow;
  * F(s, m) needs F(s-1, m)'s output; I or B (s, m) needs F(s, m) and I(s+1, m)'s (or B's)
    input gradient; on the last stage F(s, m) only; W(s, m) needs I(s, m);
  * an output crossing ranks is one transfer on the directed link between the two ranks
    (``send[s]`` ticks forward from stage s to s+1, ``send_back[s]`` backward from s+1 to s), the
    link carrying one transfer at a time, in the order the sender makes them, each in the link's
    earliest free gap from its send (``shared_link``: one link for both directions), or with
    ``rendezvous`` from when the receiver has also posted its receive (not in the CP-SAT model,
    which assumes receives posted early: its orders are priced by this timeline); on one rank
    (V-shape's turn, adjacent loop stages never share one) it is handed over at no cost;
  * stage s's gradient sync starts when its last backward item ends, one sync at a time per
    rank (its data-parallel stream); the rank's optimizer step follows its syncs and its items;
    the step ends with the last optimizer step;
  * with the parameter all-gather overlapped (``StageWork.gather`` > 0: the distributed
    optimizer's gather of the parameters the previous step updated, Megatron's
    ``--overlap-param-gather``), stage s's gather runs on the rank's DP stream from the step's
    start, the rank's stages in the order of their first forward, layer by layer as Megatron's
    buckets: the stage's first forward starts once its first layer's part (``gather_lead``) is
    in, and ends no earlier than the whole gather plus its last layer's forward (``f_tail``);
    ``sync`` is then the reduce-scatter half alone;
  * memory: stage s's activations (``held`` bytes per micro-batch) are held from F's start
    until I's end, of them ``held_for_w`` until W's end (B: all until its end; a pair: the F
    part's from the pair's start, the B part's until its end); a rank's peak is its states
    (``static_bytes``) plus the most activations it holds at once, at most ``memory_cap_bytes``.

Reported (``Timeline``): the step (makespan), the bubble (idle compute of each rank within the
step), the exposed communication (ticks a rank waits on a transfer still in flight or on a
parameter gather, and the step-end sync not hidden under compute), each rank's peak memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Union

from moegraph.passes.stages import StageLayout
from moegraph.schedules.problem import ScheduleError

__all__ = ["StageWork", "PipelineProblem", "Action", "Pair", "Item", "Orders", "Timeline", "Transfer",
           "check_orders", "simulate", "parts", "with_cap", "memory_unit", "KINDS", "least_memory_orders",
           "least_peak_bytes"]

KINDS = ("F", "I", "W", "B")


@dataclass(frozen=True)
class StageWork:
    """One stage's per-micro-batch work (ticks) and activations (bytes); module docstring."""

    f: int
    i: int
    w: int
    b: int
    pair_saving: int
    sync: int
    held: int
    held_for_w: int
    gather: int = 0
    gather_lead: int = 0
    f_tail: int = 0

    def __post_init__(self):
        for name in ("f", "i", "w", "b", "pair_saving", "sync", "held", "held_for_w", "gather", "gather_lead",
                     "f_tail"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ScheduleError(f"stage work {name}={value!r} must be an int >= 0")
        if self.held_for_w > self.held:
            raise ScheduleError(f"held_for_w={self.held_for_w} exceeds held={self.held}")
        if self.gather_lead > self.gather or self.f_tail > self.f:
            raise ScheduleError(f"gather_lead={self.gather_lead} exceeds gather={self.gather}, or f_tail={self.f_tail} "
                                f"exceeds f={self.f}")

    def gathered_start(self, begin: int) -> int:
        """The earliest start of the stage's first forward when its gather runs from ``begin``
        (module docstring; a gather without a lead or tail: the whole gather first)."""
        lead, tail = (self.gather_lead, self.f_tail) if self.gather_lead or self.f_tail else (self.gather, self.f)
        return max(begin + lead, begin + self.gather + tail - self.f)


@dataclass(frozen=True)
class PipelineProblem:
    layout: StageLayout
    micro_batches: int
    work: tuple[StageWork, ...]
    send: tuple[int, ...]
    """Ticks of stage s's forward output to stage s+1 (S - 1 of them)."""
    send_back: tuple[int, ...]
    """Ticks of stage s+1's input gradient back to stage s."""
    optimizer: tuple[int, ...]
    """Per rank, the optimizer step's ticks."""
    static_bytes: tuple[int, ...]
    """Per rank, the bytes held whatever the schedule (parameters, gradients, optimizer, buffers)."""
    memory_cap_bytes: int | None = None
    tick_us: float = 1.0
    rendezvous: bool = False
    """A transfer starts once its receive is posted too (``recv_posts``: where torch's runtime posts
    it, after some of the receiver's items) as gloo and NCCL move a message once both ends are
    posted; False: as soon as it is sent (the receive already waits)."""
    shared_link: bool = False
    """One medium carries both directions between two ranks (the calibration's emulated link: one
    token bucket on the namespace's loopback passes every packet), so a forward send and a
    backward send between the same ranks take turns; False: a full-duplex link per direction."""

    def __post_init__(self):
        S, P, M = len(self.layout.stages), self.layout.pp, self.micro_batches
        if isinstance(M, bool) or not isinstance(M, int) or M < 1:
            raise ScheduleError(f"micro_batches={M!r} must be a positive integer")
        for name, seq, size in (("work", self.work, S), ("send", self.send, S - 1), ("send_back", self.send_back, S - 1),
                                ("optimizer", self.optimizer, P), ("static_bytes", self.static_bytes, P)):
            if len(seq) != size:
                raise ScheduleError(f"{name} has {len(seq)} entries; the layout needs {size}")
        if self.memory_cap_bytes is not None and self.memory_cap_bytes <= 0:
            raise ScheduleError(f"memory_cap_bytes={self.memory_cap_bytes} must be positive or None")

    @property
    def stages(self) -> int:
        return len(self.layout.stages)

    def link(self, sender: int, receiver: int) -> tuple[int, int]:
        """The link a transfer from rank ``sender`` to ``receiver`` occupies: its direction's, or
        with ``shared_link`` the one medium both directions share."""
        return (min(sender, receiver), max(sender, receiver)) if self.shared_link else (sender, receiver)

    def pair_ticks(self, forward_stage: int, backward_stage: int) -> int:
        a, b = self.work[forward_stage], self.work[backward_stage]
        return a.f + b.b - min(a.pair_saving, b.pair_saving)

    def duration(self, item: "Item") -> int:
        if isinstance(item, Pair):
            return self.pair_ticks(item.forward.stage, item.backward.stage)
        return getattr(self.work[item.stage], item.kind.lower())


@dataclass(frozen=True, order=True)
class Action:
    kind: str
    stage: int
    mb: int

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ScheduleError(f"action kind {self.kind!r} is not one of {', '.join(KINDS)}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


@dataclass(frozen=True)
class Pair:
    """One stage's forward beside another's full backward, as one item."""

    forward: Action
    backward: Action

    def __post_init__(self):
        if self.forward.kind != "F" or self.backward.kind != "B":
            raise ScheduleError(f"a pair overlaps an F and a B, not {self.forward} and {self.backward}")

    def __str__(self) -> str:
        return f"({self.forward};{self.backward})"


Item = Union[Action, Pair]
Orders = tuple[tuple[Item, ...], ...]


def parts(item: Item) -> tuple[Action, ...]:
    return (item.forward, item.backward) if isinstance(item, Pair) else (item,)


def check_orders(problem: PipelineProblem, orders: Orders) -> None:
    """Every (stage, micro-batch) runs F once and B once or I and W once each, on its stage's
    rank; ScheduleError names the first violation."""
    layout, M = problem.layout, problem.micro_batches
    if len(orders) != layout.pp:
        raise ScheduleError(f"{len(orders)} rank orders for pp={layout.pp}")
    seen: dict[tuple[str, int, int], int] = {}
    for r, row in enumerate(orders):
        for item in row:
            for a in parts(item):
                if not (0 <= a.stage < problem.stages and 0 <= a.mb < M):
                    raise ScheduleError(f"rank {r}: action {a} is outside {problem.stages} stages x {M} micro-batches")
                if layout.rank_of(a.stage) != r:
                    raise ScheduleError(f"rank {r} runs {a}, but stage {a.stage} is on rank {layout.rank_of(a.stage)}")
                key = (a.kind, a.stage, a.mb)
                if key in seen:
                    raise ScheduleError(f"action {a} appears twice")
                seen[key] = r
    for s in range(problem.stages):
        for m in range(M):
            if ("F", s, m) not in seen:
                raise ScheduleError(f"no forward {s}F{m}")
            full, split = ("B", s, m) in seen, (("I", s, m) in seen, ("W", s, m) in seen)
            if full == any(split) or (not full and not all(split)):
                raise ScheduleError(f"stage {s} micro-batch {m} needs B, or I and W, once: "
                                    f"B {'present' if full else 'absent'}, I {split[0]}, W {split[1]}")


@dataclass(frozen=True)
class Transfer:
    direction: str          # "fwd" | "bwd"
    stage: int              # the sender
    mb: int
    link: tuple[int, int]   # PipelineProblem.link: (sender rank, receiver rank), or the shared medium
    start: int
    end: int


@dataclass(frozen=True)
class Timeline:
    """An order's timeline (module docstring); ticks, bytes."""

    problem: PipelineProblem = field(repr=False)
    orders: Orders
    start: dict[Item, int]
    end: dict[Item, int]
    transfers: tuple[Transfer, ...]
    sync: dict[int, tuple[int, int]]
    optimizer: dict[int, tuple[int, int]]
    makespan: int
    peak_bytes: tuple[int, ...]
    wait_ticks: tuple[int, ...]
    """Per rank: ticks its compute waited on transfers in flight."""
    gather: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Per stage with a parameter gather at the step's start: its (start, end)."""
    gather_wait_ticks: tuple[int, ...] = ()
    """Per rank: ticks its compute waited on its stages' parameter gathers."""

    def busy(self, rank: int) -> int:
        s, e = self.optimizer[rank]
        return sum(self.end[i] - self.start[i] for i in self.orders[rank]) + (e - s)

    @property
    def bubble_ticks(self) -> tuple[int, ...]:
        """Per rank, idle compute within the step."""
        return tuple(self.makespan - self.busy(r) for r in range(len(self.orders)))

    @property
    def bubble_fraction(self) -> float:
        return sum(self.bubble_ticks) / (len(self.orders) * self.makespan) if self.makespan else 0.0

    @property
    def exposed_sync_ticks(self) -> int:
        """On the rank that ends the step: the step-end sync not hidden under its compute."""
        r = max(range(len(self.orders)), key=lambda k: (self.optimizer[k][1], -k))
        last = max((self.end[i] for i in self.orders[r]), default=0)
        return max(0, self.optimizer[r][0] - last)

    @property
    def fits(self) -> bool:
        cap = self.problem.memory_cap_bytes
        return cap is None or max(self.peak_bytes) <= cap

    def summary(self) -> dict[str, Any]:
        t = self.problem.tick_us
        return {"step_us": round(self.makespan * t, 3), "bubble_fraction": round(self.bubble_fraction, 5),
                "bubble_us": [round(b * t, 3) for b in self.bubble_ticks],
                "exposed_p2p_us": [round(w * t, 3) for w in self.wait_ticks],
                "exposed_sync_us": round(self.exposed_sync_ticks * t, 3),
                "exposed_gather_us": [round(w * t, 3) for w in self.gather_wait_ticks] or [0.0] * len(self.orders),
                "peak_bytes": list(self.peak_bytes), "fits": self.fits}


def simulate(problem: PipelineProblem, orders: Orders) -> Timeline:
    """The timeline of ``orders`` (module docstring). ScheduleError for an invalid order, or one
    that deadlocks (a rank waits on an item another rank only runs later), naming the items."""
    check_orders(problem, orders)
    layout, S, P = problem.layout, problem.stages, problem.layout.pp
    rank = [layout.rank_of(s) for s in range(S)]
    done: dict[tuple[str, int, int], int] = {}        # (F|I|W, stage, mb) -> end (B and pairs fill F/I/W)
    arrive: dict[tuple[str, int, int], int] = {}      # ("fwd", s, m): stage s may start F; ("bwd", s, m): I
    link_busy: dict[tuple[int, int], list[tuple[int, int]]] = {}    # link -> its transfers' (start, end)
    pending: dict[tuple[str, int, int], tuple[int, int, int, int]] = {}   # rendezvous: sent, not yet posted
    posts = _recv_posts(problem, orders) if problem.rendezvous else {}
    transfers: list[Transfer] = []
    start: dict[Item, int] = {}
    end: dict[Item, int] = {}
    free = [0] * P
    wait = [0] * P
    gather_wait = [0] * P
    pos = [0] * P
    gather, dp_free = _gathers(problem, orders)
    first_forward: dict[int, Action] = {}
    for row in orders:
        for a in (a for item in row for a in parts(item) if a.kind == "F"):
            first_forward.setdefault(a.stage, a)

    def needs(a: Action) -> list[tuple[tuple[str, int, int], tuple[str, int, int] | None]]:
        """(key whose arrival gates a, the producer's key, or None when the arrival is local)."""
        s, m = a.stage, a.mb
        if a.kind == "F":
            return [] if s == 0 else [(("fwd", s, m), ("F", s - 1, m))]
        if a.kind == "W":
            return [(("I", s, m), None)]
        own = [(("F", s, m), None)]
        return own if s == S - 1 else own + [(("bwd", s, m), ("I", s + 1, m))]

    def ready(key: tuple[str, int, int]) -> int | None:
        if key[0] not in ("fwd", "bwd"):
            return done.get(key)
        if key not in arrive and key in pending:       # rendezvous: once the receiver has posted
            t, s, m, ticks = pending[key]
            k, row = posts[key], orders[rank[key[1]]]
            posted = 0 if k == 0 else end.get(row[k - 1])
            if posted is None:
                return None
            _place(key, s, m, max(t, posted), ticks)
        return arrive.get(key)

    def finish(a: Action, t: int) -> None:
        s, m = a.stage, a.mb
        if a.kind == "B":
            done[("I", s, m)] = done[("W", s, m)] = t
        else:
            done[(a.kind, s, m)] = t
        if a.kind == "F" and s < S - 1:
            _send("fwd", s, s + 1, m, t, problem.send[s])
        if a.kind in ("I", "B") and s > 0:
            _send("bwd", s, s - 1, m, t, problem.send_back[s - 1])

    def _send(direction: str, s: int, to: int, m: int, t: int, ticks: int) -> None:
        key = (direction, to, m)
        if rank[s] == rank[to]:
            arrive[key] = t
        elif problem.rendezvous:
            pending[key] = (t, s, m, ticks)
        else:
            _place(key, s, m, t, ticks)

    def _place(key: tuple[str, int, int], s: int, m: int, t: int, ticks: int) -> None:
        direction, to, _ = key
        link = problem.link(rank[s], rank[to])
        busy = link_busy.setdefault(link, [])
        begin = t                  # the earliest gap from t: a shared link's two senders are simulated
        for b, e in sorted(busy):  # rank by rank, not in time order; one sender's sends come in order
            if begin + ticks <= b:
                break
            begin = max(begin, e)
        busy.append((begin, begin + ticks))
        arrive[key] = begin + ticks
        transfers.append(Transfer(direction, s, m, link, begin, begin + ticks))

    remaining = sum(len(row) for row in orders)
    while remaining:
        progressed = False
        for r in range(P):
            while pos[r] < len(orders[r]):
                item = orders[r][pos[r]]
                deps = [d for a in parts(item) for d in needs(a)]
                times = [ready(k) for k, _ in deps]
                if any(t is None for t in times):
                    break
                begin = max([free[r], *times])
                local = max([free[r], *[done[p] if p is not None else ready(k) for k, p in deps]])
                wait[r] += begin - local
                gathered = max([problem.work[a.stage].gathered_start(gather[a.stage][0]) for a in parts(item)
                                if a.kind == "F" and first_forward.get(a.stage) == a and a.stage in gather], default=0)
                if gathered > begin:
                    gather_wait[r] += gathered - begin
                    begin = gathered
                start[item], end[item] = begin, begin + problem.duration(item)
                free[r] = end[item]
                for a in parts(item):
                    finish(a, end[item])
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = ", ".join(f"rank {r}: {orders[r][pos[r]]}" for r in range(P) if pos[r] < len(orders[r]))
            raise ScheduleError(f"the order deadlocks: every rank waits on an item another rank runs later ({stuck})")
    sync, optimizer = {}, {}
    for s in sorted(range(S), key=lambda k: (max(done[("W", k, m)] for m in range(problem.micro_batches)), k)):
        r = rank[s]
        begin = max(dp_free[r], max(done[("W", s, m)] for m in range(problem.micro_batches)))
        sync[s] = (begin, begin + problem.work[s].sync)
        dp_free[r] = sync[s][1]
    for r in range(P):
        begin = max([free[r], *[sync[s][1] for s in layout.stages_of(r)]])
        optimizer[r] = (begin, begin + problem.optimizer[r])
    return Timeline(problem, tuple(tuple(row) for row in orders), start, end, tuple(transfers), sync, optimizer,
                    max(e for _, e in optimizer.values()), _peaks(problem, orders, start, end), tuple(wait),
                    gather, tuple(gather_wait))


def _recv_posts(problem: PipelineProblem, orders: Orders) -> dict[tuple[str, int, int], int]:
    """Where torch's runtime posts each cross-rank receive of ``orders`` (rendezvous)."""
    from moegraph.schedules.pipeline_torch import recv_posts      # it imports this module
    return recv_posts(orders, problem.layout)


def _gathers(problem: PipelineProblem, orders: Orders) -> tuple[dict[int, tuple[int, int]], list[int]]:
    """The parameter gathers at the step's start (module docstring): per stage (start, end), and
    where each rank's DP stream is free after them."""
    out, free = {}, [0] * problem.layout.pp
    for r, row in enumerate(orders):
        first = [a.stage for item in row for a in parts(item) if a.kind == "F"]
        for s in sorted(set(first), key=first.index):
            if problem.work[s].gather:
                out[s] = (free[r], free[r] + problem.work[s].gather)
                free[r] = out[s][1]
    return out, free


def _peaks(problem: PipelineProblem, orders: Orders, start: dict, end: dict) -> tuple[int, ...]:
    """Per rank, states plus the most activations held at once (frees before allocations at a tie)."""
    W = {(a.stage, a.mb): end[item] for row in orders for item in row for a in parts(item) if a.kind in ("W", "B")}
    out = []
    for r, row in enumerate(orders):
        events = []
        for item in row:
            for a in parts(item):
                work = problem.work[a.stage]
                if a.kind == "F":
                    events.append((start[item], work.held))
                elif a.kind == "I":
                    events.append((end[item], -(work.held - work.held_for_w)))
                elif a.kind in ("W", "B"):
                    events.append((W[(a.stage, a.mb)], -(work.held_for_w if a.kind == "W" else work.held)))
        live = peak = 0
        for _, delta in sorted(events):
            live += delta
            peak = max(peak, live)
        out.append(problem.static_bytes[r] + peak)
    return tuple(out)


def least_memory_orders(layout: StageLayout, micro_batches: int) -> Orders:
    """One micro-batch at a time: its forwards through every stage, then its backwards (B) back,
    then the next micro-batch. The order of least memory: a rank holds one micro-batch of each of
    its stages at its peak (``least_peak_bytes``), which no order can go below (a rank's stages
    hold the same micro-batch at once: F(s, m) runs before F(s', m) for s < s' on the rank, and
    B(s', m) before B(s, m)). Not a baseline (torch generates those): the warm start that fits a
    memory cap no torch schedule fits."""
    rows: list[list[Item]] = [[] for _ in range(layout.pp)]
    S = len(layout.stages)
    for m in range(micro_batches):
        for s in range(S):
            rows[layout.rank_of(s)].append(Action("F", s, m))
        for s in reversed(range(S)):
            rows[layout.rank_of(s)].append(Action("B", s, m))
    return tuple(tuple(row) for row in rows)


def least_peak_bytes(problem: PipelineProblem) -> tuple[int, ...]:
    """Per rank, the least peak memory of any order: its states plus one micro-batch's
    activations of each of its stages (``least_memory_orders`` reaches it)."""
    return tuple(problem.static_bytes[r] + sum(problem.work[s].held for s in problem.layout.stages_of(r))
                 for r in range(problem.layout.pp))


def with_cap(problem: PipelineProblem, cap: int | None) -> PipelineProblem:
    return dataclasses.replace(problem, memory_cap_bytes=cap)


def memory_unit(problem: PipelineProblem) -> int:
    """Bytes per unit of the memory cumulative: the power of two at or below 1/1024 of the
    smallest positive hold (I's part or W's), at least 1 (moegraph.schedules.pipeline_cpsat)."""
    holds = [h for w in problem.work for h in (w.held - w.held_for_w, w.held_for_w) if h > 0]
    return 1 << max(0, (min(holds, default=1) // 1024).bit_length() - 1)
