"""benchmarks/current_figures.py: RESULTS.md's "Current figures" table is the one regenerated from
benchmarks/results/, the same inputs give the same table, the latest record of a benchmark wins,
and a malformed record stops it with one line naming the file and the field."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("current_figures", ROOT / "benchmarks" / "current_figures.py")
cf = sys.modules.setdefault("current_figures", importlib.util.module_from_spec(SPEC))   # dataclasses look it up
SPEC.loader.exec_module(cf)

LOG = ("# Benchmark results\n\n" + cf.BEGIN + "\n" + cf.END + "\n\n## Dated log\n\n"
       "## 2026-11-20, 10:00 UTC: first run (vm)\n\ntext\n\n## 2026-11-21, 09:00 UTC: second run (vm)\n\ntext\n")


def _record(benchmark="bench", date="2026-11-20", log="2026-11-20, 10:00 UTC: first run (vm)", **over):
    rec = {"benchmark": benchmark, "date": date, "machine": "vm, 2 cores", "command": "python benchmarks/x.py",
           "log": log, "figures": [{"figure": "step", "value": "1.5 ms", "bar": "<= 2 ms"},
                                   {"figure": "error", "value": "3%"}]}
    rec.update(over)
    return rec


def _write(folder: Path, name: str, rec) -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(rec if isinstance(rec, str) else json.dumps(rec))
    return path


def _table(text: str) -> list[str]:
    return [line for line in text.split(cf.BEGIN)[1].split(cf.END)[0].splitlines() if line.startswith("| ")]


def test_results_md_holds_the_regenerated_table():
    """The committed table is exactly what the script makes from the committed records."""
    assert cf.main(["--check"]) == 0


def test_the_same_records_give_the_same_table_and_the_latest_record_wins(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    old, new = _record(), _record(date="2026-11-21", log="2026-11-21, 09:00 UTC: second run (vm)",
                                  figures=[{"figure": "step", "value": "1.2 ms"}])
    other = _record(benchmark="alpha")
    for folder, order in ((a, (old, new, other)), (b, (other, new, old))):     # written in other orders
        for rec in order:
            _write(folder, f"{rec['benchmark']}-{rec['date']}.json", rec)
    first = cf.regenerate(LOG, a)
    assert cf.regenerate(LOG, b) == first == cf.regenerate(first, a)            # and idempotent
    assert _table(first)[1:] == [
        "| alpha | step | 1.5 ms | <= 2 ms | vm, 2 cores | 2026-11-20, 10:00 UTC |",
        "| alpha | error | 3% | - | vm, 2 cores | 2026-11-20, 10:00 UTC |",
        "| bench | step | 1.2 ms | - | vm, 2 cores | 2026-11-21, 09:00 UTC |",      # 2026-11-20's is older
    ]
    assert first.endswith(LOG.split(cf.END)[1])                                  # the log is untouched


MALFORMED = [
    ("bench-2026-11-20.json", "{not json", "not JSON"),
    ("bench-2026-11-20.json", [1, 2], "expected a JSON object"),
    ("bench.json", _record(), "file name is not <benchmark>-<YYYY-MM-DD>[-<tag>].json"),
    ("bench-2026-11-20.json", {k: v for k, v in _record().items() if k != "machine"}, "missing fields ['machine']"),
    ("bench-2026-11-20.json", _record(extra=1), "unknown fields ['extra']"),
    ("bench-2026-11-21.json", _record(), "date '2026-11-20' differs from the file name's '2026-11-21'"),
    ("bench-2026-13-40.json", _record(date="2026-13-40"), "date '2026-13-40' is not a calendar date"),
    ("bench-2026-11-20.json", _record(log="2026-11-22: a run nobody logged"), "is not a '## ' heading"),
    ("bench-2026-11-20.json", _record(figures=[]), "figures: expected a non-empty list"),
    ("bench-2026-11-20.json", _record(figures=[{"figure": "x"}]), "figures[0]: expected an object with"),
    ("bench-2026-11-20.json", _record(figures=[{"figure": "x", "value": "1 | 2"}]), "figures[0].value: '1 | 2' holds '|'"),
    ("bench-2026-11-20.json", _record(figures=[{"figure": "x", "value": 1.5}]), "figures[0].value: expected a non-empty string"),
    ("bench-2026-11-20.json", _record(figures=[{"figure": "x", "value": "1"}] * 2), "a figure is listed twice"),
]


@pytest.mark.parametrize("name, rec, message", MALFORMED, ids=[m[2][:30] for m in MALFORMED])
def test_a_malformed_record_is_one_line_naming_the_file_and_field(tmp_path, capsys, name, rec, message):
    results = tmp_path / "RESULTS.md"
    results.write_text(LOG)
    path = _write(tmp_path / "results", name, rec)
    assert cf.main(["--results", str(results), "--records", str(tmp_path / "results")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"current_figures.py: {path}: ") and message in err, err
    assert results.read_text() == LOG                                          # nothing written


def test_results_md_without_its_markers_is_refused(tmp_path, capsys):
    results = tmp_path / "RESULTS.md"
    results.write_text(LOG.replace(cf.END, ""))
    _write(tmp_path / "results", "bench-2026-11-20.json", _record())
    assert cf.main(["--results", str(results), "--records", str(tmp_path / "results")]) == 2
    assert "expected one '<!-- current-figures" in capsys.readouterr().err


def test_check_reports_a_stale_table(tmp_path, capsys):
    shutil.copy(cf.RESULTS, tmp_path / "RESULTS.md")
    shutil.copytree(cf.RECORDS, tmp_path / "results")
    rec = json.loads(next((tmp_path / "results").glob("*.json")).read_text())
    rec["figures"][0]["value"] += " (changed)"
    # a tag that sorts after any real one of that date ("session3" > "later"), so this record is the latest
    _write(tmp_path / "results", f"{rec['benchmark']}-{rec['date']}-zzzz-later.json", rec)
    args = ["--results", str(tmp_path / "RESULTS.md"), "--records", str(tmp_path / "results")]
    assert cf.main([*args, "--check"]) == 1
    assert "is out of date" in capsys.readouterr().err
    assert cf.main(args) == 0 and cf.main([*args, "--check"]) == 0
    assert rec["figures"][0]["value"] in (tmp_path / "RESULTS.md").read_text()
