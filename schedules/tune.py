"""`moegraph tune`: search strategies for a model on a hardware profile.

Search space: attention tp|sp x ffn tp|ep x dispatch a2a|ag-rs (ep only) x chunks x remat
policy; SM budgets and order come from the scheduler. With ``--layers L`` every candidate is a
stack of L layers, so rematerialization and peak memory are judged at model level. Each candidate is one typed
``moegraph.ir.Strategy`` (remat='paper' goes with gate='before-fc2', Fig 9's pairing), compiled
by the driver (``moegraph.schedules.driver``) from a ``CompileConfig`` whose passes are the typed
steps that build it (``moegraph.pass_steps.steps_for``): the same path as `moegraph compile`,
no pipeline string in between.
Two stages keep it quick: every candidate is scheduled by the list-scheduling baselines
(milliseconds), then the best few are refined by CP-SAT. Results are cached by content (graph,
hardware profile, options; moegraph.schedules.tune_cache), one JSON file per candidate written
atomically and validated when read, so a repeated run is instant, concurrent runs never see a
half-written entry, and a damaged entry is recomputed.

Under a memory budget (``--memory-budget``) a candidate is infeasible only when its sound
memory lower bound (compile's "below the least feasible peak") exceeds the budget. One whose
greedy schedule breaks the budget while the bound fits is scheduled as `compile
--memory-budget` schedules it (the same compile_graph call, tune's time limit; a progress line
each), then ranked. The tp+tp sequential baseline stays the speed-up reference even when it
peaks over the budget (the table says so); tune errors only when neither a candidate nor the
baseline fits, naming the candidate with the smallest bound, and keeps the baseline (saying
why) when only the baseline fits. Candidates whose schedules come out identical node for node
(at ``--n 1``) are one row that names the strategies it stands for (``also``).

The baseline is tp+tp sequential, unless n cannot split the attention's heads (a GQA model with
fewer kv heads than n, such as Qwen3-235B at n = 32): then it is the attention's TP folded onto the
ranks that can split it, with the experts EP over all n (``baseline_strategy``), and every
candidate folds its attention as far (``candidates``).

With ``fuse`` (``--fuse``) every candidate whose layer has fused comm+compute groups
(``fuse=auto``, moegraph.passes.fuse) is ranked a second time with them fused, so the search
chooses between unfused, chunked and fused per layer (and the pass per pair). Off by default:
`moegraph run` has no fused kernels and refuses a fused schedule.

The pick: the top-ranked candidate, unless its predicted gain over the tp+tp sequential
baseline is below ``min_gain`` (default: the profile's measured ``step_noise``, 0 for the
analytical registry profiles); then the baseline is kept, since a gain smaller than the
machine's step-to-step noise cannot be confirmed by measuring it.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from moegraph.builder import attention_fold
from moegraph.config import CompileConfig, SolverEffort
from moegraph.cost import variant
from moegraph.ir import ConfigError, Graph, Strategy, valid_dispatches
from moegraph.options import format_bytes
from moegraph.pass_steps import Fuse, steps_for
from moegraph.registry import Hardware, ModelConfig
from moegraph.schedules.driver import Lowered, build, lower
from moegraph.schedules.problem import MemoryBudgetError
from moegraph.schedules.schedule_file import Schedule
from moegraph.schedules.tune_cache import Cache, cache_key

CHUNKS = (1, 2, 4)
REMAT = ("none", "paper")


def candidates(model: ModelConfig, n: int, seq: int, dtype: str = "bf16", gpus_per_node: int = 0,
               batch: int = 1) -> list[Strategy]:
    """Every strategy point valid for this group size and sequence (chunks must divide s/n). A group
    that spans whole nodes of ``gpus_per_node`` GPUs (n a multiple, at least 2 nodes) also tries the
    node-spanning all-to-all (ep_nodes = n / gpus_per_node) beside the flat one, and, when the nodes
    split the ``batch``, each all-to-all point with its attention folded into the node (attn_nodes =
    the nodes: TP or SP over the node's ranks on b/N rows). Where n cannot split the attention's
    heads, kv heads or s, each all-to-all point folds it onto the ranks that can
    (builder.attention_fold), when that fold splits the batch; points whose attention cannot be split
    are left out."""
    nodes = n // gpus_per_node if gpus_per_node >= 2 and n % gpus_per_node == 0 else 1
    # the fewest attention groups whose ranks split the heads, kv heads and s (> 1 for a GQA model
    # with fewer kv heads than n): its all-to-all points fold the attention that far
    gqa = attention_fold(n, model.heads, model.kv_heads, seq)
    out = []
    for attn, ffn, chunks, remat in itertools.product(("tp", "sp"), ("tp", "ep"), CHUNKS, REMAT):
        for dispatch in valid_dispatches(ffn):
            a2a = dispatch == "a2a"
            spanning = a2a and nodes > 1
            folds = {1} | ({nodes} if spanning else set()) | ({gqa} if a2a and gqa > 1 else set())
            for ep_nodes, attn_nodes in itertools.product((1, nodes) if spanning else (1,), sorted(folds)):
                if (batch % attn_nodes or (attn_nodes > 1 and attn_nodes % ep_nodes)
                        or attention_fold(n // attn_nodes, model.heads, model.kv_heads, seq) > 1):
                    continue        # the batch or the dispatch's nodes cannot take it, or its ranks cannot split the heads
                if seq % (n // attn_nodes * chunks):
                    continue
                out.append(Strategy(attn, ffn, dispatch, n, dtype=dtype, chunks=chunks, remat=remat,
                                    gate="before-fc2" if remat == "paper" else "after-fc2", ep_nodes=ep_nodes,
                                    attn_nodes=attn_nodes))
    return out


def evaluate(config: CompileConfig, cache: Cache, lowered: Lowered | None = None) -> dict:
    """Compile one config (cached), as `compile --schedule METHOD --memory-budget` does (the same
    driver call). Returns predicted_us, peak memory, the returned schedule's method (for cpsat:
    "cpsat" or the warm start CP-SAT did not beat) and the schedule JSON; or, when it does not
    fit the budget, why (and the least feasible peak, when compile gives one). ``lowered``: the
    config's graph when the caller has it (the cache is keyed by it)."""
    lowered = lowered or lower(config)
    options = {"method": config.schedule, "memory_budget": config.memory_budget,
               "time_limit": config.solver.time_limit_s,
               **({"launch_order": config.launch_order} if config.launch_order != "free" else {})}
    key = cache_key(lowered.graph, lowered.hardware, options)
    hit = cache.get(key)          # validated: tune_cache
    if hit is not None:
        return hit | {"cached": True}
    try:
        result = build(config, lowered=lowered).result
        s = result.schedule.summary
        entry = {"feasible": True, "predicted_us": s["makespan_us"], "peak_memory_bytes": s["peak_memory_bytes"],
                 "lower_bound_us": s["lower_bound_us"], "status": result.status, "method": result.source,
                 "schedule": result.schedule.to_json()}
    except MemoryBudgetError as err:
        entry = {"feasible": False, "why": str(err).splitlines()[0],
                 **({"least_peak_bytes": err.least_peak_bytes} if err.least_peak_bytes is not None else {})}
    cache.put(key, entry)
    return entry | {"cached": False}


def baseline_strategy(model: ModelConfig, n: int, seq: int, batch: int, dtype: str = "bf16", dp: int = 1) -> Strategy:
    """The reference every candidate's speed-up is against: tp+tp (ag-rs) over n. Where n cannot split
    the attention's heads, kv heads or s (a GQA model with fewer kv heads than n) while the experts
    can span n: the attention's TP on the ranks that can split it, data-parallel over the N groups
    of them (attn_nodes = N, builder.attention_fold), and the experts EP over all n (a2a), as
    Megatron-Core folds them. Raises ConfigError (one line) when that fold does not split the batch."""
    fold = attention_fold(n, model.heads, model.kv_heads, seq)
    if fold == 1 or not model.experts or model.experts % n:
        return Strategy("tp", "tp", "ag-rs", n, dtype=dtype, dp=dp)
    if batch % fold:
        raise ConfigError(f"n={n} cannot split the attention (heads={model.heads}, kv_heads={model.kv_heads}, s={seq}); "
                          f"its ranks can, folded {fold} ways (attn_nodes={fold}: TP on n/{fold}={n // fold} ranks over "
                          f"b/{fold} of the batch), which needs --batch a multiple of {fold} (got {batch})")
    return Strategy("tp", "ep", "a2a", n, dtype=dtype, dp=dp, attn_nodes=fold)


def baseline_label(strategy: Strategy) -> str:
    """The reference's name in tables and messages (``baseline_strategy``)."""
    if strategy.attn_nodes == 1:
        return "tp+tp sequential"
    return f"tp+ep sequential (attention folded: attn_nodes={strategy.attn_nodes})"


def baseline_config(model: ModelConfig, hw: Hardware, *, n: int, batch: int, seq: int, dtype: str = "bf16",
                    layers: int = 1, micro_batches: int = 1, time_limit: float = 5.0) -> CompileConfig:
    """The sequential baseline's config (``baseline_strategy``: tp+tp, or its folded attention with
    the experts EP where n cannot split the heads), and the base of every candidate's
    (``candidate_config``): the step graph of M micro-batches, and for a stack of layers the
    model's edges (edges='auto': eager head and norm, their gradient sync, the embedding gather),
    as `compile --layers` schedules it, so that candidates and baseline compare like with like."""
    return CompileConfig(model=model, strategy=baseline_strategy(model, n, seq, batch, dtype), passes=(),
                         schedule="sequential", batch=batch, seq=seq, layers=layers, micro_batches=micro_batches,
                         hardware=hw, solver=SolverEffort(time_limit))


def candidate_config(base: CompileConfig, cand: Strategy, *, fused: bool = False) -> CompileConfig:
    """The config one candidate is compiled with: ``base`` (model, sizes, layers, micro-batches,
    the model step's edges, hardware, budget, effort) traced for the candidate's lowering fields
    and rewritten by the typed steps that give its other fields (``steps_for``: gate-reorder,
    chunk=N, sar, ...); ``fused`` adds fuse=auto (the --fuse variant)."""
    lowering = Strategy(cand.attn, cand.ffn, cand.dispatch, cand.n, dtype=cand.dtype, dp=cand.dp,
                        ep_nodes=cand.ep_nodes, attn_nodes=cand.attn_nodes)
    return base.replace(strategy=lowering, passes=steps_for(cand) + ((Fuse("auto"),) if fused else ()))


def tune(model: ModelConfig, hw: Hardware, *, n: int = 8, batch: int = 1, seq: int = 8192, dtype: str = "bf16",
         memory_budget: int | None = None, time_limit: float = 5.0, refine: int = 3, cache: Cache | None = None,
         progress=None, min_gain: float | None = None, fuse: bool = False, micro_batches: int = 1,
         layers: int = 1) -> dict:
    """Rank every candidate and pick one (module doc); the result dict is what `moegraph tune
    --json` prints. ``min_gain``: a fraction >= 0, None = ``hw.step_noise``. ``fuse``: also rank
    each candidate with its fused groups (module doc). ``micro_batches`` M > 1: every candidate
    (and the baseline) is the merged step of M micro-batches (moegraph.microbatch), so the ranking
    includes the cross-micro-batch overlap. ``layers``: every candidate (and the baseline) is a stack
    of that many layers (moegraph.layers)."""
    min_gain = hw.step_noise if min_gain is None else min_gain
    if isinstance(min_gain, bool) or not isinstance(min_gain, (int, float)) or not 0 <= min_gain < 1:
        raise ValueError(f"min_gain={min_gain!r} must be a fraction in [0, 1)")
    cache = cache or Cache(None)
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    base_config = baseline_config(model, hw, n=n, batch=batch, seq=seq, dtype=dtype, layers=layers,
                                  micro_batches=micro_batches, time_limit=time_limit)
    base_name = baseline_label(base_config.strategy)
    try:
        base = evaluate(base_config, cache)
    except ConfigError as err:
        # every candidate is ranked against this baseline: without it there is no ranking to give
        raise ConfigError(f"tune ranks every candidate against the {base_name} baseline, which cannot split "
                          f"this layer over n={n}: {err}") from None
    if base_config.strategy.attn_nodes > 1:
        say(f"n={n} cannot split the attention (heads={model.heads}, kv_heads={model.kv_heads}, s={seq}): the "
            f"baseline is {base_name}, the attention's TP on n/{base_config.strategy.attn_nodes} ranks and the "
            f"experts over all n")
    rows: list[dict] = []
    cands = candidates(model, n, seq, dtype, hw.gpus_per_node, batch)
    for i, cand in enumerate(cands, 1):
        for fused in (False, True) if fuse else (False,):
            config = candidate_config(base_config, cand, fused=fused).replace(schedule="greedy",
                                                                             memory_budget=memory_budget)
            lowered = lower(config)
            if fused and not lowered.report["fuse"]["chosen"]:
                continue                # nothing to fuse in this layer: the unfused row stands for it
            entry = evaluate(config, cache, lowered)
            g = lowered.graph
            rows.append({"candidate": cand, "graph": g, "config": config, "lowered": lowered, "stage1": entry})
            say(f"[{time.perf_counter() - t0:6.1f}s] {i:>2}/{len(cands)} {_label(cand, g):<46} greedy "
                + (f"{entry['predicted_us']:.1f} us" if entry["feasible"] else
                   "over the budget (scheduled within it below)" if _bound_fits(entry, memory_budget) else
                   "infeasible" + (f": least feasible peak >= {format_bytes(entry['least_peak_bytes'])}"
                                   if "least_peak_bytes" in entry else "")))
    # Under a budget a candidate whose greedy schedule breaks it while its sound memory bound does
    # not is scheduled under the budget as `compile --memory-budget` does (the same evaluate ->
    # compile_graph call: CP-SAT, or the min-peak schedule); only a bound above the budget makes a
    # candidate infeasible without a search.
    over = [r for r in rows if _bound_fits(r["stage1"], memory_budget)]
    for k, r in enumerate(over, 1):
        r["final"] = _refined(r, cache)
        say(f"[{time.perf_counter() - t0:6.1f}s] {k:>2}/{len(over)} {_label(r['candidate'], r['graph']):<46} "
            f"greedy over the budget; cp-sat within it: " + _outcome(r["final"]))
    feasible = sorted((r for r in rows if _entry(r)["feasible"]), key=lambda r: _entry(r)["predicted_us"])
    base_over = memory_budget is not None and base["peak_memory_bytes"] > memory_budget
    if not feasible and base_over:
        raise _nothing_fits(rows, memory_budget)
    for r in to_refine(feasible, refine):
        if "final" in r:
            continue        # already scheduled by CP-SAT under the budget above
        r["final"] = _refined(r, cache)
        say(f"[{time.perf_counter() - t0:6.1f}s] cp-sat {_label(r['candidate'], r['graph']):<46} "
            + _outcome(r["final"]))
    # rank the rows themselves, so the pick's schedule is its own row's (never found again by
    # comparing the reported dicts)
    order = sorted(rows, key=lambda r: _rank_key(_row(r, base["predicted_us"])))
    groups = _alike(order)
    order = [r for r, _ in groups]
    ranked = [_row(r, base["predicted_us"]) | {"also": [_point(o) for o in others]} for r, others in groups]
    best, schedule, label = ranked[0], _entry(order[0]).get("schedule"), \
        _label(order[0]["candidate"], order[0]["graph"]).strip()
    kept = _keep_baseline(best, base, min_gain, memory_budget, rows, base_name)
    if kept:
        best, schedule = _baseline_row(base, kept, base_config.strategy), base.get("schedule")
        label = f"the {base_name} baseline"
    if not isinstance(schedule, str):        # evaluate keeps one with every feasible entry
        raise RuntimeError(f"tune: the pick ({label}) has no schedule in its evaluation entry")
    say(f"[{time.perf_counter() - t0:6.1f}s] best: {pick_line(best, base_name)}")
    return {"model": model.name, "hardware": hw.name, "n": n, "batch": batch, "seq": seq, "layers": layers,
            "min_gain": min_gain, "micro_batches": micro_batches, "memory_budget_bytes": memory_budget,
            "device_memory_bytes": hw.hbm_capacity_bytes,
            "baseline": {"strategy": base_name, "predicted_us": base["predicted_us"],
                         "peak_memory_bytes": base["peak_memory_bytes"], "over_budget": base_over},
            "best": best, "candidates": ranked, "wall_s": round(time.perf_counter() - t0, 2),
            "_best_schedule": schedule}


def _alike(order: list[dict]) -> list[tuple[dict, list[dict]]]:
    """Ranked rows whose schedules are the same (at --n 1 the strategies differ only in
    bookkeeping: every node, cost and start time alike) folded into the first of them, in rank
    order: (row, the other rows it stands for)."""
    out: list[tuple[dict, list[dict]]] = []
    at: dict[Any, int] = {}
    for r in order:
        e = _entry(r)
        # an infeasible row (or one without its schedule: tune() raises on it) stands alone
        key = _scheduled(e["schedule"]) if e["feasible"] and "schedule" in e else id(r)
        if key in at:
            out[at[key]][1].append(r)
        else:
            at[key] = len(out)
            out.append((r, []))
    return out


def _scheduled(schedule_json: str) -> tuple:
    """What a schedule places and prices: per node its name, op, data, costs, stream, SMs and
    times, and the values' sizes; not the strategy label or attrs (the cost model has already
    turned those into the costs)."""
    sched = Schedule.from_json(schedule_json)
    return (sched.streams, tuple((v.name, v.bytes, v.kind, v.alias_of) for v in sched.values),
            tuple((n.name, n.op, n.role, n.phase, n.kind, n.inputs, n.outputs, n.flops, n.mem_bytes, n.comm_bytes,
                   n.group, n.stream, n.start_us, n.end_us, n.sm_budget) for n in sched.nodes))


def _point(r: dict) -> dict:
    """A row's strategy point, as the table and --json name it."""
    c = r["candidate"]
    return {"attn": c.attn, "ffn": c.ffn, "dispatch": c.dispatch, "chunks": c.chunks, "remat": c.remat,
            "fused": _is_fused(r["graph"]), "strategy": r["graph"].strategy.as_dict()}


def _entry(r: dict) -> dict:
    """A row's final evaluation: CP-SAT's when it ran, else the greedy one."""
    return r.get("final") or r["stage1"]


def _bound_fits(entry: dict, memory_budget: int | None) -> bool:
    """Whether a greedy entry broke the budget while the candidate's sound memory bound fits it
    (compile's error then carries that bound: api.compile_problem)."""
    least = entry.get("least_peak_bytes")
    return not entry["feasible"] and memory_budget is not None and least is not None and least <= memory_budget


def _outcome(entry: dict) -> str:
    if entry["feasible"]:
        return f"{entry['predicted_us']:.1f} us, peak {format_bytes(entry['peak_memory_bytes'])} ({entry['method']})"
    return f"no schedule within the budget ({entry['why']})"


def _nearest(rows: list[dict]) -> tuple[int, str, dict]:
    """(least feasible peak, label, entry) of the candidate whose memory bound is the smallest."""
    known = [(_entry(r)["least_peak_bytes"], _label(r["candidate"], r["graph"]).strip(), i)
             for i, r in enumerate(rows) if _entry(r).get("least_peak_bytes") is not None]
    if not known:   # every MemoryBudgetError compile raises carries its bound: a bug if none does
        raise RuntimeError("tune: no candidate fits the memory budget and none reports its least feasible peak")
    least, label, i = min(known)
    return least, label, _entry(rows[i])


def _nothing_fits(rows: list[dict], memory_budget: int | None) -> MemoryBudgetError:
    """The error when neither a candidate nor the baseline fits ``memory_budget``: the candidate
    with the smallest memory bound, and what it needs."""
    least, label, entry = _nearest(rows)
    budget = format_bytes(memory_budget)
    if least > memory_budget:   # every bound is above the budget: the least of them is one for all
        return MemoryBudgetError(f"no candidate fits the memory budget {budget}: the least feasible peak memory of "
                                 f"any candidate is at least {format_bytes(least)} ({label}); raise --memory-budget",
                                 least, False)
    return MemoryBudgetError(f"no candidate's schedule within the memory budget {budget} was found: the nearest, "
                             f"{label} (least feasible peak at least {format_bytes(least)}): {entry['why']}",
                             least, False)


def _refined(row: dict, cache: Cache) -> dict:
    """A row's candidate scheduled by CP-SAT (its config, method 'cpsat'; the same graph)."""
    return evaluate(row["config"].replace(schedule="cpsat"), cache, row["lowered"])


def _is_fused(graph: Graph) -> bool:
    return any(variant(n) == "fused" for n in graph.nodes)


def _label(cand: Strategy, graph: Graph) -> str:
    return cand.label() + (" fused" if _is_fused(graph) else "")


def _keep_baseline(top: dict, base: dict, min_gain: float, memory_budget: int | None,
                   rows: list[dict], name: str) -> str | None:
    """Why the baseline (``name``: ``baseline_label``) is kept instead of ``top`` (None: it is not)."""
    if memory_budget is not None and base["peak_memory_bytes"] > memory_budget:
        return None             # tune() raised if ``top`` does not fit either
    if not top["feasible"]:
        least, label, _ = _nearest(rows)
        return (f"kept the {name} baseline (peak {format_bytes(base['peak_memory_bytes'])}): no candidate "
                f"fits the memory budget {format_bytes(memory_budget)} (nearest: {label}, least feasible peak at "
                f"least {format_bytes(least)})")
    gain = top["speedup"] - 1
    if gain >= min_gain:
        return None
    return (f"kept the {name} baseline: the best candidate's predicted gain {gain:+.1%} is below "
            f"min gain {min_gain:.1%}")


def _baseline_row(base: dict, why: str, strategy: Strategy) -> dict:
    return {"attn": strategy.attn, "ffn": strategy.ffn, "dispatch": strategy.dispatch, "chunks": strategy.chunks,
            "remat": strategy.remat, "gate": strategy.gate, "passes": list(strategy.passes),
            "strategy": strategy.as_dict(),
            "feasible": True, "scheduler": "sequential", "predicted_us": base["predicted_us"],
            "peak_memory_bytes": base["peak_memory_bytes"], "speedup": 1.0, "kept_baseline": why}


def to_refine(feasible: list[dict], refine: int) -> list[dict]:
    """The ``refine`` best by the greedy estimate, plus the best of every attn x ffn family: greedy
    can misrank families by more than CP-SAT's gain (it once hid an sp+ep candidate that CP-SAT
    made 1.5% faster than the pick), and a family's best is the comparison users ask for."""
    chosen = feasible[:refine]
    for r in feasible:
        family = (r["candidate"].attn, r["candidate"].ffn)
        if all((c["candidate"].attn, c["candidate"].ffn) != family for c in chosen):
            chosen.append(r)
    return chosen


def _row(r: dict, baseline_us: float) -> dict:
    """One ranked row. ``scheduler``: the method of the schedule it reports ("cpsat", or the warm
    start CP-SAT did not beat, or "greedy"); ``refined``: whether CP-SAT ran on it."""
    final = _entry(r)
    out = _point(r) | {"gate": r["candidate"].gate, "passes": list(r["graph"].strategy.passes),
                       "feasible": final["feasible"], "refined": "final" in r,
                       "scheduler": final["method"] if final["feasible"] else "-"}
    if final["feasible"]:
        out |= {"predicted_us": final["predicted_us"], "peak_memory_bytes": final["peak_memory_bytes"],
                "speedup": round(baseline_us / final["predicted_us"], 4)}
    else:
        out |= {"why": final["why"], **({"least_peak_bytes": final["least_peak_bytes"]}
                                        if "least_peak_bytes" in final else {})}
    return out


def _rank_key(row: dict):
    return (not row["feasible"], row.get("predicted_us", float("inf")), row["peak_memory_bytes"] if row["feasible"] else 0,
            row["attn"], row["ffn"], row["dispatch"], row["chunks"], row["remat"], row.get("fused", False))


def _row_label(row: dict) -> str:
    """A ranked row's strategy label (column-aligned, as the table prints it), " fused" when fused:
    from the row's whole strategy (the graph's, as ``Strategy.as_dict`` wrote it)."""
    return Strategy.from_dict(row["strategy"]).label() + (" fused" if row.get("fused") else "")


def pick_line(best: dict, baseline: str = "tp+tp sequential") -> str:
    """The pick in one line: the candidate (or why the baseline was kept) and its prediction against
    ``baseline`` (``baseline_label``)."""
    if best.get("kept_baseline"):
        return best["kept_baseline"]
    name = " ".join(_row_label(best).split())
    return (f"{name} ({best['scheduler']}), predicted "
            f"{best['predicted_us']:.1f} us, {best['speedup']:.3f}x the {baseline} baseline")


def over_device_note(peak: int, capacity: int | None, hardware: str, budget: int | None = None) -> str | None:
    """The line `compile` and `tune` print when a schedule's peak exceeds the device's memory (a
    schedule that cannot run as compiled); None when it fits or the capacity is unknown. A
    ``budget`` above the device's memory is named as the cause, not suggested as the cure."""
    if capacity is None or peak <= capacity:
        return None
    cap = (f"--memory-budget {format_bytes(budget)} is above it: give at most {format_bytes(capacity)}"
           if budget is not None else "cap it with --memory-budget")
    return (f"peak memory {format_bytes(peak)} exceeds {hardware}'s {format_bytes(capacity)}: this schedule cannot "
            f"run as compiled; {cap}, or recompute more (--passes sar=budget:SIZE), or split the batch (--batch, "
            "--micro-batches)")


def format_table(res: dict) -> str:
    budget, base = res.get("memory_budget_bytes"), res["baseline"]
    lines = [f"{res['model']} on {res['hardware']}, n={res['n']}, b={res['batch']}, s={res['seq']}"
             + (f", {res['layers']} layers" if res["layers"] > 1 else "") + ": "
             f"baseline {base['strategy']} {base['predicted_us']:.1f} us, min gain {res['min_gain']:.1%}"
             + (f", memory budget {format_bytes(budget)}" if budget is not None else "")]
    if base.get("over_budget"):
        lines.append(f"note: the baseline peaks at {format_bytes(base['peak_memory_bytes'])}, over the memory budget: "
                     "speed-ups are relative to it all the same")
    # the sched column fits the longest method (a warm start CP-SAT did not beat: "interleave2+ce+mem")
    w = max(6, *(len(r["scheduler"]) for r in res["candidates"]))
    # the strategy column fits the longest label (the node fields make it longer than 40)
    wn = max(40, *(len(_row_label(r)) for r in res["candidates"]))
    lines.append(f"{'#':>3} {'strategy':<{wn}} {'sched':<{w}} {'predicted us':>12} {'peak':>10} {'speedup':>8}")
    for i, r in enumerate(res["candidates"], 1):
        name = _row_label(r)
        if r["feasible"]:
            lines.append(f"{i:>3} {name:<{wn}} {r['scheduler']:<{w}} {r['predicted_us']:>12.1f} "
                         f"{format_bytes(r['peak_memory_bytes']):>10} {r['speedup']:>7.3f}x")
        else:   # over: its memory bound is above the budget; not found: CP-SAT found no schedule within it
            what = "over budget" if r.get("least_peak_bytes", 0) > (budget or 0) else "not found"
            lines.append(f"{i:>3} {name:<{wn}} {'-':<{w}} {what:>12}"
                         + (f" {'>=' + format_bytes(r['least_peak_bytes']):>10}" if "least_peak_bytes" in r else ""))
        if r.get("also"):        # strategies whose schedule is this row's, node for node
            lines.append(f"{'':>3} = also " + ", ".join(" ".join(_row_label(o).split()) for o in r["also"]))
    lines.append(f"best: {pick_line(res['best'], base['strategy'])}")
    if note := over_device_note(res["best"]["peak_memory_bytes"], res.get("device_memory_bytes"), res["hardware"],
                                budget):
        lines.append(note)
    if res.get("schedule_file"):
        lines.append(f"wrote {res['schedule_file']} (best schedule) and {res['gantt']} (its Gantt chart)")
    return "\n".join(lines)


__all__ = ["tune", "over_device_note", "candidates", "baseline_config", "baseline_strategy", "baseline_label", "candidate_config", "evaluate", "Cache", "cache_key", "format_table",
           "to_refine"]
