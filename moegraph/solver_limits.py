"""CP-SAT effort limits shared by every stage that solves (passes' keep-set search, the
scheduler): a *deterministic* time limit (CP-SAT's work counter), so the same inputs give the
same answer on an idle or a loaded machine, and a wall-clock cap that only guards against a
stalled machine."""

from __future__ import annotations

from typing import Any

DTIME_PER_SECOND = 0.18
"""Deterministic-time units granted per second of a ``time_limit_s``. On the 2-core dev box one
unit took 1-6 s of CPU time (up to 5 s on 200-node chunked layers, whose LNS propagation is
under-counted as deterministic work; docs/scheduler.md), so 0.18 keeps searches within about
time_limit_s."""
WALL_CAP_FACTOR = 10.0
"""Wall-clock safety cap per solve = WALL_CAP_FACTOR * time_limit_s + 5 s (reported if ever
hit). Deterministic time under-counts on large layers (about 3x on a loaded 2-core box for
413 nodes), so a tighter cap would cut searches that are merely slow, not stalled."""


def set_time_limit(parameters: Any, time_limit_s: float) -> None:
    """CP-SAT ``parameters`` for ``time_limit_s`` seconds of effort: the deterministic limit,
    and the wall-clock safety cap."""
    parameters.max_deterministic_time = time_limit_s * DTIME_PER_SECOND
    parameters.max_time_in_seconds = WALL_CAP_FACTOR * time_limit_s + 5.0
