"""`moegraph tune --pp P`: strategies ranked by the predicted whole pipeline step.

Each candidate (``moegraph.schedules.tune.candidates``: attn x ffn x dispatch x chunks x remat)
is the pipeline config ``candidate_config`` makes of the pipeline base (its layers lowered with
the candidate's typed passes, the same path as `compile --pp`). Two stages, as tune's:

  estimate  the units priced by the greedy list schedule, the layers cut into stages by that
            price, each rank's whole memory checked against the budget (a candidate whose
            least peak is over it is infeasible: ``check_pipeline_budget``), and every order
            the driver starts from simulated (torch's generated schedules; the least-memory
            order when none of them fits the budget): the shortest that fits ranks it.
  refine    the best ``refine`` estimates, plus the best of every attn x ffn family, compiled
            as `compile --pp` compiles them (the driver's ``build``: units priced by CP-SAT,
            the stage-level order by CP-SAT against the same orders).

The reference is the tp+tp candidate without passes priced by the sequential list schedule (no
overlap inside a unit), its best order among the same warm starts: speed-ups are relative to its
whole step. No cache: an estimate is list-scheduled (a fraction of a second per distinct layer).
"""

from __future__ import annotations

import time
from typing import Any

from moegraph.config import CompileConfig
from moegraph.ir import Strategy
from moegraph.options import format_bytes
from moegraph.registry import Hardware, load_hardware
from moegraph.schedules.driver import (CompiledPipeline, build, check_pipeline_budget, load_config_model, lower,
                                       pipeline_warm_starts, price_pipeline)
from moegraph.schedules.pipeline import simulate
from moegraph.schedules.pipeline_report import timeline_row
from moegraph.schedules.problem import MemoryBudgetError
from moegraph.schedules.tune import baseline_label, baseline_strategy, candidate_config, candidates, to_refine

__all__ = ["tune_pipeline", "format_pipeline_table"]


def _estimate(config: CompileConfig) -> dict[str, Any]:
    """A candidate's estimate (module docstring): its best fitting order's figures, or why none fits."""
    lowered = lower(config)
    built = price_pipeline(config, lowered)
    try:
        check_pipeline_budget(built.problem)
    except MemoryBudgetError as err:
        return {"feasible": False, "why": str(err), "least_peak_bytes": err.least_peak_bytes}
    warm, _ = pipeline_warm_starts(built.problem)
    timelines = {name: simulate(built.problem, o) for name, o in warm.items()}
    name = min((n for n, t in timelines.items() if t.fits), key=lambda n: (timelines[n].makespan, n))
    return {"feasible": True, "scheduler": name, **timeline_row(timelines[name]), "_timeline": timelines[name],
            "graph": lowered.layers[-1]}


def _refined(config: CompileConfig) -> dict[str, Any]:
    """A candidate compiled as `compile --pp` compiles it (CP-SAT at both levels)."""
    compiled: CompiledPipeline = build(config.replace(schedule="cpsat"))
    return {"feasible": True, "scheduler": compiled.result.source, **timeline_row(compiled.timeline),
            "_timeline": compiled.timeline, "_compiled": compiled, "graph": compiled.lowered.layers[-1]}


def tune_pipeline(base: CompileConfig, *, refine: int = 3, progress=None) -> dict[str, Any]:
    """Rank every candidate by its predicted pipeline step (module docstring). ``base``: the
    pipeline config (model, sizes, layers, pp, vpp, placement, M, budget, hardware, effort); its
    strategy's n and dtype are the candidates'. The result is what `tune --pp --json` prints
    (``_best``: the pick's timeline and compiled step, for the CSV and chart)."""
    if base.pp < 2:
        raise ValueError(f"tune_pipeline ranks pipeline steps: base.pp={base.pp} must be >= 2")
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    n, dtype = base.strategy.n, base.strategy.dtype
    model, layers = load_config_model(base)
    hw = base.hardware if isinstance(base.hardware, Hardware) else load_hardware(base.hardware)
    base = base.replace(model=model, top_k=None, layers=layers, hardware=hw)   # loaded once for every candidate
    reference_strategy = baseline_strategy(model, n, base.seq, base.batch, dtype, dp=base.strategy.dp)
    reference_name = baseline_label(reference_strategy)
    reference = _estimate(base.replace(strategy=reference_strategy, passes=(), schedule="sequential", memory_budget=None))
    rows = []
    cands = candidates(model, n, base.seq, dtype, hw.gpus_per_node, base.batch)
    for i, cand in enumerate(cands, 1):
        config = candidate_config(base, cand).replace(schedule="greedy")
        entry = _estimate(config)
        rows.append({"candidate": cand, "config": config, "stage1": entry})
        say(f"[{time.perf_counter() - t0:6.1f}s] {i:>2}/{len(cands)} {cand.label():<46} "
            + (f"{entry['scheduler']} {entry['step_us'] / 1e3:,.3f} ms" if entry["feasible"] else
               f"over the budget: least peak {format_bytes(entry['least_peak_bytes'])}"))
    feasible = sorted((r for r in rows if r["stage1"]["feasible"]), key=lambda r: r["stage1"]["step_us"])
    if not feasible:
        least = min(rows, key=lambda r: r["stage1"]["least_peak_bytes"])
        raise MemoryBudgetError(f"no candidate's pipeline step fits the memory budget "
                                f"{format_bytes(base.memory_budget)} per rank: the smallest feasible budget of any "
                                f"is {format_bytes(least['stage1']['least_peak_bytes'])} "
                                f"({least['candidate'].label().strip()})", least["stage1"]["least_peak_bytes"], True)
    for r in to_refine(feasible, refine):
        r["final"] = _refined(r["config"])
        say(f"[{time.perf_counter() - t0:6.1f}s] cp-sat {r['candidate'].label():<46} "
            f"{r['final']['scheduler']} {r['final']['step_us'] / 1e3:,.3f} ms")
    ref_us = reference["step_us"]
    order = sorted(rows, key=lambda r: _rank_key(_row(r, ref_us)))
    ranked = [_row(r, ref_us) for r in order]
    best = order[0].get("final") or order[0]["stage1"]
    return {"model": model.name, "hardware": hw.name, "n": n, "batch": base.batch, "seq": base.seq,
            "layers": layers, "pp": base.pp, "vpp": base.vpp,
            "placement": base.placement, "micro_batches": base.micro_batches, "memory_budget_bytes": base.memory_budget,
            "baseline": {"strategy": reference_name, "scheduler": reference["scheduler"], "step_us": ref_us,
                         "peak_memory_bytes": reference["peak_memory_bytes"]},
            "best": ranked[0], "candidates": ranked, "wall_s": round(time.perf_counter() - t0, 2),
            "_best": best}


def _row(r: dict[str, Any], reference_us: float) -> dict[str, Any]:
    """One ranked row: the candidate's point and its final figures (CP-SAT's when refined)."""
    final = r.get("final") or r["stage1"]
    c = r["candidate"]
    out = {"attn": c.attn, "ffn": c.ffn, "dispatch": c.dispatch, "chunks": c.chunks, "remat": c.remat,
           "strategy": (final["graph"].strategy.as_dict() if final["feasible"] else c.as_dict()),
           "feasible": final["feasible"], "refined": "final" in r}
    if final["feasible"]:
        out |= {k: v for k, v in final.items() if not k.startswith("_") and k != "graph"}
        out["speedup"] = round(reference_us / final["step_us"], 4)
    else:
        out |= {"why": final["why"], "least_peak_bytes": final["least_peak_bytes"]}
    return out


def _rank_key(row: dict[str, Any]):
    return (not row["feasible"], row.get("step_us", float("inf")), row.get("peak_memory_bytes", 0), row["attn"],
            row["ffn"], row["dispatch"], row["chunks"], row["remat"])


def format_pipeline_table(res: dict[str, Any]) -> str:
    base, budget = res["baseline"], res["memory_budget_bytes"]
    lines = [f"{res['model']} on {res['hardware']}, n={res['n']}, b={res['batch']}, s={res['seq']}, "
             f"{res['layers']} layers in pp={res['pp']} x vpp={res['vpp']} ({res['placement']}), "
             f"M={res['micro_batches']}: baseline {base['strategy']} ({base['scheduler']}) "
             f"{base['step_us'] / 1e3:,.3f} ms per step"
             + (f", memory budget {format_bytes(budget)} per rank" if budget is not None else "")]
    w = max(8, *(len(r.get("scheduler", "-")) for r in res["candidates"]))
    wn = max(40, *(len(Strategy.from_dict(r["strategy"]).label()) for r in res["candidates"]))
    lines.append(f"{'#':>3} {'strategy':<{wn}} {'sched':<{w}} {'step ms':>11} {'bubble':>7} {'peak':>10} "
                 f"{'speedup':>8}")
    for i, r in enumerate(res["candidates"], 1):
        name = Strategy.from_dict(r["strategy"]).label()
        if r["feasible"]:
            lines.append(f"{i:>3} {name:<{wn}} {r['scheduler']:<{w}} "
                         f"{r['step_us'] / 1e3:>11,.3f} {r['bubble_fraction']:>7.3f} "
                         f"{format_bytes(r['peak_memory_bytes']):>10} {r['speedup']:>7.3f}x")
        else:
            lines.append(f"{i:>3} {name:<{wn}} {'-':<{w}} {'over budget':>11} {'':>7} "
                         f"{'>=' + format_bytes(r['least_peak_bytes']):>10}")
    b = res["best"]
    lines.append(f"best: {' '.join(Strategy.from_dict(b['strategy']).label().split())} ({b['scheduler']}), "
                 f"predicted step {b['step_us'] / 1e3:,.3f} ms, {b['speedup']:.3f}x the {base['strategy']} baseline")
    if res.get("schedule_file"):
        lines.append(f"wrote {res['schedule_file']} (best order, torch action CSV) and {res['gantt']} (its chart)")
    return "\n".join(lines)
