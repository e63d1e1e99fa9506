"""The same inputs give the same schedule file on an idle and on a loaded machine (issue 14).

The search is bounded by deterministic time only (schedules/cpsat.py), so a busy machine may make
a compile slower but not different. Two spinning processes load both cores of the CI machine
while the same compile runs again; the files must be byte-identical to the idle ones. A chunked
graph is used (the solver runs a real search there, not a proof in a fraction of a second).
"""

from __future__ import annotations

import multiprocessing as mp

import pytest

from moegraph.cli import main

ARGS = ["compile", "--model", "tiny", "--n", "2", "--seq", "256", "--passes", "gate-reorder,sar=paper,chunk=2",
        "--time-limit", "1"]


def _spin(stop) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def _compile(path) -> bytes:
    assert main([*ARGS, "-o", str(path)]) == 0
    return path.read_bytes()


@pytest.mark.slow
def test_same_file_idle_and_beside_two_busy_processes(tmp_path, capsys):
    idle = {_compile(tmp_path / f"idle{i}.json") for i in range(2)}
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    spinners = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(2)]
    for p in spinners:
        p.start()
    try:
        busy = {_compile(tmp_path / f"busy{i}.json") for i in range(2)}
    finally:
        stop.set()
        for p in spinners:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    capsys.readouterr()
    assert len(idle) == 1 and busy == idle
