"""A fake accelerator on a CPU-only torch, for the ``fake_device`` tests.

``FakeCuda`` (a TorchDispatchMode) makes every tensor built on the fake device (``device=x.device``
of a fake tensor, or ``.to`` it) a ``FakeCudaTensor``: it reports the *meta* device but holds a
real CPU tensor, so kernels compute real numbers. Meta, not "cuda": a CPU build of torch has no
CUDA device guard, so indexing a tensor that reports "cuda" fails in the Python binding before any
check could run; the meta device has a guard and is as foreign to CPU tensors as CUDA is. Every aten op checks its tensor arguments: a fake-CUDA
tensor meeting a CPU tensor with at least one dimension raises ``DeviceMix`` (real CUDA rejects
most such mixes; the few it allows, such as indexing a CUDA tensor by CPU indices, hide a
host-to-device copy, so they are rejected too). 0-dim CPU tensors are allowed: CUDA takes them as
scalars. Explicit transfers (``.to``, ``copy_``) are allowed and counted.

It also counts what would synchronise the host with a real GPU (``syncs``): reading a value
(``.item``, ``.tolist``: aten ``_local_scalar_dense``), a device-to-host copy, ops whose output
shape depends on the data (``nonzero``, ``bincount``, ...: tag ``dynamic_output_shape``), and
``torch._grouped_mm`` where CUDA's kernel would copy its group offsets to the host
(``grouped_mm_offsets``). The fake stands for an sm90 GPU: there torch's grouped GEMM kernel runs
from device-side offsets for bf16 operands only; any other dtype takes ``_grouped_mm_fallback``
(aten/src/ATen/native/GroupedMMUtils.h), whose ``offs.cpu()`` synchronises (the first GPU session
found it so for fp32). On CPU the op is that same fallback over host offsets, so nothing else in
this file would see the copy.

``fake_streams`` replaces ``torch.cuda``'s stream and event API with recording stand-ins (a
CPU-only torch has none), so the executor's CUDA path runs. With ``check_races=True`` it also
checks that path's stream safety (``StreamRaces``): a happens-before model of the streams, their
events and the CUDA caching allocator's per-stream pools, which finds a missing event wait or a
tensor freed while another stream may still read it (a missing ``record_stream``) on a CPU.

Why not FakeTensorMode: it has no data, so routing (data-dependent shapes) cannot run, and it
lets a CPU tensor be indexed by a CUDA one. The meta device has no data either.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

CUDA = torch.device("meta")                  # the fake accelerator's device, see above
aten = torch.ops.aten
SDPA_MATH = 0                   # sdp::SDPBackend::math: the composite that runs on any device


class DeviceMix(RuntimeError):
    """A fake-CUDA tensor met a CPU tensor in one op."""


class FakeCudaTensor(torch.Tensor):
    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, device=CUDA, requires_grad=data.requires_grad)
        r._data = data
        if _STATE.races is not None:
            _STATE.races.allocated(data)
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"FakeCudaTensor({tuple(self.shape)}, {self.dtype})"

    def tolist(self):
        """torch refuses ``tolist`` on subclasses; on a GPU it is one device-to-host copy."""
        _ACTIVE.mode.syncs["tolist"] += 1
        return self._data.tolist()

    def record_stream(self, stream) -> None:
        """The binding wants a real torch Stream; the stand-ins below are not."""
        if not isinstance(stream, FakeStream):
            raise TypeError(f"record_stream on {type(stream).__name__}, expected a stream")
        stream.records += 1                 # a count: holding the tensor would keep its block from being freed
        if _STATE.races is not None:
            _STATE.races.record_stream(self, stream)

    def nonzero(self, *, as_tuple: bool = False):
        """The Python binding takes a CUDA device guard first, which a CPU build lacks: go to aten."""
        idx = aten.nonzero.default(self)
        return idx.unbind(1) if as_tuple else idx

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"fake-CUDA tensor used outside FakeCuda mode ({func})")


def real(t: Any) -> Any:
    """The CPU data behind a fake-CUDA tensor (detached); anything else unchanged."""
    return t._data.detach() if isinstance(t, FakeCudaTensor) else t


_TRANSFERS = {aten._to_copy.default, aten.copy_.default}


_ACTIVE = threading.local()          # this thread's FakeCuda mode (tolist bypasses dispatch)


class FakeCuda(TorchDispatchMode):
    """Thread-local (dispatch modes are): each rank thread enters its own."""

    def __init__(self):
        super().__init__()
        self.syncs: collections.Counter[str] = collections.Counter()
        self.h2d = 0

    def __enter__(self):
        _ACTIVE.mode = self
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        tensors = [t for t in _leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        fake = any(isinstance(t, FakeCudaTensor) for t in tensors)
        cpu = [t for t in tensors if not isinstance(t, FakeCudaTensor) and t.dim() > 0]
        name = str(func.overloadpacket.__name__)
        if func is aten.record_stream.default:
            return None
        if func is aten._fused_sdp_choice.default:
            return SDPA_MATH
        if _STATE.races is not None and (fake or func in _TRANSFERS):
            _STATE.races.op(func, args, kwargs)
        if func in _TRANSFERS:
            return self._transfer(func, args, kwargs)
        if fake and cpu:
            raise DeviceMix(f"{func}: a CUDA tensor meets CPU tensor(s) of shape "
                            f"{[tuple(t.shape) for t in cpu]}")
        dev = kwargs.get("device")
        to_cuda = dev is not None and torch.device(dev) == CUDA
        if to_cuda:
            kwargs["device"] = torch.device("cpu")
        if fake:
            if func is aten._local_scalar_dense.default:
                self.syncs["item"] += 1
            elif func is aten._grouped_mm.default and not all(t.dtype == torch.bfloat16 for t in args[:2]):
                self.syncs["grouped_mm_offsets"] += 1
            elif torch.Tag.dynamic_output_shape in func.tags and _data_dependent(func, args):
                self.syncs[name] += 1
        out = func(*tree_map(real_keep_grad, args), **tree_map(real_keep_grad, kwargs))
        if not (fake or to_cuda):
            return out
        return _wrap_like(out, args)

    def _transfer(self, func, args, kwargs):
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(dst, FakeCudaTensor) != isinstance(src, FakeCudaTensor):
                if isinstance(src, FakeCudaTensor):
                    self.syncs["d2h"] += 1
                else:
                    self.h2d += 1
            real_keep_grad(dst).copy_(real_keep_grad(src), *args[2:])
            return dst
        src = args[0]
        dev = kwargs.pop("device", None)
        target_cuda = isinstance(src, FakeCudaTensor) if dev is None else torch.device(dev) == CUDA
        if isinstance(src, FakeCudaTensor) and not target_cuda:
            self.syncs["d2h"] += 1
        elif target_cuda and not isinstance(src, FakeCudaTensor):
            self.h2d += 1
        out = func(real_keep_grad(src), *args[1:], **kwargs)
        return FakeCudaTensor(out) if target_cuda else out


_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}


def _data_dependent(func, args) -> bool:
    """Tagged dynamic_output_shape ops whose shape here really depends on the data: indexing only
    with a boolean mask (integer indices give a static shape and need no sync)."""
    if func in _INDEXING:
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] if i is not None)
    return True


def real_keep_grad(t: Any) -> Any:
    return t._data if isinstance(t, FakeCudaTensor) else t


def _leaves(tree) -> list:
    out: list = []
    tree_map(out.append, tree)
    return out


def _wrap_like(out, args):
    """Wrap CPU outputs as fake-CUDA; an in-place op returns its (wrapped) argument itself."""
    by_id = {id(a._data): a for a in _leaves(args) if isinstance(a, FakeCudaTensor)}

    def wrap(t):
        if not isinstance(t, torch.Tensor) or isinstance(t, FakeCudaTensor):
            return t
        same = by_id.get(id(t))
        return same if same is not None else FakeCudaTensor(t)
    return tree_map(wrap, out)


def to_fake(t: torch.Tensor) -> FakeCudaTensor:
    """A fake-CUDA copy of a CPU tensor (call under FakeCuda)."""
    return FakeCudaTensor(t.detach().clone())


# -- streams and events -----------------------------------------------------------------------------
# Each stream keeps a vector clock (``clock``: stream -> ops of that stream it is ordered after): an
# op ticks its stream's own entry, an event copies the clock it was recorded at, a wait takes the
# entry-wise max. StreamRaces reads them; without it they are kept all the same (a few dict updates).

def _join(into: dict, other: dict | None) -> None:
    for s, t in (other or {}).items():
        if into.get(s, 0) < t:
            into[s] = t


class FakeEvent:
    def __init__(self, enable_timing: bool = False, **_kw):
        self.recorded_on: Any = None
        self.clock: dict | None = None              # never recorded: waiting on it orders nothing (CUDA)

    def record(self, stream: Any = None) -> None:
        self.recorded_on = stream if stream is not None else _STATE.current
        self.clock = dict(self.recorded_on.clock)

    def synchronize(self) -> None:
        _STATE.syncs["event_synchronize"] += 1
        _STATE.host_waits_for(self.clock)

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: "FakeEvent") -> float:
        return 0.0


class FakeStream:
    def __init__(self, device: Any = None, priority: int = 0, name: str = "side"):
        self.priority, self.name = priority, name
        self.waits: list[Any] = []
        self.records = 0                                # record_stream calls naming this stream
        self.clock: dict[FakeStream, int] = {}

    def __repr__(self) -> str:
        return f"stream {self.name!r}"

    def tick(self) -> int:
        t = self.clock[self] = self.clock.get(self, 0) + 1
        return t

    def after(self, other: "FakeStream", tick: int) -> bool:
        """Whether this stream's next op runs after ``other``'s op number ``tick``."""
        return other is self or self.clock.get(other, 0) >= tick

    def wait_event(self, ev: FakeEvent) -> None:
        self.waits.append(ev)
        _join(self.clock, ev.clock)

    def wait_stream(self, other: "FakeStream") -> None:
        self.waits.append(other)
        _join(self.clock, other.clock)

    def synchronize(self) -> None:
        _STATE.syncs["stream_synchronize"] += 1
        _STATE.host_waits_for(self.clock)

    def query(self) -> bool:
        return True


class _State:
    def __init__(self, races: "StreamRaces | None" = None):
        self.default = FakeStream(name="default")
        self.current = self.default
        self.syncs: collections.Counter[str] = collections.Counter()
        self.streams: list[FakeStream] = []
        self.races = races

    def host_waits_for(self, clock: dict | None) -> None:
        """The host blocked until ``clock``'s work was done: whatever it issues next, on any stream, runs after."""
        for s in (self.default, *self.streams):
            _join(s.clock, clock)


_STATE = _State()


@contextlib.contextmanager
def _stream_ctx(stream: FakeStream):
    prev, _STATE.current = _STATE.current, stream
    try:
        yield stream
    finally:
        _STATE.current = prev


def _new_stream(device: Any = None, priority: int = 0) -> FakeStream:
    s = FakeStream(device, priority, name=f"side{len(_STATE.streams)}")
    _STATE.streams.append(s)
    return s


def _synchronize(device: Any = None) -> None:
    _STATE.syncs["cuda_synchronize"] += 1
    every: dict = {}
    for s in (_STATE.default, *_STATE.streams):
        _join(every, s.clock)
    _STATE.host_waits_for(every)


def fake_streams(monkeypatch, *, check_races: bool = False) -> _State:
    """Patch torch.cuda's stream/event API with the stand-ins above; returns their shared state
    (``syncs`` counts host-blocking calls, ``streams`` the side streams created; ``races`` the
    StreamRaces checker when ``check_races``: one thread only, since the current stream is global)."""
    global _STATE
    _STATE = _State(StreamRaces() if check_races else None)
    monkeypatch.setattr(torch.cuda, "Stream", _new_stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _STATE.current)
    monkeypatch.setattr(torch.cuda, "stream", _stream_ctx)
    monkeypatch.setattr(torch.cuda, "synchronize", _synchronize)
    return _STATE


# -- stream safety -----------------------------------------------------------------------------------

@dataclass(eq=False)
class _Block:
    """What StreamRaces knows of one storage (a CUDA caching-allocator block)."""

    what: str                                          # dtype, bytes, the op that made it
    stream: FakeStream                                 # allocated on: the pool it returns to when freed
    write: tuple[FakeStream, int, str]                 # last write: stream, its op number, op name
    reads: dict = field(default_factory=dict)          # stream -> (op number, op name) since that write
    uses: dict = field(default_factory=dict)           # stream -> (op number, op name), every use
    recorded: set = field(default_factory=set)         # streams record_stream named


def _written(func, args, kwargs) -> set[int]:
    """ids of the tensors an op writes: the arguments its schema marks written (in place, out=)."""
    ids = set()
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            ids.update(id(t) for t in _leaves(v) if isinstance(t, torch.Tensor))
    return ids


class StreamRaces:
    """A happens-before check of the fake device's streams (``fake_streams(check_races=True)``).

    Every aten op on a fake tensor runs on the current stream and reads its tensor arguments (view
    ops read nothing: they touch no data) and writes those its schema marks written, or the new
    storage it returns. Ordering comes only from a stream's own order, event waits, wait_stream and
    host synchronisation (the vector clocks above). ``violations`` lists, one line each:

    read   an op on X reads a storage last written on Y != X, and X has not waited for that write
           (a missing event wait: X may read the buffer before Y has filled it);
    write  an op on X writes a storage that Y != X read or wrote, and X has not waited for that;
    free   a storage dies (its last tensor is dropped) while a stream Y other than the one it was
           allocated on, A, used it, and Y was neither ``record_stream``-ed nor waited for by A.
           The CUDA caching allocator returns a freed block to A's pool at once, and A's next
           allocation takes it without waiting for Y: Y's pending read sees the new owner's data
           (or Y's pending write corrupts it). record_stream makes the allocator wait for Y, as
           keeping the tensor alive until A has waited for Y does.

    Single-threaded: rank threads share the one current stream of ``fake_streams``.
    """

    def __init__(self):
        self.blocks: dict[int, _Block] = {}
        self.violations: list[str] = []
        self.cross_stream_reads = 0        # ops reading a block allocated on another stream
        self.cross_stream_frees = 0        # blocks freed after another stream than theirs used them

    def _block(self, t: Any) -> _Block | None:
        return self.blocks.get(id(t._data.untyped_storage())) if isinstance(t, FakeCudaTensor) else None

    def allocated(self, data: torch.Tensor) -> None:
        """A fake tensor wraps ``data``: a new block if its storage is new (not a view of a known one)."""
        storage = data.untyped_storage()
        key = id(storage)
        if key in self.blocks or storage.nbytes() == 0:
            return
        stream = _STATE.current
        what = f"{data.dtype} block of {storage.nbytes()} bytes"
        self.blocks[key] = _Block(what, stream, (stream, stream.tick(), "allocation"))
        weakref.finalize(storage, self._freed, key)

    def record_stream(self, t: Any, stream: FakeStream) -> None:
        block = self._block(t)
        if block is not None:
            block.recorded.add(stream)

    def op(self, func, args, kwargs) -> None:
        if func.is_view:
            return
        stream, name = _STATE.current, str(func.overloadpacket.__name__)
        tick = stream.tick()
        written = _written(func, args, kwargs)
        for t in _leaves((args, kwargs)):
            block = self._block(t)
            if block is None:
                continue
            self._check(block, stream, name, [block.write], "read", "written")
            block.uses[stream] = (tick, name)
            self.cross_stream_reads += block.stream is not stream
            if id(t) in written:
                self._check(block, stream, name, [(s, *r) for s, r in block.reads.items()], "write", "read")
                block.write, block.reads = (stream, tick, name), {}
            else:
                block.reads[stream] = (tick, name)

    def _check(self, block: _Block, stream: FakeStream, name: str, prior, kind: str, did: str) -> None:
        for s, t, by in prior:
            if not stream.after(s, t):
                self.violations.append(f"{kind}: {name} on {stream} uses a {block.what} {did} on {s} by {by} "
                                       f"(op {t} there) without waiting for it")

    def _freed(self, key: int) -> None:
        block = self.blocks.pop(key)
        self.cross_stream_frees += any(s is not block.stream for s in block.uses)
        for s, (t, by) in block.uses.items():
            if s is not block.stream and s not in block.recorded and not block.stream.after(s, t):
                self.violations.append(f"free: a {block.what} allocated on {block.stream} and last used on {s} by "
                                       f"{by} is freed without record_stream({s.name}) while {block.stream} has "
                                       "not waited for that use: its pool may reuse it at once")
