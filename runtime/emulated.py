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
measured on the device, ``sleep_cycles_per_us``), and the plans are made by a cost model told
what the run runs (``EmulatedCost``: that comm time, fp32 compute at the fp32 rate, the masked
grouped GEMM's E-fold FLOPs). Sized so that the device, not the host, sets the pace
(``GPU_SIZES``): the first GPU session's graph (b=2 s=1024 h=512) ran ~1 ms of kernels against
~65 ms of host issue time, so no kernel ever ran beside a collective and the overlap could not be
measured. The second (GPU_SIZES, its plans priced with fp32 at the bf16 peak and the grouped
GEMMs at their native FLOPs: 37 ms predicted, 147 ms measured) hid 0.39 of the comm time: plans
made for a comm-bound step, run on a compute-bound one.

Bitwise comparisons between runs (``exact_numerics``): the memory-efficient SDPA kernel, which
CUDA runs for fp32 attention, computes its backward's query gradient by atomic adds over key
blocks (``num_splits_key`` > 1 unless torch's deterministic mode is on), so its bits depend on
the order the device schedules blocks in, which kernels running beside it on comm streams
change. Two runs of one plan then differ in the last bits of every gradient upstream of attention
(the second GPU session's dx mismatch, with y equal bit for bit), with no race involved.

Notation: b batch, s sequence, h hidden, n group size, k top-k, f expert ffn width.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch

from moegraph.cost import CostModel
from moegraph.ir import Graph, Node, OpKind
from moegraph.runtime import RuntimeFailure
from moegraph.runtime.collectives import Pending

# Each emulated collective's duration on CUDA: about what a step's all-gather or reduce-scatter of
# these sizes costs over a slow inter-node link, and long against the host's issue time per node
# (a few hundred microseconds at most), so the plans' overlap, not the host, decides what hides it.
# GPU_SIZES' 37 collectives then take 18.5 ms against ~140 ms of compute: less than the compute
# they can hide behind, as a comm-bound emulation could hide nothing. Shorter collectives do not
# raise the greedy plan's predicted hidden share much (benchmarks/gpu_overlap.py's predicted column;
# RESULTS.md): what stays exposed is structural (the attention all-to-alls before and after
# attention, which only a chunk's small projection can hide, and the last gradients' all-reduces).
DEFAULT_COMM_US = 500.0
# FP32 (TF32 off) FMA throughput of an H100 or H200 SXM: 132 SMs x 128 FP32 lanes x 2 FLOP x
# 1.98 GHz = 66.9 TFLOP/s (NVIDIA's datasheets: 67 TFLOPS FP32 for both; the second GPU session's
# sleep probe measured its H200's SM clock at 1.95 GHz). Hardware profiles carry the bf16 rate only.
HOPPER_FP32_FLOPS_S = 66.9e12
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
        if node.op is OpKind.ALL_GATHER and 1 < len(tensors) == len(shapes):   # a router's weights and ids:
            outs = [_fill(t.reshape(-1), shape) for t, shape in zip(tensors, shapes)]   # each from its operand
        else:
            dtype = tensors[0].dtype               # a collective's outputs have its operand's dtype
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
    """The cost model of an emulated run, priced for what it runs.

    Collectives: every one at the emulated duration ``comm_us`` (its sleep; the copy after it, a
    few microseconds of memory traffic at these sizes, is not priced). An emulated collective
    holds no SMs worth pricing (one spinning thread, then a copy: the only budget is 0, so compute
    beside it is not slowed) and a sleep does not stretch beside compute.
    Compute: as the hardware profile prices it, except
      ``fp32_flops_s``   the rate of FLOP-bound terms (the profile's own efficiency curves still
                         apply) instead of the profile's bf16 peak: the emulated graph is fp32, run
                         with TF32 off (None: the profile's rate); and no GEMM tile factors, which
                         are cuBLAS's bf16 tensor-core tiles (fp32 without TF32 runs other kernels);
      ``masked_groups``  node name -> E for the grouped GEMMs the device runs in the masked
                         formulation (moegraph.grouped_gemm: every one of the E experts' products
                         for every row), priced at E times their FLOPs.
    """

    def __init__(self, hw: Any, comm_us: float, *, fp32_flops_s: float | None = None,
                 masked_groups: Mapping[str, int] | None = None):
        if not comm_us >= 0:
            raise ValueError(f"comm_us={comm_us!r} must be >= 0")
        if fp32_flops_s is not None and not fp32_flops_s > 0:
            raise ValueError(f"fp32_flops_s={fp32_flops_s!r} must be > 0")
        super().__init__(hw if fp32_flops_s is None
                         else dataclasses.replace(hw.without_gemm_shapes(), peak_flops_bf16=fp32_flops_s))
        self.comm_us = comm_us
        self.masked_groups = dict(masked_groups or {})
        self._as_run: dict[str, tuple[Node, Node]] = {}

    def node_time_us(self, node: Node, sm_budget: int | None = None) -> float:
        if not node.is_comm:
            return super().node_time_us(self._run_node(node), sm_budget)
        if sm_budget not in (None, 0):
            raise ValueError(f"sm_budget={sm_budget} is not allowed for emulated collective {node.name!r}; allowed: 0")
        return self.comm_us

    def _run_node(self, node: Node) -> Node:
        """``node`` with the FLOPs the device runs (masked grouped GEMMs: E times), built once."""
        groups = self.masked_groups.get(node.name)
        if groups is None:
            return node
        hit = self._as_run.get(node.name)
        if hit is None or hit[0] is not node:
            hit = self._as_run[node.name] = (node, dataclasses.replace(node, flops=node.flops * groups))
        return hit[1]

    def comm_sm_budgets(self, node: Node) -> tuple[int, ...]:
        if not node.is_comm:
            raise ValueError(f"node {node.name!r} ({node.op.value}) is not a collective; SM budgets apply to collectives only")
        return (0,)

    def comm_overlap_stretch(self) -> float:
        return 1.0


def masked_grouped_gemms(graph: Graph) -> dict[str, int]:
    """Grouped GEMM node -> E, its expert count: the first dimension of the [E, N, K] weight it reads
    or the weight gradient it makes."""
    out = {}
    for nd in graph.nodes:
        if nd.op is OpKind.GROUPED_GEMM:
            weights = [graph.value[v].shape for v in (*nd.inputs, *nd.outputs) if len(graph.value[v].shape) == 3]
            if not weights:
                raise RuntimeFailure(f"grouped GEMM {nd.name!r} reads and makes no [E, N, K] weight")
            out[nd.name] = weights[0][0]
    return out


@contextlib.contextmanager
def exact_numerics() -> Iterator[None]:
    """Attention by SDPA's math backend (matmuls and a softmax: the same bits on every run) while
    inside, so that two runs can be compared bit for bit (module docstring: the memory-efficient
    kernel's backward is not deterministic). Costs time and an [b, heads, s, s] score tensor:
    for numerics checks, not for timed steps."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):
        yield


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


# Device-bound on an H100/H200 in fp32 (TF32 off, as the GPU tests run): ~5.5 TFLOP of kernels per
# step, 4.9 of them the 36 grouped GEMMs' masked formulation (moegraph.grouped_gemm: all 8 experts'
# products for every row), ~123 ms on the second session's H200 (sequential step 160 ms less its 37
# fenced 1 ms collectives), against 181 nodes of host issue time (~50 ms at its 280 us per node);
# chunked in 4 so that compute can hide the collectives
GPU_SIZES = RankGraphSizes(b=4, s=4096, h=1024, heads=16, kv_heads=8, f=2048, experts=8, k=2, chunks=4)
TINY_SIZES = RankGraphSizes(b=2, s=16, h=64, heads=4, kv_heads=2, f=128, experts=4, k=2, chunks=2)
# The plans' hardware profile: the H200 calibrated by the second GPU session (bf16 curves and kernel
# latency as measured; EmulatedCost swaps in the fp32 rate). An H100 differs in HBM bandwidth,
# which this compute-bound fp32 step barely reads.
MEASURED_PROFILE = "nvidia-h200-2026-11-27"


@dataclass(frozen=True)
class EmulatedStep:
    y: torch.Tensor                       # this rank's output shard [b, s/n, h]
    dx: torch.Tensor | None               # its input-shard gradient
    grads: list[torch.Tensor | None]      # parameter-shard gradients, graph order
    trace: Any                            # runtime.trace.StepTrace of the step (None: not recorded)


class EmulatedRankGraph:
    """Rank 0 of the n-rank graph (attn=sp, ffn=tp, dispatch=ag-rs, chunked, fp32) of one
    MoETransformerLayer, with its parameter shards and one input shard, on ``device``."""

    def __init__(self, sizes: RankGraphSizes, device: torch.device | str, *, hardware: str = MEASURED_PROFILE,
                 seed: int = 0, comm_us: float = DEFAULT_COMM_US, masked: bool | None = None):
        """``comm_us``: every emulated collective's duration on CUDA, the plans' cost model told so.
        ``masked``: whether the plans price the grouped GEMMs as the masked formulation (None: as
        ``device`` runs them: on CUDA where torch's grouped GEMM would read the host, as for fp32)."""
        from moegraph.grouped_gemm import native_grouped_mm
        from moegraph.config import CompileConfig
        from moegraph.interpreter import shard_param
        from moegraph.ir import Strategy
        from moegraph.models import MoETransformerLayer
        from moegraph.registry import load_hardware
        from moegraph.schedules.driver import lower
        z = sizes
        self.sizes, self.device = z, torch.device(device)
        torch.manual_seed(seed)
        layer = MoETransformerLayer(hidden=z.h, heads=z.heads, kv_heads=z.kv_heads, ffn_hidden=z.f,
                                    experts=z.experts, top_k=z.k).to(self.device)
        self.comm_us = comm_us
        # lowered for the chunk count directly (what chunk=N re-lowers to): a typed value, no pipeline
        self.lowered = lower(CompileConfig(model=layer, strategy=Strategy("sp", "tp", "ag-rs", z.n, dtype="fp32",
                                                                          chunks=z.chunks),
                                           passes=(), batch=z.b, seq=z.s, hardware=hardware))
        self.graph = self.lowered.graph
        if masked is None:
            masked = self.device.type == "cuda" and not native_grouped_mm(self.device, torch.float32)
        self.masked = masked
        self.cost = EmulatedCost(load_hardware(hardware), comm_us, fp32_flops_s=HOPPER_FP32_FLOPS_S,
                                 masked_groups=masked_grouped_gemms(self.graph) if masked else None)
        full = {k: p.detach() for k, p in layer.named_parameters()}
        self.params = [shard_param(spec, full, 0, z.n) for _, spec in self.graph.params]
        gen = torch.Generator().manual_seed(seed + 1)
        shard = (z.b, z.s // z.n, z.h)                       # [b, s/n, h]
        self.x = torch.randn(shard, generator=gen).to(self.device)
        self.dy = torch.randn(shard, generator=gen).to(self.device)

    def plan(self, schedule: str, *, time_limit_s: float = 10.0, launch_order: str = "free") -> Any:
        """``launch_order``: 'free' (a hardware queue per stream) or 'program' (one queue, as under
        CUDA_DEVICE_MAX_CONNECTIONS=1: the plan is scheduled for it, and issues in its order)."""
        from moegraph.runtime.module import make_plan
        from moegraph.runtime.plan import ExecutionPlan
        if schedule == "sequential":
            return ExecutionPlan.sequential(self.graph)
        # scheduled with the emulation's cost model (EmulatedCost: every collective lasts comm_us),
        # which the driver's profile-priced build cannot take: the graph-level planner
        return make_plan(self.graph, self.cost, schedule, time_limit_s=time_limit_s, launch_order=launch_order)

    def predicted_hidden_fraction(self, plan: Any) -> float | None:
        """The share of comm time the plan's own schedule overlaps with compute, measured on its
        predicted times as ``hidden_comm_fraction`` measures a step (None: a plan without times)."""
        from moegraph.runtime.trace import NodeTiming, StepTrace, hidden_comm_fraction
        if any(e.start_us is None or e.end_us is None for e in plan.entries):
            return None
        nodes = tuple(NodeTiming(e.name, e.stream, e.sm_budget, self.graph.node[e.name].phase.value, e.start_us,
                                 e.end_us) for e in plan.entries)
        return hidden_comm_fraction(StepTrace(0, "predicted", nodes))

    def predicted_serial_us(self) -> float:
        """Every node priced alone, one after another: what the sequential plan (every collective
        alone, fenced) is predicted to take; a held-out check of the plans' cost model."""
        return sum(self.cost.node_time_us(nd) for nd in self.graph.nodes)

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
