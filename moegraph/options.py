"""Command-line value types every command shares: byte sizes, bounded numbers, output paths.

Each parser takes the text the user typed and returns the value, or raises
``argparse.ArgumentTypeError`` with a message that names the value and what would be valid;
the CLI prints that as one line and exits 2 before any work starts. ``check_output`` runs in a
command before its long work, so a bad ``-o`` is reported before solving, and nothing is
written.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from moegraph.sizes import BYTE_UNITS, SIZE_FORMS, format_bytes, format_bytes_apart, parse_byte_size  # noqa: F401


class UsageError(ValueError):
    """A bad command-line value; reported as one line on stderr, exit code 2."""


def byte_size(text: str) -> int:
    """--memory-budget value: ``moegraph.sizes.parse_byte_size`` as an argparse type."""
    try:
        return parse_byte_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _number(text: str, kind: type, what: str, ok) -> float | int:
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if isinstance(value, float) and not math.isfinite(value) or not ok(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, "a positive integer", lambda v: v >= 1)


def non_negative_int(text: str) -> int:
    return _number(text, int, "a non-negative integer", lambda v: v >= 0)


def positive_float(text: str) -> float:
    return _number(text, float, "a positive finite number", lambda v: v > 0)


def fraction(text: str) -> float:
    return _number(text, float, "a fraction between 0 and 1", lambda v: 0 <= v <= 1)


def check_output(path: str | Path, *, suffixes: tuple[str, ...] = (), flag: str = "-o") -> Path:
    """Raise UsageError (one line) unless ``path`` can be written as a file: not an existing
    directory, no regular file among its parents, one of ``suffixes`` when given, and a folder
    that takes new files (``moegraph.atomic.check_writable``: /proc or a read-only mount is
    refused here, before the work). Missing parent folders are fine (they are created at write
    time). Leaves nothing behind."""
    p = Path(path)
    if str(path) == "" or p.name in ("", ".", ".."):
        raise UsageError(f"{flag} {str(path)!r} is not a file name")
    if p.is_dir():
        raise UsageError(f"{flag} {str(path)!r} is an existing directory; give a file path")
    _check_parents(p, flag)
    if suffixes and p.suffix.lower() not in suffixes:
        raise UsageError(f"{flag} {str(path)!r} must end in one of {', '.join(suffixes)}")
    _check_writable(p, flag)
    return p


def make_parents(path: str | Path) -> Path:
    """Create the missing folders above an output file, just before writing it: the one rule of
    every command's outputs (``check_output`` refused a bad path up front; a new folder is fine)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


def check_output_dir(path: str | Path, *, flag: str = "-o") -> Path:
    """Raise UsageError (one line) unless ``path`` is a directory or can be created as one."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{flag} {str(path)!r} is an existing file; give a directory")
    _check_parents(p, flag)
    _check_writable(p / "entry", flag, shown=p)       # a file inside the folder
    return p


def _check_writable(p: Path, flag: str, *, shown: Path | None = None) -> None:
    """UsageError naming the path and the reason unless a file can be created at ``p``."""
    from moegraph.atomic import check_writable
    try:
        check_writable(p)
    except OSError as err:
        raise UsageError(f"{flag} {str(shown or p)!r} cannot be written: {err.strerror or err}") from None


def _check_parents(p: Path, flag: str) -> None:
    """The nearest existing ancestor of ``p`` must be a directory (then the rest can be created)."""
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"{flag} {str(p)!r}: {str(parent)!r} is a file, not a directory")
            return


def check_distinct_files(outputs: list[tuple[str, str | Path]], inputs: list[tuple[str, str | Path]] = ()) -> None:
    """Raise UsageError (one line) when an output path names the same file as an input it reads or
    as another output (after resolving links and ``..``): writing it would replace that file, and
    a command that reads a schedule and writes a chart must not destroy the schedule. Each entry
    is (flag, path); ``None`` or empty paths are skipped (their own checks name them)."""
    seen: dict[Path, str] = {}
    for flag, path in inputs:
        if path:
            seen.setdefault(Path(path).resolve(), f"the file {flag} reads")
    for flag, path in outputs:
        if not path:
            continue
        key = Path(path).resolve()
        if key in seen:
            raise UsageError(f"{flag} {str(path)!r} is also {seen[key]}: writing it would replace that file; "
                             "give another path")
        seen[key] = f"the file {flag} writes"
