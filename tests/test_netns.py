"""The emulated link (moegraph.runtime.netns): namespace lifecycle, shaping, ranks inside it,
`moegraph run --link`, and the one-line errors (bad rate, no privilege).

Tests that create namespaces skip where this machine cannot (not root, no iproute2); the
no-privilege test needs neither and always runs where `ip` and `setpriv` exist.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from moegraph.cli import main
from moegraph.registry import load_hardware
from moegraph.runtime.netns import (NETNS_DIR, Link, LinkUnavailable, current_inode, emulated_link, format_rate,
                                    link_latency, link_mismatch, link_rate, qdisc_show)

HAS_IP = shutil.which("ip") is not None and shutil.which("tc") is not None


def _can_make_namespaces() -> str:
    """'' where a namespace can be made and shaped here, else why not."""
    if not HAS_IP:
        return "iproute2 (ip, tc) is not installed"
    try:
        with emulated_link(Link(10**9)):
            return ""
    except LinkUnavailable as err:
        return str(err)


WHY_NOT = _can_make_namespaces()
needs_netns = pytest.mark.skipif(bool(WHY_NOT), reason=f"cannot create network namespaces: {WHY_NOT}")


def ours() -> set[str]:
    """The namespaces this test process created (their names carry our pid)."""
    return {p.name for p in NETNS_DIR.glob(f"moegraph-{os.getpid()}-*")} if NETNS_DIR.is_dir() else set()


def ip_netns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


# -- values ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,bits", [("1gbit", 10**9), ("500mbit", 5 * 10**8), ("2.5Gbit", 25 * 10**8),
                                       ("100kbit", 10**5), ("64bit", 64)])
def test_link_rates(text, bits):
    assert link_rate(text) == bits


def test_link_none_means_plain_loopback():
    assert link_rate("none") is None and link_rate("NONE") is None


@pytest.mark.parametrize("text", ["1gb", "1gbps", "fast", "", "0bit", "-1gbit", "1 gig"])
def test_bad_link_rates(text):
    import argparse
    with pytest.raises(argparse.ArgumentTypeError, match="is not a link rate such as 1gbit"):
        link_rate(text)


def test_latencies_and_names():
    assert link_latency("2ms") == 2000.0 and link_latency("500us") == 500.0 and link_latency("0.5s") == 5e5
    assert format_rate(10**9) == "1gbit" and format_rate(5 * 10**8) == "500mbit" and format_rate(1500) == "1500bit"
    assert str(Link(10**9, 2000.0)) == "1gbit+2000us"


def test_without_a_link_nothing_changes():
    before, inode = ours(), current_inode()
    with emulated_link(None) as ns:
        assert ns is None and current_inode() == inode and ours() == before


def test_profile_link_mismatch_warns():
    import dataclasses
    loopback = load_hardware("cpu-2core-gloo")
    assert loopback.link_bit_s == 0 and link_mismatch(loopback, None) is None
    on_link = dataclasses.replace(loopback, link_bit_s=1e9)
    assert link_mismatch(on_link, Link(10**9)) is None
    assert "calibrated on an emulated 1gbit link, this run uses plain loopback" in link_mismatch(on_link, None)
    assert "this run uses an emulated 500mbit link" in link_mismatch(on_link, Link(5 * 10**8))
    assert "this run uses an emulated 1gbit+500us link" in link_mismatch(on_link, Link(10**9, 500.0))
    # the shipped profile calibrated on the run's link is named when there is one
    assert "(--hardware cpu-2core-gloo-1gbit was calibrated on it)" in link_mismatch(loopback, Link(10**9))
    assert "(calibrate with the same --link for the latter)" in link_mismatch(loopback, Link(5 * 10**8))


@needs_netns
@pytest.mark.slow
def test_run_on_a_link_without_hardware_takes_the_profile_calibrated_on_it(capfd):
    assert main(["run", "--model", "tiny", "--seq", "64", "--steps", "1", "--warmup", "0", "--schedule", "sequential",
                 "--link", "1gbit", "--json"]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out)["hardware"] == "cpu-2core-gloo-1gbit"
    assert "run: --link 1gbit: profile cpu-2core-gloo-1gbit (calibrated on this link)" in err
    assert "warning" not in err


# -- lifecycle ------------------------------------------------------------------------------------

@needs_netns
def test_created_shaped_entered_and_removed():
    host = current_inode()
    with emulated_link(Link(10**9)) as ns:
        assert ns.path.exists() and ns.name in ip_netns_list()
        assert current_inode() == ns.path.stat().st_ino != host
        shown = qdisc_show(ns.name)
        assert "tbf" in shown and "rate 1Gbit" in shown, shown
        links = subprocess.run(["ip", "-n", ns.name, "-o", "link", "show"], capture_output=True, text=True,
                               check=True).stdout.strip().splitlines()
        assert len(links) == 1 and ": lo:" in links[0] and "UP" in links[0], links
    assert not ns.path.exists() and ns.name not in ip_netns_list()
    assert current_inode() == host and not ours()


@needs_netns
def test_removed_after_an_exception():
    host = current_inode()
    with pytest.raises(ZeroDivisionError):
        with emulated_link(Link(5 * 10**8)) as ns:
            assert ns.path.exists()
            1 / 0
    assert not ns.path.exists() and current_inode() == host and not ours()


@needs_netns
def test_latency_needs_netem_or_is_shaped():
    """netem is a kernel option: where it exists the delay is applied, where not the error says
    so in one line and the half-made namespace is gone."""
    try:
        with emulated_link(Link(10**9, 2000.0)) as ns:
            shown = qdisc_show(ns.name)
            assert "netem" in shown and "delay 2ms" in shown, shown
    except LinkUnavailable as err:
        assert "--link-latency needs the kernel's netem qdisc" in str(err) and "\n" not in str(err)
    assert not ours()


@needs_netns
def test_a_namespace_left_by_a_killed_run_is_removed_by_the_next():
    """A run killed by SIGKILL cannot clean up; the next run deletes namespaces whose creator is
    gone (and only those: its own, live, namespace stays while it runs)."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = f"moegraph-{gone.pid}-dead00"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with emulated_link(Link(10**9)) as ns:
            assert not (NETNS_DIR / stale).exists() and ns.path.exists()
    finally:
        subprocess.run(["ip", "netns", "delete", stale], capture_output=True)


@pytest.mark.slow
@needs_netns
def test_a_sigkilled_run_leaves_its_namespace_until_a_sweep(capsys):
    """SIGKILL gives `run --link` no chance to clean up (docs/runtime.md): its namespace stays,
    `moegraph netns` lists it as left behind, and `moegraph netns --sweep` deletes it while a
    live run's namespace stays (a holder started first: every --link run sweeps when it starts)."""
    holder = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    live = holder.stdout.readline().strip()
    assert live.startswith(f"moegraph-{holder.pid}-"), holder.stderr.read()
    run = subprocess.Popen([sys.executable, "-m", "moegraph", "run", "--model", "tiny", "--hardware", "cpu-2core-gloo",
                            "--n", "2", "--seq", "128", "--steps", "1000", "--schedule", "sequential", "--link",
                            "1gbit"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not list(NETNS_DIR.glob(f"moegraph-{run.pid}-*")) and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [p.name for p in NETNS_DIR.glob(f"moegraph-{run.pid}-*")]
        assert len(left) == 1, run.stderr.read().decode() if run.poll() is not None else "no namespace in 120 s"
    finally:
        os.killpg(run.pid, signal.SIGKILL)       # the run and the ranks it started (its own session)
        run.wait(timeout=30)
        run.stderr.close()
    try:
        assert (NETNS_DIR / left[0]).exists()
        capsys.readouterr()
        assert main(["netns", "--json"]) == 0
        listed = json.loads(capsys.readouterr().out)
        assert left[0] in listed["left_behind"] and live in listed["live"]
        assert main(["netns", "--sweep", "--json"]) == 0
        swept = json.loads(capsys.readouterr().out)
        assert left[0] in swept["removed"] and not (NETNS_DIR / left[0]).exists()
        assert (NETNS_DIR / live).exists() and live not in swept["removed"]
    finally:
        subprocess.run(["ip", "netns", "delete", left[0]], capture_output=True)
        holder.terminate()
        holder.wait(timeout=30)
    assert not (NETNS_DIR / live).exists()


CHILD = """
import sys, time
from moegraph.runtime.netns import Link, emulated_link
with emulated_link(Link(10**9)) as ns:
    print(ns.name, flush=True)
    time.sleep(120)
"""


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_removed_when_the_holder_is_interrupted(sig):
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        name = child.stdout.readline().strip()
        assert name.startswith(f"moegraph-{child.pid}-"), child.stderr.read()
        assert (NETNS_DIR / name).exists()
        child.send_signal(sig)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode != 0
    assert not (NETNS_DIR / name).exists() and name not in ip_netns_list()


@pytest.mark.skipif(not HAS_IP or shutil.which("setpriv") is None, reason="needs ip and setpriv")
@pytest.mark.parametrize("command", [["run", "--steps", "1"], ["demo", "-o", "{tmp}/out"],
                                     ["calibrate", "-o", "{tmp}/p.yaml"]], ids=lambda c: c[0])
@pytest.mark.slow
def test_without_privilege_one_line_exit_2_nothing_written(command, tmp_path):
    """The real path: `ip netns add` refused because the process lacks CAP_SYS_ADMIN (dropped
    from its bounding set: for root that removes it from the process; a non-root user lacks it)."""
    cmd = [sys.executable, "-m", "moegraph", *(a.replace("{tmp}", str(tmp_path)) for a in command), "--link", "1gbit"]
    if os.geteuid() == 0:
        cmd = ["setpriv", "--bounding-set", "-sys_admin,-net_admin", "--inh-caps", "-all", "--", *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"moegraph {command[0]}: error: --link 1gbit: creating a network namespace needs "
                               f"root"), lines[0]
    assert done.stdout == "" and list(tmp_path.iterdir()) == []


# -- ranks on the link ----------------------------------------------------------------------------

def netns_probe(rank: int, n: int, nbytes: int) -> tuple[int, float]:
    """A rank's namespace inode and the seconds a broadcast of ``nbytes`` took."""
    import torch
    import torch.distributed as dist
    x = torch.zeros(nbytes // 4)
    dist.barrier()
    t0 = time.perf_counter()
    dist.broadcast(x, src=0)
    dist.barrier()
    return current_inode(), time.perf_counter() - t0


@needs_netns
@pytest.mark.slow
def test_ranks_run_inside_and_feel_the_rate(capfd):
    """Both ranks report the namespace's inode, and 1 MiB takes at least its wire time at 20 Mbit/s
    (the bucket's first burst, 128 KiB, passes at once); unshaped loopback moves it in milliseconds.
    The ranks print nothing about names they cannot look up (the namespace has no DNS)."""
    from moegraph.runtime.launch import spawn
    rate, nbytes, burst = 20 * 10**6, 2**20, 2**17
    with emulated_link(Link(rate)) as ns:
        inode = ns.path.stat().st_ino
        results = spawn(netns_probe, 2, args=(nbytes,), timeout_s=120, pg_timeout_s=60)
    assert [r[0] for r in results] == [inode, inode] and inode != current_inode()
    assert min(r[1] for r in results) >= (nbytes - burst) * 8 / rate, results
    assert "cannot be retrieved" not in capfd.readouterr().err


@needs_netns
@pytest.mark.slow
def test_run_on_the_link_matches_eager_and_is_shaped(capsys):
    """`moegraph run --link`: numerics against the eager module, and each step at least the wire
    time of the bytes both ranks send at 4 Mbit/s (unshaped, the tiny layer's step takes ~30 ms)."""
    layer = ["--model", "tiny", "--hardware", "cpu-2core-gloo", "--n", "2", "--seq", "128", "--dtype", "fp32",
             "--attn", "sp", "--ffn", "ep", "--dispatch", "ag-rs", "--passes", "gate-reorder,sar=paper"]
    assert main(["run", *layer, "--steps", "2", "--schedule", "sequential", "--check", "--json",
                 "--link", "4mbit"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["link"] == "4mbit"
    assert ("warning: profile cpu-2core-gloo was calibrated on plain loopback (no --link), this run uses an "
            "emulated 4mbit link") in err
    assert report["max_rel_err_output"] < 1e-5 and report["max_rel_err_grads"] < 1e-5
    assert main(["trace", *layer, "--json"]) == 0
    nodes = json.loads(capsys.readouterr().out)["nodes"]
    # both ranks' bytes cross the one shaped loopback; a full bucket lets its burst through at once
    wire_s = (2 * sum(n["comm_bytes"] for n in nodes if n["kind"] == "comm") - 2**17) * 8 / 4e6
    assert wire_s > 0.2, "the layer must move enough bytes for the bound to mean something"
    assert min(report["step_us_all"]) >= wire_s * 1e6, (report["step_us_all"], wire_s)


@needs_netns
@pytest.mark.slow
def test_calibrate_on_the_link_records_it_and_measures_its_bandwidth(tmp_path):
    """The ranks calibrate inside the namespace: the fitted per-rank bandwidth is of the link's
    order, far below plain loopback (~1 GB/s here), and the profile records the link. Not "below
    the rate": tbf's token bucket lets each short transfer's first burst through at loopback speed,
    so a fit over short transfers lands above rate/8 (measured 14.8-20.9 MB/s at 12.5 on a quiet
    machine, 56.4 MB/s beside niced work, where the 10 s budget reaches fewer and shorter sizes)."""
    out = tmp_path / "link.yaml"
    proc = subprocess.Popen([sys.executable, "-m", "moegraph", "calibrate", "--time-budget", "10", "--n", "2",
                             "--link", "100mbit", "--quiet", "-o", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    assert not list(NETNS_DIR.glob(f"moegraph-{proc.pid}-*")), "the calibration left its namespace behind"
    hw = load_hardware(out)
    assert hw.link_bit_s == 1e8 and hw.link_latency_us == 0
    assert hw.link_burst_bytes == 2 * 65536          # 1 ms of 100mbit is under two 64 KiB loopback packets
    assert hw.nvlink_bw_bytes_s <= 8 * 100e6 / 8, hw.nvlink_bw_bytes_s      # loopback would be ~80x this
    assert "gloo over an emulated 100mbit link" in hw.description
