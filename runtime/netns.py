"""An emulated link: run ranks in a private network namespace whose loopback is rate-limited.

On a CPU machine gloo's loopback transfers run on the same cores as the compute, so overlapping
the two can only fill idle time. A network namespace of the run's own, whose loopback carries a
token-bucket qdisc (``tc ... tbf``), makes every byte between ranks take wire time while barely
using a core: a 1 Gbit/s link moved 100 MiB in 0.86 s of wall time and 0.09 s of CPU here.

``emulated_link(link)`` is a context manager: it creates a namespace with a unique name
(``moegraph-<pid>-<token>``), brings up only its loopback, shapes it, and moves the *calling
thread* into it (setns(2)). Every process that thread starts inherits the namespace, so ranks
spawned inside the block (``launch.spawn``, calibration's ranks) talk over the shaped loopback at
MASTER_ADDR 127.0.0.1 without knowing it. On leaving the block (normally, on an exception, on
SIGINT, SIGTERM or SIGHUP) the thread returns to its own namespace and the namespace is removed.
Nothing outside the namespace is touched: no host interface is created, changed or used.

What this models and what not: docs/runtime.md, "Emulated link".
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from moegraph.options import UsageError
from moegraph.registry import Hardware, hardware_names
from moegraph.runtime import RuntimeFailure

NETNS_DIR = Path("/run/netns")        # where `ip netns` keeps the namespaces it names
PREFIX = "moegraph"
CLONE_NEWNET = 0x40000000             # <sched.h>
LO_MTU = 65536                        # the loopback's MTU: one packet must fit in the bucket
BURST_S = 0.001                       # bucket depth in seconds of rate: short bursts only
QUEUE_S = 0.1                         # tbf queue, in seconds of rate, before it drops
TC_TIMEOUT_S = 10.0

RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}   # tc's: decimal
LATENCY_UNITS = {"us": 1.0, "ms": 1e3, "s": 1e6}
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-z]+)\s*$", re.IGNORECASE)
RATE_FORMS = "a link rate such as 1gbit, 500mbit or 100kbit, or none"
LATENCY_FORMS = "a one-way latency such as 500us or 2ms"


class LinkUnavailable(RuntimeFailure):
    """The emulated link cannot be set up here (no privilege, no `ip`/`tc`, a missing qdisc)."""


@dataclass(frozen=True)
class Link:
    """A bandwidth- (and optionally latency-) limited medium shared by every rank of a run."""

    rate_bit_s: int
    """Token rate of the loopback's qdisc, bits per second (tc's decimal units)."""
    latency_us: float = 0.0
    """Extra one-way delay per packet (netem), microseconds; 0: none."""

    def __post_init__(self) -> None:
        if self.rate_bit_s < 1 or not self.latency_us >= 0:
            raise ValueError(f"Link(rate_bit_s={self.rate_bit_s}, latency_us={self.latency_us}): the rate must be "
                             f"positive and the latency non-negative")

    def __str__(self) -> str:
        text = format_rate(self.rate_bit_s)
        return text + (f"+{self.latency_us:g}us" if self.latency_us else "")


def format_rate(bit_s: int) -> str:
    """Bits per second in tc's largest unit that keeps the number whole: 10**9 -> '1gbit'."""
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bit_s % RATE_UNITS[unit] == 0:
            return f"{bit_s // RATE_UNITS[unit]}{unit}"
    return f"{bit_s}bit"


def link_rate(text: str) -> int | None:
    """argparse type of ``--link``: '1gbit' -> 10**9 bits/s; 'none' -> None (no emulation).

    Only bit units: tc also reads 'mbps' as megabytes per second, a factor of 8 that should not
    hang on one letter."""
    if str(text).strip().lower() == "none":
        return None
    m = _RATE.match(str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in RATE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not {RATE_FORMS}")
    value = float(m.group(1)) * RATE_UNITS[unit]
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not {RATE_FORMS}")
    return int(round(value))


def link_latency(text: str) -> float:
    """argparse type of ``--link-latency``: '2ms' -> 2000.0 microseconds (0 allowed)."""
    m = _RATE.match(str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in LATENCY_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not {LATENCY_FORMS}")
    return float(m.group(1)) * LATENCY_UNITS[unit]


AUTO = "auto"                         # --link auto (the demo): the link when a namespace can be made


def link_rate_or_auto(text: str) -> int | None | str:
    """argparse type of the demo's ``--link``: 'auto' (AUTO), or what ``link_rate`` reads."""
    if str(text).strip().lower() == AUTO:
        return AUTO
    try:
        return link_rate(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {RATE_FORMS}, or auto") from None


def add_link_args(p, *, auto: bool = False) -> None:
    """``--link RATE`` and ``--link-latency T`` on a command that starts ranks; with ``auto`` the
    default is 'auto' (the command picks, moegraph.runtime.demo.choose_link)."""
    if auto:
        p.add_argument("--link", type=link_rate_or_auto, default=AUTO, metavar="RATE|auto",
                       help="auto (default): an emulated 1gbit link when a network namespace can be made, else "
                            "plain loopback (the output says which and why); RATE (e.g. 1gbit) insists on it; "
                            "none: plain loopback (docs/runtime.md)")
    else:
        p.add_argument("--link", type=link_rate, default=None, metavar="RATE",
                       help="run the ranks in a private network namespace whose loopback is limited to RATE "
                            "(e.g. 1gbit, 500mbit; needs root); default none: plain loopback (docs/runtime.md)")
    p.add_argument("--link-latency", type=link_latency, default=None, metavar="T",
                   help="with --link: extra one-way delay per packet (e.g. 500us, 2ms; needs the kernel's netem)")


def link_from_args(args) -> Link | None:
    """The Link a command's ``--link``/``--link-latency`` ask for; None for plain loopback."""
    rate, latency = getattr(args, "link", None), getattr(args, "link_latency", None)
    if rate is None:
        if latency:
            raise UsageError(f"--link-latency {latency:g}us needs --link RATE (the link it delays)")
        return None
    return Link(rate, latency or 0.0)


PLAIN_PROFILE = "cpu-2core-gloo"                # the shipped CPU profile, calibrated on plain loopback
LINK_PROFILES = {Link(10**9): "cpu-2core-gloo-1gbit"}   # the same machine calibrated inside a link (registry/profiles/)


def profile_for(link: Link | None) -> tuple[str, str]:
    """(profile, note): the shipped profile calibrated under ``link`` if there is one, else the
    plain-loopback profile and a note that its collective prices do not describe the link. What
    ``run --link`` and ``demo`` use when no --hardware is given."""
    if link is None:
        return PLAIN_PROFILE, f"profile {PLAIN_PROFILE} (calibrated on plain loopback)"
    name = LINK_PROFILES.get(link)
    if name in hardware_names():
        return name, f"profile {name} (calibrated on this link)"
    return PLAIN_PROFILE, (f"profile {PLAIN_PROFILE}: no profile calibrated on a {link} link is shipped, so the "
                           f"prediction is uncalibrated for the link")


def link_mismatch(hardware: Hardware, link: Link | None) -> str | None:
    """One warning line when ``hardware`` was calibrated under another link than ``link`` (its
    collective prices then describe that link, not this one); None when they agree. Names the
    shipped profile calibrated on ``link`` when there is one."""
    have = (hardware.link_bit_s, hardware.link_latency_us)
    want = (float(link.rate_bit_s), link.latency_us) if link else (0.0, 0.0)
    if have == want:
        return None

    def say(rate: float, latency: float) -> str:
        return f"an emulated {Link(int(rate), latency)} link" if rate else "plain loopback (no --link)"
    shipped, _ = profile_for(link)
    remedy = (f"--hardware {shipped} was calibrated on it" if shipped != hardware.name and (link is None or shipped
              != PLAIN_PROFILE) else "calibrate with the same --link for the latter")
    return (f"warning: profile {hardware.name} was calibrated on {say(*have)}, this run uses {say(*want)}: "
            f"predicted collective times describe the former ({remedy})")


CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21       # <linux/capability.h> bit numbers


def namespace_privilege() -> str | None:
    """Why this process cannot create an emulated link, or None when it can (as far as can be told
    without creating one: the tools are there and the effective capabilities include both)."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command (iproute2) is not installed"
    try:
        caps = next(int(line.split()[1], 16) for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return "the process's capabilities cannot be read (/proc/self/status)"
    missing = [name for name, bit in (("CAP_SYS_ADMIN", CAP_SYS_ADMIN), ("CAP_NET_ADMIN", CAP_NET_ADMIN))
               if not caps >> bit & 1]
    if missing:
        return f"creating a network namespace needs root ({' and '.join(missing)}), which this process lacks"
    return None


# -- namespace lifecycle --------------------------------------------------------------------------

@dataclass(frozen=True)
class Namespace:
    """A named network namespace this process created (``ip netns`` keeps it at ``path``)."""

    name: str
    link: Link

    @property
    def path(self) -> Path:
        return NETNS_DIR / self.name


@contextlib.contextmanager
def emulated_link(link: Link | None) -> Iterator[Namespace | None]:
    """Run the block with the calling thread inside a fresh namespace shaped to ``link``.

    ``None``: no namespace, the block runs as it would without this manager. Raises
    LinkUnavailable (one line) when the namespace cannot be made or shaped; it is removed then too.
    """
    if link is None:
        yield None
        return
    with _cleanup_on_signals(), _no_c10d_name_warnings():
        ns = Namespace(f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}", link)
        try:
            create(ns)
            with _inside(ns):
                yield ns
        finally:
            remove(ns)


@contextlib.contextmanager
def _no_c10d_name_warnings() -> Iterator[None]:
    """Ranks started in the block log c10d messages from ERROR up only (TORCH_CPP_LOG_LEVEL, read
    by each rank at start; unless the user set it). Why: c10d names each store connection's peer
    by reverse lookup; the rendezvous runs over IPv4-mapped IPv6 (::ffff:127.0.0.1), which
    /etc/hosts does not list, so the lookup goes to DNS, which a namespace with only a loopback
    cannot reach (EAI_AGAIN), and every rank printed "[c10d] The hostname of the client socket
    cannot be retrieved. err=-3": harmless (the connection is made), but noise on every run."""
    if "TORCH_CPP_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    try:
        yield
    finally:
        os.environ.pop("TORCH_CPP_LOG_LEVEL", None)


def bucket_bytes(rate_bit_s: int) -> int:
    """The token bucket's depth for a link of ``rate_bit_s``: BURST_S of its rate, at least two
    loopback packets. A lone send passes this much at once (Hardware.link_burst_bytes)."""
    return max(2 * LO_MTU, int(rate_bit_s / 8 * BURST_S))


def create(ns: Namespace) -> None:
    """Create ``ns``, bring its loopback up and shape it; LinkUnavailable names what failed."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise LinkUnavailable(f"--link {ns.link}: the `{tool}` command (iproute2) is not installed")
    remove_stale()
    _run(ns, ["ip", "netns", "add", ns.name], privilege=True)
    _run(ns, ["ip", "-n", ns.name, "link", "set", "lo", "up"], privilege=True)
    burst = bucket_bytes(ns.link.rate_bit_s)
    _run(ns, ["tc", "-n", ns.name, "qdisc", "add", "dev", "lo", "root", "handle", "1:", "tbf",
              "rate", f"{ns.link.rate_bit_s}bit", "burst", str(burst), "latency", f"{int(QUEUE_S * 1e3)}ms"])
    if ns.link.latency_us:
        _run(ns, ["tc", "-n", ns.name, "qdisc", "add", "dev", "lo", "parent", "1:1", "handle", "10:", "netem",
                  "delay", f"{ns.link.latency_us:g}us"], what="--link-latency needs the kernel's netem qdisc")


def remove(ns: Namespace) -> None:
    """Delete ``ns`` if it exists (idempotent). Processes still inside keep it alive until they
    exit; its name and mount go now, so it can never be joined again."""
    if ns.path.exists():
        subprocess.run(["ip", "netns", "delete", ns.name], capture_output=True, timeout=TC_TIMEOUT_S, check=False)


def left_behind() -> tuple[list[str], list[str]]:
    """(stale, live): the names of moegraph's namespaces whose creator pid is gone (a run killed
    by SIGKILL, which no handler can see) and of those whose creator still runs."""
    stale, live = [], []
    for path in sorted(NETNS_DIR.glob(f"{PREFIX}-*-*")) if NETNS_DIR.is_dir() else ():
        m = re.fullmatch(rf"{PREFIX}-(\d+)-[0-9a-f]+", path.name)
        if m:
            (live if _alive(int(m.group(1))) else stale).append(path.name)
    return stale, live


def remove_stale() -> list[str]:
    """Delete namespaces an earlier moegraph process created and could not remove (it was
    SIGKILLed): those whose creator pid is gone. Live runs' namespaces are left alone. Every
    ``--link`` run calls it before creating its own; ``moegraph netns --sweep`` on demand.
    Returns the names removed (a namespace that could not be deleted is not among them)."""
    removed = []
    for name in left_behind()[0]:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=TC_TIMEOUT_S, check=False)
        if not (NETNS_DIR / name).exists():
            removed.append(name)
    return removed


def netns_command(p: argparse.ArgumentParser):
    """`moegraph netns [--sweep]`: list the namespaces of --link runs (left behind or live);
    with --sweep delete those left behind by a killed run (docs/runtime.md, "Emulated link")."""
    p.add_argument("--sweep", action="store_true",
                   help="delete the namespaces whose creating moegraph process is gone (a run killed by SIGKILL); "
                        "live runs' namespaces are left alone. Without it: list them")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")

    def run(args) -> int:
        import json
        stale, live = left_behind()
        removed: list[str] = []
        if args.sweep and stale:
            if shutil.which("ip") is None:
                raise UsageError("netns --sweep: the `ip` command (iproute2) is not installed")
            removed = remove_stale()
            kept = [name for name in stale if name not in removed]
            if kept:
                raise UsageError(f"netns --sweep: could not delete {', '.join(kept)} (deleting a network namespace "
                                 "needs root: CAP_SYS_ADMIN)")
        result = {"left_behind": [name for name in stale if name not in removed], "live": live, "removed": removed}
        if args.json:
            print(json.dumps(result, indent=1))
        elif args.sweep:
            print(f"removed {len(removed)} namespace(s) left by killed runs" + (f": {', '.join(removed)}" if removed
                                                                                  else ""))
        else:
            print(f"left behind by killed runs: {', '.join(stale) or 'none'}"
                  + (" (moegraph netns --sweep deletes them)" if stale else ""))
            print(f"in use by running moegraph processes: {', '.join(live) or 'none'}")
        return 0
    return run


def qdisc_show(name: str) -> str:
    """`tc qdisc show dev lo` inside namespace ``name`` (for tests and diagnostics)."""
    return subprocess.run(["tc", "-n", name, "qdisc", "show", "dev", "lo"], capture_output=True, text=True,
                          timeout=TC_TIMEOUT_S, check=True).stdout


def current_inode() -> int:
    """Inode of the calling thread's network namespace: equal inodes, same namespace."""
    return os.stat(f"/proc/self/task/{threading.get_native_id()}/ns/net").st_ino


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _run(ns: Namespace, cmd: list[str], *, privilege: bool = False, what: str = "") -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TC_TIMEOUT_S, check=False)
    if done.returncode == 0:
        return
    said = " ".join((done.stderr or done.stdout).split()) or f"exit code {done.returncode}"
    if privilege and _denied(said):
        raise LinkUnavailable(f"--link {ns.link}: creating a network namespace needs root (CAP_SYS_ADMIN and "
                              f"CAP_NET_ADMIN), which this process lacks ({' '.join(cmd[:3])}: {said}); "
                              f"run without --link, or as root")
    raise LinkUnavailable(f"--link {ns.link}: {what + ': ' if what else ''}`{' '.join(cmd)}` failed: {said}")


def _denied(message: str) -> bool:
    return any(w in message.lower() for w in ("not permitted", "permission denied"))


@contextlib.contextmanager
def _inside(ns: Namespace) -> Iterator[None]:
    """Move the calling thread into ``ns`` for the block, then back (setns(2) is per thread)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    home = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
    try:
        _setns(libc, str(ns.path), ns)
        try:
            yield
        finally:
            if libc.setns(home, CLONE_NEWNET) != 0:            # cannot happen for our own namespace
                raise LinkUnavailable(f"could not return from namespace {ns.name}: "
                                      f"{os.strerror(ctypes.get_errno())}")
    finally:
        os.close(home)


def _setns(libc, path: str, ns: Namespace) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise LinkUnavailable(f"--link {ns.link}: joining namespace {ns.name} failed: {os.strerror(err)}")
    finally:
        os.close(fd)


class _Terminated(SystemExit):
    """SIGTERM/SIGHUP inside ``emulated_link``: unwinds like Ctrl-C so the namespace is removed."""


@contextlib.contextmanager
def _cleanup_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP would kill Python without running ``finally``; inside the block they
    raise instead (SIGINT already does). Only the main thread can install handlers; elsewhere the
    block runs with the process's own handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, _frame):
        raise _Terminated(128 + signum)

    before = {s: signal.signal(s, _raise) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
