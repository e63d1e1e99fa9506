"""The compiled layer: an nn.Module holding this rank's parameter shards that runs a plan.

Input and output are this rank's *sequence shard* [b, s/n, h] (rank r holds positions
r*s/n .. (r+1)*s/n - 1), as the graph's blocks exchange them; ``shard_input`` and
``unshard_output`` convert from and to the full [b, s, h]. Parameters are cut from the source
module's full parameters by each graph parameter's ParamSpec (``interpreter.shard_param``):
sharded ones hold 1/n, replicated ones (norms, router, SP attention) a full copy, identical on
every rank because their gradients are all-reduced by the graph. ``full_grads`` reassembles
module-shaped gradients (a collective).

Data parallelism (strategy.dp = D > 1): n x D ranks, replica-major (``layout.Layout``:
global rank p*n + r is rank r of replica p). The *global* input is [D*b, s, h]: replica p takes
batch rows p*b .. (p+1)*b - 1, then its rank's sequence shard (``shard_input``); ``unshard_output``
gathers all n x D shards back. The graph's DP sync (reduce="mean" across replicas) leaves every
replica the MEAN over replicas of its parameter gradients: the gradient of the mean of the
replicas' losses, which equals the eager module's gradient on the concatenated data with the
seed gradient divided by D. Input (activation) gradients stay each replica's own, unscaled.

Micro-batches (gradient accumulation): a layer built on a merged step graph of M micro-batches
(``moegraph.passes.microbatch.merge_microbatches``) runs a whole optimizer step's forwards and backwards
with ``train_step(xs, dys)``, in the schedule's interleaved order; ``forward`` refuses it.

``compile_module`` is the pipeline: trace -> passes -> schedule -> plan -> check that every
rank holds the same plan -> process groups -> CompiledLayer. ``moegraph.compile`` calls it.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import warnings
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from moegraph.config import CompileConfig
from moegraph.cost import CostModel
from moegraph.interpreter import axis_of, shard_param, unshard_grad, writes_region
from moegraph.ir import ExpertRows, Graph, Strategy, check_expert_rows
from moegraph.expert_rows import expert_rows_refusal
from moegraph.lowering import LoweringError, train_only_settings
from moegraph.runtime import CudaGraphs, PlanError, RuntimeFailure
from moegraph.runtime.autograd import ScheduledLayerFunction
from moegraph.runtime.collectives import Comm, NoComm, check_same_plan, metadata_group
from moegraph.runtime.layout import Layout
from moegraph.runtime.cudagraph import GraphBackend, GraphedExecutor, capture_refusal, check_device, check_mode
from moegraph.runtime.executor import Executor
from moegraph.runtime.options import RuntimeOptions
from moegraph.runtime.native_budgets import runnable_config, world_backend
from moegraph.runtime.plan import COMM, FUSED_AS_MEMBERS, ExecutionPlan, check_plan, fused_group_count
from moegraph.runtime.trace import StepRecorder, StepTrace
from moegraph.token_layout import shard_tokens, unshard_tokens

if TYPE_CHECKING:
    from moegraph.config import LaunchOrder
    from moegraph.schedules.driver import Lowered
    from moegraph.schedules.schedule_file import Schedule

DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
MAX_TRACES = 1000
MAX_UNREAD_STEPS = 16     # GPU steps whose events are kept unread; older ones are read or dropped


def refuse_autocast(device_type: str, what: str) -> None:
    """Refuse a call under ``torch.autocast``: the compiled kernels run in the dtype the graph was
    compiled for (its costs, buffers and saved values), which autocast would change op by op, and
    the backward runs outside the autocast region (a dtype clash) - never a silent mix."""
    # a device type with no autocast (meta, a test's fake device) cannot be under it
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        raise RuntimeFailure(f"{what} was called under torch.autocast({device_type!r}, "
                             f"dtype={torch.get_autocast_dtype(device_type)}): a compiled module runs in the dtype "
                             "it was compiled for; compile a bf16 module instead (model.to(torch.bfloat16), or a "
                             "bf16 example input for a layer) and call it without autocast")


def refuse_cast(module: nn.Module, fn) -> None:
    """Raise if ``fn`` (what ``.half()``, ``.to(dtype)``, ``.double()`` apply) changes the dtype of
    ``module``'s parameters: its plan was compiled, priced and checked for theirs."""
    p = next(module.parameters(), None)
    if p is not None:
        cast = fn(torch.empty(0, dtype=p.dtype, device=p.device)).dtype
        if cast != p.dtype:
            raise ValueError(f"{type(module).__name__} was compiled for {p.dtype}; casting it to {cast} is not "
                             f"supported: cast the module before compiling it (moegraph compiles "
                             f"{' or '.join(map(str, DTYPES))})")


class CompiledLayer(nn.Module):
    """One MoE layer on this rank: parameter shards + an Executor for ``plan``.

    ``traces`` holds the measured timing of the last steps (forward+backward), at most
    ``MAX_TRACES``. GPU steps are CUDA events, read without synchronising: at most
    ``MAX_UNREAD_STEPS`` stay unread; beyond that the oldest is read if its events have completed
    (a non-blocking query) and dropped otherwise (counted in ``dropped_traces``). ``traces``
    synchronises once to read what is left.
    """

    def _apply(self, fn, recurse: bool = True):
        refuse_cast(self, fn)
        return super()._apply(fn, recurse)

    def __init__(self, graph: Graph, plan: ExecutionPlan, full_params: Mapping[str, torch.Tensor], *,
                 rank: int, n: int, comm: Comm | NoComm, timeout_s: float = 300.0, record: bool = True,
                 layout: Layout | None = None, cuda_graphs: CudaGraphs = "off", graph_backend: GraphBackend | None = None,
                 expert_rows: ExpertRows = "exact", frozen: frozenset[str] = frozenset()):
        """``rank``: this rank's index in its n-rank group; ``layout``: its place among n x dp
        ranks (default: dp=1, the group is the world). ``cuda_graphs``: 'attention' | 'layer'
        replays captured segments (``runtime.cudagraph``; no per-node traces then, ``record`` is
        off); ``graph_backend``: its capture backend (default: real CUDA graphs).
        ``expert_rows``: 'exact' | 'padded', the local index maps' rows (``moegraph.kernels.build_index_map``;
        'padded' only where the graph has one: ValueError otherwise). ``frozen``: source parameter
        names (ParamSource qualnames) with requires_grad=False: their shards keep it, so no
        gradient reaches their ``.grad`` (``frozen_sources``)."""
        super().__init__()
        self.graph, self.plan, self.rank, self.n = graph, plan, rank, n
        self.layout = layout if layout is not None else Layout(n, 1, rank, node_ranks=node_ranks(graph.strategy),
                                                               attn_ranks=attn_ranks(graph.strategy))
        if (self.layout.n, self.layout.mp_rank) != (n, rank):
            raise RuntimeFailure(f"rank {rank} of n={n} disagrees with the layout {self.layout}")
        self.cuda_graphs = check_mode(cuda_graphs)
        self.expert_rows = check_expert_rows(expert_rows)
        if why := expert_rows_refusal(graph, self.expert_rows):
            raise ValueError(why)
        # per-node timing events cannot be recorded inside a CUDA graph: a graphed layer keeps no traces
        self.timeout_s, self.record = timeout_s, record and self.cuda_graphs == "off"
        self._attr: dict[str, str] = {}
        self.full_shapes = {src.qualname: tuple(full_params[src.qualname].shape)
                            for _, spec in graph.params for src in spec.sources}
        device = None
        for pname, spec in graph.params:
            shard = shard_param(spec, full_params, rank, n).detach().clone().contiguous()
            device = shard.device
            attr = _attr_name(pname, self._attr.values())
            if spec.buffer:          # read by the graph, never trained (DeepSeek-V3's router score bias)
                self.register_buffer(attr, shard)
            else:
                self.register_parameter(attr, nn.Parameter(shard, requires_grad=_trainable(pname, spec, frozen)))
            self._attr[pname] = attr
        device = device or torch.device("cpu")
        if self.cuda_graphs == "off":
            self.executor = Executor(graph, plan, comm, rank=rank, n=n, device=device, timeout_s=timeout_s,
                                     expert_rows=self.expert_rows)
        else:
            self.executor = GraphedExecutor(graph, plan, comm, rank=rank, n=n, device=device, timeout_s=timeout_s,
                                            mode=self.cuda_graphs, backend=graph_backend, expert_rows=self.expert_rows)
        self._recorders: collections.deque[StepRecorder] = collections.deque()
        self.dropped_traces = 0
        self._traces: collections.deque[StepTrace] = collections.deque(maxlen=MAX_TRACES)
        # the source's training-only settings (moegraph.lowering.train_only_settings): compiled in
        # eval mode, the graph never applies them, so .train() refuses
        self.train_only: tuple[str, ...] = ()

    def train(self, mode: bool = True) -> "CompiledLayer":
        if mode and self.train_only:
            raise LoweringError(f"{', '.join(self.train_only)}: the source applies this only in training mode, "
                                "which the compiled module does not model (it was compiled in eval mode); set it to 0 "
                                "and compile again to train")
        return super().train(mode)

    # -- parameters ------------------------------------------------------------------------------

    def shard(self, graph_param: str) -> nn.Parameter:
        """This rank's shard of a graph parameter (e.g. 'qkv.weight', 'w1')."""
        return getattr(self, self._attr[graph_param])

    def named_shards(self) -> list[tuple[str, nn.Parameter]]:
        return [(p, self.shard(p)) for p, _ in self.graph.params]

    @torch.no_grad()
    def load_full(self, full_params: Mapping[str, torch.Tensor]) -> None:
        """Copy this rank's shards out of full module parameters (e.g. a new state_dict)."""
        for pname, spec in self.graph.params:
            self.shard(pname).copy_(shard_param(spec, full_params, self.rank, self.n))

    @torch.no_grad()
    def full_grads(self, group: Any = None) -> dict[str, torch.Tensor]:
        """Module-shaped gradients (qualname -> tensor) on every rank; collective over ``group``
        (default: this rank's replica, the n ranks that hold the shards; every replica holds the
        same DP-synchronised gradients). Missing grads count as zero."""
        return self._gather(lambda p: p.grad, group)

    @torch.no_grad()
    def full_params(self, group: Any = None) -> dict[str, torch.Tensor]:
        """Module-shaped parameters (qualname -> tensor) gathered from the shards, on every rank
        (e.g. after optimizer steps); collective over ``group`` as ``full_grads``."""
        return self._gather(lambda p: p, group)

    def _gather(self, pick, group: Any) -> dict[str, torch.Tensor]:
        """Each rank writes its shard's region of ``pick(shard)``, replicated parameters only from
        rank 0 (they are identical everywhere), then one all_reduce per tensor sums the regions."""
        group = group if group is not None else self.executor.comm.mp_group
        out: dict[str, torch.Tensor] = {}
        for pname, spec in self.graph.params:
            if spec.buffer:
                continue
            p = self.shard(pname)
            for src in spec.sources:
                if src.qualname not in out:
                    out[src.qualname] = p.new_zeros(self.full_shapes[src.qualname])
        for pname, spec in self.graph.params:
            if not writes_region(spec, self.rank, self.n) or spec.buffer:
                continue
            t = pick(self.shard(pname))
            if t is not None:
                unshard_grad(spec, t.detach(), self.rank, self.n, out)
        if self.n > 1:
            for t in out.values():
                dist.all_reduce(t, group=group)
        return out

    # -- running ---------------------------------------------------------------------------------

    def params(self) -> tuple[nn.Parameter, ...]:
        return tuple(self.shard(p) for p, _ in self.graph.params)

    @property
    def micro_batches(self) -> int:
        """M of the step graph this layer runs (1: an ordinary layer, run by ``forward``)."""
        return self.executor.micro_batches

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: this rank's sequence shard [b, s/n, h] -> the layer output's shard [b, s/n, h]."""
        if self.micro_batches > 1:
            raise RuntimeFailure(f"layer {self.graph.name!r} runs a step of {self.micro_batches} micro-batches whose "
                                 "forwards and backwards interleave: call train_step(xs, dys) with one input and "
                                 "one seed gradient per micro-batch, not forward")
        params = self.params()
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
            self._check_input(x, params)
            return ScheduledLayerFunction.apply(self, x, *params)
        return self.forward_only(x)[0]

    def forward_only(self, x: torch.Tensor, keep: Sequence[str] = ()) -> tuple[torch.Tensor, dict[str, Any]]:
        """The forward alone (no backward will follow: nothing saved for it), recorded as a step;
        returns the output shard and the forward values named in ``keep`` (e.g. the aux stats)."""
        params = self.params()
        self._check_input(x, params)
        rec = self._new_recorder()
        y, kept = self.executor.forward(x, params, keep_saved=False, recorder=rec, also_keep=frozenset(keep))
        self._keep(rec)
        return y, kept

    def _check_input(self, x: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
        """The call's activation against what the layer was compiled for: a tensor of the compiled
        dtype (fp32 or bf16: other dtypes would be cast silently or fail inside a kernel) on the
        shards' device, outside torch.autocast."""
        what = f"compiled layer {self.graph.name!r}"
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what} takes a tensor [b, s/n, h], got {type(x).__name__}")
        refuse_autocast(x.device.type, what)
        want = self.graph.value[self.executor.input_name].dtype
        if DTYPES.get(x.dtype) != want:
            dtype = next(k for k, v in DTYPES.items() if v == want)
            raise TypeError(f"{what} was compiled for {want} activations and got {x.dtype}: pass a {dtype} "
                            f"tensor (x.to({dtype}))")
        dev = params[0].device if params else x.device
        if x.device != dev:
            raise ValueError(f"{what} holds its parameters on {dev} and got an input on {x.device}: "
                             f"move the input there (x.to({str(dev)!r}))")

    @torch.no_grad()
    def train_step(self, xs: Sequence[torch.Tensor], dys: Sequence[torch.Tensor]
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """One optimizer step's forwards and backwards of a micro-batch layer (``micro_batches`` M
        >= 2) in the schedule's order: ``xs[j]``, ``dys[j]`` are micro-batch j's input shard and
        the gradient of its output shard, each [b, s/n, h]. Adds the parameter gradients, summed
        over the M micro-batches (as M separate forward/backward passes accumulate them), into
        the shards' ``.grad``; returns (output shards, input-gradient shards), one per
        micro-batch. Outside autograd: nothing upstream of ``xs`` receives a gradient."""
        if self.micro_batches == 1:
            raise RuntimeFailure(f"layer {self.graph.name!r} runs one micro-batch: call it (forward) and backward; "
                                 "train_step runs a step graph of M >= 2 micro-batches (--micro-batches, "
                                 "moegraph.passes.microbatch.merge_microbatches)")
        params = self.params()
        rec = self._new_recorder()
        ys, dxs, grads = self.executor.step([x.detach() for x in xs], [dy.detach() for dy in dys],
                                            [p.detach() for p in params], recorder=rec)
        self._keep(rec)
        accumulate_grads(params, grads)
        return ys, dxs

    def run_forward(self, x: torch.Tensor, params: Sequence[torch.Tensor]):
        rec = self._new_recorder()
        y, saved = self.executor.forward(x, params, recorder=rec)
        return y, (saved, rec)

    def run_backward(self, state, dy: torch.Tensor, params: Sequence[torch.Tensor]):
        saved, rec = state
        if rec is not None:
            rec.mark_backward(torch.cuda.current_stream(dy.device) if dy.is_cuda else None)
        dx, grads = self.executor.backward(saved, dy, params, recorder=rec)
        self._keep(rec)
        return dx, grads

    def _new_recorder(self) -> StepRecorder | None:
        if not self.record:
            return None
        rec = StepRecorder(self.layout.rank, self.executor.cuda)     # global rank: one trace process per rank
        rec.start(torch.cuda.current_stream(self.executor.device) if self.executor.cuda else None)
        return rec

    def _keep(self, rec: StepRecorder | None) -> None:
        """Store a finished step's recording. CPU rows reference the step's collectives (and so
        their output buffers): finalise them now, or every kept step would pin its MiBs of
        activations. GPU rows are CUDA events, read lazily so recording never syncs the device."""
        if rec is None:
            return
        if rec.cuda:
            self._recorders.append(rec)
            while len(self._recorders) > MAX_UNREAD_STEPS:
                old = self._recorders.popleft()
                if old.complete():
                    self._traces.append(old.finalize(sync=False))
                else:
                    self.dropped_traces += 1
        else:
            self._traces.append(rec.finalize())

    @property
    def traces(self) -> list[StepTrace]:
        """Measured steps, oldest first (GPU: synchronises once to read pending events)."""
        first = True
        while self._recorders:                   # one device sync covers every unread step
            self._traces.append(self._recorders.popleft().finalize(sync=first))
            first = False
        return list(self._traces)

    def clear_traces(self) -> None:
        self._recorders.clear()
        self._traces.clear()

    # -- sharding helpers --------------------------------------------------------------------------

    def shard_input(self, x: torch.Tensor) -> torch.Tensor:
        """The global input [dp*b, s, h] -> this rank's [b, s/n, h] (its replica's rows, its
        sequence shard)."""
        if self.layout.dp > 1:
            if x.shape[0] % self.layout.dp:
                raise ValueError(f"batch {x.shape[0]} is not divisible by dp={self.layout.dp} replicas")
            x = x.chunk(self.layout.dp, dim=0)[self.layout.replica]
        return shard_input(x, self.graph.strategy, self.rank)

    def unshard_output(self, y: torch.Tensor, group: Any = None) -> torch.Tensor:
        """Every rank's [b, s/n, h] -> the global [dp*b, s, h] on every rank (collective over all
        n x dp ranks; ``group``: the n ranks' group when dp=1)."""
        if self.layout.dp == 1:
            return unshard_output(y, self.graph.strategy, group)
        parts = [torch.empty_like(y) for _ in range(self.layout.world)]
        dist.all_gather(parts, y.contiguous())                       # global rank order: replica-major
        n, st = self.n, self.graph.strategy
        return torch.cat([unshard_tokens(parts[p * n:(p + 1) * n], st) for p in range(self.layout.dp)], dim=0)

    def extra_repr(self) -> str:
        st = self.graph.strategy
        return (f"graph={self.graph.name}, attn={st.attn}, ffn={st.ffn}, dispatch={st.dispatch}, rank={self.rank}, "
                f"n={self.n}, dp={self.layout.dp}, replica={self.layout.replica}, "
                f"plan={self.plan.method} ({self.plan.hash[:12]})"
                + (f", cuda_graphs={self.cuda_graphs}" if self.cuda_graphs != "off" else "")
                + (f", expert_rows={self.expert_rows}" if self.expert_rows != "exact" else ""))


def _trainable(pname: str, spec: Any, frozen: frozenset[str]) -> bool:
    """Whether graph parameter ``pname`` trains: not if all its sources are frozen; a parameter
    fused from frozen and trainable sources (q/k/v into one qkv) cannot keep both: refused."""
    sources = [src.qualname for src in spec.sources]
    cold = [q for q in sources if q in frozen]
    if cold and len(cold) != len(sources):
        raise ValueError(f"graph parameter {pname!r} is fused from {', '.join(sources)}, but only "
                         f"{', '.join(cold)} has requires_grad=False: freeze all of them or none")
    return not cold


def frozen_sources(named_params: Any) -> frozenset[str]:
    """The names of the parameters with requires_grad=False in ``named_params`` ((name, param) pairs)."""
    return frozenset(k for k, p in named_params if not p.requires_grad)


def accumulate_grads(params: Sequence[torch.Tensor | None], grads: Sequence[torch.Tensor | None]) -> None:
    """Add each gradient into its parameter's ``.grad`` as autograd's backward would (a copy the
    first time: the executor's tensor may alias another step value), in the parameter's dtype
    (autograd's engine casts so too: with dp > 1 the plan's gradients are the fp32 main
    gradients of ``_dp_sync``, a bf16 parameter's ``.grad`` must be bf16); None entries and
    parameters that do not require a gradient are skipped."""
    for p, g in zip(params, grads):
        if p is None or g is None or not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = g.detach().to(p.dtype, copy=True)
        else:
            p.grad.add_(g.to(p.grad.dtype))


def shard_input(x: torch.Tensor, strategy: Strategy, rank: int) -> torch.Tensor:
    """[b, s, ...] -> rank's tokens [b/N, s/G, ...] (contiguous copy; ``moegraph.token_layout``:
    [b, s/n, ...] unless the attention spans a node, Strategy.attn_nodes = N)."""
    return shard_tokens(x, strategy, rank).contiguous()


def unshard_output(y: torch.Tensor, strategy: Strategy, group: Any = None) -> torch.Tensor:
    """All n ranks' tokens [b/N, s/G, h] -> the full [b, s, h] on every rank (collective)."""
    if strategy.n == 1:
        return y
    parts = [torch.empty_like(y) for _ in range(strategy.n)]
    dist.all_gather(parts, y.contiguous(), group=group)
    return unshard_tokens(parts, strategy)


def _attr_name(pname: str, taken) -> str:
    base = re.sub(r"\W", "_", pname)
    name, i = base, 2
    while name in set(taken):
        name, i = f"{base}_{i}", i + 1
    return name


# -- the pipeline --------------------------------------------------------------------------------

def make_plan(graph: Graph, cost: CostModel, schedule: "str | Schedule | ExecutionPlan" = "cpsat", *, memory_budget: int | None = None,
              time_limit_s: float = 10.0, comm_streams: Sequence[str] = (COMM,),
              launch_order: "LaunchOrder" = "free") -> ExecutionPlan:
    """An ExecutionPlan of a lowered graph from a method name (scheduled by
    ``moegraph.schedules.compile_graph``: for tests and benchmarks that build graphs by hand;
    the front doors compile a CompileConfig with the driver), a Schedule, or a plan (checked).
    ``launch_order`` (a method name only): one hardware queue fed in that order
    (moegraph.schedules.launch); the plan's issue order, its predicted start order, follows it."""
    if isinstance(schedule, ExecutionPlan):
        return check_plan(graph, schedule)
    if not isinstance(schedule, str):
        return ExecutionPlan.from_schedule(graph, schedule)
    from moegraph.schedules.api import METHODS, MICROBATCH_METHODS, compile_graph
    if schedule not in METHODS + MICROBATCH_METHODS:
        raise PlanError(f"schedule {schedule!r} is not one of {', '.join(METHODS + MICROBATCH_METHODS)}")
    result = compile_graph(graph, cost, memory_budget_bytes=memory_budget, time_limit_s=time_limit_s,
                           comm_streams=tuple(comm_streams), method=schedule, launch_order=launch_order)
    return ExecutionPlan.from_schedule(graph, result.schedule, method=schedule)


def compiled_plan(config: CompileConfig, given: "Schedule | ExecutionPlan | None" = None, *,
                  lowered: "Lowered | None" = None,
                  source: str = "<the given schedule>") -> "tuple[Lowered, ExecutionPlan]":
    """(the lowered config, its execution plan): the driver's schedule of ``config``
    (``moegraph.schedules.driver.build``), or ``given`` (a Schedule, e.g. a file's, or a plan)
    for the driver's graph of ``config`` (``lower``), checked against it: a Schedule must schedule
    this very graph (``check_same_graph``: the same digest, not merely nodes of the same names;
    ``source`` names it in the error, e.g. the file). ``lowered``: the config's ``lower`` result
    when the caller has it."""
    from moegraph.schedules.driver import build, lower
    if given is None:
        compiled = build(config, lowered=lowered)
        return compiled.lowered, ExecutionPlan.from_schedule(compiled.graph, compiled.schedule, method=config.schedule)
    lowered = lowered or lower(config)
    if isinstance(given, ExecutionPlan):
        return lowered, check_plan(lowered.graph, given)
    from moegraph.runtime.schedule_check import check_same_graph
    check_same_graph(lowered.graph, given, source)
    return lowered, ExecutionPlan.from_schedule(lowered.graph, given)


def rank_and_size(n: int | None, dp: int = 1) -> tuple[int, int]:
    """(global rank, n): n defaults to the world size / dp; the world must be n x dp ranks;
    without torch.distributed only n = dp = 1 runs."""
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        if n is None and world % dp == 0:
            n = world // dp
        if n is None or n * dp != world:
            what = f"n={n}" + (f" x dp={dp}" if dp > 1 else "")
            raise RuntimeFailure(f"{what} but the default process group has {world} ranks; the runtime runs "
                                 "n x dp ranks (launch that many processes)")
        return dist.get_rank(), n
    if n not in (None, 1) or dp != 1:
        what = f"n={n or 1}" + (f" x dp={dp}" if dp > 1 else "")
        raise RuntimeFailure(f"{what} needs torch.distributed initialised with {(n or 1) * dp} ranks "
                             "(torchrun, or moegraph.runtime.launch.spawn)")
    return 0, 1


def replica_batch(rows: int, n: int | None, dp: Any, what: str) -> tuple[int, int, int]:
    """(global rank, n, b) for a global input of ``rows`` batch rows over ``dp`` replicas (b rows
    each; ``rank_and_size``); ``what`` names the input (and its shape) in the errors."""
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp={dp!r} must be a positive integer (data-parallel replicas)")
    rank, n = rank_and_size(n, dp)
    if rows % dp:
        raise ValueError(f"{what} has batch {rows}, not divisible by dp={dp}: with data parallelism it is the "
                         "global batch, b rows per replica")
    return rank, n, rows // dp


def node_ranks(strategy: Strategy) -> int:
    """G, the ranks per node of the node and rail axes (``layout.Layout``); 0 without nodes."""
    return strategy.n // strategy.ep_nodes if strategy.ep_nodes > 1 else 0


def attn_ranks(strategy: Strategy) -> int:
    """G, the ranks per attention of the attn and attn_dp axes (``layout.Layout``); 0 unfolded."""
    return strategy.attn_ranks if strategy.attn_nodes > 1 else 0


def comm_axes(graph: Graph) -> tuple[str, ...]:
    """The group axes the graph's collectives run on (each checked: an unknown axis raises)."""
    return tuple(sorted({axis_of(node) for node in graph.nodes if node.is_comm}))


def build_layer(graph: Graph, plan: ExecutionPlan, full_params: Mapping[str, torch.Tensor], *, rank: int, n: int,
                options: RuntimeOptions = RuntimeOptions(), frozen: frozenset[str] = frozenset(), pp: int = 1,
                comm: tuple[Sequence[tuple[str, int]], Sequence[str]] | None = None) -> CompiledLayer:
    """Check that every rank holds the same plan (before any other collective), create the process
    groups, and shard the parameters. ``rank``: the global rank among pp x n x strategy.dp ranks
    (``pp`` > 1: pipeline blocks, ``layout.Layout``; the plan is checked within the block).
    ``comm``: the (stream, budget) keys and axes to create groups for, when ranks of other
    blocks hold other plans (the union of every block's: ``new_group`` is collective); default
    the plan's. Collective when pp x n x dp > 1. The runtime gets the plan, its graph and
    ``options``: nothing of how they were compiled."""
    timeout_s = options.timeout_s
    check_plan(graph, plan)
    if graph.strategy.n != n:
        raise RuntimeFailure(f"graph {graph.name!r} is lowered for n={graph.strategy.n}, the runtime has {n} ranks")
    layout = Layout(n, graph.strategy.dp, rank, pp, node_ranks(graph.strategy), attn_ranks(graph.strategy))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() != layout.world * pp:
        blocks = f"pp={pp} x " if pp > 1 else ""
        raise RuntimeFailure(f"graph {graph.name!r} runs on {blocks}n={n} x dp={layout.dp} = {layout.world * pp} "
                             f"ranks, the default process group has {dist.get_world_size()}")
    if layout.world == 1:
        comm_ = NoComm()
    else:
        block_meta = metadata_group(layout.blocks())
        check_same_plan(plan.hash, rank=rank, n=layout.world, group=block_meta, timeout_s=timeout_s)
        keys, axes = comm if comm is not None else (plan.comm_keys(graph), comm_axes(graph))
        comm_ = Comm(keys, rank=rank, n=n, dp=layout.dp, axes=axes, timeout_s=timeout_s, emulate=options.emulate,
                     pp=pp, node_ranks=layout.node_ranks, attn_ranks=layout.attn_ranks)
    return CompiledLayer(graph, plan, full_params, rank=layout.mp_rank, n=n, comm=comm_, timeout_s=timeout_s,
                         record=options.record, layout=layout, cuda_graphs=options.cuda_graphs,
                         expert_rows=options.expert_rows, frozen=frozen)


def compile_module(module: nn.Module, example_inputs: Any, config: CompileConfig,
                   options: RuntimeOptions = RuntimeOptions(), *, n: int | None = None,
                   given: "Schedule | ExecutionPlan | None" = None) -> CompiledLayer:
    """See ``moegraph.compile``: one decoder layer. The world and the example input decide what
    ``config`` cannot know in advance: n (``n``, default the world size / dp), the batch b, the
    sequence s and the dtype replace the config's; the driver compiles the result (or lowers it
    for ``given``, a Schedule or ExecutionPlan), and the layer runs its plan with ``options``."""
    x = example_inputs[0] if isinstance(example_inputs, (tuple, list)) else example_inputs
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError("example_inputs must be the layer input [b, s, h] (a tensor, or a tuple starting with it)")
    if x.dtype not in DTYPES:
        raise ValueError(f"input dtype {x.dtype} is not one of {sorted(map(str, DTYPES))}")
    check_device(check_mode(options.cuda_graphs), x.device)              # before tracing and scheduling
    rank, n, b = replica_batch(x.shape[0], n, config.strategy.dp, "example_inputs [dp*b, s, h]")
    config = runnable_config(config.replace(model=module, layers=1, top_k=None, edges="auto", batch=b, seq=x.shape[1],
                                            strategy=dataclasses.replace(config.strategy, n=n, dtype=DTYPES[x.dtype])),
                             world_backend())
    full = {k: p.detach() for k, p in module.named_parameters()}
    odd = sorted({f"{p.device}/{p.dtype}" for p in full.values()} - {f"{x.device}/{x.dtype}"})
    # buffers the graph reads (a router's score bias) keep their own dtype (transformers keeps it fp32)
    full |= {k: t.detach() for k, t in module.named_buffers()}
    if odd:
        raise ValueError(f"module parameters live on {odd} but example_inputs is {x.device}/{x.dtype}: "
                         "move the module and the input to one device and dtype")
    from moegraph.schedules.driver import lower
    lowered = lower(config)
    graph = lowered.graph
    if x.shape[-1] != graph.dims.h:     # the sizes come from the module: an input it cannot take is refused
        raise ValueError(f"example_inputs has hidden size {x.shape[-1]} but {type(module).__name__}'s layer has "
                         f"h={graph.dims.h}: the layer input is [b, s, {graph.dims.h}]")
    # data-dependent nodes refuse 'layer' whatever the order: ask before scheduling
    if why := expert_rows_refusal(graph, options.expert_rows) or capture_refusal(
            graph, ExecutionPlan.sequential(graph), options.cuda_graphs, options.expert_rows):
        raise ValueError(why)
    _, plan = compiled_plan(config, given, lowered=lowered)
    if fused := fused_group_count(graph):
        warnings.warn(f"{fused} {FUSED_AS_MEMBERS}", stacklevel=3)
    layer = build_layer(graph, plan, full, rank=rank, n=n, options=options,
                        frozen=frozen_sources(module.named_parameters()))
    layer.train_only = train_only_settings(module)
    return layer.train(module.training)          # the source's mode: eval stays eval
