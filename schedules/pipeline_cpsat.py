"""The stage-level pipeline schedule by CP-SAT: per rank, the order of F, I, W (or B) and F&B pairs.

The upper level of the hierarchical solve: the op-level schedule prices each unit
(moegraph.schedules.pipeline_price), this model orders the units of all stages and micro-batches
under the rules of moegraph.schedules.pipeline (``simulate`` states them; this model states the
same as constraints). Variables, named after their action (``F3.5``: stage 3, micro-batch 5):

    start[a], end[a]    F, I, W of each (stage, micro-batch); ticks
    split[s.m]          the backward runs as I then W (zero-bubble's split) rather than as one B:
                        I lasts i if split, else b, and W (w ticks) is present only if split
    pair[F a.m1|B b.m2] the rank runs F(a, m1) beside B(b, m2) as one OVERLAP_F_B item (candidate
                        pairs only, ``candidate_pairs``): both start together and end together
    xfer[...]           each transfer between two ranks: a fixed interval on its directed link
    sync[s], opt[r]     the step end: stage syncs on the rank's DP stream, then its optimizer
    gather[s]           a stage's parameter gather at the step's start (``StageWork.gather`` > 0),
                        on the same DP stream, before F(s, 0)
    makespan            the objective

A rank's items (solo F, I, W, pairs, optimizer) share one NoOverlap; each link one NoOverlap;
each rank's activations one cumulative under its memory cap (in units of a power of two near
1/1024 of the smallest per-micro-batch hold, ``memory_unit``; holds rounded up, the cap down: a
solution here always fits in bytes, and loses at most 0.1% of a hold to the rounding). Micro-batches enter each stage in order (F, I and W of
micro-batch m before m+1's), as in every torch schedule: a symmetry cut, micro-batches cost the
same.

Warm start: the best torch schedule that fits the cap (``moegraph.schedules.pipeline_torch``),
its timeline as a complete hint, solved first with every variable fixed to it (a feasibility
check that fills in the rest), then searched with ``makespan <=`` its value, as the op-level
solver does (moegraph.schedules.cpsat). The returned order is CP-SAT's when its timeline
(re-simulated: the one rule for every order) is shorter than every warm start's, else the best
warm start's, named as the source. Deterministic: one worker by default, interleaved search, a
fixed seed and a deterministic time limit (moegraph.solver_limits); more workers search interleaved
(deterministic for any count).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Mapping

from ortools.sat.python import cp_model

from moegraph.schedules.pipeline import (Action, Orders, Pair, PipelineProblem, Timeline, memory_unit, parts,
                                         simulate)
from moegraph.schedules.pipeline_lns import WindowSearch, add_transfers, improve_by_windows
from moegraph.schedules.problem import ScheduleError
from moegraph.solver_limits import set_time_limit

__all__ = ["PipelineResult", "solve_pipeline", "candidate_pairs", "SEARCH_ACTIONS"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineResult:
    timeline: Timeline
    source: str
    """'cpsat', or the warm start's name when CP-SAT found nothing shorter."""
    status: str
    wall_s: float
    warm_starts: Mapping[str, Timeline]
    cpsat_step_ticks: int | None
    """The re-simulated step of CP-SAT's own order (None: no solution)."""
    bound_ticks: int | None
    windows: WindowSearch | None = None
    """The window search after the whole-step one (None: not asked)."""


def candidate_pairs(problem: PipelineProblem, orders: Mapping[str, Orders]) -> list[tuple[Action, Action]]:
    """(F, B) pairs a rank may overlap: those the warm starts overlap, and for stages a, b on one
    rank the micro-batch offsets of a steady state in which each rank alternates F and B:
    F(a, m1) becomes ready about when B(b, m2) does for m1 - m2 = (2S - 1 - a - b) / 2."""
    S, M = problem.stages, problem.micro_batches
    out: dict[tuple[Action, Action], None] = {}
    for o in orders.values():
        for row in o:
            for item in row:
                if isinstance(item, Pair):
                    out[(item.forward, item.backward)] = None
    for r in range(problem.layout.pp):
        stages = problem.layout.stages_of(r)
        for a in stages:
            for b in stages:
                if min(problem.work[a].pair_saving, problem.work[b].pair_saving) <= 0:
                    continue
                d = (2 * S - 1 - a - b) / 2
                for off in sorted({math.floor(d), math.ceil(d)}):
                    for m2 in range(M):
                        m1 = m2 + off
                        if 0 <= m1 < M and not (a == b and m1 == m2):
                            out[(Action("F", a, m1), Action("B", b, m2))] = None
    return list(out)


def _whole_backwards(orders: Orders) -> Orders:
    """``orders`` with each I run as the whole B (at I's place) and each W dropped."""
    return tuple(tuple(Action("B", i.stage, i.mb) if isinstance(i, Action) and i.kind == "I" else i
                       for i in row if not (isinstance(i, Action) and i.kind == "W")) for row in orders)


SEARCH_ACTIONS = 8000
"""Most actions (F, I, W over stages and micro-batches) the whole-step search takes on. Above it
(e.g. internal-352b's PP=15 x M=360 step, 16,200 actions) the search found no solution in 3 s of
effort, even from the complete hint, and took 94 s of wall time on the 2-core box: the model is
not built (``status`` SKIPPED) and only the window search (moegraph.schedules.pipeline_lns) runs."""


def solve_pipeline(problem: PipelineProblem, warm_starts: Mapping[str, Orders], *, time_limit_s: float = 30.0,
                   pairs: bool = True, split: bool = True, workers: int = 1, seed: int = 0, windows: int = 0,
                   window: int = 4, window_limit_s: float = 1.0, cross_pairs: bool = True) -> PipelineResult:
    """Order the pipeline step (module docstring). ``warm_starts``: name -> orders (torch's
    schedules); at least one must fit the memory cap. Steps of more than ``SEARCH_ACTIONS``
    actions skip the whole-step search. ``pairs``: F&B pairs allowed; ``split``: a backward
    may run as I then W (False for stages whose backward is one unit, e.g. moegraph's compiled
    stages: a warm start's I becomes B, its W goes). ``cross_pairs``: a pair may overlap two
    stages' F and B (False: a stage's F beside its own B only, what a compiled stage's merged
    F&B runs; warm starts pairing two stages are left out). ``windows`` > 0: then up to that many windows
    of ``window`` micro-batches per sweep, ``window_limit_s`` of effort each, improve the best
    order so far (moegraph.schedules.pipeline_lns; two sweeps at most)."""
    t0 = time.perf_counter()
    if not split:       # a split warm start runs each whole backward where its I was
        warm_starts = {(k if o == whole else f"{k} (B at I)"): whole
                       for k, o in warm_starts.items() for whole in [_whole_backwards(o)]}
    if not cross_pairs:
        warm_starts = {k: o for k, o in warm_starts.items() if not any(
            isinstance(i, Pair) and i.forward.stage != i.backward.stage for row in o for i in row)}
        if not warm_starts:
            raise ScheduleError("cross_pairs=False, but every warm start pairs two stages' F and B")
    timelines = {name: simulate(problem, o) for name, o in warm_starts.items()}
    fitting = {k: t for k, t in timelines.items() if t.fits}
    if not fitting:
        peaks = ", ".join(f"{k} {max(t.peak_bytes) / 2**30:.2f} GiB" for k, t in timelines.items())
        raise ScheduleError(f"no warm start fits the memory cap {problem.memory_cap_bytes / 2**30:.2f} GiB "
                            f"per rank ({peaks})")
    best_name = min(fitting, key=lambda k: (fitting[k].makespan, k))
    best = fitting[best_name]
    actions = 3 * problem.stages * problem.micro_batches
    if actions > SEARCH_ACTIONS:
        _log.info("pipeline: %d actions > %d: no whole-step search", actions, SEARCH_ACTIONS)
        return _windows(PipelineResult(best, best_name, "SKIPPED", 0.0, timelines, None, None), problem, split,
                        seed, windows, window, window_limit_s, t0)
    cands = [(f, b) for f, b in candidate_pairs(problem, warm_starts) if cross_pairs or f.stage == b.stage] if pairs else []
    model = _Model(problem, cands, split)
    model.hint(best)
    solver = cp_model.CpSolver()
    p = solver.parameters
    p.num_workers = workers
    p.random_seed = seed
    p.interleave_search = workers > 1
    # stage 1: the hint, every hinted variable fixed: a feasibility check completing the solution
    p.fix_variables_to_their_hinted_value = True
    set_time_limit(p, max(1.0, time_limit_s / 10))
    status = solver.Solve(model.m)
    _log.info("pipeline: fixed warm start %s: %s in %.1f s", best_name, solver.StatusName(status), solver.WallTime())
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        model.rehint(solver)
        model.m.Add(model.makespan <= solver.Value(model.makespan))
    p.fix_variables_to_their_hinted_value = False
    # one worker: the plain search, which starts from the complete hint; the interleaved
    # subsolvers lost it on DeepSeek-V3's 3,072 actions (no solution at all in the same effort)
    p.interleave_search = workers > 1
    set_time_limit(p, time_limit_s)
    status = solver.Solve(model.m)
    name = solver.StatusName(status)
    _log.info("pipeline: search: %s in %.1f s", name, solver.WallTime())
    own, bound = None, None
    chosen, source = best, best_name
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        bound = int(solver.BestObjectiveBound())
        timeline = simulate(problem, model.orders(solver))
        own = timeline.makespan
        if timeline.fits and timeline.makespan < best.makespan:
            chosen, source = timeline, "cpsat"
    return _windows(PipelineResult(chosen, source, name, 0.0, timelines, own, bound), problem, split, seed, windows,
                    window, window_limit_s, t0)


def _windows(res: PipelineResult, problem: PipelineProblem, split: bool, seed: int, windows: int, window: int,
             limit_s: float, t0: float) -> PipelineResult:
    """``res`` improved by the window search when asked (source 'cpsat' if it shortened the step)."""
    if windows <= 0:
        return dataclasses.replace(res, wall_s=time.perf_counter() - t0)
    timeline, search = improve_by_windows(problem, res.timeline, window=window, max_windows=windows,
                                          window_limit_s=limit_s, split=split, seed=seed)
    _log.info("pipeline: windows: %s", search)
    source = "cpsat" if search.after_ticks < search.before_ticks else res.source
    return dataclasses.replace(res, timeline=timeline, source=source, wall_s=time.perf_counter() - t0,
                               windows=search)


class _Model:
    """The CP-SAT model of a PipelineProblem (module docstring); handles keyed by action."""

    def __init__(self, problem: PipelineProblem, pairs: list[tuple[Action, Action]], can_split: bool = True):
        self.problem = pr = problem
        self.m = m = cp_model.CpModel()
        S, M, P = pr.stages, pr.micro_batches, pr.layout.pp
        rank = [pr.layout.rank_of(s) for s in range(S)]
        unit = memory_unit(pr)
        horizon = (sum(w.f + max(w.b, w.i + w.w) + w.sync + w.gather for w in pr.work) * M + sum(pr.send) * M
                   + sum(pr.send_back) * M + sum(pr.optimizer))
        self.horizon = H = max(1, horizon)
        self.start, self.end, self.split = {}, {}, {}
        on_rank: list[list] = [[] for _ in range(P)]
        mem: list[list] = [[] for _ in range(P)]
        self.pair_lit: dict[tuple[Action, Action], cp_model.IntVar] = {}
        by_part: dict[Action, list] = {}
        for f, b in pairs:
            lit = m.NewBoolVar(f"pair[{f}|{b}]")
            self.pair_lit[(f, b)] = lit
            by_part.setdefault(f, []).append(lit)
            by_part.setdefault(b, []).append(lit)
        for s in range(S):
            w = pr.work[s]
            r = rank[s]
            for j in range(M):
                for k in "FIW":
                    self.start[(k, s, j)] = m.NewIntVar(0, H, f"start[{k}{s}.{j}]")
                    self.end[(k, s, j)] = m.NewIntVar(0, H, f"end[{k}{s}.{j}]")
                st, en = (lambda k: self.start[(k, s, j)]), (lambda k: self.end[(k, s, j)])
                split = self.split[(s, j)] = m.NewBoolVar(f"split[{s}.{j}]")
                if not can_split:
                    m.Add(split == 0)
                f_pairs = by_part.get(Action("F", s, j), [])
                b_pairs = by_part.get(Action("B", s, j), [])
                solo_f = m.NewBoolVar(f"solo[F{s}.{j}]")
                m.Add(solo_f + sum(f_pairs) == 1)
                solo_b = m.NewBoolVar(f"solo[B{s}.{j}]")
                m.Add(solo_b + sum(b_pairs) == 1)
                for lit in b_pairs:
                    m.AddImplication(lit, split.Not())
                m.Add(en("F") == st("F") + w.f).OnlyEnforceIf(solo_f)
                on_rank[r].append(m.NewOptionalFixedSizeIntervalVar(st("F"), w.f, solo_f, f"run[F{s}.{j}]"))
                size_i = m.NewIntVar(min(w.i, w.b), max(w.i, w.b), f"size[I{s}.{j}]")
                m.Add(size_i == w.b + (w.i - w.b) * split)
                m.Add(en("I") == st("I") + size_i).OnlyEnforceIf(solo_b)
                on_rank[r].append(m.NewOptionalIntervalVar(st("I"), size_i, en("I"), solo_b, f"run[I{s}.{j}]"))
                m.Add(st("I") >= en("F"))
                m.Add(st("W") >= en("I"))
                m.Add(en("W") == st("W") + w.w).OnlyEnforceIf(split)
                m.Add(st("W") == en("I")).OnlyEnforceIf(split.Not())
                m.Add(en("W") == en("I")).OnlyEnforceIf(split.Not())
                on_rank[r].append(m.NewOptionalFixedSizeIntervalVar(st("W"), w.w, split, f"run[W{s}.{j}]"))
                if j:
                    for k in "FIW":
                        m.Add(self.start[(k, s, j - 1)] <= st(k))
                if pr.memory_cap_bytes is not None:
                    held_i = -(-(w.held - w.held_for_w) // unit)
                    held_w = -(-w.held_for_w // unit)
                    if held_i:
                        size = m.NewIntVar(0, H, f"live[{s}.{j}]")
                        mem[r].append((m.NewIntervalVar(st("F"), size, en("I"), f"live[{s}.{j}]"), held_i))
                    if held_w:
                        size = m.NewIntVar(0, H, f"live_w[{s}.{j}]")
                        mem[r].append((m.NewIntervalVar(st("F"), size, en("W"), f"live_w[{s}.{j}]"), held_w))
        for (f, b), lit in self.pair_lit.items():
            dur = pr.pair_ticks(f.stage, b.stage)
            ps = self.start[("F", f.stage, f.mb)]
            on_rank[rank[f.stage]].append(m.NewOptionalFixedSizeIntervalVar(ps, dur, lit, f"run[{f}|{b}]"))
            m.Add(self.start[("I", b.stage, b.mb)] == ps).OnlyEnforceIf(lit)
            m.Add(self.end[("F", f.stage, f.mb)] == ps + dur).OnlyEnforceIf(lit)
            m.Add(self.end[("I", b.stage, b.mb)] == ps + dur).OnlyEnforceIf(lit)
        # transfers and the data flow between stages
        self.xfer: dict[tuple[str, int, int], cp_model.IntVar] = {}
        links: dict[tuple[int, int], list] = {}
        for s in range(S - 1):
            for j in range(M):
                add_transfers(m, pr, s, j, self.start, self.end, self.xfer, links, H)
        for ivs in links.values():
            m.AddNoOverlap(ivs)
        for j in range(M):
            m.Add(self.start[("I", S - 1, j)] >= self.end[("F", S - 1, j)])
        # the step end
        self.makespan = m.NewIntVar(0, H, "makespan")
        self.sync, self.opt = {}, {}
        dp: list[list] = [[] for _ in range(P)]
        self.gather = {}
        for s in range(S):
            x = self.sync[s] = m.NewIntVar(0, H, f"sync[{s}]")
            for j in range(M):
                m.Add(x >= self.end[("W", s, j)])
            dp[rank[s]].append(m.NewFixedSizeIntervalVar(x, pr.work[s].sync, f"dp[{s}]"))
            if pr.work[s].gather:
                g = self.gather[s] = m.NewIntVar(0, H, f"gather[{s}]")
                w = pr.work[s]
                lead, tail = (w.gather_lead, w.f_tail) if w.gather_lead or w.f_tail else (w.gather, w.f)
                m.Add(self.start[("F", s, 0)] >= g + lead)
                m.Add(self.start[("F", s, 0)] >= g + w.gather + tail - w.f)
                dp[rank[s]].append(m.NewFixedSizeIntervalVar(g, pr.work[s].gather, f"dp_gather[{s}]"))
        for r in range(P):
            x = self.opt[r] = m.NewIntVar(0, H, f"opt[{r}]")
            for s in pr.layout.stages_of(r):
                m.Add(x >= self.sync[s] + pr.work[s].sync)
            on_rank[r].append(m.NewFixedSizeIntervalVar(x, pr.optimizer[r], f"opt[{r}]"))
            m.Add(self.makespan >= x + pr.optimizer[r])
            m.AddNoOverlap(on_rank[r])
            m.AddNoOverlap(dp[r])
            if pr.memory_cap_bytes is not None and mem[r]:
                cap = (pr.memory_cap_bytes - pr.static_bytes[r]) // unit
                if cap < 0:
                    raise ScheduleError(f"rank {r}'s states ({pr.static_bytes[r] / 2**30:.2f} GiB) exceed the memory "
                                        f"cap {pr.memory_cap_bytes / 2**30:.2f} GiB before any activation")
                m.AddCumulative([iv for iv, _ in mem[r]], [d for _, d in mem[r]], cap)
        m.Minimize(self.makespan)

    def hint(self, t: Timeline) -> None:
        """Hint every variable from a simulated timeline of an order."""
        m = self.m
        values: dict = {}
        for row in t.orders:
            for item in row:
                b, e = t.start[item], t.end[item]
                if isinstance(item, Pair):
                    f, bw = item.forward, item.backward
                    values.update({("F", f.stage, f.mb): (b, e), ("I", bw.stage, bw.mb): (b, e),
                                   ("W", bw.stage, bw.mb): (e, e)})
                    if (f, bw) in self.pair_lit:
                        m.AddHint(self.pair_lit[(f, bw)], 1)
                    m.AddHint(self.split[(bw.stage, bw.mb)], 0)
                    continue
                a = item
                if a.kind == "B":
                    values.update({("I", a.stage, a.mb): (b, e), ("W", a.stage, a.mb): (e, e)})
                    m.AddHint(self.split[(a.stage, a.mb)], 0)
                else:
                    values[(a.kind, a.stage, a.mb)] = (b, e)
                    if a.kind == "W":
                        m.AddHint(self.split[(a.stage, a.mb)], 1)
        hinted = {k for k, lit in self.pair_lit.items()
                  if any(isinstance(i, Pair) and (i.forward, i.backward) == k for row in t.orders for i in row)}
        for k, lit in self.pair_lit.items():
            if k not in hinted:
                m.AddHint(lit, 0)
        for key, (b, e) in values.items():
            m.AddHint(self.start[key], b)
            m.AddHint(self.end[key], e)
        for tr in t.transfers:
            m.AddHint(self.xfer[(tr.direction, tr.stage, tr.mb)], tr.start)
        for s, (b, _) in t.sync.items():
            m.AddHint(self.sync[s], b)
        for s, (b, _) in t.gather.items():
            m.AddHint(self.gather[s], b)
        for r, (b, _) in t.optimizer.items():
            m.AddHint(self.opt[r], b)
        m.AddHint(self.makespan, t.makespan)

    def rehint(self, solver: cp_model.CpSolver) -> None:
        """Replace the hint with the solver's complete solution."""
        self.m.ClearHints()
        for i in range(len(self.m.Proto().variables)):
            var = self.m.GetIntVarFromProtoIndex(i)
            self.m.AddHint(var, solver.Value(var))

    def orders(self, solver: cp_model.CpSolver) -> Orders:
        """Per rank, its items in start order."""
        pr = self.problem
        rows: list[list] = [[] for _ in range(pr.layout.pp)]
        paired: set[Action] = set()
        for (f, b), lit in self.pair_lit.items():
            if solver.Value(lit):
                rows[pr.layout.rank_of(f.stage)].append((solver.Value(self.start[("F", f.stage, f.mb)]), 0, Pair(f, b)))
                paired |= {f, b}
        for (k, s, j), var in self.start.items():
            r = pr.layout.rank_of(s)
            split = solver.Value(self.split[(s, j)])
            if k == "F" and Action("F", s, j) not in paired:
                rows[r].append((solver.Value(var), 0, Action("F", s, j)))
            elif k == "I" and Action("B", s, j) not in paired:
                rows[r].append((solver.Value(var), 1, Action("I" if split else "B", s, j)))
            elif k == "W" and split:
                rows[r].append((solver.Value(var), 2, Action("W", s, j)))
        return tuple(tuple(item for _, _, item in sorted(row, key=lambda x: (x[0], x[1], str(x[2])))) for row in rows)

