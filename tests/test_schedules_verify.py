"""The verifier accepts every produced schedule and rejects hand-broken ones, naming the nodes."""

import dataclasses
import re

import pytest

from moegraph.options import format_bytes
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
@pytest.mark.slow
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
    assert re.fullmatch(rf"peak memory {format_bytes(peak)} at [0-9.]+ us exceeds the budget "
                        rf"{format_bytes(peak - 1)} \(largest live: '.+' [0-9.]+[KMGT]?i?B.*\)", msg), msg


def test_memory_summary_must_match():
    s = _compiled(moe_layer)
    bad = dataclasses.replace(s, summary={**s.summary, "peak_memory_bytes": 1}).with_hash()
    assert _first(bad) == (f"summary.peak_memory_bytes is 1 but the schedule peaks at "
                           f"{s.summary['peak_memory_bytes']} bytes")


def test_an_input_cut_from_the_graph_leaves_its_producer_dead():
    """A hand edit that drops the edges from the all-gather (fc2 and its weight gradient no longer
    read y_ag), the hash recomputed: fc2 may now start before it, but the all-gather feeds
    nothing, which no produced graph has."""
    s = _compiled(tiny_chain)
    cut = {name: {"inputs": tuple(v for v in s.node[name].inputs if v != "y_ag")} for name in ("fc2", "fc2.wgrad")}
    bad = _edit(s, **cut)
    assert _first(bad) == "node 'ag''s outputs (y_ag) are read by no node and are no graph output"


@pytest.mark.parametrize("field,value,message", [
    ("exposed_comm_us", 0.0, "summary.exposed_comm_us is 0.0 but the nodes leave {exposed:.2f} us of communication "
                             "exposed"),
    ("lower_bound_us", 1e9, "summary.lower_bound_us 1000000000.0 exceeds the makespan {makespan}: no schedule is "
                            "shorter than a lower bound"),
    ("strategy", None, "summary.strategy says n=4 but graph.strategy has n=8"),
])
def test_summary_figures_are_the_nodes_own(field, value, message):
    from moegraph.schedules.schedule_file import exposed_comm, round_us
    s = _compiled(tiny_chain)
    exposed = round_us(sum(e - b for b, e in exposed_comm(s.nodes)))
    assert exposed > 0 and s.graph["strategy"]["n"] == 8          # the tiny chain's all-gather on 8 ranks
    value = s.summary["strategy"].replace("n=8", "n=4") if value is None else value
    bad = dataclasses.replace(s, summary={**s.summary, field: value}).with_hash()
    assert _first(bad) == message.format(exposed=exposed, makespan=s.summary["makespan_us"])


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


# -- coverage: every graph node scheduled exactly once ----------------------------------------------------

def _without(s: Schedule, name: str) -> Schedule:
    """The schedule with one node deleted and the file re-hashed (so the hash check passes)."""
    return dataclasses.replace(s, nodes=tuple(n for n in s.nodes if n.name != name)).with_hash()


@pytest.mark.parametrize("which", ["first", "mid-backward", "last"])
@pytest.mark.slow
def test_a_deleted_node_is_rejected(which):
    s = _compiled(lambda: moe_layer(recompute=True))
    backward = [n for n in s.nodes if n.phase == "backward"]
    victim = {"first": s.nodes[0], "mid-backward": backward[len(backward) // 2], "last": s.nodes[-1]}[which]
    v = verify_schedule(_without(s, victim.name))       # named by the graph's node list (graph.nodes)
    assert [(x.check, x.message, x.nodes) for x in v] == [
        ("coverage", f"node {victim.name!r} of the graph is missing from the schedule", (victim.name,))]
    # a file written before graph.nodes was recorded: the value the node would have produced
    legacy = _without(dataclasses.replace(s, graph={k: x for k, x in s.graph.items() if k != "nodes"}), victim.name)
    v = verify_schedule(legacy)
    assert v and v[0].check == "coverage"
    assert "is neither a graph input nor written by any scheduled node" in v[0].message
    assert any(f"value {o!r}" in x.message for x in v for o in victim.outputs)


def test_a_node_not_in_the_graph_is_named():
    s = _compiled(tiny_chain)
    renamed = dataclasses.replace(s, nodes=(dataclasses.replace(s.nodes[0], name="stray"), *s.nodes[1:])).with_hash()
    assert [x.message for x in verify_schedule(renamed)] == [
        f"node {s.nodes[0].name!r} of the graph is missing from the schedule",
        "node 'stray' is scheduled but is no node of the graph (graph.nodes)"]


def test_a_value_written_twice_is_rejected():
    s = _compiled(tiny_chain)
    ag = s.node["ag"]
    bad = _edit(s, fc2={"outputs": ag.outputs + s.node["fc2"].outputs})
    assert _first(bad) == f"value {ag.outputs[0]!r} is written by both 'ag' and 'fc2'"


# -- compile and verify agree on every hardware, with and without an overlap stretch ---------------------

@pytest.fixture(scope="module")
def small_graph():
    from moegraph.ir import Strategy
    from moegraph.registry import load_model
    from moegraph.tracer import trace_model
    # tp attention + a2a dispatch: tiny latency-bound weight-gradient all-reduces, where an
    # alone mode at the default budget is no faster than a smaller budget (the case that
    # once lost its alone twin and was priced stretched while nothing overlapped it)
    return trace_model(load_model("small"), Strategy(attn="tp", ffn="ep", dispatch="a2a", n=2), batch=1, seq=256)


def _registry_hardware():
    from moegraph.registry import hardware_names
    return hardware_names()


@pytest.mark.parametrize("stretch", [None, 3.0], ids=["as-registered", "stretch3"])
@pytest.mark.parametrize("hw_name", _registry_hardware())
@pytest.mark.slow
def test_every_compile_output_verifies(small_graph, hw_name, stretch):
    from moegraph.cost import CostModel
    from moegraph.registry import load_hardware
    hw = load_hardware(hw_name)
    if stretch is not None:
        hw = dataclasses.replace(hw, comm_overlap_stretch=stretch)
    cost = CostModel(hw)
    for method in ("sequential", "greedy", "megascale", "cpsat"):
        s = compile_graph(small_graph, cost, method=method, time_limit_s=0.3).schedule
        assert verify_schedule(s) == [], (method, verify_schedule(s)[:1])


def test_every_beside_mode_has_its_alone_twin(small_graph):
    from moegraph.cost import CostModel
    from moegraph.registry import load_hardware
    from moegraph.schedules.problem import build_problem
    p = build_problem(small_graph, CostModel(dataclasses.replace(load_hardware("h20"), comm_overlap_stretch=3.0)))
    checked = 0
    for t in p.tasks:
        if t.kind == "comm":
            alone = {m.sm for m in t.modes if m.alone}
            assert {m.sm for m in t.modes if not m.alone} <= alone, t.name
            checked += 1
    assert checked > 0


# -- files written by `run --trace`: measured and predicted ----------------------------------------------

def _runtime_file(s: Schedule, origin: str, shift_us: float = 0.0) -> Schedule:
    """A compiled schedule dressed as `run --trace` writes it (runtime summary, no peak memory,
    no solver, compute entries at 0 SMs), with every time stretched by a non-cost-model factor."""
    from moegraph.schedules.schedule_file import exposed_comm, round_us
    nodes = tuple(dataclasses.replace(n, start_us=round(n.start_us * 1.37 + shift_us, 6),
                                      end_us=round(n.end_us * 1.37 + shift_us, 6),
                                      sm_budget=n.sm_budget if n.kind == "comm" else 0) for n in s.nodes)
    summary = {"method": s.summary["method"], "plan_hash": "0" * 64, "strategy": s.summary["strategy"],
               "makespan_us": round(s.makespan_us * 1.37 + shift_us, 6),
               "exposed_comm_us": round_us(sum(e - b for b, e in exposed_comm(nodes))),   # as runtime.trace writes it
               "measured": origin == "measured"}
    if origin == "measured":
        summary.update(rank=0, device="cpu", barrier_us=0.0)
    return dataclasses.replace(s, nodes=nodes, summary=summary).with_hash()


@pytest.mark.parametrize("origin", ["measured", "predicted"])
def test_runtime_files_are_checked_for_structure_not_cost(origin):
    from moegraph.schedules.verify import verdict
    s = _runtime_file(_compiled(tiny_chain), origin)
    v = verdict(Schedule.from_json(s.to_json()))
    assert v.origin == origin and v.ok, v.violations[:1]
    assert {k for k, _ in v.skipped} >= {"duration", "sm", "memory"}
    assert ("stream" in dict(v.skipped)) == (origin == "measured")   # CPU measurements: comm spans may overlap
    # what still applies: coverage, dependencies, the compute stream, the recorded makespan
    assert verify_schedule(_without(s, "fc1"))[0].check == "coverage"
    fc2, ag = s.node["fc2"], s.node["ag"]
    early = _edit(s, fc2={"start_us": ag.end_us - 1.0, "end_us": ag.end_us - 1.0 + fc2.duration_us})
    assert any(x.check == "dependency" and x.nodes == ("fc2", "ag") for x in verify_schedule(early))
    a, b = sorted((s.node["fc2.dgrad"], s.node["fc2.wgrad"]), key=lambda n: n.start_us)
    clash = _edit(s, **{b.name: {"start_us": a.start_us, "end_us": a.start_us + b.duration_us}})
    assert any(x.check == "stream" for x in verify_schedule(clash))
    wrong_span = dataclasses.replace(s, summary={**s.summary, "makespan_us": 1.0}).with_hash()
    assert verify_schedule(wrong_span)[0].check == "summary"


def test_a_real_runtime_trace_file_verifies():
    """The exporter `run --trace` uses (moegraph.runtime.trace) on a plan made from a compiled
    schedule, and a measured step with every time scaled (not cost-model times)."""
    import json
    from moegraph.runtime.plan import ExecutionPlan
    from moegraph.runtime.trace import as_schedule, predicted_schedule, schedule_json
    graph = tiny_chain()
    plan = ExecutionPlan.from_schedule(graph, _compiled(tiny_chain, "greedy"))
    predicted = predicted_schedule(graph, plan, hardware=COST.hw)
    times = {e.name: (e.start_us * 1.3, e.end_us * 1.3) for e in plan.entries}
    measured = as_schedule(graph, plan, times, hardware=COST.hw, measured=True, rank=0, device="cpu")
    for s, origin in ((predicted, "predicted"), (measured, "measured")):
        loaded = Schedule.from_json(json.dumps(schedule_json(s)))
        assert loaded.origin == origin
        assert verify_schedule(loaded) == []
