"""Starting ranks: ``spawn`` (torch.multiprocessing, loopback) and ``init_from_env`` (torchrun).

``spawn(fn, n, args=...)`` starts n processes with the 'spawn' start method, each with
MASTER_ADDR=127.0.0.1, a free port and the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK),
initialises the default process group (env://), calls ``fn(rank, n, *args)`` and sends its
(picklable) return value back. ``fn`` must be importable by name (a module-level function).

Failures. The first failing rank's error comes back as a RankFailure naming the rank (an
unexpected error: a RankCrash carrying the rank's traceback); ranks still running are stopped
after a short grace period, so a stuck collective never hangs the caller. A rank that dies
without reporting (killed by a signal, or exiting on its own) is the cause, not its survivors'
symptoms ("Connection closed by peer"): the RankFailure names the rank that died first and how.

Lifetime. Ranks never outlive the launcher: each asks the kernel for SIGKILL when its parent
dies (PR_SET_PDEATHSIG, Linux), and while ``spawn`` waits it turns SIGTERM into SystemExit so
its clean-up stops the ranks (SIGINT already raises KeyboardInterrupt).

Under torchrun, call ``init_from_env()`` instead (or ``dist.init_process_group`` yourself) and
then ``moegraph.compile``; nothing else changes.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import signal
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Sequence

from moegraph.runtime import RankFailure, RuntimeFailure

GRACE_S = 3.0          # after the first failure, how long other ranks get to report theirs


class RankCrash(RuntimeError):
    """A rank raised an unexpected error (a bug): the message carries that rank's traceback."""


def free_port() -> int:
    """A free TCP port on the loopback interface (released just before the ranks bind it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keep_freed_memory() -> bool:
    """Stop glibc from returning freed tensor memory to the OS (CPU ranks; returns whether it could).

    A step allocates and frees the same large activation and gradient buffers every time. With
    glibc's defaults each buffer above the mmap threshold is a fresh mapping whose every page
    faults on first touch, which made memory-bound kernels 2-4x slower in a real step than in
    isolation (the calibration's regime). Keeping freed memory in the heap makes each step reuse
    warm pages. Both calibration ranks and runtime ranks call this, so the two regimes match.
    """
    libc = _glibc()
    if libc is None:
        return False
    try:
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
        ok = libc.mallopt(m_mmap_threshold, 32 << 20)           # glibc's largest allowed threshold
        ok &= libc.mallopt(m_trim_threshold, 2**31 - 1)        # (a C int) ~never trim the heap top
        ok &= libc.mallopt(m_top_pad, 64 << 20)
        return bool(ok)
    except AttributeError:                                       # not glibc: nothing to tune
        return False


def release_freed_memory() -> None:
    """Give memory this (parent) process has freed back to the OS before starting ranks.

    After a large job in the parent (CP-SAT on a paper-scale layer) its freed heap stays mapped;
    on this project's VM the kernel then reclaims it (DAMON pageout) while the ranks run, and the
    first run's step times came out ~1.8x slower (287 vs 156 ms for the demo's layer)."""
    import gc
    gc.collect()
    libc = _glibc()
    try:
        if libc is not None:
            libc.malloc_trim(0)
    except AttributeError:                                       # not glibc: nothing to release
        pass


def _glibc():
    """The C library through ctypes, or None where it cannot be loaded."""
    import ctypes
    import ctypes.util
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def init_from_env(backend: str | None = None, timeout_s: float = 300.0) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment (env://); (rank, world)."""
    import torch
    import torch.distributed as dist
    if not dist.is_initialized():
        for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise RuntimeFailure(f"{var} is not set: launch with torchrun, or use moegraph.runtime.launch.spawn")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "gloo":
            keep_freed_memory()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def spawn(fn: Callable[..., Any], n: int, *, args: Sequence[Any] = (), backend: str = "gloo",
          timeout_s: float = 600.0, pg_timeout_s: float = 300.0, threads: int | None = None) -> list[Any]:
    """Run ``fn(rank, n, *args)`` on n fresh processes; return their results in rank order."""
    import torch.multiprocessing as mp
    if n < 1:
        raise RuntimeFailure(f"n={n} must be a positive number of ranks")
    if backend not in ("gloo", "nccl"):
        raise RuntimeFailure(f"backend {backend!r} is not one of 'gloo', 'nccl'")
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // n)
    release_freed_memory()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, n, port, backend, fn, tuple(args), q, pg_timeout_s, threads),
                         daemon=True, name=f"moegraph-rank{r}") for r in range(n)]
    results: dict[int, Any] = {}
    errors: list[tuple[int, str, str, str, bool]] = []
    died: list[int] = []                   # ranks that exited without reporting, in the order seen

    def watch() -> None:
        for r, p in enumerate(procs):
            if (p.exitcode not in (None, 0) and r not in died and r not in results
                    and all(e[0] != r for e in errors)):
                died.append(r)

    with _terminate_on_sigterm():
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        try:
            while len(results) + len(errors) + len(died) < n:
                now = time.monotonic()
                if now > deadline:
                    break
                try:
                    kind, rank, payload = q.get(timeout=min(0.2, deadline - now))
                except queue_mod.Empty:
                    watch()
                    if errors or died:
                        deadline = min(deadline, time.monotonic() + GRACE_S)
                    continue
                if kind == "ok":
                    results[rank] = payload
                else:
                    errors.append((rank, *payload))
                    deadline = min(deadline, time.monotonic() + GRACE_S)
            watch()                        # before _stop: its terminations are not deaths of their own
        finally:
            _stop(procs)
    if died:
        rank = died[0]
        others = sorted(set(died[1:]) | {e[0] for e in errors})
        also = f" (ranks {others} failed after it)" if others else ""
        raise RankFailure(f"rank {rank} {_exit_reason(procs[rank].exitcode)} before reporting{also}", rank=rank,
                          error_type="RankDied")
    if errors:
        rank, etype, message, tb, expected = errors[0]
        others = sorted({e[0] for e in errors[1:]})
        also = f" (ranks {others} failed too)" if others else ""
        prefix = f"rank {rank}: "
        text = f"{prefix}{etype}: {message.removeprefix(prefix)}{also}"
        if expected:
            raise RankFailure(text, rank=rank, error_type=etype, traceback=tb)
        raise RankCrash(f"{text}\n--- traceback of rank {rank} ---\n{tb}")
    missing = [r for r in range(n) if r not in results]
    if missing:
        raise RuntimeFailure(f"ranks {missing} did not finish within {timeout_s:g} s")
    return [results[r] for r in range(n)]


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@contextmanager
def _terminate_on_sigterm():
    """While the ranks run: SIGTERM raises SystemExit in the launcher, so ``spawn``'s clean-up
    stops them. Only the main thread may install signal handlers; elsewhere PR_SET_PDEATHSIG
    in the ranks is what ends them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        raise SystemExit(128 + signum)
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def die_with_parent() -> bool:
    """Ask the kernel to SIGKILL this (spawned) process when its parent dies (Linux
    PR_SET_PDEATHSIG); returns whether it could. Exits at once if the parent is already gone
    (it may die while this process still imports torch, before the request)."""
    import multiprocessing
    libc = _glibc()
    launcher = multiprocessing.parent_process()
    parent = launcher.pid if launcher is not None else os.getppid()
    try:
        if libc is None or libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:      # PR_SET_PDEATHSIG = 1
            return False
    except AttributeError:                                                   # no prctl: not Linux
        return False
    if os.getppid() != parent:                                               # it died before prctl
        os._exit(1)
    return True


def _stop(procs) -> None:
    for p in procs:
        p.join(timeout=0.5 if p.exitcode is None else 5.0)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)


def _worker(rank: int, n: int, port: int, backend: str, fn: Callable[..., Any], args: tuple, q: Any,
            pg_timeout_s: float, threads: int) -> None:
    die_with_parent()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(n),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n))
    if backend == "gloo" and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")         # loopback only
    ok = False
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(threads)
        if backend == "gloo":
            keep_freed_memory()
        if backend == "nccl":
            torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=n,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        result = fn(rank, n, *args)
        q.put(("ok", rank, result))
        ok = True
    except BaseException as err:  # noqa: BLE001 - every failure goes back to the parent, named by rank
        lowering = sys.modules.get("moegraph.lowering")   # a module that cannot be lowered: one line, no traceback
        failure = isinstance(err, RuntimeFailure) or (lowering is not None and isinstance(err, lowering.LoweringError))
        q.put(("error", rank, (type(err).__name__, str(err).strip(), traceback.format_exc(), failure)))
    finally:
        q.close()
        q.join_thread()
        if ok:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        else:
            os._exit(1)        # a collective may still be pending: skip teardown that could block
