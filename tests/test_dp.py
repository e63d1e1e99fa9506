"""Data parallelism in the runtime: n=2 x dp=2 on 4 gloo ranks (CPU, fp32, tiny shapes).

The replicas get distinct data (rows of one global batch); the graph's DP sync averages parameter
gradients over them, so the compiled gradients must equal the eager module's on the global batch
divided by dp, and AdamW training must follow eager training step for step.
"""

from __future__ import annotations


import pytest

import dp_workers
from helpers import RANK_BATCH, fresh_seed

N, DP = 2, 2
TOL = 1e-5
# compress=dp-bf16 sends every DP reduce-scatter's values as bf16 (8 significant bits: each sent value
# is rounded with relative error <= 2^-9) and sums in fp32. A replicated parameter's gradient passes
# two compressed stages (intra-node over n ranks, inter-node over dp replicas), so each partial
# carries at most ~2 * 2^-9 = 3.9e-3 relative error; partials of opposite sign can cancel, which
# raises the error relative to the sum. 2e-2 allows a 5x cancellation.
BF16_TOL = 2e-2

CASES = [
    dict(attn="sp", ffn="ep", dispatch="ag-rs", passes="", schedule="cpsat"),
    dict(attn="tp", ffn="tp", dispatch="ag-rs", passes="sar=paper,gate-reorder"),
    dict(attn="sp", ffn="ep", dispatch="a2a", passes="compress=dp-bf16", interpreter=True),
]



ADAMW_CASE = dict(attn="sp", ffn="ep", dispatch="ag-rs", passes="sar=paper,gate-reorder")


# Runs in the suite's shared 4-rank spawn (helpers.RankBatch): starting 4 ranks on 2 cores costs seconds.
DP_CASES = RANK_BATCH.add(N * DP, "dp.grads_then_adamw", dp_workers.grads_then_adamw, CASES, ADAMW_CASE, fresh_seed(), N,
                          timeout_s=600)


@pytest.fixture(scope="module")
def dp_results(rank_results):
    return rank_results(N * DP, DP_CASES)


@pytest.fixture(scope="module")
def grad_results(dp_results):
    return [r["grads"] for r in dp_results]


@pytest.mark.parametrize("i", range(2))
def test_gradients_equal_eager_on_the_global_batch(grad_results, i):
    for r in grad_results:                            # every rank of every replica holds the same values
        row = r[i]
        assert row["dp_nodes"], "the graph has no data-parallel sync nodes"
        assert row["output"] < TOL and row["input_grad"] < TOL, row
        worst = max(row["grads"], key=row["grads"].get)
        assert row["grads"][worst] < TOL, (worst, row["grads"][worst])


def test_bf16_compressed_sync_within_its_rounding_bound(grad_results):
    for r in grad_results:
        row = r[2]
        assert row["compressed"], "compress=dp-bf16 rewrote no reduce-scatter"
        assert row["output"] < TOL and row["input_grad"] < TOL, row   # forward and dgrads are not compressed
        errs = row["grads"]
        worst = max(errs, key=errs.get)
        assert errs[worst] < BF16_TOL, (worst, errs[worst])
        assert errs[worst] > 1e-5, "no bf16 rounding visible: the compressed path did not run"
        # identical replicas: exactly the interpreter's compressed sync (same casts, same fp32 sums)
        same = row["vs_interpreter"]
        worst = max(same, key=same.get)
        assert same[worst] < TOL, (worst, same[worst])


def test_three_adamw_steps_match_eager_training(dp_results):
    for r in (res["adamw"] for res in dp_results):
        assert max(r["output"]) < TOL, r["output"]
        worst = max(r["params"], key=r["params"].get)
        assert r["params"][worst] < TOL, (worst, r["params"][worst])
        assert min(r["moved"].values()) > 1e-4, "some parameter did not train"


def test_axis_and_layout_switches_end_in_errors():
    from moegraph.interpreter import axis_of
    from moegraph.ir import Node, OpKind, Phase
    from moegraph.runtime import RuntimeFailure
    from moegraph.runtime.layout import Layout
    node = Node("x.grad_rs", OpKind.REDUCE_SCATTER, Phase.BACKWARD, ("a",), ("b",), group=2)
    assert axis_of(node) == "mp"
    assert axis_of(node.with_attrs(axis="dp")) == "dp"
    with pytest.raises(ValueError, match=r"^collective 'x.grad_rs' has axis='pp'; valid axes: mp"):
        axis_of(node.with_attrs(axis="pp"))
    lay = Layout(n=2, dp=3, rank=3)                  # rank 1 of replica 1
    assert (lay.replica, lay.mp_rank, lay.world) == (1, 1, 6)
    assert lay.partition("mp") == ((0, 1), (2, 3), (4, 5))
    assert lay.partition("dp") == ((0, 2, 4), (1, 3, 5))
    with pytest.raises(ValueError, match="axis 'pp' is not one of mp, dp"):
        lay.partition("pp")
    with pytest.raises(RuntimeFailure, match="rank 6 does not fit a layout of n=2 x dp=3"):
        Layout(n=2, dp=3, rank=6)


@pytest.mark.slow
def test_run_dp_checks_against_eager_and_traces_every_rank(capsys, tmp_path):
    import json

    from moegraph.cli import main
    out = tmp_path / "dp.json"
    assert main(["run", "--n", "2", "--dp", "2", "--steps", "1", "--warmup", "0", "--schedule", "greedy", "--check",
                 "--trace", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["n"] == 2 and report["dp"] == 2
    assert report["max_rel_err_output"] < TOL and report["max_rel_err_grads"] < TOL, report
    chrome = json.loads(out.with_suffix(".chrome.json").read_text())
    assert {e["pid"] for e in chrome["traceEvents"]} == {0, 1, 2, 3}


@pytest.mark.slow
def test_compile_json_reports_the_dp_sync_exposure(capsys):
    """A sequential schedule runs every DP collective alone: all of it exposed. CP-SAT overlaps part
    of it with backward compute. dp=1 has no DP sync and no such keys."""
    import json

    from moegraph.cli import main
    base = ["compile", "--model", "tiny", "--n", "2", "--seq", "512", "--time-limit", "2", "--json"]
    got = {}
    for schedule in ("sequential", "cpsat"):
        assert main([*base, "--dp", "2", "--schedule", schedule]) == 0
        got[schedule] = json.loads(capsys.readouterr().out)
    seq, cp = got["sequential"], got["cpsat"]
    assert seq["dp_sync_us"] > 0 and seq["exposed_dp_sync_us"] == pytest.approx(seq["dp_sync_us"], abs=0.01)
    assert 0 <= cp["exposed_dp_sync_us"] < cp["dp_sync_us"]
    # the least exposure any schedule could have: both schedules respect it, and it is the same bound
    assert seq["exposed_dp_sync_bound_us"] == cp["exposed_dp_sync_bound_us"] <= cp["exposed_dp_sync_us"] + 0.02
    assert main([*base, "--dp", "1", "--schedule", "sequential"]) == 0
    assert "dp_sync_us" not in json.loads(capsys.readouterr().out)
