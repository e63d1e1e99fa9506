"""Atomic outputs (moegraph.atomic): the helper itself, and a SIGKILL timed to the write of every
output kind (schedule, Gantt chart, calibration profile, tune cache entry, run trace, RESULTS
table) leaving the old file intact and the new one complete beside it.

The kill is timed by the helper's fault point (MOEGRAPH_FAULT_BEFORE_RENAME=<file name>): the
writer SIGKILLs itself after the temporary file is written and fsynced, before the rename, the
instant at which a plain write would leave a partial file. A writer that does not go through the
helper never reaches the fault point, exits 0 and overwrites the old file: each test fails then.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from moegraph.atomic import FAULT_ENV, append_atomic, atomic_output, check_writable, temp_files, write_atomic

OLD = b"the previous file, which a killed writer must leave intact\n"


def test_write_replaces_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "new" / "deeper" / "f.json"              # missing folders are made
    write_atomic(path, "first")
    write_atomic(path, b"second")
    assert path.read_bytes() == b"second" and temp_files(path) == []
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.json"]


def test_mode_of_an_existing_file_is_kept_and_a_new_one_follows_the_umask(tmp_path):
    old = tmp_path / "old.txt"
    old.write_text("x")
    old.chmod(0o640)
    write_atomic(old, "y")
    assert stat.S_IMODE(old.stat().st_mode) == 0o640
    umask = os.umask(0o022)
    try:
        write_atomic(tmp_path / "new.txt", "z")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "new.txt").stat().st_mode) == 0o644      # not mkstemp's 0600


def test_a_symlink_stays_a_link_and_its_target_is_replaced(tmp_path):
    target = tmp_path / "target.txt"
    target.write_text("old")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    write_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "new"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "chart.png"
    path.write_bytes(OLD)
    with pytest.raises(RuntimeError, match="renderer broke"):
        with atomic_output(path) as buf:
            buf.write(b"half a chart")
            raise RuntimeError("renderer broke")
    assert path.read_bytes() == OLD and temp_files(path) == []


def test_append_adds_to_the_whole_file(tmp_path):
    path = tmp_path / "RESULTS.md"
    append_atomic(path, "a\n")
    append_atomic(path, "b\n")
    assert path.read_text() == "a\nb\n"


def test_check_writable_probes_the_nearest_folder(tmp_path):
    check_writable(tmp_path / "not" / "yet" / "made.json")
    assert list(tmp_path.iterdir()) == []                       # the probe leaves nothing
    for bad in ("/proc/x.json", "/proc/a/b/x.json"):
        with pytest.raises(OSError, match="the folder '/proc' does not take new files"):
            check_writable(bad)


# -- a SIGKILL timed to the write, for every output kind ------------------------------------------

def _killed_at_the_write(tmp_path: Path, target: Path, code: str | None = None, argv: list[str] | None = None) -> Path:
    """Run a writer of ``target`` (python -c ``code`` or python -m moegraph ``argv``) with the fault
    point armed for ``target``'s name; check it died by SIGKILL and ``target`` still holds OLD.
    Returns the temporary file the killed writer left (the complete new content)."""
    target.write_bytes(OLD)
    env = {**os.environ, FAULT_ENV: target.name}
    cmd = [sys.executable, "-c", code] if code is not None else [sys.executable, "-m", "moegraph", *argv]
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, (done.returncode, done.stderr[-2000:])
    assert target.read_bytes() == OLD, "the killed writer damaged the previous file"
    left = temp_files(target)
    assert len(left) == 1, left
    return left[0]


@pytest.fixture(scope="module")
def schedule_file(tmp_path_factory) -> Path:
    from moegraph.cli import main
    path = tmp_path_factory.mktemp("atomic") / "sched.json"
    assert main(["compile", "--model", "tiny", "--hardware", "h800", "--n", "2", "--seq", "64", "--schedule",
                 "sequential", "-o", str(path)]) == 0
    return path


@pytest.mark.slow
@pytest.mark.parametrize("suffix", [".png", ".html"])
def test_gantt_killed_at_the_write_keeps_the_old_chart(tmp_path, schedule_file, suffix):
    chart = tmp_path / f"chart{suffix}"
    new = _killed_at_the_write(tmp_path, chart, argv=["gantt", str(schedule_file), "-o", str(chart)])
    head = new.read_bytes()[:16]
    assert head.startswith(b"\x89PNG") if suffix == ".png" else head.startswith(b"<!DOCTYPE html>")
    assert new.read_bytes().rstrip().endswith(b"IEND\xaeB`\x82" if suffix == ".png" else b"</html>")


@pytest.mark.slow
def test_profile_killed_at_the_write_keeps_the_old_profile(tmp_path):
    from moegraph.registry import load_hardware
    profile = tmp_path / "machine.yaml"
    code = ("from pathlib import Path\n"
            "from moegraph.registry import load_hardware\n"
            "from moegraph.runtime.calibrate.profile_io import Profile, read_facts, write_profile\n"
            "hw = load_hardware('cpu-2core-gloo')\n"
            "d = hw.to_dict()\n"
            "fields = {k: v for k, v in d.items() if k not in ('description', 'measured')}\n"
            f"write_profile(Path({str(profile)!r}), Profile(fields, read_facts(hw), d['description']), [], [])\n")
    new = _killed_at_the_write(tmp_path, profile, code=code)
    complete = tmp_path / "complete.yaml"
    new.rename(complete)
    unnamed = {"name": "x"}                     # the file's name is its profile name
    assert load_hardware(complete).to_dict() | unnamed == load_hardware("cpu-2core-gloo").to_dict() | unnamed


@pytest.mark.slow
def test_cache_entry_killed_at_the_write_keeps_the_old_entry(tmp_path):
    entry = tmp_path / "k.json"
    code = ("from pathlib import Path\n"
            "from moegraph.schedules.tune_cache import Cache\n"
            f"Cache(Path({str(tmp_path)!r})).put('k', {{'feasible': False, 'why': 'new entry'}})\n")
    new = _killed_at_the_write(tmp_path, entry, code=code)
    assert json.loads(new.read_text())["why"] == "new entry"


@pytest.mark.slow
def test_trace_json_and_results_table_killed_at_the_write_keep_the_old_file(tmp_path):
    trace = tmp_path / "t.json"
    new = _killed_at_the_write(tmp_path, trace, code=(
        "from moegraph.runtime.trace import write_json\n"
        f"write_json({str(trace)!r}, {{'steps': [1.5, 2.5]}})\n"))
    assert json.loads(new.read_text()) == {"steps": [1.5, 2.5]}
    results = tmp_path / "RESULTS.md"
    new = _killed_at_the_write(tmp_path, results, code=(
        "from moegraph.atomic import append_atomic\n"
        f"append_atomic({str(results)!r}, '| a new table |\\n')\n"))
    assert new.read_bytes() == OLD + b"| a new table |\n"
