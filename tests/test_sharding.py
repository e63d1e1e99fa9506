"""scripts/test.sh's two shards (tests/sharding.py): together they run every test once, whole
files each, the shared rank spawn's files in shard 0, balanced by weight."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import sharding


@dataclass(frozen=True)
class _Item:                        # what shard_of reads of a pytest item
    nodeid: str
    fixturenames: tuple


def _item(path: str, test: str, shared: bool = False) -> _Item:
    return _Item(f"{path}::{test}", ("rank_results",) if shared else ("tmp_path",))


def test_two_shards_partition_the_tests_by_whole_files(monkeypatch, tmp_path):
    weights = tmp_path / "w.json"
    weights.write_text('{"tests/a.py": 10, "tests/b.py": 9, "tests/c.py": 1, "tests/s1.py": 3, "tests/s2.py": 3}')
    monkeypatch.setattr(sharding, "WEIGHTS", weights)
    items = [_item("tests/a.py", "t1"), _item("tests/a.py", "t2"), _item("tests/b.py", "t"),
             _item("tests/c.py", "t"), _item("tests/s1.py", "t", shared=True), _item("tests/s1.py", "u"),
             _item("tests/s2.py", "t", shared=True), _item("tests/new.py", "t")]
    zero, one = sharding.shard_of(items, "0/2"), sharding.shard_of(items, "1/2")
    assert not zero & one and len(zero | one) == len(items)
    files = {k: {i.nodeid.split("::")[0] for i in s} for k, s in (("0", zero), ("1", one))}
    assert {"tests/s1.py", "tests/s2.py"} <= files["0"]            # the shared spawn runs once
    assert not files["0"] & files["1"]                             # whole files
    # shard 0 holds the spawn's 6 s; heaviest first onto the lighter shard: a (10) -> 1, b (9) -> 0,
    # new (unlisted, 2) -> 1 (10 < 15), c (1) -> 1 (12 < 15)
    assert files["1"] == {"tests/a.py", "tests/new.py", "tests/c.py"}
    assert files["0"] == {"tests/s1.py", "tests/s2.py", "tests/b.py"}


@pytest.mark.parametrize("spec", ["2/2", "x", "1"])
def test_a_bad_shard_spec_is_named(spec):
    with pytest.raises(ValueError, match=f"--shard {spec!r}"):
        sharding.parse(spec)
