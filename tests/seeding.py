"""Test seeds: every random draw in a test run derives from one session seed, so a rare failure
can be replayed.

The session seed is ``MOEGRAPH_TEST_SEED`` when set, else drawn from os.urandom (fresh data every
run). Each test gets its own seed, a hash of the session seed and the test's node id, so a test's
numbers do not depend on which other tests run; conftest.py seeds torch's and ``random``'s global
generators and the ``rng`` fixture with it, and prints the session seed under a failing test:

    MOEGRAPH_TEST_SEED=<seed> pytest 'tests/test_x.py::test_y'     # the same numbers again

``fresh_seed()`` gives seeds for cases built outside a test (a rank batch registered at import):
a hash of the session seed, the calling module and how many seeds that module drew before, so
they too come back with the session seed, whichever files are collected. Hypothesis keeps its
own seeding (``--hypothesis-seed``).
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections import Counter

ENV = "MOEGRAPH_TEST_SEED"
BITS = 31                           # fits torch, numpy and `random`, with room for seed + k

_session: int | None = None
_current: str | None = None         # node id of the test running now, if any
_draws: Counter = Counter()         # seeds drawn so far per module (or per running test)


def session_seed() -> int:
    """``MOEGRAPH_TEST_SEED`` (a non-negative integer), else a fresh draw; fixed for the session."""
    global _session
    if _session is None:
        text = os.environ.get(ENV)
        if text is None:
            _session = int.from_bytes(os.urandom(4), "little") % 2**BITS
        elif text.strip().isdigit() and int(text) < 2**BITS:
            _session = int(text)
        else:
            raise ValueError(f"{ENV}={text!r}: expected an integer in [0, 2^{BITS})")
    return _session


def derive(*labels: object) -> int:
    """A seed from the session seed and ``labels``: stable across runs, processes and platforms."""
    key = ":".join(map(str, (session_seed(), *labels))).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % 2**BITS


def begin_test(nodeid: str) -> int:
    """Mark ``nodeid`` as running; its seed."""
    global _current
    _current = nodeid
    _draws.pop(nodeid, None)
    return derive("test", nodeid)


def end_test() -> None:
    global _current
    _current = None


def fresh_seed() -> int:
    """A seed for a case's data: inside a test, derived from that test's seed; at import, from the
    calling module's name. The k-th call in the same place gets the same seed on a replay."""
    owner = _current if _current is not None else sys._getframe(1).f_globals.get("__name__", "?")
    _draws[owner] += 1
    return derive("fresh", owner, _draws[owner])
