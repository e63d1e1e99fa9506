"""`moegraph tune`'s cache: one JSON file per evaluated candidate, trusted only after checking it.

An entry is keyed by content (``cache_key``: the graph's digest, the hardware profile's
fingerprint, the scheduling options, ``CACHE_VERSION``) and stored as ``<root>/<key>.json``,
written atomically (``moegraph.atomic.write_atomic``), so a repeated run is instant and
concurrent runs never see a half-written entry.

What is read back is used only when all of these hold, else the entry is a miss (recomputed and
rewritten) and ``warn`` gets one line naming the file and the reason (once per Cache: a cache
folder damaged as a whole gives one line, not one per candidate):

* the path is a readable regular file of at most ``MAX_ENTRY_BYTES`` (a folder, a FIFO or a
  file this process may not read is a miss, never a traceback);
* it is UTF-8 JSON without NaN or Infinity (Python's json reads both by default);
* it records the key it was written under and this ``CACHE_VERSION`` (a file copied or renamed
  onto another key's name, or left by an older moegraph, is not that key's result);
* it matches the schema ``evaluate`` writes (``is_entry``): every field of its kind present with
  its JSON type, every number finite and non-negative, and a feasible entry's schedule a schedule
  file that ``Schedule.from_json`` reads (which checks every time is finite).

Writing is best effort: a failed write (the entry's name taken by a folder, a full disk) is a
warning line, and tune goes on without caching that entry. A Cache warns once in all, so a run
over a damaged cache says so in one line.
"""

from __future__ import annotations

import hashlib
import json
import math
import stat
import sys
from pathlib import Path
from typing import Any, Callable

from moegraph.atomic import write_atomic
from moegraph.canonical import canonical_json
from moegraph.ir import Graph, graph_digest
from moegraph.registry import Hardware
from moegraph.schedules.schedule_file import Schedule, ScheduleFormatError

__all__ = ["CACHE_VERSION", "MAX_ENTRY_BYTES", "Cache", "cache_key", "is_entry", "why_not_entry"]

CACHE_VERSION = 5          # 2: keyed by ir.graph_digest, typed strategies; 3: infeasible entries keep the least peak;
                           # 4: entries name the returned schedule's method (compile's unconstrained-first budget);
                           # 5: entries record their key and version, and are validated when read
MAX_ENTRY_BYTES = 256 * 2**20
"""Largest entry read: a schedule of the largest graph moegraph.limits admits (100,000 nodes at
~0.7 KB each in the file) is about 70 MB."""
_STAMP = ("key", "v")      # what put() adds to an entry and get() checks and strips


def cache_key(graph: Graph, hw: Hardware, options: dict[str, Any]) -> str:
    blob = canonical_json({"v": CACHE_VERSION, "graph": graph_digest(graph), "hw": hw.fingerprint(), "options": options})
    return hashlib.sha256(blob.encode()).hexdigest()


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _time(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


_FEASIBLE: dict[str, tuple[Callable[[Any], bool], str]] = {
    "predicted_us": (_time, "a finite number >= 0"),
    "peak_memory_bytes": (_count, "a non-negative integer"),
    "method": (lambda v: isinstance(v, str), "a string"),
    "schedule": (lambda v: isinstance(v, str), "a schedule file's text"),
}
_OPTIONAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "lower_bound_us": (_time, "a finite number >= 0"),
    "status": (lambda v: isinstance(v, str), "a string"),
    "least_peak_bytes": (_count, "a non-negative integer"),
}


def why_not_entry(entry: Any) -> str | None:
    """Why ``entry`` (parsed JSON, the stamp removed) is not what ``evaluate`` writes, or None:
    feasible with a time, peak, method and schedule; or infeasible with a why (and
    ``least_peak_bytes`` when the error gave one)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("feasible"), bool):
        return "is not a tune cache entry"
    fields = dict(_OPTIONAL)
    if entry["feasible"]:
        fields |= _FEASIBLE
    else:
        fields["why"] = (lambda v: isinstance(v, str), "a string")
    for k, (ok, want) in fields.items():
        if k not in entry:
            if k in _OPTIONAL:
                continue
            return f"is not a tune cache entry (no {k!r})"
        if not ok(entry[k]):
            return f"is not a tune cache entry ({k} is {entry[k]!r}, not {want})"
    if entry["feasible"]:
        try:
            Schedule.from_json(entry["schedule"])
        except ScheduleFormatError as err:
            return f"holds a damaged schedule ({err})"
    return None


def is_entry(entry: Any) -> bool:
    return why_not_entry(entry) is None


class Cache:
    """One JSON file per entry under ``root`` (None: no cache). See the module doc for what a
    read checks; ``warn`` gets one line, once per Cache (a bad entry or a failed write)."""

    def __init__(self, root: Path | None, warn: Callable[[str], None] | None = None):
        self.root = root
        self._warn = warn or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._warned = False

    def get(self, key: str, is_entry: Callable[[Any], bool] | None = None) -> dict | None:
        """The entry under ``key`` (without its stamp), or None on a miss. ``is_entry`` replaces
        the schema check (``why_not_entry``) for callers that store other dicts."""
        if self.root is None:
            return None
        path = self.root / f"{key}.json"
        try:
            info = path.stat()
        except FileNotFoundError:
            return None
        except OSError as err:
            return self._miss(path, f"cannot be read ({err.strerror})")
        if stat.S_ISDIR(info.st_mode):
            return self._miss(path, "is a directory")
        if not stat.S_ISREG(info.st_mode):
            return self._miss(path, "is not a regular file")
        if info.st_size > MAX_ENTRY_BYTES:
            return self._miss(path, f"is {info.st_size:,} bytes, over the {MAX_ENTRY_BYTES:,} an entry may hold")
        try:
            entry = json.loads(path.read_bytes().decode("utf-8"), parse_constant=_no_constant)
        except OSError as err:
            return self._miss(path, f"cannot be read ({err.strerror})")
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return self._miss(path, f"is not valid JSON ({type(err).__name__})")
        except _NonFinite as err:
            return self._miss(path, f"holds a non-finite number ({err})")
        if not isinstance(entry, dict):
            return self._miss(path, "is not a tune cache entry")
        if entry.get("v") != CACHE_VERSION:
            return self._miss(path, f"was written by another cache version ({entry.get('v')!r}, this one "
                                    f"{CACHE_VERSION})")
        if entry.get("key") != key:
            return self._miss(path, f"was written under another key ({str(entry.get('key'))[:16]}...)")
        body = {k: v for k, v in entry.items() if k not in _STAMP}
        why = why_not_entry(body) if is_entry is None else (None if is_entry(body) else "is not a tune cache entry")
        if why is not None:
            return self._miss(path, why)
        return body

    def _miss(self, path: Path, why: str) -> None:
        if not self._warned:
            self._warned = True
            self._warn(f"moegraph tune: warning: cache entry {path} {why}; recomputing it (further bad "
                       f"entries are recomputed silently)")
        return None

    def put(self, key: str, entry: dict) -> None:
        """Store ``entry`` under ``key``, stamped with the key and version, atomically."""
        if self.root is None:
            return
        path = self.root / f"{key}.json"
        try:
            write_atomic(path, json.dumps({**entry, "key": key, "v": CACHE_VERSION}, sort_keys=True,
                                          allow_nan=False))
        except OSError as err:
            if not self._warned:       # one line per run, read or write (a folder's name is both)
                self._warned = True
                self._warn(f"moegraph tune: warning: cannot write cache entry {path} ({err.strerror or err}); "
                           "going on without caching it (further cache problems are not reported)")


class _NonFinite(ValueError):
    pass


def _no_constant(name: str) -> Any:
    """json's hook for NaN, Infinity and -Infinity: refused (no cached number may be one)."""
    raise _NonFinite(name)
