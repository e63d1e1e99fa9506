"""`moegraph compile` and `moegraph verify` from the command line."""

import json

import pytest

from moegraph.cli import main

TINY = ["--model", "tiny", "--n", "2", "--seq", "256", "--time-limit", "2"]


def compile_json(capsys, *extra):
    assert main(["compile", *TINY, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_compile_json_summary_fields(capsys, tmp_path):
    out = compile_json(capsys, "-o", str(tmp_path / "s.json"))
    assert set(out) >= {"makespan_us", "lower_bound_us", "baselines", "peak_memory_bytes", "solver", "strategy"}
    assert set(out["baselines"]) == {"sequential", "greedy", "megascale"}
    assert set(out["solver"]) >= {"status", "objective_bound_us", "wall_s", "makespan_us", "warm_start",
                                  "warm_start_makespan_us", "wall_cap_hit"}
    assert out["source"] == "cpsat" and out["solver"]["status"] in ("OPTIMAL", "FEASIBLE")
    assert out["solver"]["makespan_us"] == out["makespan_us"] <= out["solver"]["warm_start_makespan_us"]
    assert out["solver"]["wall_cap_hit"] is False
    assert out["lower_bound_us"] <= out["makespan_us"] <= min(out["baselines"].values())
    assert out["strategy"]["remat"] == "paper" and out["strategy"]["gate"] == "before-fc2"   # the default passes
    assert main(["verify", str(tmp_path / "s.json")]) == 0


def test_ten_runs_give_byte_identical_files(tmp_path, capsys):
    # 0.5 deterministic s (not TINY's 2): CP-SAT still stops mid-search (FEASIBLE, better than its
    # warm start), where a run-dependent search would show, at a quarter of the time
    short = [*TINY[:-1], "0.5"]
    texts = set()
    for i in range(10):
        path = tmp_path / f"s{i}.json"
        assert main(["compile", *short, "-o", str(path)]) == 0
        texts.add(path.read_bytes())
    assert json.loads(next(iter(texts)))["summary"]["solver"]["status"] == "FEASIBLE"     # stopped mid-search
    capsys.readouterr()
    assert len(texts) == 1


def test_memory_budget_below_least_feasible_names_the_least_value(capsys):
    assert main(["compile", *TINY, "--memory-budget", "1KiB"]) == 2
    err = capsys.readouterr().err
    assert "memory budget 0.00 GiB is below the least feasible peak memory" in err
    assert len(err.strip().splitlines()) == 1


def test_verify_names_the_first_violation(tmp_path, capsys):
    path = tmp_path / "s.json"
    assert main(["compile", *TINY, "-o", str(path)]) == 0
    doc = json.loads(path.read_text())
    # hand-break it: move the first backward node to time 0, before its inputs exist
    node = next(n for n in doc["nodes"] if n["phase"] == "backward")
    width = node["end_us"] - node["start_us"]
    node["start_us"], node["end_us"] = 0.0, width
    # re-hash, as a tool that edits schedules would, so the check that fires is the dependency
    from moegraph.schedules.schedule_file import Schedule
    path.write_text(Schedule.from_json(json.dumps(doc)).with_hash().to_json())
    capsys.readouterr()
    assert main(["verify", str(path)]) == 1
    assert node["name"] in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["verify", "/no/such.json"], "no schedule file '/no/such.json'"),
    (["compile", *TINY, "--passes", "sarr"], "unknown pass 'sarr'"),
])
def test_compile_and_verify_errors_are_one_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_verify_and_gantt_json(tmp_path, capsys):
    path = tmp_path / "s.json"
    assert main(["compile", *TINY, "--schedule", "greedy", "-o", str(path)]) == 0
    capsys.readouterr()
    assert main(["verify", "--json", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"file": str(path), "ok": True, "origin": "compiled", "violations": [], "skipped": {}}
    doc = json.loads(path.read_text())
    doc["nodes"] = doc["nodes"][1:]  # drop the first node, re-hash
    from moegraph.schedules.schedule_file import Schedule
    bad = tmp_path / "bad.json"
    bad.write_text(Schedule.from_json(json.dumps(doc)).with_hash().to_json())
    assert main(["verify", "--json", str(bad)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["violations"][0]["check"] == "coverage"
    assert main(["gantt", "--json", str(path), "--compare", str(path), "-o", str(tmp_path / "g.json")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["output"] == str(tmp_path / "g.json") and len(out["panels"]) == 2
    assert out["panels"][0]["label"] != out["panels"][1]["label"]
