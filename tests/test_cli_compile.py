"""`moegraph compile` and `moegraph verify` from the command line."""

import json

import pytest

from moegraph.cli import main

TINY = ["--model", "tiny", "--n", "2", "--seq", "256", "--time-limit", "2"]


def compile_json(capsys, *extra):
    assert main(["compile", *TINY, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_compile_json_summary_fields(capsys, tmp_path):
    # on h20 CP-SAT beats its warm start here (on h800, since issue 29's interference, the
    # megascale warm start of this tiny layer is already optimal)
    out = compile_json(capsys, "--hardware", "h20", "-o", str(tmp_path / "s.json"))
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


@pytest.mark.slow
def test_ten_runs_give_byte_identical_files(tmp_path, capsys):
    # 0.5 deterministic s: CP-SAT stops mid-search (FEASIBLE, better than its warm start), where a
    # run-dependent search would show (mixtral-8x7b at n=8, s=1024 on h20: an instance where it
    # does; tiny's layers solve to optimality since gate-reorder's weights moved into SwiGLU)
    short = ["--model", "mixtral-8x7b", "--n", "8", "--seq", "1024", "--hardware", "h20", "--time-limit", "0.5"]
    texts = set()
    for i in range(10):
        path = tmp_path / f"s{i}.json"
        assert main(["compile", *short, "-o", str(path)]) == 0
        texts.add(path.read_bytes())
    solver = json.loads(next(iter(texts)))["summary"]["solver"]
    assert solver["status"] == "FEASIBLE" and solver["makespan_us"] < solver["warm_start_makespan_us"]  # mid-search
    capsys.readouterr()
    assert len(texts) == 1


def test_memory_budget_below_least_feasible_names_the_least_value(capsys):
    assert main(["compile", *TINY, "--memory-budget", "1KiB"]) == 2
    err = capsys.readouterr().err
    assert "memory budget 1.00KiB is below the least feasible peak memory " in err and "0.00" not in err
    assert len(err.strip().splitlines()) == 1


def test_sizes_that_read_alike_are_told_apart_in_bytes(capsys):
    """a3-f8: a budget one byte below tiny's bound (446,464 bytes on cpu-2core-gloo) read
    "436.00KiB is below the least feasible peak memory 436.00KiB"."""
    from moegraph.options import format_bytes_apart
    assert format_bytes_apart(446463, 446464) == ("436.00KiB (446,463 bytes)", "436.00KiB (446,464 bytes)")
    assert format_bytes_apart(2**20, 2**19) == ("1.00MiB", "512.00KiB")
    assert main(["compile", *TINY, "--hardware", "cpu-2core-gloo", "--memory-budget", "446463"]) == 2
    err = capsys.readouterr().err
    budget, least = err.split("memory budget ")[1].split(" for this graph")[0].split(
        " is below the least feasible peak memory ")
    assert budget == "436.00KiB (446,463 bytes)" and least != budget


@pytest.mark.slow
def test_a_budget_the_unconstrained_schedule_meets_changes_nothing(capsys, tmp_path):
    """a3-f7: tiny on cpu-2core-gloo, no budget 29,459.1 us (peak 596KiB) but --memory-budget 2MiB
    gave 29,731.8: a budget that does not bind must return the schedule compiled without one."""
    from moegraph.schedules.schedule_file import Schedule
    from moegraph.schedules.verify import verify_schedule
    gloo = ["--hardware", "cpu-2core-gloo", "--time-limit", "1"]
    free = compile_json(capsys, *gloo, "-o", str(tmp_path / "free.json"))
    two = compile_json(capsys, *gloo, "--memory-budget", "2MiB", "-o", str(tmp_path / "two.json"))
    assert free["peak_memory_bytes"] <= 2 * 2**20        # the budget does not bind
    assert two["makespan_us"] == free["makespan_us"] and two["peak_memory_bytes"] == free["peak_memory_bytes"]
    a, b = (Schedule.load(str(tmp_path / f)) for f in ("free.json", "two.json"))
    assert [(n.name, n.start_us, n.stream, n.sm_budget) for n in a.nodes] == \
        [(n.name, n.start_us, n.stream, n.sm_budget) for n in b.nodes]
    assert b.memory_budget_bytes == 2 * 2**20 and verify_schedule(b) == []
    assert "no budget needed" in two["status"]


@pytest.mark.slow
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
    assert out == {"file": str(path), "ok": True, "origin": "compiled", "violation_count": 0, "violations": [],
                   "skipped": {}}
    doc = json.loads(path.read_text())
    doc["nodes"] = doc["nodes"][1:]  # drop the first node, re-hash
    from moegraph.schedules.schedule_file import Schedule
    bad = tmp_path / "bad.json"
    bad.write_text(Schedule.from_json(json.dumps(doc)).with_hash().to_json())
    assert main(["verify", "--json", str(bad)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["violations"][0]["check"] == "coverage"
    assert out["violation_count"] == len(out["violations"]) == 1
    assert out["violations"][0]["message"] == f"node {doc['graph']['nodes'][0]!r} of the graph is missing from the schedule"
    assert main(["gantt", "--json", str(path), "--compare", str(path), "-o", str(tmp_path / "g.json")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["output"] == str(tmp_path / "g.json") and len(out["panels"]) == 2
    assert out["panels"][0]["label"] != out["panels"][1]["label"]


def test_table_lists_a_returned_baseline_once_in_aligned_columns(capsys):
    assert main(["compile", *TINY, "--micro-batches", "2", "--schedule", "dualpipe"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = lines[2:lines.index(next(line for line in lines if line.startswith("lower bound")))]
    assert [r.split()[0] for r in rows] == ["dualpipe", "greedy", "megascale", "megatron-1f1b", "sequential"]
    assert rows[0].split()[1] == "*"
    assert len({r.index("x") for r in rows}) == 1          # the "vs bound" column lines up on every row


@pytest.mark.slow
def test_table_marks_baselines_over_the_memory_budget(capsys):
    out = compile_json(capsys, "--memory-budget", "500KiB", "--time-limit", "1")
    over = {k for k, peak in out["baseline_peak_memory_bytes"].items() if peak > 500 * 2**10}
    assert over and "sequential" not in over              # tiny at s=256: greedy and megascale peak higher
    assert main(["compile", *TINY, "--memory-budget", "500KiB", "--time-limit", "1"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert all("over budget: peak" in rows[name] for name in over)
    assert "over budget" not in rows["sequential"]


@pytest.mark.slow
def test_outputs_in_new_folders_are_created_by_every_writer(tmp_path, capsys):
    """One output rule: a path is refused up front only for what cannot become a file (a
    directory, a file among its parents); missing folders are made when it is written."""
    sched = tmp_path / "new" / "a" / "s.json"
    assert main(["compile", *TINY, "--schedule", "sequential", "-o", str(sched)]) == 0
    assert main(["gantt", str(sched), "-o", str(tmp_path / "charts" / "deep" / "s.svg")]) == 0
    assert sched.is_file() and (tmp_path / "charts" / "deep" / "s.svg").is_file()
    from moegraph.runtime.calibrate.command import _check_writable
    _check_writable(tmp_path / "profiles" / "p.yaml")          # calibrate's up-front check agrees
    assert not (tmp_path / "profiles").exists()


@pytest.mark.slow
def test_compile_prints_solver_progress_with_elapsed_time_on_stderr(capsys, monkeypatch):
    import re

    import moegraph.schedules.api as api
    monkeypatch.setattr(api, "LNS_MIN_TASKS", 0)   # the tiny merged step gets the window search too
    # h20, s = 256: CP-SAT stops mid-search here, so the window search runs (on h800, or at s = 64
    # since the router reads the rank's own tokens, the step is proven optimal)
    assert main(["compile", "--model", "tiny", "--n", "2", "--seq", "256", "--micro-batches", "2",
                 "--time-limit", "0.2", "--json", "--hardware", "h20"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["micro_batches"] == 2       # stdout stays one JSON object
    lines = captured.err.strip().splitlines()
    assert all(re.match(r"\[ *\d+\.\ds\] ", line) for line in lines), lines
    text = [line.split("] ", 1)[1] for line in lines]
    assert re.fullmatch(r"CP-SAT on \d+ tasks, effort 0.2 s, from the \S+ schedule \([0-9.]+ us\)", text[0]), text
    assert re.fullmatch(r"CP-SAT (OPTIMAL|FEASIBLE): [0-9.]+ us", text[1]), text
    windows = int(re.fullmatch(r"window search: (\d+) windows of \d+ tasks, effort \S+ s each", text[2]).group(1))
    assert [t.split(" (")[0] for t in text[3:]] == [f"window search {k}/{windows}" for k in range(1, windows + 1)]
    assert main(["compile", "--model", "tiny", "--n", "2", "--seq", "64", "--schedule", "greedy"]) == 0
    assert capsys.readouterr().err == ""                        # no solve, nothing to report


def test_header_names_dp_when_there_are_replicas(capsys):
    """a3-f8: `compile --dp 2` printed the same header as dp=1 (96 nodes against 67)."""
    assert main(["compile", *TINY, "--schedule", "sequential", "--dp", "2"]) == 0
    two = capsys.readouterr().out.splitlines()[0]
    assert main(["compile", *TINY, "--schedule", "sequential"]) == 0
    one = capsys.readouterr().out.splitlines()[0]
    assert two.endswith(" dp=2") and "dp=" not in one


def test_a_schedule_whose_peak_exceeds_the_devices_memory_says_so(capsys, tmp_path):
    """h800 holds 80 GB: tiny's layer at b=1 fits, at b=262,144 (s=256) its activations alone do not, and
    the table says the schedule cannot run as compiled (it compiled silently before 2026-11-28)."""
    assert main(["compile", *TINY, "--hardware", "h800"]) == 0
    assert "cannot run as compiled" not in capsys.readouterr().out
    out = compile_json(capsys, "--hardware", "h800", "--batch", "262144")
    assert out["peak_memory_bytes"] > out["device_memory_bytes"] == 80_000_000_000
    assert main(["compile", *TINY, "--hardware", "h800", "--batch", "262144"]) == 0
    text = capsys.readouterr().out
    assert f"exceeds h800's 74.51GiB: this schedule cannot run as compiled" in text
