"""tune's cache (moegraph.schedules.tune_cache): an entry is used only when it parses, records its
key and version, matches the schema and holds finite numbers; anything else is a miss with one
warning line, never a traceback. The pick over a poisoned cache: tests/test_cli_errors.py."""

from __future__ import annotations

import json
import os

import pytest

from moegraph.config import CompileConfig, SolverEffort
from moegraph.ir import Strategy
from moegraph.registry import load_hardware, load_model
from moegraph.schedules.driver import lower
from moegraph.schedules.tune import evaluate
from moegraph.schedules.tune_cache import CACHE_VERSION, Cache, cache_key


def tiny_tp(hw):
    """tiny tp+tp greedy, as tune evaluates a config (its graph keys the cache)."""
    return CompileConfig(model=load_model("tiny"), strategy=Strategy("tp", "tp", "ag-rs", 2), passes=(),
                         schedule="greedy", batch=1, seq=64, hardware=hw, solver=SolverEffort(1))


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A real feasible entry (the greedy schedule of tiny tp+tp) and its key, as evaluate wrote it."""
    root = tmp_path_factory.mktemp("tune-cache")
    hw = load_hardware("h800")
    config = tiny_tp(hw)
    evaluate(config, Cache(root))
    key = cache_key(lower(config).graph, hw, {"method": "greedy", "memory_budget": None, "time_limit": 1})
    return key, (root / f"{key}.json").read_text()


def test_a_written_entry_is_read_back_without_its_stamp(good, tmp_path):
    key, text = good
    stored = json.loads(text)
    assert stored["key"] == key and stored["v"] == CACHE_VERSION
    (tmp_path / f"{key}.json").write_text(text)
    warnings: list[str] = []
    entry = Cache(tmp_path, warn=warnings.append).get(key)
    assert entry == {k: v for k, v in stored.items() if k not in ("key", "v")} and warnings == []


def _edit(**changes):
    def poison(path, entry):
        path.write_text(json.dumps({**entry, **changes}))
    return poison


POISONS = {
    "nan": (_edit(predicted_us=float("nan")), "holds a non-finite number (NaN)"),
    "inf": (_edit(peak_memory_bytes=float("inf")), "holds a non-finite number (Infinity)"),
    "minus inf": (_edit(lower_bound_us=float("-inf")), "holds a non-finite number (-Infinity)"),
    "negative time": (_edit(predicted_us=-1.0),
                      "is not a tune cache entry (predicted_us is -1.0, not a finite number >= 0)"),
    "wrong type": (_edit(feasible="yes"), "is not a tune cache entry"),
    "missing field": (lambda p, e: p.write_text(json.dumps({k: v for k, v in e.items() if k != "method"})),
                      "is not a tune cache entry (no 'method')"),
    "damaged schedule": (_edit(schedule="{}"), "holds a damaged schedule"),
    "another key": (_edit(key="0" * 64), "was written under another key (0000000000000000...)"),
    "old version": (_edit(v=CACHE_VERSION - 1), f"was written by another cache version ({CACHE_VERSION - 1}"),
    "no stamp": (lambda p, e: p.write_text(json.dumps({k: v for k, v in e.items() if k not in ("key", "v")})),
                 "was written by another cache version (None"),
    "not an object": (lambda p, e: p.write_text("[1, 2]"), "is not a tune cache entry"),
    "truncated": (lambda p, e: p.write_text(json.dumps(e)[:100]), "is not valid JSON (JSONDecodeError)"),
    "binary": (lambda p, e: p.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe"), "is not valid JSON (UnicodeDecodeError)"),
    "directory": (lambda p, e: p.mkdir(), "is a directory"),
    "fifo": (lambda p, e: os.mkfifo(p), "is not a regular file"),
}


@pytest.mark.parametrize("kind", list(POISONS))
def test_a_poisoned_entry_is_a_miss_with_one_warning(kind, good, tmp_path):
    key, text = good
    path = tmp_path / f"{key}.json"
    poison, why = POISONS[kind]
    poison(path, json.loads(text))
    warnings: list[str] = []
    cache = Cache(tmp_path, warn=warnings.append)
    assert cache.get(key) is None
    assert cache.get(key) is None                                   # a second bad read: no second line
    assert len(warnings) == 1 and warnings[0].startswith(f"moegraph tune: warning: cache entry {path} {why}"), warnings
    assert warnings[0].endswith("recomputing it (further bad entries are recomputed silently)")


def test_an_entry_whose_name_is_a_folder_is_recomputed_and_not_written(good, tmp_path):
    """The miss is recomputed; the write then fails (the name is a folder) without a traceback or a
    second warning line, and the result is still returned."""
    key, text = good
    (tmp_path / f"{key}.json").mkdir()
    warnings: list[str] = []
    entry = evaluate(tiny_tp(load_hardware("h800")), Cache(tmp_path, warn=warnings.append))
    assert entry["cached"] is False and entry["predicted_us"] == json.loads(text)["predicted_us"]
    assert len(warnings) == 1 and "is a directory" in warnings[0]
