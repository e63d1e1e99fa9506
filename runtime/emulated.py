"""Emulated collectives: an n-rank graph on ONE device, its collectives replaced by copies.

``EmulatedComm`` stands in for the other ranks of a rank graph (the graph one rank of n runs):
every collective becomes a copy of the same size as its outputs, made from its inputs on the
stream it is issued on (the executor enters the plan's comm stream before ``issue``), lengthened
on CUDA by ``torch.cuda._sleep(sleep_cycles)`` so that it lasts as long as a collective.
Outputs are a fixed function of the inputs: a consumer that does not wait for the comm stream
reads a buffer not yet written, and two plans of one graph give identical numbers. It exercises
what no single-GPU run otherwise would: comm streams, event waits, fences, the measured
overlap. It does not compute the collective's values (the numbers are not the layer's), and it
refuses collectives whose output sizes depend on the data (token all-to-alls).

Device-agnostic: on CPU the executor's CPU path runs it (no streams; the copy is made when
issued, the work is complete at once), which is how the CPU suite checks the same code.

``EmulatedRankGraph`` builds the rank graph the GPU test and ``benchmarks/gpu_overlap.py`` run:
attn=sp, ffn=tp, dispatch=ag-rs, n=2, chunked so that compute can hide the collectives. Every
emulated collective lasts ``comm_us`` on CUDA (its sleep, converted to cycles at the clock
measured on the device, ``sleep_cycles_per_us``), and the plans are made by a cost model told so
(``EmulatedCost``). Sized so that the device, not the host, sets the pace (``GPU_SIZES``): the
first GPU session's graph (b=2 s=1024 h=512) ran ~1 ms of kernels against ~65 ms of host issue
time, so no kernel ever ran beside a collective and the overlap could not be measured.

Notation: b batch, s sequence, h hidden, n group size, k top-k, f expert ffn width.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from moegraph.cost import CostModel
from moegraph.ir import Node, OpKind
from moegraph.runtime import RuntimeFailure
from moegraph.runtime.collectives import Pending

# Each emulated collective's duration on CUDA: about what a step's all-gather or reduce-scatter of
# these sizes costs over a slow inter-node link, and long against the host's issue time per node
# (a few hundred microseconds at most), so the plans' overlap, not the host, decides what hides it
DEFAULT_COMM_US = 1000.0
_PROBE_CYCLES = 2_000_000           # ~1 ms at a Hopper's ~2 GHz SM clock: long against launch jitter


class _IssuedWork:
    """The work of an emulated collective: complete once issued. CUDA: the copy was issued on the
    current (comm) stream, so ``wait`` has nothing to order; CPU: the copy is already made."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


class EmulatedComm:
    """Comm stand-in for rank 0 of an n-rank graph run alone on one device (module docstring).

    synchronous:   the host synchronises the device after every collective (nothing can race:
                   the reference a concurrent run must equal bit for bit).
    sleep_cycles:  device clock cycles each collective spins first on its stream (CUDA only; the
                   CPU path does not sleep: there the copy is the whole collective).
    """

    rank = 0
    backend = "emulated"
    native_budgets = False
    meta = world_meta = mp_group = None

    def __init__(self, n: int, *, synchronous: bool = False, sleep_cycles: int = 0):
        if n < 2:
            raise ValueError(f"EmulatedComm emulates the other ranks of an n-rank graph: n={n} must be at least 2")
        if sleep_cycles < 0:
            raise ValueError(f"sleep_cycles={sleep_cycles} must be >= 0")
        self.n, self.synchronous, self.sleep_cycles = n, synchronous, sleep_cycles
        self.groups: dict = {}
        self.issued = 0

    def issue(self, node: Node, ins: list[Any], stream: str, budget: int,
              shapes: Sequence[tuple[int, ...]] = ()) -> Pending:
        _check_emulable(node)
        tensors = [t for t in ins if isinstance(t, torch.Tensor)]
        if not tensors:
            raise RuntimeFailure(f"collective {node.name!r} ({node.op.value}) has no tensor input to emulate")
        if len(shapes) != len(node.outputs):
            raise RuntimeFailure(f"collective {node.name!r}: {len(shapes)} output shapes given for "
                                 f"{len(node.outputs)} outputs")
        issued = time.perf_counter_ns()
        cuda = tensors[0].is_cuda
        if cuda and self.sleep_cycles:
            _cuda_sleep(self.sleep_cycles)
        dtype = tensors[0].dtype                   # a collective's outputs have its operand's dtype
        src = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
        outs = [_fill(src, shape) for shape in shapes]
        if self.synchronous and cuda:
            torch.cuda.synchronize(tensors[0].device)
        self.issued += 1
        return Pending(node, stream, [_IssuedWork()], lambda: outs, issued_ns=issued)


def _check_emulable(node: Node) -> None:
    """Static output sizes only: the graph's shapes then are exactly what a real collective makes."""
    op = node.op
    if op in (OpKind.ALL_GATHER, OpKind.REDUCE_SCATTER, OpKind.ALL_REDUCE):
        return
    if op is OpKind.ALL_TO_ALL:
        mode = node.attr("mode")
        if mode in ("heads", "shards"):
            return
        if mode == "tokens":
            raise RuntimeFailure(f"collective {node.name!r}: a token all-to-all's row counts depend on the routing, "
                                 "which an emulated (copy) collective cannot know; emulate graphs with "
                                 "dispatch=ag-rs")
        raise RuntimeFailure(f"collective {node.name!r}: no emulation of all_to_all mode {mode!r}; "
                             "emulable modes: heads, shards")
    raise RuntimeFailure(f"node {node.name!r}: {op.value} is not a collective EmulatedComm emulates "
                         "(all_gather, reduce_scatter, all_reduce, all_to_all heads/shards)")


def _fill(src: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A new tensor of ``shape`` holding ``src`` repeated (and cut): [X] -> shape."""
    numel = math.prod(shape)
    if numel == 0:
        return src.new_empty(shape)
    if src.numel() == 0:
        raise RuntimeFailure(f"an emulated collective must fill {shape} from empty inputs")
    return src.repeat(-(-numel // src.numel()))[:numel].view(shape)


def _cuda_sleep(cycles: int) -> None:
    sleep = getattr(torch.cuda, "_sleep", None)      # private API: in torch 2.11 and 2.13 both
    if sleep is None:
        raise RuntimeFailure(f"torch {torch.__version__} has no torch.cuda._sleep: EmulatedComm cannot lengthen "
                             "its collectives (use sleep_cycles=0)")
    sleep(cycles)


_CYCLES_PER_US: dict[str, float] = {}


def sleep_cycles_per_us(device: torch.device | str) -> float:
    """``torch.cuda._sleep`` spins for SM clock cycles: how many make a microsecond on ``device``,
    timed once with CUDA events around a long sleep (the clock the GPU runs at, not its datasheet
    boost). Synchronises the device: call it before a step, never inside one."""
    key = str(torch.device(device))
    if key not in _CYCLES_PER_US:
        with torch.cuda.device(torch.device(device)):
            _cuda_sleep(1000)                                   # first launch: module load, not timed
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _cuda_sleep(_PROBE_CYCLES)
            end.record()
            end.synchronize()
            _CYCLES_PER_US[key] = _PROBE_CYCLES / (start.elapsed_time(end) * 1e3)
    return _CYCLES_PER_US[key]


class EmulatedCost(CostModel):
    """The cost model of an emulated run: compute priced as the hardware profile prices it, every
    collective at the emulated duration ``comm_us`` (its sleep; the copy after it, a few
    microseconds of memory traffic at these sizes, is not priced). An emulated collective holds no
    SMs worth pricing (one spinning thread, then a copy: the only budget is 0, so compute beside it
    is not slowed) and a sleep does not stretch beside compute."""

    def __init__(self, hw: Any, comm_us: float):
        if not comm_us >= 0:
            raise ValueError(f"comm_us={comm_us!r} must be >= 0")
        super().__init__(hw)
        self.comm_us = comm_us

    def node_time_us(self, node: Node, sm_budget: int | None = None) -> float:
        if not node.is_comm:
            return super().node_time_us(node, sm_budget)
        if sm_budget not in (None, 0):
            raise ValueError(f"sm_budget={sm_budget} is not allowed for emulated collective {node.name!r}; allowed: 0")
        return self.comm_us

    def comm_sm_budgets(self, node: Node) -> tuple[int, ...]:
        if not node.is_comm:
            raise ValueError(f"node {node.name!r} ({node.op.value}) is not a collective; SM budgets apply to collectives only")
        return (0,)

    def comm_overlap_stretch(self) -> float:
        return 1.0


# -- the rank graph the emulated runs use ------------------------------------------------------------

@dataclass(frozen=True)
class RankGraphSizes:
    """The eager layer and step of an emulated rank graph."""

    b: int
    s: int          # full sequence; this rank's input shard is [b, s/n, h]
    h: int
    heads: int
    kv_heads: int
    f: int          # expert ffn width
    experts: int
    k: int          # top-k
    chunks: int     # the chunk pass's factor: independent pieces compute can overlap
    n: int = 2


# Device-bound on an H100/H200 in fp32 (TF32 off, as the GPU tests run): ~0.3 TFLOP of kernels per
# step (the grouped GEMMs' masked formulation, moegraph.grouped_gemm, computes all 8 experts' rows),
# some 100 ms, against 181 nodes of host issue time (tens of ms even at the first session's
# 360 us per node); chunked in 4 so that compute can hide the collectives
GPU_SIZES = RankGraphSizes(b=4, s=4096, h=1024, heads=16, kv_heads=8, f=2048, experts=8, k=2, chunks=4)
TINY_SIZES = RankGraphSizes(b=2, s=16, h=64, heads=4, kv_heads=2, f=128, experts=4, k=2, chunks=2)


@dataclass(frozen=True)
class EmulatedStep:
    y: torch.Tensor                       # this rank's output shard [b, s/n, h]
    dx: torch.Tensor | None               # its input-shard gradient
    grads: list[torch.Tensor | None]      # parameter-shard gradients, graph order
    trace: Any                            # runtime.trace.StepTrace of the step (None: not recorded)


class EmulatedRankGraph:
    """Rank 0 of the n-rank graph (attn=sp, ffn=tp, dispatch=ag-rs, chunked, fp32) of one
    MoETransformerLayer, with its parameter shards and one input shard, on ``device``."""

    def __init__(self, sizes: RankGraphSizes, device: torch.device | str, *, hardware: str = "h100", seed: int = 0,
                 comm_us: float = DEFAULT_COMM_US):
        """``comm_us``: every emulated collective's duration on CUDA, the plans' cost model told so."""
        from moegraph.interpreter import shard_param
        from moegraph.ir import Strategy
        from moegraph.models import MoETransformerLayer
        from moegraph.registry import load_hardware
        from moegraph.tracer import trace_module
        z = sizes
        self.sizes, self.device = z, torch.device(device)
        torch.manual_seed(seed)
        layer = MoETransformerLayer(hidden=z.h, heads=z.heads, kv_heads=z.kv_heads, ffn_hidden=z.f,
                                    experts=z.experts, top_k=z.k).to(self.device)
        self.comm_us = comm_us
        self.cost = EmulatedCost(load_hardware(hardware), comm_us)
        # lowered for the chunk count directly (what chunk=N re-lowers to): a typed value, no pipeline
        self.graph = trace_module(layer, Strategy("sp", "tp", "ag-rs", z.n, dtype="fp32", chunks=z.chunks),
                                  batch=z.b, seq=z.s)
        full = {k: p.detach() for k, p in layer.named_parameters()}
        self.params = [shard_param(spec, full, 0, z.n) for _, spec in self.graph.params]
        gen = torch.Generator().manual_seed(seed + 1)
        shard = (z.b, z.s // z.n, z.h)                       # [b, s/n, h]
        self.x = torch.randn(shard, generator=gen).to(self.device)
        self.dy = torch.randn(shard, generator=gen).to(self.device)

    def plan(self, schedule: str, *, time_limit_s: float = 10.0) -> Any:
        from moegraph.runtime.module import make_plan
        from moegraph.runtime.plan import ExecutionPlan
        if schedule == "sequential":
            return ExecutionPlan.sequential(self.graph)
        return make_plan(self.graph, self.cost, schedule, time_limit_s=time_limit_s)

    def executor(self, plan: Any, *, synchronous: bool = False) -> Any:
        """An executor of ``plan`` whose collectives each sleep ``comm_us`` (CUDA; the CPU path does
        not sleep)."""
        from moegraph.runtime.executor import Executor
        comm = EmulatedComm(self.sizes.n, synchronous=synchronous, sleep_cycles=self.sleep_cycles())
        return Executor(self.graph, plan, comm, rank=0, n=self.sizes.n, device=self.device)

    def sleep_cycles(self) -> int:
        """``comm_us`` in the device's clock cycles (0 off CUDA)."""
        if self.device.type != "cuda":
            return 0
        return round(self.comm_us * sleep_cycles_per_us(self.device))

    def step(self, executor: Any, *, record: bool = True) -> EmulatedStep:
        """One forward + backward step of ``executor`` (made by ``self.executor``). ``record``:
        time every node (reading the CUDA events synchronises the device once, after the step);
        without it nothing in the step asks the host to wait, and ``trace`` is None."""
        from moegraph.runtime.trace import StepRecorder
        cuda = self.device.type == "cuda"
        stream = torch.cuda.current_stream(self.device) if cuda else None
        rec = StepRecorder(0, cuda) if record else None
        if rec:
            rec.start(stream)
        y, saved = executor.forward(self.x, self.params, recorder=rec)
        if rec:
            rec.mark_backward(stream)
        dx, grads = executor.backward(saved, self.dy, self.params, recorder=rec)
        return EmulatedStep(y, dx, grads, rec.finalize() if rec else None)
