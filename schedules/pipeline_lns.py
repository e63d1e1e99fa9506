"""Large pipeline steps: CP-SAT over windows of micro-batches, around a fixed rest (a rolling
horizon / large-neighbourhood search over the warm start).

One CP-SAT model of a whole step grows with its actions (3 per stage and micro-batch: DeepSeek-V3
at PP=16, V=2, M=32 has 3,072, internal-352b at PP=15, M=360 has 16,200) until the search finds
nothing in its effort (moegraph.schedules.pipeline_cpsat.SEARCH_ACTIONS). Here the step is
improved a window at a time: the actions of K consecutive micro-batches are free, every other
item keeps its place in time (a fixed interval on its rank, its link, its memory), and CP-SAT
re-orders the window under the rules of moegraph.schedules.pipeline (the same constraints as
the whole-step model: ranks and links one item at a time, data flow, micro-batches in order per
stage, the memory cap, I/W splits where allowed; the window's own F&B pairs are kept as they
are, never made or broken). The window's objective is the sum of its actions' ends (everything
as early as it can go, which is what frees the fixed rest to move up); a window holding the
last micro-batch also carries the step's end (syncs, optimizer) and minimises the step first.
The window's order merged with the rest's is re-simulated (``simulate``: the one rule every
order is priced by, so the fixed rest moves up into what the window freed) and kept when the
step is shorter and fits the cap.

Windows: K micro-batches, stepping by K/2, from the step's end to its start, for ``passes``
sweeps or until a sweep keeps nothing. Deterministic: each window's effort is a deterministic
limit (moegraph.solver_limits), one worker, a fixed seed; the number of windows is fixed by K,
M and ``passes``, never by the wall clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from moegraph.schedules.pipeline import (Action, Orders, Pair, PipelineProblem, Timeline, memory_unit, parts,
                                         simulate)
from moegraph.schedules.problem import ScheduleError
from moegraph.solver_limits import set_time_limit

__all__ = ["WindowSearch", "improve_by_windows"]


@dataclass(frozen=True)
class WindowSearch:
    """What ``improve_by_windows`` did: windows solved, kept, the step before and after."""

    windows: int
    kept: int
    before_ticks: int
    after_ticks: int
    wall_s: float


def improve_by_windows(problem: PipelineProblem, start: Timeline, *, window: int = 4, passes: int = 2,
                       max_windows: int | None = None, window_limit_s: float = 1.0, split: bool = True,
                       seed: int = 0) -> tuple[Timeline, WindowSearch]:
    """The best timeline found from ``start`` (module docstring). ``max_windows``: at most this
    many windows per sweep, taken from both ends of the step inwards (the fill and the drain,
    where orders differ; a long steady state between them is left as it is)."""
    t0 = time.perf_counter()
    M = problem.micro_batches
    K = max(1, min(window, M))
    stride = max(1, K // 2)
    firsts = _from_both_ends(sorted({min(m, M - K) for m in range(0, M, stride)}, reverse=True))
    firsts = firsts[:max_windows] if max_windows is not None else firsts
    best, tried, kept = start, 0, 0
    for _ in range(passes):
        changed = False
        for m0 in firsts:
            tried += 1
            orders = _solve_window(problem, best, frozenset(range(m0, m0 + K)), window_limit_s, split, seed)
            if orders is None:
                continue
            try:
                tl = simulate(problem, orders)
            except ScheduleError:           # a tie the time order broke against a dependency
                continue
            if tl.fits and tl.makespan < best.makespan:
                best, changed, kept = tl, True, kept + 1
        if not changed:
            break
    return best, WindowSearch(tried, kept, start.makespan, best.makespan, time.perf_counter() - t0)


def _from_both_ends(xs: list) -> list:
    """x0, x-1, x1, x-2, ...: the ends first."""
    out, lo, hi = [], 0, len(xs) - 1
    while lo <= hi:
        out.append(xs[lo])
        if hi != lo:
            out.append(xs[hi])
        lo, hi = lo + 1, hi - 1
    return out


def _solve_window(problem: PipelineProblem, t: Timeline, free_mbs: frozenset[int], limit_s: float, split: bool,
                  seed: int) -> Orders | None:
    """The orders with the window's actions re-placed by CP-SAT (None: no solution in effort)."""
    w = _Window(problem, t, free_mbs, split)
    if not w.free:
        return None
    solver = cp_model.CpSolver()
    p = solver.parameters
    p.num_workers, p.random_seed = 1, seed
    # the hint (the current timeline) completed with every hinted variable fixed, then the search
    # from that complete solution (as pipeline_cpsat's whole-step solve)
    p.fix_variables_to_their_hinted_value = True
    set_time_limit(p, max(0.1, limit_s / 10))
    if solver.Solve(w.m) in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        w.m.ClearHints()
        for i in range(len(w.m.Proto().variables)):
            var = w.m.GetIntVarFromProtoIndex(i)
            w.m.AddHint(var, solver.Value(var))
    p.fix_variables_to_their_hinted_value = False
    set_time_limit(p, limit_s)
    status = solver.Solve(w.m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return w.orders(solver)


class _Window:
    """The CP-SAT model of one window over a fixed rest (module docstring); handles keyed by
    (kind, stage, micro-batch) as in pipeline_cpsat."""

    def __init__(self, pr: PipelineProblem, t: Timeline, free_mbs: frozenset[int], can_split: bool):
        self.pr, self.t = pr, t
        self.m = m = cp_model.CpModel()
        S, M, P = pr.stages, pr.micro_batches, pr.layout.pp
        rank = [pr.layout.rank_of(s) for s in range(S)]
        # free: the window's items that are single actions (pairs stay as they are)
        self.free: set[tuple[int, int]] = set()          # (stage, mb) whose F, I/B, W are all free
        paired = {a for row in t.orders for i in row if isinstance(i, Pair) for a in parts(i)}
        for s in range(S):
            for j in free_mbs:
                if Action("F", s, j) not in paired and Action("B", s, j) not in paired:
                    self.free.add((s, j))
        if not self.free:
            return
        times = _action_times(t)                          # (kind, s, j) -> (start, end), F/I/W (B fills I and W)
        span = [times[(k, s, j)] for s, j in self.free for k in "FIW"]
        lo0, hi0 = min(b for b, _ in span), max(e for _, e in span)
        lo, hi = max(0, lo0 - (hi0 - lo0)), hi0 + (hi0 - lo0)
        ends_step = M - 1 in free_mbs
        H = t.makespan + (hi0 - lo0) if ends_step else hi
        self.H, unit = H, memory_unit(pr)
        self.start, self.end, self.split = {}, {}, {}

        def fixed(key):
            b, e = times[key]
            return m.NewConstant(b), m.NewConstant(e)
        on_rank: list[list] = [[] for _ in range(P)]
        mem: list[list] = [[] for _ in range(P)]
        for r, row in enumerate(t.orders):          # the rest, where it could meet the window
            for item in row:
                if all((a.stage, a.mb) in self.free for a in parts(item)):
                    continue
                b, e = t.start[item], t.end[item]
                if e > lo and b < H and e > b:
                    on_rank[r].append(m.NewFixedSizeIntervalVar(b, e - b, f"rest[{item}]"))
            if ends_step:
                continue
            b, e = t.optimizer[r]
            if e > b:
                on_rank[r].append(m.NewFixedSizeIntervalVar(b, e - b, f"rest[opt{r}]"))
        for s in range(S):
            w = pr.work[s]
            r = rank[s]
            held_i, held_w = -(-(w.held - w.held_for_w) // unit), -(-w.held_for_w // unit)
            for j in range(M):
                if (s, j) not in self.free:
                    for k in "FIW":
                        self.start[(k, s, j)], self.end[(k, s, j)] = fixed((k, s, j))
                    f0, i1, w1 = times[("F", s, j)][0], times[("I", s, j)][1], times[("W", s, j)][1]
                    if pr.memory_cap_bytes is not None and max(i1, w1) > lo and f0 < H:
                        for size, until in ((held_i, i1), (held_w, w1)):
                            if size and until > f0:
                                mem[r].append((m.NewFixedSizeIntervalVar(f0, until - f0, f"rest_live[{s}.{j}]"), size))
                    continue
                st = {k: m.NewIntVar(lo, H, f"start[{k}{s}.{j}]") for k in "FIW"}
                en = {k: m.NewIntVar(lo, H, f"end[{k}{s}.{j}]") for k in "FIW"}
                for k in "FIW":
                    self.start[(k, s, j)], self.end[(k, s, j)] = st[k], en[k]
                split = self.split[(s, j)] = m.NewBoolVar(f"split[{s}.{j}]")
                if not can_split:
                    m.Add(split == 0)
                m.Add(en["F"] == st["F"] + w.f)
                on_rank[r].append(m.NewFixedSizeIntervalVar(st["F"], w.f, f"run[F{s}.{j}]"))
                size_i = m.NewIntVar(min(w.i, w.b), max(w.i, w.b), f"size[I{s}.{j}]")
                m.Add(size_i == w.b + (w.i - w.b) * split)
                on_rank[r].append(m.NewIntervalVar(st["I"], size_i, en["I"], f"run[I{s}.{j}]"))
                m.Add(st["I"] >= en["F"])
                m.Add(st["W"] >= en["I"])
                m.Add(en["W"] == st["W"] + w.w).OnlyEnforceIf(split)
                m.Add(st["W"] == en["I"]).OnlyEnforceIf(split.Not())
                m.Add(en["W"] == en["I"]).OnlyEnforceIf(split.Not())
                on_rank[r].append(m.NewOptionalFixedSizeIntervalVar(st["W"], w.w, split, f"run[W{s}.{j}]"))
                if pr.memory_cap_bytes is not None:
                    for size, until, tag in ((held_i, en["I"], "live"), (held_w, en["W"], "live_w")):
                        if size:
                            length = m.NewIntVar(0, H, f"{tag}[{s}.{j}]")
                            mem[r].append((m.NewIntervalVar(st["F"], length, until, f"{tag}[{s}.{j}]"), size))
        # micro-batches enter each stage in order (pipeline_cpsat's symmetry cut), the window
        # between its fixed neighbours
        for s, j in self.free:
            if j == 0 and s in t.gather:                # the parameter gathers stay where they are
                m.Add(self.start[("F", s, 0)] >= pr.work[s].gathered_start(t.gather[s][0]))
            for k in "FIW":
                if j > 0:
                    m.Add(self.start[(k, s, j - 1)] <= self.start[(k, s, j)])
                if j + 1 < M and (s, j + 1) not in self.free:
                    m.Add(self.start[(k, s, j)] <= self.start[(k, s, j + 1)])
        # data flow and transfers
        links: dict[tuple[int, int], list] = {}
        self.xfer: dict[tuple[str, int, int], cp_model.IntVar] = {}
        for tr in t.transfers:                      # the rest's transfers stay where they are
            touches = (tr.stage, tr.mb) in self.free or (
                (tr.stage + 1 if tr.direction == "fwd" else tr.stage - 1, tr.mb) in self.free)
            if not touches and tr.end > lo and tr.start < H and tr.end > tr.start:
                links.setdefault(tr.link, []).append(m.NewFixedSizeIntervalVar(tr.start, tr.end - tr.start,
                                                                               f"rest_link[{tr}]"))
        for s in range(S - 1):
            for j in free_mbs:
                if (s, j) in self.free or (s + 1, j) in self.free:
                    add_transfers(m, pr, s, j, self.start, self.end, self.xfer, links, H)
        for ivs in links.values():
            m.AddNoOverlap(ivs)
        for r in range(P):
            if pr.memory_cap_bytes is not None and mem[r]:
                cap = (pr.memory_cap_bytes - pr.static_bytes[r]) // unit
                m.AddCumulative([iv for iv, _ in mem[r]], [d for _, d in mem[r]], max(0, cap))
        ends = [self.end[(k, s, j)] for s, j in sorted(self.free) for k in "FIW"]
        if ends_step:
            makespan = self._step_end(on_rank, rank)
            m.Minimize(makespan * (len(ends) * H + 1) + sum(ends))
        else:
            m.Minimize(sum(ends))
        for r in range(P):
            m.AddNoOverlap(on_rank[r])
        self._hint(times)
        for tr in t.transfers:
            if (tr.direction, tr.stage, tr.mb) in self.xfer:
                m.AddHint(self.xfer[(tr.direction, tr.stage, tr.mb)], tr.start)

    def _step_end(self, on_rank: list[list], rank: list[int]):
        """Syncs on each rank's DP stream after its stages' last backward, then the optimizer."""
        m, pr, H, t = self.m, self.pr, self.H, self.t
        makespan = m.NewIntVar(0, H, "makespan")
        m.AddHint(makespan, t.makespan)
        sync: dict[int, cp_model.IntVar] = {}
        dp: list[list] = [[] for _ in range(pr.layout.pp)]
        for s in range(pr.stages):
            x = sync[s] = m.NewIntVar(0, H, f"sync[{s}]")
            m.AddHint(x, t.sync[s][0])
            for j in range(pr.micro_batches):
                m.Add(x >= self.end[("W", s, j)])
            dp[rank[s]].append(m.NewFixedSizeIntervalVar(x, pr.work[s].sync, f"dp[{s}]"))
            if s in t.gather:
                b, e = t.gather[s]
                dp[rank[s]].append(m.NewFixedSizeIntervalVar(b, e - b, f"dp_gather[{s}]"))
        for r in range(pr.layout.pp):
            x = m.NewIntVar(0, H, f"opt[{r}]")
            m.AddHint(x, t.optimizer[r][0])
            for s in pr.layout.stages_of(r):
                m.Add(x >= sync[s] + pr.work[s].sync)
            on_rank[r].append(m.NewFixedSizeIntervalVar(x, pr.optimizer[r], f"opt[{r}]"))
            m.Add(makespan >= x + pr.optimizer[r])
            m.AddNoOverlap(dp[r])
        return makespan

    def _hint(self, times: dict) -> None:
        for (s, j), lit in self.split.items():
            self.m.AddHint(lit, int(any(isinstance(i, Action) and i == Action("W", s, j)
                                        for i in self.t.orders[self.pr.layout.rank_of(s)])))
            for k in "FIW":
                b, e = times[(k, s, j)]
                self.m.AddHint(self.start[(k, s, j)], b)
                self.m.AddHint(self.end[(k, s, j)], e)

    def orders(self, solver: cp_model.CpSolver) -> Orders:
        """Per rank: the rest's items at their times and the window's at the solution's, in time order."""
        rows: list[list] = [[] for _ in range(self.pr.layout.pp)]
        for r, row in enumerate(self.t.orders):
            for pos, item in enumerate(row):
                if not all((a.stage, a.mb) in self.free for a in parts(item)):
                    rows[r].append((self.t.start[item], 0, pos, item))
        for s, j in self.free:
            r = self.pr.layout.rank_of(s)
            split = solver.Value(self.split[(s, j)])
            rows[r].append((solver.Value(self.start[("F", s, j)]), 1, 0, Action("F", s, j)))
            rows[r].append((solver.Value(self.start[("I", s, j)]), 1, 1, Action("I" if split else "B", s, j)))
            if split:
                rows[r].append((solver.Value(self.start[("W", s, j)]), 1, 2, Action("W", s, j)))
        return tuple(tuple(x[3] for x in sorted(row, key=lambda x: (x[0], x[1], x[2], str(x[3])))) for row in rows)


def add_transfers(m: cp_model.CpModel, pr: PipelineProblem, s: int, j: int, start: dict, end: dict, xfer: dict,
                  links: dict, horizon: int) -> None:
    """Micro-batch j's data flow across the boundary of stages s and s+1 (its output forward,
    its input gradient back): on one rank the consumer follows the producer; across ranks a
    transfer ``xfer[...]`` of the boundary's ticks on its link's NoOverlap list (``PipelineProblem.link``)."""
    rank = pr.layout.rank_of
    for direction, src, dst, ticks, made, needed in (
            ("fwd", s, s + 1, pr.send[s], ("F", s, j), ("F", s + 1, j)),
            ("bwd", s + 1, s, pr.send_back[s], ("I", s + 1, j), ("I", s, j))):
        if rank(src) == rank(dst):
            m.Add(start[needed] >= end[made])
            continue
        x = xfer[(direction, src, j)] = m.NewIntVar(0, horizon, f"xfer[{direction}{src}.{j}]")
        m.Add(x >= end[made])
        m.Add(start[needed] >= x + ticks)
        if ticks:
            links.setdefault(pr.link(rank(src), rank(dst)), []).append(
                m.NewFixedSizeIntervalVar(x, ticks, f"link[{direction}{src}.{j}]"))


def _action_times(t: Timeline) -> dict[tuple[str, int, int], tuple[int, int]]:
    """(kind, stage, mb) -> (start, end) for F, I and W of every (stage, micro-batch): a B (alone
    or in a pair) gives I its span and W an empty one at its end."""
    out = {}
    for row in t.orders:
        for item in row:
            b, e = t.start[item], t.end[item]
            for a in parts(item):
                if a.kind == "B":
                    out[("I", a.stage, a.mb)], out[("W", a.stage, a.mb)] = (b, e), (e, e)
                else:
                    out[(a.kind, a.stage, a.mb)] = (b, e)
    return out
