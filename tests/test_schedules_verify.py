"""The verifier accepts every produced schedule and rejects hand-broken ones, naming the nodes."""

import dataclasses
import re

import pytest

from moegraph.schedules import compile_graph, verify_schedule
from moegraph.schedules.schedule_file import Schedule
from moegraph.schedules.verify import DURATION_TOLERANCE_US, check
from schedules_fakes import barrier_graph, cost_model, moe_layer, tiny_chain

COST = cost_model()


def _compiled(make, method="cpsat", **kw):
    return compile_graph(make(), COST, method=method, time_limit_s=2.0, **kw).schedule


def _edit(s: Schedule, **changes) -> Schedule:
    """Replace nodes by name (dict of field updates) and re-hash, so only the edit is wrong."""
    nodes = tuple(dataclasses.replace(n, **changes[n.name]) if n.name in changes else n for n in s.nodes)
    return dataclasses.replace(s, nodes=nodes).with_hash()


def _first(s: Schedule) -> str:
    v = verify_schedule(s)
    assert v, "expected a violation"
    return v[0].message


@pytest.mark.parametrize("method", ["cpsat", "sequential", "greedy", "megascale"])
@pytest.mark.parametrize("make", [tiny_chain, barrier_graph, lambda: moe_layer(chunks=2, recompute=True)],
                         ids=["tiny", "barrier", "moe_c2_re"])
def test_every_produced_schedule_is_accepted(make, method):
    s = _compiled(make, method)
    assert verify_schedule(s) == []
    assert verify_schedule(s, COST) == []  # with the caller's cost model too
    check(s)


def test_two_streams_and_budget_accepted():
    s = _compiled(lambda: moe_layer(scope="inter"), comm_streams=("comm.intra", "comm.inter"),
                  memory_budget_bytes=1 << 30)
    assert verify_schedule(s) == []


def test_broken_dependency():
    s = _compiled(tiny_chain)
    ag, fc2 = s.node["ag"], s.node["fc2"]
    shift = fc2.start_us - (ag.end_us - 1.0)  # start 1 us before its input exists
    bad = _edit(s, fc2={"start_us": fc2.start_us - shift, "end_us": fc2.end_us - shift})
    assert _first(bad) == (f"node 'fc2' starts at {fc2.start_us - shift:.2f} us before its input 'y_ag' is produced "
                           f"at {ag.end_us:.2f} us by 'ag'")
    assert verify_schedule(bad)[0].nodes == ("fc2", "ag")


def test_broken_barrier():
    s = _compiled(barrier_graph)
    e = s.node["early.dgrad"]
    fwd_end = s.node["fwd2"].end_us
    bad = _edit(s, **{"early.dgrad": {"start_us": 0.0, "end_us": e.end_us - e.start_us}})
    assert _first(bad) == (f"node 'early.dgrad' (backward) starts at 0.00 us before the forward pass ends at "
                           f"{fwd_end:.2f} us (last forward node 'fwd2')")


def test_two_ops_on_one_stream():
    s = _compiled(tiny_chain, "sequential")
    d, w = s.node["fc2.dgrad"], s.node["fc2.wgrad"]
    a, b = (d, w) if d.start_us < w.start_us else (w, d)
    dur = b.end_us - b.start_us
    bad = _edit(s, **{b.name: {"start_us": a.start_us, "end_us": a.start_us + dur}})
    msg = _first(bad)
    assert msg == (f"nodes {a.name!r} [{a.start_us:.2f}, {a.end_us:.2f}) us and {b.name!r} [{a.start_us:.2f}, "
                   f"{a.start_us + dur:.2f}) us overlap on stream 'compute'")


def test_too_many_sms():
    s = _compiled(tiny_chain, "greedy")
    # greedy runs compute beside a collective holding SMs in a slowed mode; claim full SMs instead
    comm = [n for n in s.nodes if n.kind == "comm" and n.sm_budget > 0]
    pair = next((c, n) for c in comm for n in s.nodes
                if n.kind == "compute" and n.start_us < c.end_us and c.start_us < n.end_us and n.sm_budget > 0)
    c, n = pair
    S = COST.sm_count()
    bad = _edit(s, **{n.name: {"sm_budget": S}})
    t = max(c.start_us, n.start_us)
    holders = ", ".join(f"{k!r} ({v})" for k, v in sorted({c.name: c.sm_budget, n.name: S}.items()))
    assert _first(bad) == f"SMs exceed sm_count={S} at {t:.2f} us: {holders} hold {S + c.sm_budget}"


def test_wrong_duration():
    s = _compiled(tiny_chain)
    fc1 = s.node["fc1"]
    bad = _edit(s, fc1={"end_us": fc1.end_us - 1.0})
    base = COST.node_time_us(next(n for n in tiny_chain().nodes if n.name == "fc1"))
    want = base * COST.sm_count() / fc1.sm_budget
    assert _first(bad) == (f"node 'fc1' lasts {fc1.end_us - 1.0 - fc1.start_us:.4f} us but the cost model gives "
                           f"{want:.4f} us on {fc1.sm_budget} of {COST.sm_count()} SMs")


def test_duration_tolerance_is_one_tick():
    assert DURATION_TOLERANCE_US == pytest.approx(0.01, abs=1e-5)


def test_disallowed_sm_budget():
    s = _compiled(tiny_chain)
    bad = _edit(s, ag={"sm_budget": 7})
    ag = next(n for n in tiny_chain().nodes if n.name == "ag")
    assert _first(bad) == f"node 'ag' holds 7 SMs; allowed budgets: {list(COST.comm_sm_budgets(ag))}"


def test_memory_over_budget():
    s = _compiled(moe_layer)
    peak = s.summary["peak_memory_bytes"]
    bad = dataclasses.replace(s, memory_budget_bytes=peak - 1).with_hash()
    msg = _first(bad)
    assert re.fullmatch(rf"peak memory {peak / 2**30:.2f} GiB at [0-9.]+ us exceeds the budget "
                        rf"{(peak - 1) / 2**30:.2f} GiB \(largest live: '.+' [0-9.]+ GiB.*\)", msg), msg


def test_memory_summary_must_match():
    s = _compiled(moe_layer)
    bad = dataclasses.replace(s, summary={**s.summary, "peak_memory_bytes": 1}).with_hash()
    assert _first(bad) == (f"summary.peak_memory_bytes is 1 but the schedule peaks at "
                           f"{s.summary['peak_memory_bytes']} bytes")


def test_tampered_hash():
    s = _compiled(tiny_chain)
    bad = dataclasses.replace(s, hash="sha256:" + "0" * 64)
    assert _first(bad).startswith("hash mismatch: the file records sha256:000000000000... but its content hashes to "
                                  "sha256:")
    edited = dataclasses.replace(s, summary={**s.summary, "makespan_us": 1.0})  # content changed, hash kept
    assert verify_schedule(edited)[0].check == "hash"
    loaded = Schedule.from_json(bad.to_json())
    assert verify_schedule(loaded)[0].check == "hash"


def test_duplicate_and_unknown_stream():
    s = _compiled(tiny_chain)
    twice = dataclasses.replace(s, nodes=s.nodes + (s.nodes[0],)).with_hash()
    assert _first(twice) == f"node {s.nodes[0].name!r} is scheduled more than once"
    lost = _edit(s, fc1={"stream": "nccl"})
    assert _first(lost) == "node 'fc1' is on unknown stream 'nccl'; streams: ['compute', 'comm']"
