"""Emulated collectives: an n-rank graph on ONE device, its collectives replaced by copies.

``EmulatedComm`` stands in for the other ranks of a rank graph (the graph one rank of n runs):
every collective becomes a copy of the same size as its outputs, made from its inputs on the
stream it is issued on (the executor enters the plan's comm stream before ``issue``), lengthened
on CUDA by ``torch.cuda._sleep(sleep_cycles)`` so that it lasts about as long as a collective.
Outputs are a fixed function of the inputs: a consumer that does not wait for the comm stream
reads a buffer not yet written, and two plans of one graph give identical numbers. It exercises
what no single-GPU run otherwise would: comm streams, event waits, fences, the measured
overlap. It does not compute the collective's values (the numbers are not the layer's), and it
refuses collectives whose output sizes depend on the data (token all-to-alls).

Device-agnostic: on CPU the executor's CPU path runs it (no streams; the copy is made when
issued, the work is complete at once), which is how the CPU suite checks the same code.

``EmulatedRankGraph`` builds the rank graph the GPU test and ``benchmarks/gpu_overlap.py`` run:
attn=sp, ffn=tp, dispatch=ag-rs, n=2, chunked so that compute can hide the collectives.

Notation: b batch, s sequence, h hidden, n group size, k top-k, f expert ffn width.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from moegraph.ir import Node, OpKind
from moegraph.runtime import RuntimeFailure
from moegraph.runtime.collectives import Pending

DEFAULT_SLEEP_CYCLES = 20_000       # ~10-15 us of spinning per emulated collective on an H100/H800


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

    def __init__(self, n: int, *, synchronous: bool = False, sleep_cycles: int = DEFAULT_SLEEP_CYCLES):
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


# chunked: the h100 cost model predicts 75% of comm time overlapped by the greedy plan of this graph
GPU_SIZES = RankGraphSizes(b=2, s=1024, h=512, heads=8, kv_heads=4, f=1024, experts=8, k=2, chunks=4)
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

    def __init__(self, sizes: RankGraphSizes, device: torch.device | str, *, hardware: str = "h100", seed: int = 0):
        from moegraph.cost import CostModel
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
        self.cost = CostModel(load_hardware(hardware))
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

    def executor(self, plan: Any, *, synchronous: bool = False, sleep_cycles: int = DEFAULT_SLEEP_CYCLES) -> Any:
        from moegraph.runtime.executor import Executor
        comm = EmulatedComm(self.sizes.n, synchronous=synchronous, sleep_cycles=sleep_cycles)
        return Executor(self.graph, plan, comm, rank=0, n=self.sizes.n, device=self.device)

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
