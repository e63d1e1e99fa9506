"""Atomic file output: every file moegraph writes is either the old one or the complete new one.

``write_atomic(path, data)`` writes ``data`` to a temporary file in ``path``'s own folder
(``.<name>.<random>.tmp``: the same filesystem, so the rename cannot turn into a copy), flushes
and fsyncs it, renames it over ``path`` (``os.replace``: atomic on POSIX) and fsyncs the folder,
so the rename itself survives a power cut. A process killed at any instant leaves ``path`` as it
was or complete; at worst a ``.<name>.*.tmp`` file stays beside it (the reader of ``path`` never
looks at it). Missing parent folders are created (the one rule of every command's outputs:
``moegraph.options.check_output`` refused a bad path before the work started).

Writers that produce bytes through a file object (matplotlib's ``savefig``, ``yaml.dump``) write
into memory first and hand the bytes over: ``atomic_output(path)`` yields a BytesIO and writes it
atomically when the block ends without an exception (on an exception nothing is written).

``check_writable(path)`` is the probe commands run before their long work: it creates and
removes a temporary file in the nearest existing folder of ``path``, so a folder that cannot
take files (/proc, /sys, a read-only mount, missing permission, also as root) is refused in one
line before solving, not after it.

Fault point for tests: with the environment variable ``MOEGRAPH_FAULT_BEFORE_RENAME`` set to
``1`` (every write) or to a file name (writes of that name only), the writer SIGKILLs its own
process after the temporary file is written and fsynced, before the rename: the instant at which
a non-atomic writer would leave a partial file (tests/test_cli_errors.py, tests/test_atomic.py).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import tempfile
from pathlib import Path
from typing import Iterator

__all__ = ["FAULT_ENV", "write_atomic", "append_atomic", "atomic_output", "check_writable", "temp_files"]

FAULT_ENV = "MOEGRAPH_FAULT_BEFORE_RENAME"


def write_atomic(path: str | Path, data: bytes | str, *, encoding: str = "utf-8") -> Path:
    """Replace ``path`` with ``data`` atomically (module doc); returns ``path``. Text is encoded
    with ``encoding``. A symbolic link at ``path`` stays a link: its target is replaced."""
    dest = Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)
    blob = data.encode(encoding) if isinstance(data, str) else bytes(data)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _mode_for(dest))
        _fault_point(dest)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(dest.parent)
    return Path(path)


def append_atomic(path: str | Path, text: str, *, encoding: str = "utf-8") -> Path:
    """``path``'s current text (none if absent) with ``text`` added, written atomically: a table
    appended to benchmarks/RESULTS.md is all there or not there, never half a table."""
    p = Path(path)
    old = p.read_text(encoding=encoding) if p.exists() else ""
    return write_atomic(p, old + text, encoding=encoding)


@contextlib.contextmanager
def atomic_output(path: str | Path) -> Iterator[io.BytesIO]:
    """A binary buffer whose content replaces ``path`` atomically when the block succeeds."""
    buf = io.BytesIO()
    yield buf
    write_atomic(path, buf.getvalue())


def check_writable(path: str | Path) -> None:
    """Raise OSError (with the folder and the reason) unless a file can be created at ``path``:
    the nearest existing folder above it must take a new file (probed with a temporary file that
    is removed at once) and an existing ``path`` must be a file this process may replace."""
    p = Path(path)
    folder = next((a for a in (p.parent, *p.parent.parents) if a.exists()), Path("."))
    if not folder.is_dir():
        raise NotADirectoryError(f"{folder} is not a directory")
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".moegraph-probe.", suffix=".tmp")
    except OSError as err:
        raise OSError(err.errno, f"the folder {str(folder)!r} does not take new files ({err.strerror})") from None
    os.close(fd)
    os.unlink(tmp)


def temp_files(path: str | Path) -> list[Path]:
    """The temporary files a write of ``path`` left behind (a writer killed before its rename)."""
    p = Path(path)
    return sorted(p.parent.glob(f".{p.name}.*.tmp")) if p.parent.is_dir() else []


def _mode_for(dest: Path) -> int:
    """The permission bits the new file gets: the old file's, else what open() would give."""
    try:
        return dest.stat().st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _fault_point(dest: Path) -> None:
    """The test hook (module doc): SIGKILL this process between the temporary file and the rename."""
    target = os.environ.get(FAULT_ENV)
    if target and (target == "1" or target == dest.name):
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable. Some filesystems cannot fsync a folder (EINVAL): the rename is
    atomic all the same, only its durability over a power cut is then the filesystem's."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
