"""The runtime on real ranks (gloo, CPU, fp32): exact against the eager module, and failing loudly.

Every check runs on spawned ranks (moegraph.runtime.launch.spawn). Starting ranks costs seconds, so one
process group checks many cases (module-scoped fixtures) and each case is reported as its own
test. Fresh random weights and inputs every run, replayable (tests/seeding.py).
"""

from __future__ import annotations

import time

import pytest

import runtime_workers as workers
from helpers import RANK_BATCH, fresh_seed
from moegraph.runtime import CollectiveTimeout, RankFailure, RuntimeFailure, ScheduleMismatch
from moegraph.runtime.launch import spawn

TOL = 1e-5
COMBOS = [(attn, ffn, dispatch) for attn in ("tp", "sp")
          for ffn, dispatch in (("ep", "a2a"), ("ep", "ag-rs"), ("tp", "ag-rs"))]


def _case(attn, ffn, dispatch, **kw):
    return dict(attn=attn, ffn=ffn, dispatch=dispatch, **kw)


def _id(case):
    extra = [f"{k}={v}" for k, v in case.items() if k not in ("attn", "ffn", "dispatch")]
    return "-".join([case["attn"], case["ffn"], case["dispatch"], *map(str, extra)])


PASS_CASES = [
    _case("sp", "ep", "ag-rs", passes="sar=paper"),
    _case("sp", "ep", "a2a", passes="sar=paper"),
    _case("sp", "ep", "ag-rs", passes="gate-reorder"),
    _case("sp", "ep", "a2a", passes="chunk=2"),
    _case("tp", "tp", "ag-rs", passes="chunk=2"),
    _case("sp", "ep", "ag-rs", passes="sar=paper,gate-reorder,chunk=2"),
    _case("tp", "tp", "ag-rs", passes="compress=tp-fp8", reference="interpreter"),   # lossy on purpose
    _case("sp", "ep", "a2a", passes="chunk=2,compress=ep-fp8,sar=paper", reference="interpreter"),  # rows + scales
]

N2_CASES = ([_case(*c) for c in COMBOS]
            + [_case("sp", "ep", "ag-rs", schedule="sequential"),
               _case("tp", "tp", "ag-rs", native=["reduce_scatter"]),      # gloo's own reduce_scatter
               _case("sp", "ep", "a2a", schedule="cpsat", hardware="cpu-2core-gloo"),   # alone + beside
               _case("sp", "ep", "a2a", model="hf"),
               _case("tp", "tp", "ag-rs", model="hf"),
               _case("tp", "ep", "a2a", attn_nodes=2)]             # each rank's attention alone, on its own row
            + PASS_CASES)
N4_CASES = ([_case(*c) for c in COMBOS]
            + [_case("sp", "ep", "a2a", model="hf")]
            + [_case("sp", "ep", "a2a", passes="sar=paper,gate-reorder,chunk=2")]
            # the node-spanning dispatch: 2 nodes of 2 ranks, each token once per node over the rail
            + [_case("sp", "ep", "a2a", ep_nodes=2), _case("sp", "ep", "a2a", ep_nodes=2, passes="sar=paper,chunk=2"),
               _case("sp", "ep", "a2a", ep_nodes=2, passes="gate-reorder,compress=ep-fp8", reference="interpreter"),
               # every token to experts 0-2: node 1 receives no row, its rail peers send it nothing
               _case("sp", "ep", "a2a", ep_nodes=2, model="deepseek_v3_skewed")]
            # a node's attention: TP/SP on each node's 2 ranks, one batch row per node, the experts over all 4
            + [_case("tp", "ep", "a2a", attn_nodes=2), _case("tp", "ep", "a2a", attn_nodes=2, model="hf"),
               _case("sp", "ep", "a2a", attn_nodes=2, ep_nodes=2, passes="sar=paper,chunk=2")])
FAULT = _case("tp", "tp", "ag-rs", fault="drop-partial-sums")



# The rank functions that must succeed run in the suite's shared 2- and 4-rank spawns
# (helpers.RankBatch): starting ranks costs more than most of these checks.
N2 = RANK_BATCH.add(2, "runtime.check_cases", workers.check_cases, N2_CASES + [FAULT], fresh_seed(), timeout_s=600)
N4 = RANK_BATCH.add(4, "runtime.check_cases", workers.check_cases, N4_CASES, fresh_seed(), timeout_s=900)
LIVE_BYTES = RANK_BATCH.add(2, "runtime.live_tensor_bytes_over_steps", workers.live_tensor_bytes_over_steps, fresh_seed(),
                            (2, 12), timeout_s=120)
BESIDE = RANK_BATCH.add(2, "runtime.compute_beside_collectives", workers.compute_beside_collectives, fresh_seed(),
                        timeout_s=180)


@pytest.fixture(scope="module")
def n2_ranks(rank_results):
    """Per rank, per case id: that rank's check results."""
    return [{_id(r["case"]): r for r in per_rank} for per_rank in rank_results(2, N2)]


@pytest.fixture(scope="module")
def n2_results(n2_ranks):
    return n2_ranks[0]


@pytest.fixture(scope="module")
def n4_results(rank_results):
    return {_id(r["case"]): r for r in rank_results(4, N4)[0]}


def _assert_exact(r):
    assert r["max_rel_err_output"] < TOL, f"output: relative error {r['max_rel_err_output']:.2e}"
    assert r["max_rel_err_grads"] < TOL, f"gradient of {r['worst_grad']}: relative error {r['max_rel_err_grads']:.2e}"


@pytest.mark.parametrize("case", N2_CASES, ids=_id)
def test_exact_on_two_ranks(case, n2_results):
    _assert_exact(n2_results[_id(case)])


@pytest.mark.parametrize("case", N4_CASES, ids=_id)
def test_exact_on_four_ranks(case, n4_results):
    _assert_exact(n4_results[_id(case)])


def test_ranks_agree_on_the_check(n2_ranks):
    """Every rank reports the same errors: each gathers the full output and gradients and compares
    them with its own eager module, so a rank whose shards or collectives differ shows up here."""
    assert len(n2_ranks) == 2 and n2_ranks[0].keys() == n2_ranks[1].keys()
    for case, ref in n2_ranks[0].items():
        assert ref["comm_nodes"] > 0, case
        for rank, results in enumerate(n2_ranks[1:], start=1):
            r = results[case]
            for key in ("max_rel_err_output", "max_rel_err_grads", "worst_grad", "comm_nodes"):
                assert r[key] == ref[key], f"{case}: rank {rank} {key}={r[key]!r}, rank 0 {ref[key]!r}"


def test_pass_cases_really_rewrite_the_graph(n2_results):
    assert n2_results[_id(PASS_CASES[0])]["recompute_nodes"] > 0           # sar adds recompute nodes
    chunked = n2_results[_id(PASS_CASES[3])]["comm_nodes"]
    assert chunked > n2_results[_id(_case("sp", "ep", "a2a"))]["comm_nodes"]  # chunk=2 splits collectives


def test_the_check_catches_a_wrong_collective(n2_results):
    """A reduce-scatter that forgets the other ranks' partial sums is caught by the same check."""
    r = n2_results[_id(FAULT)]
    assert r["max_rel_err_output"] > 1e-3 and r["max_rel_err_grads"] > 1e-3


@pytest.mark.slow
def test_mismatched_schedules_fail_on_every_rank_within_the_timeout():
    """The ranks' schedule check raises (ScheduleMismatch); were it missing, the ranks would hang
    until spawn's timeout, a RuntimeFailure that is no RankFailure."""
    with pytest.raises(RankFailure) as info:
        spawn(workers.mismatched_plans, 2, args=(fresh_seed(),), timeout_s=120)
    err = info.value
    assert err.error_type == ScheduleMismatch.__name__
    assert "ranks [1] hold a different schedule than the other ranks (rank 0: " in str(err)
    assert isinstance(err, RuntimeFailure)


@pytest.mark.slow
def test_a_stuck_collective_times_out_naming_the_node():
    """The executor's 2 s collective timeout fires (CollectiveTimeout naming the node), not spawn's."""
    with pytest.raises(RankFailure) as info:
        spawn(workers.stalled_rank, 2, args=(fresh_seed(), "ffn_rs", 2.0), timeout_s=120)
    err = info.value
    assert err.rank == 0 and err.error_type == CollectiveTimeout.__name__
    assert "collective 'ffn_rs' (reduce_scatter, stream 'comm') did not complete within 2 s" in str(err)


def test_recorded_steps_do_not_keep_their_buffers(rank_results):
    """Recording step timings must not pin each step's collective buffers (a leak that grew a
    `small` rank by ~20 MiB per step and made every step page-fault on fresh memory)."""
    res = rank_results(2, LIVE_BYTES)
    for rank, (after_2, after_12) in enumerate(res):
        assert after_12 <= after_2, f"rank {rank}: live tensors grew {after_2} -> {after_12} bytes over 10 steps"


def test_alone_collectives_run_with_no_compute_beside_them(rank_results):
    """A plan entry marked alone fences its collective: the compute issued after it waits. The
    positive control is deterministic: one collective is held in flight for 50 ms in both plans,
    and the unfenced plan issues compute before its consumer, so compute must run beside it."""
    for rank, r in enumerate(rank_results(2, BESIDE)):
        assert r["unfenced_slow"] > 0, f"rank {rank}: no compute ran beside the held collective {r['slow']!r}"
        assert r["fenced"] == 0, f"rank {rank}: {r['fenced']} compute nodes ran beside alone collectives"
        _assert_exact(r["check"])
