"""What `compile --pp`, `trace --pp` and `tune --pp` report of a pipeline step.

Per order (CP-SAT's, each torch schedule's): the step, the bubble (idle compute within the
step), the exposed communication (p2p waits of the worst rank, the step-end sync not hidden, a
parameter gather waited on) and the peak memory of the worst rank, all from the one timeline
rule (``moegraph.schedules.pipeline.simulate``). Per pipeline rank: its peak memory component
by component (``moegraph.memory.COMPONENTS``: parameters, fp32 main gradients, optimizer
states, the activations of its in-flight micro-batches at the peak, p2p buffers).

``compile_summary`` renders a ``CompiledPipeline`` (solved); ``estimate_summary`` a lowered
pipeline config priced by the greedy list schedule with torch's schedules simulated, nothing
solved (what `trace --pp` shows).
"""

from __future__ import annotations

from typing import Any

from moegraph.memory import COMPONENTS
from moegraph.options import format_bytes
from moegraph.schedules.pipeline import Timeline, simulate
from moegraph.schedules.pipeline_model import BuiltPipeline, rank_memory_report
from moegraph.schedules.pipeline_torch import torch_baselines
from moegraph.strategy import node_fields

__all__ = ["timeline_row", "memory_rows", "compile_summary", "estimate_summary", "format_pipeline",
           "format_estimate", "ESTIMATE_PREFERENCE"]

ESTIMATE_PREFERENCE = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")
"""The torch schedule whose in-flight micro-batches `trace --pp` reports the memory under (the
1F1B family of each placement; the first torch generates for P, V, M otherwise)."""


def timeline_row(t: Timeline) -> dict[str, Any]:
    """One order's figures (module docstring); microseconds and bytes. The returned order and each
    baseline carry this one shape: the worst rank's exposed p2p and gather, and each rank's."""
    s = t.summary()
    return {"step_us": s["step_us"], "bubble_fraction": s["bubble_fraction"],
            "exposed_p2p_us": max(s["exposed_p2p_us"]), "exposed_p2p_us_per_rank": s["exposed_p2p_us"],
            "exposed_sync_us": s["exposed_sync_us"],
            "exposed_gather_us": max(s["exposed_gather_us"]), "exposed_gather_us_per_rank": s["exposed_gather_us"],
            "peak_memory_bytes": max(s["peak_bytes"]), "fits": s["fits"]}


def memory_rows(built: BuiltPipeline, t: Timeline) -> list[dict[str, Any]]:
    """Per pipeline rank, its stages and its peak under ``t`` component by component."""
    layout = built.problem.layout
    return [row | {"stages": list(layout.stages_of(row["rank"]))} for row in rank_memory_report(built, t)]


def _pipeline(lowered, built: BuiltPipeline) -> dict[str, Any]:
    c, st = lowered.config, lowered.graph.strategy
    layout = built.problem.layout
    return {"pp": c.pp, "vpp": c.vpp, "placement": c.placement, "micro_batches": c.micro_batches,
            "layers": layout.layers, "stages": [list(s) for s in layout.stages], "n": st.n, "dp": st.dp,
            "world": c.pp * st.n * st.dp, "memory_budget_bytes": c.memory_budget}


def _head(lowered) -> dict[str, Any]:
    return {"model": lowered.model.name, "hardware": lowered.hardware.name,
            "strategy": lowered.layers[-1].strategy.as_dict()}


def compile_summary(compiled, output: str | None = None) -> dict[str, Any]:
    """`compile --pp --json`: the returned order, the torch baselines beside it, per-rank memory."""
    res, built = compiled.result, compiled.built
    tick = built.problem.tick_us
    windows = res.windows
    return {**_head(compiled.lowered), "pipeline": _pipeline(compiled.lowered, built), **timeline_row(res.timeline),
            "memory": compiled.memory(), "source": res.source, "status": res.status,
            "solver": {"wall_s": round(res.wall_s, 3),
                       "cpsat_step_us": None if res.cpsat_step_ticks is None else res.cpsat_step_ticks * tick,
                       "bound_us": None if res.bound_ticks is None else res.bound_ticks * tick,
                       "windows": None if windows is None else {"solved": windows.windows, "kept": windows.kept}},
            "baselines": {name: timeline_row(t) for name, t in res.warm_starts.items()},
            "refused": dict(compiled.refused), "hash": compiled.hash, "output": output,
            "passes": compiled.lowered.report}


def estimate_summary(lowered) -> dict[str, Any]:
    """`trace --pp --json`: the pipeline priced by the greedy list schedule, torch's schedules
    simulated (no CP-SAT at either level); per-rank memory under ``ESTIMATE_PREFERENCE``'s."""
    from moegraph.schedules.driver import price_pipeline
    built = price_pipeline(lowered.config, lowered, method="greedy")
    orders, refused = torch_baselines(built.problem.layout, built.problem.micro_batches)     # no cap: torch's
    timelines = {name: simulate(built.problem, o) for name, o in orders.items()}
    chosen = next((n for n in ESTIMATE_PREFERENCE if n in timelines), next(iter(timelines)))
    return {**_head(lowered), "pipeline": _pipeline(lowered, built), "priced_by": "greedy",
            "baselines": {name: timeline_row(t) for name, t in timelines.items()}, "refused": refused,
            "memory_under": chosen, "memory": memory_rows(built, timelines[chosen]),
            "p2p_us": round(built.p2p_us, 3), "passes": lowered.report}


def _stages_text(p: dict[str, Any]) -> str:
    return " | ".join(f"{s[0]}-{s[-1]}" if len(s) > 1 else f"{s[0]}" for s in p["stages"])


def _header(c: dict[str, Any]) -> list[str]:
    p, st = c["pipeline"], c["strategy"]
    return [f"{c['model']} on {c['hardware']}: pp={p['pp']} x vpp={p['vpp']} ({p['placement']}), "
            f"M={p['micro_batches']}, n={p['n']}, dp={p['dp']}: world {p['world']} ranks; strategy "
            + " ".join(f"{k}={st[k]}" for k in ("attn", "ffn", "dispatch", "chunks", "remat", "gate"))
            + node_fields(st),
            f"layers per stage: {_stages_text(p)}"]


def _orders_table(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    width = max(14, *(len(name) for name, _ in rows))
    out = [f"{'schedule':<{width}} {'step ms':>11} {'bubble':>7} {'exp. p2p ms':>11} {'exp. sync ms':>12} "
           f"{'peak':>10} fits"]
    for name, r in rows:
        out.append(f"{name:<{width}} {r['step_us'] / 1e3:>11,.3f} {r['bubble_fraction']:>7.3f} "
                   f"{r['exposed_p2p_us'] / 1e3:>11,.3f} {r['exposed_sync_us'] / 1e3:>12,.3f} "
                   f"{format_bytes(r['peak_memory_bytes']):>10} {'yes' if r['fits'] else 'NO'}")
    return out


def _memory_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [f"{'rank':>4} {'stages':<10} " + " ".join(f"{c:>12}" for c in COMPONENTS) + f" {'total':>12}"]
    for r in rows:
        out.append(f"{r['rank']:>4} {','.join(map(str, r['stages'])):<10} "
                   + " ".join(f"{format_bytes(r[c]):>12}" for c in COMPONENTS) + f" {format_bytes(r['total']):>12}")
    return out


def format_pipeline(c: dict[str, Any]) -> str:
    """`compile --pp`'s table: the returned order (*) and torch's beside it, per-rank peaks."""
    mine = {k: c[k] for k in ("step_us", "bubble_fraction", "exposed_p2p_us", "exposed_sync_us",
                              "peak_memory_bytes", "fits")}
    rows = [(f"{c['source']} *", mine)] + [(k, v) for k, v in c["baselines"].items() if k != c["source"]]
    budget = c["pipeline"]["memory_budget_bytes"]
    lines = _header(c) + _orders_table(rows)
    lines += [f"(* returned{'; torch does not generate ' + ', '.join(c['refused']) + ' here' if c['refused'] else ''}"
              f"{'; memory budget ' + format_bytes(budget) + ' per rank' if budget is not None else ''})",
              "peak memory per rank:"] + _memory_table(c["memory"])
    sol = c["solver"]
    whole = ("skipped (over SEARCH_ACTIONS)" if c["status"] == "SKIPPED" else
             f"{sol['cpsat_step_us'] / 1e3:,.3f} ms" if sol["cpsat_step_us"] is not None else "no solution")
    lines.append(f"returned: {c['source']} ({c['status']}); whole-step CP-SAT {whole}"
                 + (f", windows {sol['windows']['kept']}/{sol['windows']['solved']} kept" if sol["windows"] else "")
                 + f"; {sol['wall_s']:.1f} s")
    lines.append(f"schedule hash {c['hash'][:23]}" + (f", action CSV written to {c['output']}" if c["output"] else ""))
    return "\n".join(lines)


def format_estimate(c: dict[str, Any]) -> str:
    """`trace --pp`'s text: torch's schedules priced, per-rank memory under one of them."""
    lines = _header(c) + [f"estimate (units priced by the greedy list schedule; nothing solved), p2p "
                          f"{c['p2p_us']:.1f} us per boundary tensor:"]
    lines += _orders_table(list(c["baselines"].items()))
    lines += [f"peak memory per rank under {c['memory_under']}:"] + _memory_table(c["memory"])
    return "\n".join(lines)
