"""Stream safety of the executor's CUDA path, checked on a CPU: tests/fake_cuda.StreamRaces models
the streams, their events and the CUDA caching allocator's per-stream pools, and names every read
before a write is waited for, every write over another stream's pending use, and every tensor
freed while another stream may still use it (no ``record_stream``, no wait)."""

from __future__ import annotations

import gc

import pytest
import torch

import fake_cuda as fc
from moegraph.runtime.emulated import TINY_SIZES, EmulatedComm, EmulatedRankGraph
from moegraph.runtime.executor import Executor

pytestmark = pytest.mark.usefixtures("one_thread")       # tests/conftest.py


def _violations(monkeypatch, body) -> list[str]:
    """Run ``body(side)`` (side: a second stream) on the fake device with the race check on."""
    state = fc.fake_streams(monkeypatch, check_races=True)
    with fc.FakeCuda():
        body(torch.cuda.Stream())                         # its blocks are freed (and checked) as it returns
    return state.races.violations


def _made_on_compute():
    return torch.ones(4, device=fc.CUDA) * 2


def _read_on(side, a, *, wait: bool):
    if wait:
        side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        return a + 1


def test_fake_device_stream_races_name_each_kind(monkeypatch):
    """The checker itself, one case per rule, each with the fix that silences it."""
    def no_wait(side):
        a = _made_on_compute()
        _read_on(side, a, wait=False)
        a.record_stream(side)
    got = _violations(monkeypatch, no_wait)
    assert len(got) == 1 and got[0].startswith("read: add on stream 'side0'") and "written on stream 'default'" in got[0]

    def freed_early(side):                                # read on side, dropped: compute's pool may reuse it
        a = _made_on_compute()
        _read_on(side, a, wait=True)
    got = _violations(monkeypatch, freed_early)
    assert len(got) == 1 and got[0].startswith("free: ") and "without record_stream(side0)" in got[0]

    def recorded(side):
        a = _made_on_compute()
        _read_on(side, a, wait=True)
        a.record_stream(side)
    assert _violations(monkeypatch, recorded) == []

    def kept_until_waited(side):                          # ProcessGroupNCCL's stash: alive until a wait
        a = _made_on_compute()
        _read_on(side, a, wait=True)
        torch.cuda.current_stream().wait_stream(side)
    assert _violations(monkeypatch, kept_until_waited) == []

    def overwritten(side):                                # compute writes what side may still read
        a = _made_on_compute()
        _read_on(side, a, wait=True)
        a.record_stream(side)
        a.add_(1)
    got = _violations(monkeypatch, overwritten)
    assert len(got) == 1 and got[0].startswith("write: add_ on stream 'default'") and "read on stream 'side0'" in got[0]

    def comm_output_read_by_compute(side):                # the other direction: made on side, read on compute
        with torch.cuda.stream(side):
            out = torch.ones(4, device=fc.CUDA) * 3
        done = torch.cuda.Event()
        done.record(side)
        torch.cuda.current_stream().wait_event(done)
        _ = out * 2
    got = _violations(monkeypatch, comm_output_read_by_compute)
    assert len(got) == 1 and "allocated on stream 'side0' and last used on stream 'default'" in got[0]


def _emulated_steps(monkeypatch, schedule: str, steps: int = 2) -> fc.StreamRaces:
    """``steps`` forward + backward steps of the emulated n=2 rank graph (EmulatedComm: each
    collective a copy made on its comm stream) on the fake device, the race check on."""
    rg = EmulatedRankGraph(TINY_SIZES, "cpu")
    plan = rg.plan(schedule)
    state = fc.fake_streams(monkeypatch, check_races=True)
    with fc.FakeCuda():
        ex = Executor(rg.graph, plan, EmulatedComm(2), rank=0, n=2, device=torch.device("cuda", 0))
        params = [fc.to_fake(p) for p in rg.params]
        x, dy = fc.to_fake(rg.x), fc.to_fake(rg.dy)
        for _ in range(steps):
            y, saved = ex.forward(x, params)
            ex.backward(saved, dy, params)
            del y, saved
    gc.collect()                                          # anything a reference cycle held: freed, checked
    return state.races


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["greedy", "sequential"])
def test_fake_device_emulated_step_is_stream_safe(schedule, monkeypatch):
    """The second GPU session's suspect: a tensor made on one stream, read on another, freed by
    the executor after its reader was issued and reused by its own stream's next allocation before
    the reader ran. Every cross-stream read of two emulated steps (forward, backward, the
    gradients' all-reduces) is waited for and outlives its reader; the check saw such reads and
    such frees (it is not vacuous)."""
    races = _emulated_steps(monkeypatch, schedule)
    assert races.violations == [], "\n".join(races.violations[:10])
    assert races.cross_stream_reads > 0 and races.cross_stream_frees > 0


@pytest.mark.slow
@pytest.mark.parametrize("broken", ["record_stream", "event waits"])
def test_fake_device_stream_races_catch_an_executor_without_them(broken, monkeypatch):
    """The same steps with the executor's record_stream calls (or its event waits) taken out: the
    check names the frees (reads) that would race on a GPU. Without record_stream, the emulated
    collectives' inputs (made on the compute stream, read on the comm stream after its sleep) are
    freed to the compute stream's pool while the comm stream may still read them."""
    import moegraph.runtime.executor as executor
    if broken == "record_stream":
        monkeypatch.setattr(executor, "_device_tensors", lambda value: [])
    else:
        monkeypatch.setattr(fc.FakeStream, "wait_event", lambda self, ev: None)
    got = _emulated_steps(monkeypatch, "greedy", steps=1).violations
    kind = "free" if broken == "record_stream" else "read"
    assert got and all(v.startswith(f"{kind}: ") for v in got)
    assert any("side0" in v and "default" in v for v in got)
