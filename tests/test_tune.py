"""`moegraph tune`: the search space, ranking, and the content cache."""

import json
import multiprocessing as mp

import pytest

from moegraph.cli import main
from moegraph.cost import CostModel
from moegraph.ir import Strategy
from moegraph.registry import load_hardware, load_model
from moegraph.config import CompileConfig, SolverEffort
from moegraph.schedules.driver import lower
from moegraph.schedules.tune import Cache, _row_label, cache_key, candidate_config, candidates, format_table, tune

ARGS = ["--model", "tiny", "--n", "2", "--seq", "256", "--time-limit", "1", "--refine", "1"]


def build_graph(model, cand, cost, *, batch, seq, micro_batches=1):
    """A candidate's graph as tune compiles it (``candidate_config``, lowered by the driver)."""
    base = CompileConfig(model=model, passes=(), batch=batch, seq=seq, micro_batches=micro_batches, hardware=cost.hw)
    return lower(candidate_config(base, cand)).graph


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    """One tune cache for the tests that tune the tiny model the same way (ARGS, h800): the cache
    is keyed by content and CP-SAT's limit is in deterministic seconds, so a hit is what a fresh
    solve returns; each test still checks its own property of the result, only the solves are shared.
    test_repeat_run_is_served_from_the_cache keeps its own cache: it tests the cache itself."""
    return tmp_path_factory.mktemp("tune-cache")


def test_search_space_covers_every_valid_strategy():
    cands = candidates(load_model("mixtral-8x7b"), 8, 8192)
    strategies = {(c.attn, c.ffn, c.dispatch) for c in cands}
    assert strategies == {(a, f, d) for a in ("tp", "sp") for f, d in (("ep", "a2a"), ("ep", "ag-rs"), ("tp", "ag-rs"))}
    assert {c.chunks for c in cands} == {1, 2, 4} and {c.remat for c in cands} == {"none", "paper"}
    assert all(isinstance(c, Strategy) and c.n == 8 for c in cands)
    assert {(c.remat, c.gate) for c in cands} == {("none", "after-fc2"), ("paper", "before-fc2")}   # Fig 9's pairing
    assert {c.chunks for c in candidates(load_model("mixtral-8x7b"), 8, 8 * 6)} == {1, 2}          # 4 does not divide s/n


def test_a_group_spanning_nodes_also_tries_the_node_spanning_all_to_all():
    one_node = candidates(load_model("deepseek-v2"), 8, 4096, gpus_per_node=8)
    assert {c.ep_nodes for c in one_node} == {1}
    two = candidates(load_model("deepseek-v2"), 16, 4096, gpus_per_node=8)
    spanning = [c for c in two if c.ep_nodes > 1]
    assert spanning and {(c.ffn, c.dispatch, c.ep_nodes) for c in spanning} == {("ep", "a2a", 2)}
    assert len(two) == len(one_node) + len(spanning)        # each a2a point once flat, once spanning
    config = candidate_config(CompileConfig(model="deepseek-v2", strategy=spanning[0], seq=4096), spanning[0])
    assert config.strategy.ep_nodes == 2                    # the candidate is traced spanning the nodes
    assert {c.attn_nodes for c in two} == {1}               # one row: the nodes cannot split it


def test_a_batch_the_nodes_split_also_tries_the_attention_folded_into_each_node():
    """With b = 2 over 2 nodes of 8, each all-to-all point is also tried with its attention on each
    node's 8 ranks (attn_nodes = 2), flat and node-spanning; the other points are unchanged."""
    plain = candidates(load_model("deepseek-v2"), 16, 4096, gpus_per_node=8)
    folded = candidates(load_model("deepseek-v2"), 16, 4096, gpus_per_node=8, batch=2)
    extra = [c for c in folded if c.attn_nodes > 1]
    assert {(c.ffn, c.dispatch, c.attn_nodes, c.ep_nodes) for c in extra} == {("ep", "a2a", 2, 1), ("ep", "a2a", 2, 2)}
    assert len(folded) == len(plain) + len(extra) and len(extra) == len([c for c in plain if c.dispatch == "a2a"])
    config = candidate_config(CompileConfig(model="deepseek-v2", strategy=extra[0], seq=4096, batch=2), extra[0])
    assert config.strategy.attn_nodes == 2


def test_a_gqa_model_n_cannot_split_folds_its_attention_in_every_candidate():
    """Qwen3-235B-A22B has 4 kv heads: at n = 32 no candidate can split its attention over all n, so
    every candidate (and the baseline) runs it on n/8 = 4 ranks over b/8 of the batch (attn_nodes = 8,
    the fold builder.attention_fold gives), flat or node-spanning; the experts stay EP over all 32."""
    from moegraph.schedules.tune import baseline_strategy
    model = load_model("qwen3-235b-a22b")
    cands = candidates(model, 32, 4096, gpus_per_node=8, batch=8)
    assert cands and {(c.ffn, c.dispatch, c.attn_nodes) for c in cands} == {("ep", "a2a", 8)}
    assert {c.ep_nodes for c in cands} == {1, 4} and {c.attn for c in cands} == {"tp", "sp"}
    base = baseline_strategy(model, 32, 4096, 8)
    assert (base.attn, base.ffn, base.dispatch, base.attn_nodes) == ("tp", "ep", "a2a", 8)
    # a model n can split keeps the tp+tp baseline and its unfolded candidates
    assert baseline_strategy(load_model("mixtral-8x7b"), 8, 8192, 1) == Strategy("tp", "tp", "ag-rs", 8)
    assert {c.attn_nodes for c in candidates(load_model("mixtral-8x7b"), 8, 8192, batch=2)} == {1}


def test_tune_ranks_a_gqa_layer_against_its_folded_baseline(tmp_path):
    """tiny has 2 kv heads: over n = 4 tp+tp cannot lower it, so tune's baseline folds the
    attention onto 2 ranks (attn_nodes = 2) with the experts EP over 4, and ranks every candidate,
    each folded the same way, against it; the table and the pick name that baseline."""
    from moegraph.config import ConfigError
    from moegraph.tracer import trace_model
    tiny = load_model("tiny")
    with pytest.raises(ConfigError, match="n=4 does not divide kv_heads=2"):
        trace_model(tiny, Strategy("tp", "tp", "ag-rs", 4), batch=2, seq=64)
    res = tune(tiny, load_hardware("h800"), n=4, batch=2, seq=64, time_limit=1, refine=1, cache=Cache(tmp_path))
    assert res["baseline"]["strategy"] == "tp+ep sequential (attention folded: attn_nodes=2)"
    assert res["candidates"] and all(r["strategy"]["attn_nodes"] == 2 for r in res["candidates"])
    best = res["best"]
    assert best["speedup"] == round(res["baseline"]["predicted_us"] / best["predicted_us"], 4)
    text = format_table(res)
    assert "baseline tp+ep sequential (attention folded: attn_nodes=2)" in text.splitlines()[0]
    assert text.splitlines()[-1].endswith("the tp+ep sequential (attention folded: attn_nodes=2) baseline") \
        or "kept the tp+ep sequential (attention folded: attn_nodes=2) baseline" in text.splitlines()[-1]


def test_a_typed_candidate_builds_the_graph_its_recorded_passes_rebuild(monkeypatch):
    """A candidate is compiled from typed pass steps (``steps_for``), never a pipeline string; the
    passes it records are the pipeline that rebuilds the same graph from attn, ffn, dispatch, n,
    dtype (what `run --schedule FILE` replays from a tune-written file), for every chunks x remat
    x dispatch point."""
    from moegraph.passes import run_pipeline
    from moegraph.passes.manager import same_computation
    from moegraph.tracer import trace_model
    import moegraph.passes.manager as manager
    model, cost = load_model("tiny"), CostModel(load_hardware("h800"))
    real_parse = manager.parse_passes

    def no_strings(spec):
        raise AssertionError(f"tune parsed a pipeline string {spec!r}")
    cands = [c for c in candidates(model, 2, 64) if (c.attn, c.ffn) == ("sp", "ep")]   # passes do not vary by family
    assert len(cands) == 12
    for cand in cands:
        monkeypatch.setattr(manager, "parse_passes", no_strings)
        typed = build_graph(model, cand, cost, batch=1, seq=64)
        monkeypatch.setattr(manager, "parse_passes", real_parse)
        base = trace_model(model, Strategy(cand.attn, cand.ffn, cand.dispatch, 2), batch=1, seq=64)
        piped, _ = run_pipeline(base, ",".join(typed.strategy.passes), cost=cost)
        assert typed.strategy == piped.strategy, cand
        assert same_computation(typed, piped) and typed.meta_get("remat") == piped.meta_get("remat"), cand
        assert (typed.strategy.chunks, typed.strategy.gate, typed.strategy.remat) == (cand.chunks, cand.gate, cand.remat)
    paper = next(c for c in cands if c.chunks == 2 and c.remat == "paper")
    assert build_graph(model, paper, cost, batch=1, seq=64).strategy.passes == ("gate-reorder", "chunk=2", "sar=paper")


@pytest.mark.slow
def test_tune_ranks_and_reports_speedup_over_sequential_tp_tp(tiny_cache):
    res = tune(load_model("tiny"), load_hardware("h800"), n=2, seq=256, time_limit=1, refine=1,
               cache=Cache(tiny_cache))
    ranked = [c["predicted_us"] for c in res["candidates"] if c["feasible"]]
    assert ranked == sorted(ranked) and res["best"]["predicted_us"] == ranked[0]
    assert set(res["best"]) >= {"attn", "ffn", "dispatch", "chunks", "remat", "passes", "predicted_us",
                                "peak_memory_bytes"}
    assert res["best"]["speedup"] == round(res["baseline"]["predicted_us"] / res["best"]["predicted_us"], 4)
    for row in res["candidates"]:      # each row carries its graph's whole typed strategy (labels read it)
        st = Strategy.from_dict(row["strategy"])
        assert (st.attn, st.ffn, st.dispatch, st.chunks, st.remat, st.gate, st.n, st.dtype) == (
            row["attn"], row["ffn"], row["dispatch"], row["chunks"], row["remat"], row["gate"], 2, "bf16")
        assert list(st.passes) == row["passes"]


@pytest.mark.slow
def test_repeat_run_is_served_from_the_cache(tmp_path, capsys, monkeypatch):
    import moegraph.schedules.tune as tune_mod
    cache = str(tmp_path / "cache")
    out = ["-o", str(tmp_path / "best.json"), "--json"]
    assert main(["tune", *ARGS, "--cache", cache, *out]) == 0
    a = json.loads(capsys.readouterr().out)

    def no_solver(*args, **kwargs):
        raise AssertionError("a repeated tune run called the scheduler instead of the cache")

    monkeypatch.setattr(tune_mod, "build", no_solver)
    assert main(["tune", *ARGS, "--cache", cache, *out]) == 0
    b = json.loads(capsys.readouterr().out)
    assert a["candidates"] == b["candidates"]
    assert (tmp_path / "best.png").stat().st_size > 0


def _writer(root, key, i):
    c = Cache(root)
    for j in range(50):
        c.put(key, {"writer": i, "j": j, "pad": "x" * 10000})


def test_concurrent_writers_never_leave_a_torn_entry(tmp_path):
    # fork: the writers start at once and their writes overlap (spawned, each first imported torch,
    # seconds apart, ~4 s of the test); they only write files, never touch torch
    procs = [mp.get_context("fork").Process(target=_writer, args=(tmp_path, "k", i)) for i in range(3)]
    for p in procs:
        p.start()
    reader = Cache(tmp_path)
    seen = 0
    while any(p.is_alive() for p in procs):
        entry = reader.get("k", is_entry=lambda e: "pad" in e)
        if entry is not None:
            assert len(entry["pad"]) == 10000
            seen += 1
    for p in procs:
        p.join()
    assert reader.get("k", is_entry=lambda e: "pad" in e)["j"] == 49 and not list(tmp_path.glob(".*.tmp"))


@pytest.mark.slow
def test_every_strategy_family_gets_a_cpsat_refinement(tiny_cache):
    res = tune(load_model("tiny"), load_hardware("h800"), n=2, seq=256, time_limit=1, refine=1,
               cache=Cache(tiny_cache))
    families = {(c["attn"], c["ffn"]) for c in res["candidates"] if c["feasible"]}
    refined = {(c["attn"], c["ffn"]) for c in res["candidates"] if c["refined"]}
    assert refined == families and len(families) == 4


def _tiny_tune(tmp_path, hw="h800", **kw):
    hardware = load_hardware(hw) if isinstance(hw, str) else hw
    return tune(load_model("tiny"), hardware, n=2, seq=256, time_limit=1, refine=1, cache=Cache(tmp_path), **kw)


@pytest.mark.slow
def test_min_gain_keeps_the_baseline_when_the_best_gain_is_smaller(tiny_cache):
    free = _tiny_tune(tiny_cache, min_gain=0.0)
    top = free["candidates"][0]
    gain = top["speedup"] - 1
    assert gain > 0.01 and free["best"] == top and "kept_baseline" not in free["best"]
    below = _tiny_tune(tiny_cache, min_gain=gain - 0.005)
    assert below["best"] == top
    above = _tiny_tune(tiny_cache, min_gain=gain + 0.005)
    best = above["best"]
    assert (best["attn"], best["ffn"], best["scheduler"], best["speedup"]) == ("tp", "tp", "sequential", 1.0)
    assert best["predicted_us"] == above["baseline"]["predicted_us"]
    assert f"predicted gain {gain:+.1%} is below min gain {gain + 0.005:.1%}" in best["kept_baseline"]
    assert above["candidates"] == free["candidates"]          # the ranking itself does not change


@pytest.mark.slow
def test_the_picks_schedule_is_its_own_rows_and_a_missing_one_is_an_error(tiny_cache, monkeypatch):
    """The written schedule is the ranked first row's (strategy and predicted time); a pick whose
    entry has no schedule raises instead of leaving `tune --output` with nothing to write."""
    import moegraph.schedules.tune as tune_mod
    from moegraph.schedules.schedule_file import Schedule
    res = _tiny_tune(tiny_cache, min_gain=0.0)
    best, sched = res["best"], Schedule.from_json(res["_best_schedule"])
    st = sched.graph["strategy"]
    assert (st["attn"], st["ffn"], st["dispatch"], st["passes"]) == (best["attn"], best["ffn"], best["dispatch"],
                                                                     best["passes"])
    assert sched.summary["method"] == best["scheduler"]
    assert sched.summary["makespan_us"] == pytest.approx(best["predicted_us"])
    real = tune_mod.evaluate

    def no_schedule(config, cache, lowered=None):
        entry = real(config, cache, lowered)
        return {k: v for k, v in entry.items() if k != "schedule"} if config.schedule == "cpsat" else entry
    monkeypatch.setattr(tune_mod, "evaluate", no_schedule)
    with pytest.raises(RuntimeError, match="has no schedule"):
        _tiny_tune(tiny_cache, min_gain=0.0)


@pytest.mark.slow
def test_min_gain_defaults_to_the_profiles_step_noise(tiny_cache):
    import dataclasses
    noisy = dataclasses.replace(load_hardware("h800"), step_noise=0.9)
    res = _tiny_tune(tiny_cache, hw=noisy)
    assert res["min_gain"] == 0.9 and res["best"]["scheduler"] == "sequential"
    assert _tiny_tune(tiny_cache)["min_gain"] == 0.0              # registry profiles: not measured


@pytest.mark.slow
def test_cli_writes_the_kept_baseline_and_rejects_a_bad_min_gain(tmp_path, tiny_cache, capsys):
    from moegraph.schedules.schedule_file import Schedule
    out = tmp_path / "best.json"
    assert main(["tune", *ARGS, "--cache", str(tiny_cache), "-o", str(out), "--min-gain", "0.99"]) == 0
    text = capsys.readouterr().out
    assert "best: kept the tp+tp sequential baseline" in text
    s = Schedule.load(str(out))
    assert s.summary["method"] == "sequential" and s.graph["strategy"]["attn"] == "tp"
    with pytest.raises(SystemExit) as done:
        main(["tune", *ARGS, "--min-gain=-0.1"])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("moegraph tune: error: argument --min-gain: '-0.1' is not a fraction between 0 and 1")


def test_cache_at_a_regular_file_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    import moegraph.schedules.tune as tune_mod
    monkeypatch.setattr(tune_mod, "tune", lambda *a, **k: pytest.fail("tune ran with a bad --cache"))
    (tmp_path / "f").write_text("x")
    for cache in (tmp_path / "f", tmp_path / "f" / "sub"):
        assert main(["tune", *ARGS, "--cache", str(cache), "-o", str(tmp_path / "best.json")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"moegraph tune: error: --cache '{cache}'"), err
    assert not (tmp_path / "best.json").exists()


def test_a_corrupt_cache_entry_is_a_miss_with_one_warning(tmp_path, capsys):
    model, hw = load_model("tiny"), load_hardware("h800")
    config = CompileConfig(model=model, strategy=Strategy("tp", "tp", "ag-rs", 2), passes=(), schedule="greedy",
                           batch=1, seq=64, hardware=hw, solver=SolverEffort(1))
    graph = lower(config).graph
    from moegraph.schedules.tune import evaluate
    good = evaluate(config, Cache(tmp_path))
    key = cache_key(graph, hw, {"method": "greedy", "memory_budget": None, "time_limit": 1})
    entry = tmp_path / f"{key}.json"
    assert entry.is_file() and good["cached"] is False
    warnings: list[str] = []
    for garbage in (b"{not json", b"\xff\xfe", b"[1, 2]"):          # truncated, not UTF-8, not an entry
        entry.write_bytes(garbage)
        cache = Cache(tmp_path, warn=warnings.append)
        again = evaluate(config, cache)
        assert again["cached"] is False and again["predicted_us"] == good["predicted_us"]     # recomputed
        assert cache.get(key) is not None                                                      # and rewritten
        assert Cache(tmp_path, warn=warnings.append).get(key)["predicted_us"] == good["predicted_us"]
    assert len(warnings) == 3 and all(f"cache entry {entry}" in w and "recomputing it" in w for w in warnings)
    assert "not valid JSON" in warnings[0] and "not a tune cache entry" in warnings[2]
    # the default warning is one stderr line, once per run
    entry.write_text("{not json")
    other = tmp_path / "other.json"
    other.write_text("{not json")
    cache = Cache(tmp_path)
    assert cache.get(key) is None and cache.get("other") is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moegraph tune: warning: cache entry ")


@pytest.fixture(scope="module")
def stack_cache(tmp_path_factory):
    """One tune cache for the two tests that tune 2-layer `small` stacks the same way (h800, n=2,
    s=64, CP-SAT limit 0.05 deterministic s, refine 1): what they check (node names and counts,
    the edges) does not depend on the solver's effort, and the second is served from the cache."""
    return tmp_path_factory.mktemp("tune-stack-cache")


@pytest.mark.slow
def test_tune_layers_schedules_stacks(stack_cache):
    """layers=2 (`tune --layers 2`): every candidate and the baseline are 2-layer stacks with the
    model's edges, so the best schedule has twice the one-layer graph's nodes, named by layer, and
    the 12 edge nodes (6 eager head/norm, the norm's all-reduce, the head's in two 25 MiB buckets with
    their split and concat, 1 embedding gather at n=2)."""
    from moegraph.schedules.schedule_file import Schedule
    res = tune(load_model("small"), load_hardware("h800"), n=2, seq=64, time_limit=0.05, refine=1, layers=2,
               cache=Cache(stack_cache))
    assert res["layers"] == 2 and res["best"]["feasible"]
    best = res["best"]
    one = build_graph(load_model("small"), Strategy(best["attn"], best["ffn"], best["dispatch"], 2,
                                                     chunks=best["chunks"], remat=best["remat"], gate=best["gate"]),
                      CostModel(load_hardware("h800")), batch=1, seq=64)
    sched = Schedule.from_json(res["_best_schedule"])
    assert len(sched.nodes) == 2 * len(one.nodes) + 12
    assert {n.name.split(".")[0] for n in sched.nodes} == {"l0", "l1", "edges"}


@pytest.mark.slow
def test_tune_layers_ranks_stacks_with_the_edges(capsys, tmp_path, stack_cache):
    """`tune --layers 2` ranks each candidate's stack with the model's edges (eager head and norm,
    their sync, the embedding gather), as compile --layers schedules it."""
    from moegraph.schedules.schedule_file import Schedule
    out = tmp_path / "best.json"
    assert main(["tune", "--model", "small", "--hardware", "h800", "--n", "2", "--seq", "64", "--layers", "2",
                 "--time-limit", "0.05", "--refine", "1", "--cache", str(stack_cache), "--json",
                 "-o", str(out)]) == 0
    sched = Schedule.load(str(out))
    assert {"edges.lm_head.bucket0.grad_allreduce", "edges.norm.grad_allreduce", "edges.embed.grad_gather",
            "edges.lm_head"} <= {n.name for n in sched.nodes}


@pytest.mark.slow
def test_cli_names_the_pick_and_the_files_it_wrote(tmp_path, capsys):
    out = tmp_path / "new" / "best.json"
    assert main(["tune", *ARGS, "--cache", str(tmp_path / "c"), "--min-gain", "0", "-o", str(out)]) == 0
    captured = capsys.readouterr()
    table = captured.out.strip().splitlines()
    first = next(line.split() for line in table if line.split()[:1] == ["1"])       # rank 1: the pick
    strategy, sched = " ".join(first[1:5]), first[5]                                  # tp+ep a2a chunks=1 remat=none
    assert table[-2].startswith(f"best: {strategy} ({sched}), predicted "), (table[-2], first)
    assert table[-1] == f"wrote {out} (best schedule) and {out.with_suffix('.png')} (its Gantt chart)"
    assert out.is_file() and out.with_suffix(".png").is_file()
    progress = captured.err.strip().splitlines()
    assert progress[-3].endswith(table[-2]) and progress[-1].endswith(f"wrote {out} and {out.with_suffix('.png')}")


@pytest.mark.slow
def test_cli_budget_no_candidate_fits_is_exit_2_naming_the_least_peak(tmp_path, capsys):
    out = tmp_path / "best.json"
    rc = main(["tune", "--model", "tiny", "--n", "2", "--seq", "64", "--memory-budget", "1KiB", "--cache", "",
               "-o", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1].startswith("moegraph tune: error: no candidate fits the memory budget 1.00KiB: the least "
                              "feasible peak memory of any candidate is at least "), err[-1]
    assert not out.exists() and not out.with_suffix(".png").exists()


# -- under a memory budget: the audit's cases (a3-f1, a3-f2), on a few candidates each --------------

GLOO = dict(n=2, seq=256, time_limit=1, refine=1, min_gain=0.0)


def _few(monkeypatch, *points, n=2):
    """tune over only these candidates: (attn, ffn, dispatch, chunks, remat) points."""
    import moegraph.schedules.tune as tune_mod
    picked = [c for c in candidates(load_model("tiny"), n, 256)
              if (c.attn, c.ffn, c.dispatch, c.chunks, c.remat) in points]
    assert len(picked) == len(points)
    monkeypatch.setattr(tune_mod, "candidates", lambda *a, **k: picked)
    return picked


def _compiled(cand, budget, micro_batches=1):
    """What `compile --memory-budget` returns for a candidate: (makespan, peak), or None when
    it finds no schedule within the budget; and whether its greedy schedule breaks the budget."""
    from moegraph.schedules.api import compile_graph
    from moegraph.schedules.problem import MemoryBudgetError
    cost = CostModel(load_hardware("cpu-2core-gloo"))
    g = build_graph(load_model("tiny"), cand, cost, batch=1, seq=256, micro_batches=micro_batches)
    try:
        compile_graph(g, cost, memory_budget_bytes=budget, time_limit_s=1, method="greedy")
        greedy_over = False
    except MemoryBudgetError:
        greedy_over = True
    try:
        s = compile_graph(g, cost, memory_budget_bytes=budget, time_limit_s=1).schedule.summary
    except MemoryBudgetError:
        return None, greedy_over
    return (s["makespan_us"], s["peak_memory_bytes"]), greedy_over


def _point(row):
    return row["attn"], row["ffn"], row["dispatch"], row["chunks"], row["remat"]


@pytest.mark.slow
def test_a_candidate_whose_greedy_breaks_the_budget_is_scheduled_within_it(monkeypatch, tmp_path):
    """a3-f1: at 520KiB tp+ep ag-rs chunks=1 remat=paper was "infeasible" (its greedy schedule
    peaks above the budget) though compile schedules it within the budget 1.8x faster than the
    pick; and the tp+tp baseline (624KiB) is over the budget without a word."""
    budget = 520 * 2**10
    cands = _few(monkeypatch, ("tp", "ep", "ag-rs", 1, "paper"), ("sp", "ep", "ag-rs", 2, "paper"))
    compiled = {c.label(): _compiled(c, budget) for c in cands}
    assert compiled[cands[0].label()][1]                       # the audit's case: its greedy breaks the budget
    fits = {k: v[0] for k, v in compiled.items() if v[0] is not None and v[0][1] <= budget}
    expected = min(fits, key=lambda k: fits[k][0])
    res = tune(load_model("tiny"), load_hardware("cpu-2core-gloo"), memory_budget=budget, cache=Cache(tmp_path),
               **GLOO)
    best = res["best"]
    assert " ".join(_row_label(best).split()) == " ".join(expected.split())
    assert best["predicted_us"] == fits[expected][0] and best["peak_memory_bytes"] <= budget
    for row in res["candidates"]:           # every candidate compile fits is ranked with compile's time
        label = " ".join(_row_label(row).split())
        match = next(v for k, v in fits.items() if " ".join(k.split()) == label)
        assert row["feasible"] and row["predicted_us"] == match[0]
    assert res["baseline"]["over_budget"] and res["baseline"]["peak_memory_bytes"] > budget
    assert "over the memory budget: speed-ups are relative to it all the same" in format_table(res)


@pytest.mark.slow
def test_no_greedy_fits_yet_the_pick_is_compiles_fastest_within_the_budget(monkeypatch, tmp_path):
    """a3-f2: tune --micro-batches 2 --memory-budget 700KiB exited 2 ("no candidate's greedy
    schedule fits") while the tp+tp sequential baseline (656KiB) and CP-SAT schedules fit."""
    budget = 700 * 2**10
    cands = _few(monkeypatch, ("tp", "ep", "ag-rs", 1, "none"), ("sp", "ep", "a2a", 1, "none"))
    compiled = {c.label(): _compiled(c, budget, micro_batches=2) for c in cands}
    assert all(greedy_over for _, greedy_over in compiled.values())      # the audit's case
    fits = {k: v[0] for k, v in compiled.items() if v[0] is not None and v[0][1] <= budget}
    expected = min(fits, key=lambda k: fits[k][0])
    res = tune(load_model("tiny"), load_hardware("cpu-2core-gloo"), memory_budget=budget, micro_batches=2,
               cache=Cache(tmp_path), **GLOO)
    assert " ".join(_row_label(res["best"]).split()) == " ".join(expected.split())
    assert res["best"]["predicted_us"] == fits[expected][0]
    assert not res["baseline"]["over_budget"] and "kept_baseline" not in res["best"]


def test_when_nothing_fits_the_error_names_the_smallest_bound(monkeypatch, tmp_path):
    """When neither a candidate nor the baseline fits, the error names the candidate with the
    smallest memory bound (compile's "below the least feasible" value), not the first one (the
    baseline kept when only it fits: the next test)."""
    from moegraph.schedules.api import compile_graph
    from moegraph.schedules.problem import MemoryBudgetError
    cands = _few(monkeypatch, ("tp", "tp", "ag-rs", 1, "none"), ("sp", "tp", "ag-rs", 1, "none"))
    cost = CostModel(load_hardware("cpu-2core-gloo"))
    least = {}
    for c in cands:
        with pytest.raises(MemoryBudgetError) as err:
            compile_graph(build_graph(load_model("tiny"), c, cost, batch=1, seq=256), cost, memory_budget_bytes=1024)
        least[c.label()] = err.value.least_peak_bytes
    nearest = min(least, key=least.get)
    assert nearest != cands[0].label()                 # the old error named the first candidate
    with pytest.raises(MemoryBudgetError, match="no candidate fits the memory budget 1.00KiB") as err:
        tune(load_model("tiny"), load_hardware("cpu-2core-gloo"), memory_budget=1024, cache=Cache(tmp_path), **GLOO)
    assert f"({' '.join(nearest.split())})" in " ".join(str(err.value).split())
    assert err.value.least_peak_bytes == least[nearest]


def test_the_baseline_is_kept_with_the_reason_when_no_candidate_schedule_is_found(monkeypatch, tmp_path):
    """Never an error while the baseline fits: with every candidate's search under the budget
    coming back empty (stubbed: on tiny every bound is at or below the baseline's peak, so
    only a search that finds nothing leaves the baseline alone), tune keeps the baseline."""
    import moegraph.schedules.tune as tune_mod
    _few(monkeypatch, ("tp", "ep", "ag-rs", 1, "none"), ("sp", "ep", "a2a", 1, "none"))
    budget = 700 * 2**10                       # the baseline peaks at 608KiB (a3-f1: 624KiB before local routing)
    real = tune_mod.evaluate

    def nothing_found(config, cache, lowered=None):
        if config.passes or config.strategy.ffn == "ep":            # a candidate, not the baseline
            return {"feasible": False, "why": "no schedule found (stub)", "least_peak_bytes": budget - 1}
        return real(config, cache, lowered)
    monkeypatch.setattr(tune_mod, "evaluate", nothing_found)
    res = tune(load_model("tiny"), load_hardware("cpu-2core-gloo"), memory_budget=budget, cache=Cache(tmp_path),
               **GLOO)
    best = res["best"]
    assert best["scheduler"] == "sequential" and best["predicted_us"] == res["baseline"]["predicted_us"]
    assert best["kept_baseline"].startswith("kept the tp+tp sequential baseline (peak 608.00KiB): no candidate "
                                            "fits the memory budget 700.00KiB (nearest: ")
    assert all(not r["feasible"] for r in res["candidates"]) and "not found" in format_table(res)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.slow
def test_strategies_with_the_same_schedule_are_one_row_naming_them_all(monkeypatch, tmp_path, n):
    """a3-f8: at --n 1 strategies that schedule identically were separate rows. One row stands
    for them and names the others; at n=2 (real collectives) the same points stay apart."""
    from moegraph.schedules.api import compile_graph
    points = [("tp", "tp", "ag-rs", 1, "paper"), ("sp", "tp", "ag-rs", 1, "paper"), ("tp", "ep", "ag-rs", 1, "paper")]
    cands = _few(monkeypatch, *points, n=n)
    cost = CostModel(load_hardware("cpu-2core-gloo"))
    placed = {tuple((x.name, x.stream, x.start_us, x.end_us) for x in compile_graph(
        build_graph(load_model("tiny"), c, cost, batch=1, seq=256), cost, method="greedy").schedule.nodes)
        for c in cands}
    res = tune(load_model("tiny"), load_hardware("cpu-2core-gloo"), **(GLOO | {"n": n}), cache=Cache(tmp_path))
    rows = res["candidates"]
    assert len(rows) == len(placed)                         # one row per distinct compiled schedule
    assert sorted(_point(r) for r in rows for r in [r, *r["also"]]) == sorted(points)
    if n == 1:
        assert len(rows) == 1 and len(rows[0]["also"]) == 2
        assert "= also " in format_table(res)


def test_a_pick_over_the_devices_memory_is_said_as_compile_says_it(tmp_path, capsys):
    """A profile with 100 kB of memory: every candidate peaks above it. tune used to pick one and
    exit 0 saying nothing; now its table says the pick cannot run, as compile's does, and compile
    names a --memory-budget above the device as the cause instead of suggesting one."""
    import yaml
    raw = load_hardware("h800").to_dict()
    raw.pop("name", None)
    profile = tmp_path / "tiny_mem.yaml"
    profile.write_text(yaml.safe_dump(raw | {"hbm_capacity_bytes": 100_000}))
    args = ["--model", "tiny", "--n", "2", "--seq", "64", "--hardware", str(profile)]
    assert main(["tune", *args, "--time-limit", "1", "--cache", "", "-o", str(tmp_path / "best.json")]) == 0
    out = capsys.readouterr().out
    best = json.loads((tmp_path / "best.json").read_text())["summary"]["peak_memory_bytes"]
    assert best > 100_000
    assert "exceeds tiny_mem's 97.66KiB: this schedule cannot run as compiled; cap it with --memory-budget" in out
    assert main(["tune", *args, "--time-limit", "1", "--cache", "", "-o", "", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["device_memory_bytes"] == 100_000
    assert main(["compile", *args, "--memory-budget", "2GiB", "--schedule", "greedy"]) == 0
    assert "--memory-budget 2.00GiB is above it: give at most 97.66KiB" in capsys.readouterr().out


def test_a_kill_between_tunes_two_writes_leaves_no_chart_of_another_pick(tmp_path, capsys, monkeypatch):
    """tune writes the schedule, then its chart: interrupted between the two, the folder held the
    new schedule beside the previous run's chart. The old chart is removed before the schedule is
    written, so what is left always belongs together."""
    import moegraph.schedules.gantt as gantt
    best, chart = tmp_path / "best.json", tmp_path / "best.png"
    chart.write_bytes(b"a chart of the previous run's pick")

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(gantt, "render", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["tune", *ARGS, "--cache", "", "-o", str(best)])
    assert best.exists() and not chart.exists()
