"""Launching ranks: a rank that dies is named (not its survivors' symptoms), and ranks never
outlive a launcher killed with SIGTERM or SIGINT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import runtime_workers as workers
from moegraph.runtime import RankFailure
from moegraph.runtime.launch import spawn

TESTS = Path(__file__).resolve().parent


@pytest.mark.slow
def test_a_rank_killed_during_start_up_is_named(tmp_path):
    """The survivor is stopped, not left to its 60 s rendezvous timeout: had spawn waited for it
    (its own limit is longer), the survivor's timeout would be named too ("ranks [r] failed after it")."""
    with pytest.raises(RankFailure) as info:
        spawn(workers.die_at_startup, 2, args=(workers.StartupKiller(str(tmp_path / "flag")),), timeout_s=180,
              pg_timeout_s=60)
    err = info.value
    assert err.error_type == "RankDied"
    assert str(err) == f"rank {err.rank} was killed by signal SIGKILL before reporting"


@pytest.mark.slow
def test_a_rank_killed_mid_run_is_named_not_the_survivors_symptom():
    with pytest.raises(RankFailure) as info:
        spawn(workers.die_mid_run, 2, args=(1,), timeout_s=120, pg_timeout_s=60)
    err = info.value
    assert err.rank == 1 and err.error_type == "RankDied"
    assert str(err).startswith("rank 1 was killed by signal SIGKILL before reporting"), str(err)
    assert "Connection closed" not in str(err)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _launcher_with_ranks(pid_dir: Path) -> tuple[subprocess.Popen, list[int]]:
    """A launcher process spawning two ranks that sleep; (launcher, rank pids) once both run."""
    code = (f"import sys; sys.path.insert(0, {str(TESTS)!r}); import runtime_workers as w; "
            f"from moegraph.runtime.launch import spawn; spawn(w.sleep_forever, 2, args=({str(pid_dir)!r},))")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while len(list(pid_dir.glob("rank*.pid"))) < 2:
        assert parent.poll() is None, parent.communicate()
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.1)
    pids = [int(p.read_text()) for p in sorted(pid_dir.glob("rank*.pid"))]
    assert all(_alive(p) for p in pids)
    return parent, pids


def _left_alive(pids: list[int], within_s: float = 60.0) -> list[int]:
    """The ranks still running after at most ``within_s``. The ranks would sleep forever: the
    limit only keeps a failure from hanging, it states no speed (they go in well under 1 s)."""
    gone_by = time.monotonic() + within_s
    while any(_alive(p) for p in pids) and time.monotonic() < gone_by:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _cleanup(parent: subprocess.Popen, pid_dir: Path) -> None:
    if parent.poll() is None:
        parent.kill()
        parent.wait()
    for p in pid_dir.glob("rank*.pid"):
        try:
            os.kill(int(p.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
@pytest.mark.slow
def test_killing_the_launcher_ends_its_ranks(sig, tmp_path):
    """SIGTERM and SIGINT: the launcher stops its ranks; SIGKILL leaves it no clean-up, and
    PR_SET_PDEATHSIG alone ends them."""
    parent, pids = None, []
    try:
        parent, pids = _launcher_with_ranks(tmp_path)
        parent.send_signal(sig)
        parent.wait(timeout=30)
        assert not _left_alive(pids), f"ranks still running after {sig.name} to the launcher"
    finally:
        if parent is not None:
            _cleanup(parent, tmp_path)
