"""A failing test prints its seed, and setting MOEGRAPH_TEST_SEED replays the same numbers
(tests/seeding.py, conftest.py), run on a tiny failing test file in a fresh pytest."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

TINY = '''
import random
import torch
from seeding import fresh_seed

AT_IMPORT = fresh_seed()        # a case built at import, as a rank batch is


def _draws(rng):
    return [torch.randint(0, 2**30, (3,), generator=rng).tolist(), torch.rand(2).tolist(),
            random.random(), AT_IMPORT, fresh_seed()]


def test_first(rng):
    print("DRAWS", _draws(rng))
    assert False


def test_second(rng):
    print("DRAWS", _draws(rng))
    assert False
'''


def _run(folder: Path, seed: str | None, *select: str) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """pytest on the tiny file; (process, each test's DRAWS line)."""
    env = {k: v for k, v in os.environ.items() if k != "MOEGRAPH_TEST_SEED"}
    if seed is not None:
        env["MOEGRAPH_TEST_SEED"] = seed
    targets = [f"test_tiny.py::{s}" for s in select] or ["test_tiny.py"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *targets],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    # a failure's report: "____ test_first ____", its captured stdout ("DRAWS [...]"), its sections
    draws = dict(re.findall(r"_ (test_\w+) _.*?^DRAWS (.*?)$", proc.stdout, re.S | re.M))
    return proc, draws


@pytest.mark.slow
def test_a_failing_test_reports_its_seed_and_the_seed_replays_it(tmp_path):
    for name in ("conftest.py", "seeding.py", "sharding.py"):
        shutil.copy(TESTS / name, tmp_path / name)
    (tmp_path / "test_tiny.py").write_text(TINY)

    first, draws = _run(tmp_path, None)
    assert first.returncode == 1, first.stdout + first.stderr
    seeds = set(re.findall(r"MOEGRAPH_TEST_SEED=(\d+) \(this test's seed \d+\); replay: "
                           r"MOEGRAPH_TEST_SEED=\1 pytest 'test_tiny.py::test_\w+'", first.stdout))
    assert len(seeds) == 1, first.stdout                         # one session seed, under each failure
    (seed,) = seeds
    assert f"test seed: MOEGRAPH_TEST_SEED={seed}" in first.stdout   # and in the header
    assert sorted(draws) == ["test_first", "test_second"] and draws["test_first"] != draws["test_second"]

    # the reported seed replays the test alone: the same numbers (torch's global generator,
    # `random`, the rng fixture, seeds drawn at import and inside the test)
    again, replay = _run(tmp_path, seed, "test_second")
    assert replay == {"test_second": draws["test_second"]}, again.stdout
    assert f"MOEGRAPH_TEST_SEED={seed} (this test's seed" in again.stdout

    other, changed = _run(tmp_path, str((int(seed) + 1) % 2**31), "test_second")
    assert changed["test_second"] != draws["test_second"], other.stdout


@pytest.mark.slow
def test_a_malformed_seed_is_one_usage_error(tmp_path):
    for name in ("conftest.py", "seeding.py", "sharding.py"):
        shutil.copy(TESTS / name, tmp_path / name)
    (tmp_path / "test_tiny.py").write_text(TINY)
    proc, _ = _run(tmp_path, "12x")
    assert proc.returncode == 4                                   # pytest's usage error
    assert "MOEGRAPH_TEST_SEED='12x': expected an integer in [0, 2^31)" in proc.stderr
