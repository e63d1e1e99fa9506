"""Schedule file: canonical, versioned, self-describing, hashed."""

import json
import re

import pytest

from moegraph.schedules import Schedule, ScheduleFormatError, compile_graph
from moegraph.schedules.schedule_file import FORMAT, VERSION, canonical_json, exposed_comm
from schedules_fakes import cost_model, moe_layer, tiny_chain

COST = cost_model()


@pytest.fixture(scope="module")
def sched():
    return compile_graph(moe_layer(chunks=2, recompute=True), COST, time_limit_s=1.0).schedule


def test_round_trip_is_byte_identical(sched, tmp_path):
    text = sched.to_json()
    back = Schedule.from_json(text)
    assert back == sched
    assert back.to_json() == text
    path = sched.save(tmp_path / "layer.schedule.json")
    assert path.read_text() == text
    assert Schedule.load(path).to_json() == text


def test_canonical_and_self_describing(sched):
    d = json.loads(sched.to_json())
    assert sched.to_json() == canonical_json(d) + "\n"
    assert d["format"] == FORMAT and d["version"] == VERSION
    assert set(d) == {"format", "version", "graph", "hardware", "streams", "memory_budget_bytes", "tick_us",
                      "values", "nodes", "summary", "hash"}
    assert d["graph"]["strategy"]["chunks"] == 2 and d["graph"]["dims"]["h"] == 4096
    assert d["hardware"] == COST.hw.to_dict()
    assert set(d["summary"]) == {"method", "strategy", "makespan_us", "lower_bound_us", "barrier_us",
                                 "exposed_comm_us", "baselines", "peak_memory_bytes", "solver"}
    assert set(d["summary"]["baselines"]) == {"sequential", "greedy", "megascale"}
    assert "wall_s" not in json.dumps(d)  # run-dependent numbers stay out of the file
    node = d["nodes"][0]
    assert set(node) == {"name", "op", "role", "phase", "kind", "inputs", "outputs", "flops", "mem_bytes",
                         "comm_bytes", "group", "attrs", "module", "block", "forward_of", "stream", "start_us",
                         "end_us", "sm_budget"}
    assert d["hash"] == sched.compute_hash() and d["hash"].startswith("sha256:")


def test_times_are_rounded(sched):
    for n in sched.nodes:
        assert n.start_us == round(n.start_us, 6) and n.end_us == round(n.end_us, 6)


def test_reader_errors():
    with pytest.raises(ScheduleFormatError, match="not JSON"):
        Schedule.from_json("{")
    with pytest.raises(ScheduleFormatError, match="not a moegraph.schedule file"):
        Schedule.from_json('{"format": "x"}')
    with pytest.raises(ScheduleFormatError, match="schedule version 99 is not supported"):
        Schedule.from_json(json.dumps({"format": FORMAT, "version": 99}))
    with pytest.raises(ScheduleFormatError, match="schedule file misses 'graph'"):
        Schedule.from_json(json.dumps({"format": FORMAT, "version": VERSION}))


def test_exposed_comm():
    s = compile_graph(tiny_chain(), COST, method="sequential").schedule
    comm = sum(n.end_us - n.start_us for n in s.nodes if n.kind == "comm")
    assert sum(b - a for a, b in exposed_comm(s.nodes)) == pytest.approx(comm)  # nothing overlaps
    assert s.summary["exposed_comm_us"] == pytest.approx(comm)


def _doc(sched) -> dict:
    return json.loads(sched.to_json())


@pytest.mark.parametrize("field,value,message", [
    ("start_us", float("nan"), "start_us is NaN, not a finite number >= 0"),
    ("end_us", float("inf"), "end_us is infinite, not a finite number >= 0"),
    ("start_us", "12.5", "start_us is str '12.5', not a finite number >= 0"),
    ("end_us", None, "end_us is NoneType None, not a finite number >= 0"),
    ("start_us", True, "start_us is bool True, not a finite number >= 0"),
    ("sm_budget", 1.5, "sm_budget is float 1.5, not a non-negative integer"),
    ("inputs", "x", "inputs is str 'x', not a list of value names"),
])
def test_bad_node_fields_name_the_node_and_field(sched, field, value, message):
    d = _doc(sched)
    d["nodes"][3][field] = value
    name = d["nodes"][3]["name"]
    text = json.dumps(d)  # json writes NaN / Infinity, as a damaged file would hold them
    with pytest.raises(ScheduleFormatError) as err:
        Schedule.from_json(text)
    assert str(err.value) == f"node {name!r}: {message}"


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["summary"].update(makespan_us=float("nan")), "summary.makespan_us is NaN, not a finite number"),
    (lambda d: d["summary"].update(peak_memory_bytes="1 GiB"),
     "summary.peak_memory_bytes is str '1 GiB', not a non-negative integer"),
    (lambda d: d.update(tick_us=0), "tick_us is int 0, not a positive finite number"),
    (lambda d: d["values"][0].update(bytes=-1), "bytes is int -1, not a non-negative integer"),
    (lambda d: d["nodes"][0].pop("end_us"), "misses field 'end_us'"),
    (lambda d: d.update(nodes={}), "nodes is dict {}, not a list"),
])
def test_bad_file_fields_are_named(sched, edit, message):
    d = _doc(sched)
    edit(d)
    with pytest.raises(ScheduleFormatError, match=re.escape(message)):
        Schedule.from_json(json.dumps(d))


def test_origin_of_runtime_files(sched):
    assert sched.origin == "compiled"
    d = _doc(sched)
    d["summary"]["measured"] = True
    assert Schedule.from_json(json.dumps(d)).origin == "measured"
    d["summary"]["measured"] = False
    assert Schedule.from_json(json.dumps(d)).origin == "predicted"
    d["summary"]["measured"] = "yes"
    with pytest.raises(ScheduleFormatError, match="summary.measured is str 'yes', not true or false"):
        Schedule.from_json(json.dumps(d))
