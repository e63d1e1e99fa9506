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
CPU-only torch has none), so the executor's CUDA path runs.

Why not FakeTensorMode: it has no data, so routing (data-dependent shapes) cannot run, and it
lets a CPU tensor be indexed by a CUDA one. The meta device has no data either.
"""

from __future__ import annotations

import collections
import contextlib
import threading
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
        stream.recorded.append(self)

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

class FakeEvent:
    def __init__(self, enable_timing: bool = False, **_kw):
        self.recorded_on: Any = None

    def record(self, stream: Any = None) -> None:
        self.recorded_on = stream if stream is not None else _STATE.current

    def synchronize(self) -> None:
        _STATE.syncs["event_synchronize"] += 1

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: "FakeEvent") -> float:
        return 0.0


class FakeStream:
    def __init__(self, device: Any = None, priority: int = 0, name: str = "side"):
        self.priority, self.name = priority, name
        self.waits: list[Any] = []
        self.recorded: list[Any] = []

    def wait_event(self, ev: FakeEvent) -> None:
        self.waits.append(ev)

    def wait_stream(self, other: "FakeStream") -> None:
        self.waits.append(other)

    def synchronize(self) -> None:
        _STATE.syncs["stream_synchronize"] += 1

    def query(self) -> bool:
        return True


class _State:
    def __init__(self):
        self.default = FakeStream(name="default")
        self.current = self.default
        self.syncs: collections.Counter[str] = collections.Counter()
        self.streams: list[FakeStream] = []


_STATE = _State()


@contextlib.contextmanager
def _stream_ctx(stream: FakeStream):
    prev, _STATE.current = _STATE.current, stream
    try:
        yield stream
    finally:
        _STATE.current = prev


def _new_stream(device: Any = None, priority: int = 0) -> FakeStream:
    s = FakeStream(device, priority)
    _STATE.streams.append(s)
    return s


def _synchronize(device: Any = None) -> None:
    _STATE.syncs["cuda_synchronize"] += 1


def fake_streams(monkeypatch) -> _State:
    """Patch torch.cuda's stream/event API with the stand-ins above; returns their shared state
    (``syncs`` counts host-blocking calls, ``streams`` the side streams created)."""
    global _STATE
    _STATE = _State()
    monkeypatch.setattr(torch.cuda, "Stream", _new_stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _STATE.current)
    monkeypatch.setattr(torch.cuda, "stream", _stream_ctx)
    monkeypatch.setattr(torch.cuda, "synchronize", _synchronize)
    return _STATE
