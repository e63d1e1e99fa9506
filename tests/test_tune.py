"""`moegraph tune`: the search space, ranking, and the content cache."""

import json
import multiprocessing as mp

from moegraph.cli import main
from moegraph.registry import load_hardware, load_model
from schedules.tune import Cache, candidates, tune

ARGS = ["--model", "tiny", "--n", "2", "--seq", "256", "--time-limit", "1", "--refine", "1"]


def test_search_space_covers_every_valid_strategy():
    cands = candidates(load_model("mixtral-8x7b"), 8, 8192)
    strategies = {(c.attn, c.ffn, c.dispatch) for c in cands}
    assert strategies == {(a, f, d) for a in ("tp", "sp") for f, d in (("ep", "a2a"), ("ep", "ag-rs"), ("tp", "ag-rs"))}
    assert {c.chunks for c in cands} == {1, 2, 4} and {c.remat for c in cands} == {"none", "paper"}


def test_tune_ranks_and_reports_speedup_over_sequential_tp_tp(tmp_path):
    res = tune(load_model("tiny"), load_hardware("h800"), n=2, seq=256, time_limit=1, refine=1,
               cache=Cache(tmp_path))
    ranked = [c["predicted_us"] for c in res["candidates"] if c["feasible"]]
    assert ranked == sorted(ranked) and res["best"]["predicted_us"] == ranked[0]
    assert set(res["best"]) >= {"attn", "ffn", "dispatch", "chunks", "remat", "passes", "predicted_us",
                                "peak_memory_bytes"}
    assert res["best"]["speedup"] == round(res["baseline"]["predicted_us"] / res["best"]["predicted_us"], 4)


def test_repeat_run_is_served_from_the_cache(tmp_path, capsys, monkeypatch):
    import schedules.tune as tune_mod
    cache = str(tmp_path / "cache")
    out = ["-o", str(tmp_path / "best.json"), "--json"]
    assert main(["tune", *ARGS, "--cache", cache, *out]) == 0
    a = json.loads(capsys.readouterr().out)

    def no_solver(*args, **kwargs):
        raise AssertionError("a repeated tune run called the scheduler instead of the cache")

    monkeypatch.setattr(tune_mod, "compile_graph", no_solver)
    assert main(["tune", *ARGS, "--cache", cache, *out]) == 0
    b = json.loads(capsys.readouterr().out)
    assert a["candidates"] == b["candidates"]
    assert (tmp_path / "best.png").stat().st_size > 0


def _writer(root, key, i):
    c = Cache(root)
    for j in range(50):
        c.put(key, {"writer": i, "j": j, "pad": "x" * 10000})


def test_concurrent_writers_never_leave_a_torn_entry(tmp_path):
    procs = [mp.get_context("spawn").Process(target=_writer, args=(tmp_path, "k", i)) for i in range(3)]
    for p in procs:
        p.start()
    reader = Cache(tmp_path)
    seen = 0
    while any(p.is_alive() for p in procs):
        entry = reader.get("k")
        if entry is not None:
            assert len(entry["pad"]) == 10000
            seen += 1
    for p in procs:
        p.join()
    assert reader.get("k")["j"] == 49 and not list(tmp_path.glob(".tmp-*"))


def test_every_strategy_family_gets_a_cpsat_refinement(tmp_path):
    res = tune(load_model("tiny"), load_hardware("h800"), n=2, seq=256, time_limit=1, refine=1,
               cache=Cache(tmp_path))
    families = {(c["attn"], c["ffn"]) for c in res["candidates"] if c["feasible"]}
    refined = {(c["attn"], c["ffn"]) for c in res["candidates"] if c["scheduler"] == "cpsat"}
    assert refined == families and len(families) == 4
