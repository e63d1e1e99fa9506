"""Executor: runs one rank's share of a plan, node by node, forward or backward.

Each plan stream is a queue; the host walks the plan's issue order (identical on every rank):

    compute node    ``moegraph.kernels.run_compute`` (the kernels the interpreter uses), on the
                    compute stream;
    collective      issued asynchronously (``async_op=True``) on its stream's process group;
                    its outputs become available when a consumer first needs them.

Cross-stream dependencies. CPU: the host thread *is* the compute stream, so a compute node that
reads a collective's output waits on the collective's work handle (``work.wait`` with a
timeout that names the node); meanwhile gloo's threads move the data, which is the overlap.
GPU: one CUDA stream per plan stream (compute = the caller's current stream). A collective is
issued under its comm stream (high priority); ``work.wait()`` then orders that stream after
NCCL's. The host never waits for a collective inside a step on GPU: the end of a phase orders
the compute stream after the comm streams, and a hung collective is the NCCL watchdog's to
report (process-group timeout ``timeout_s``). A value read on another stream than its producer's
is made safe twice (``_get``, ``_finish``): the reader waits on an event recorded after the
producer, and the value's tensors are ``record_stream``-ed for the reader (kept values: for the
caller's stream), as the caching allocator hands a freed block to its allocation stream's next
allocation at once and a value is dropped when its last reader is *issued*, which on another
stream may run ms later. ProcessGroupNCCL record_streams or stashes our tensors for its own streams
until ``wait()``, called at issue under the comm stream. tests/fake_cuda.StreamRaces checks this.

Values live in an environment keyed by value name and are dropped after their last consumer in
the phase. Forward keeps what backward and recompute nodes read (the graph's saved values and
the parameters); backward returns the layer-input gradient and the parameter gradients. Every
collective issued in a phase completes before the phase returns.

A model step graph's edges (``moegraph.edges``, ``runtime.model.CompiledModel``): ``eager`` nodes
whose outputs the caller supplies (final norm, LM head) are never run here, autograd runs them; ``backward_edges`` takes their
outputs (the last layer's incoming gradient, the head and norm partial gradients) as inputs and
returns, besides the layers' gradients, what the plan's edge collectives made (synchronised
gradients, gathered rows). An eager node whose output the plan itself reads and nobody supplies
(the PARTIAL embedding gradient's ``edges.embed.scatter``: its input is made by the plan, its
output read by the plan's sync) is run HERE, at its plan position on the compute stream, by the
callable given for it (``Executor(eager_kernels=...)`` / ``set_eager_kernel``, or per call
``backward_edges(eager_kernels=...)`` for a kernel bound to the step's data: ins -> outs, the
node's input tensors to its output tensors); a phase that holds one without a callable is
refused, by name, before it runs anything.

Merged step graphs (``moegraph.microbatch``: M micro-batches) run whole: ``step`` takes the M
input shards and seeds and walks every plan entry in one pass (micro-batch j+1's forward between
j's backward entries where the schedule put it); ``forward``/``backward`` refuse such a graph.
Parameter gradients come out summed over the micro-batches by the graph itself (accumulating
weight-gradient kernels, ADD nodes), then synchronised once per step. WITH the model's edges
(``CompiledModel.train_step``) ``step_edges`` takes no seeds: every eager edge node of micro-batch
j (norm and head forward, their gradients) is plan-run by the caller's callable (ins -> outs) at
its plan position, so j's norm backward makes its seed where the schedule put it and the weight-
gradient kernels add into the previous micro-batch's partial. The plan then syncs the summed
partials once per step and gathers each micro-batch's embedding-gradient rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.profiler import record_function

from moegraph.edges import edge_values, is_eager, is_edge
from moegraph.ir import ExpertRows, Graph, ValueKind
from moegraph.kernels import RankContext, run_compute
from moegraph.microbatch import micro_batch_count, microbatch_boundaries
from moegraph.runtime import RuntimeFailure
from moegraph.runtime.collectives import Pending
from moegraph.runtime.plan import COMPUTE, ExecutionPlan, PlanEntry, check_plan
from moegraph.runtime.trace import StepRecorder, new_event

COMM_STREAM_PRIORITY = -100      # below the device's range: torch clamps it to the highest priority


@dataclass(slots=True)
class _Slot:
    """A value in the environment: produced on ``stream``; on GPU ``event`` marks it ready; on CPU
    ``pending`` is the in-flight collective that will produce it."""

    value: Any
    stream: str
    event: Any = None
    pending: Pending | None = None
    synced: set[str] = field(default_factory=set)   # streams already ordered after ``event``


@dataclass
class HostTime:
    """Host time the executor spends per node, over the phases run since ``reset``: the host's
    wall-clock in ``forward``/``backward`` minus its blocking waits on collectives (CPU), divided
    by the nodes run. GPU: issue cost (Python, kernel launches); if it exceeds a node's device
    time the device starves. CPU: it includes the kernels, which the host runs itself."""

    busy_ns: int = 0
    nodes: int = 0

    def reset(self) -> None:
        self.busy_ns, self.nodes = 0, 0

    def us_per_node(self) -> float | None:
        return None if not self.nodes else round(self.busy_ns / self.nodes / 1e3, 3)


_Step = tuple  # (PlanEntry, Node, is a collective, output shapes, an output read on another stream)

EagerKernel = Callable[[list[Any]], list[Any]]
"""A plan-run eager node's kernel: its input tensors -> its output tensors (module docstring)."""


class Executor:
    def __init__(self, graph: Graph, plan: ExecutionPlan, comm: Any, *, rank: int, n: int,
                 device: torch.device, timeout_s: float = 300.0, expert_rows: ExpertRows = "exact",
                 eager_kernels: Mapping[str, EagerKernel] | None = None):
        """``expert_rows``: the local index maps' rows (``moegraph.index_map.build_index_map``);
        ``eager_kernels``: callables for plan-run eager nodes (module docstring)."""
        self.graph, self.plan, self.comm = graph, check_plan(graph, plan), comm
        self.eager_kernels: dict[str, EagerKernel] = {}
        self.plan_eager: frozenset[str] = frozenset()
        self.rank, self.n, self.timeout_s = rank, n, timeout_s
        self.device, self.cuda = torch.device(device), torch.device(device).type == "cuda"
        # node_ctx: a step's own contexts by node (CompiledModel.train_step: each micro-batch's layout)
        self.ctx, self.node_ctx = RankContext.of(graph, rank, expert_rows), {}
        self.param_names = tuple(p for p, _ in graph.params)
        self._cross = _cross_stream_values(graph, plan)
        self._programs: dict[int, tuple[Sequence[PlanEntry], list[_Step]]] = {}
        self.comm_streams: dict[str, Any] = {}
        self.host = HostTime()
        self._waited_ns = 0                  # host blocking waits of the phase being run
        if self.cuda:
            for s in plan.streams:
                if s != COMPUTE:
                    # highest priority (torch maps any lower number to the device's highest): a
                    # collective's kernels get SMs before a resident GEMM's next blocks
                    self.comm_streams[s] = torch.cuda.Stream(self.device, priority=COMM_STREAM_PRIORITY)
        self.micro_batches = micro_batch_count(graph)
        self.edges = edge_values(graph)
        if self.micro_batches > 1:
            # (input, seed, output, input gradient) per micro-batch; the whole plan is one phase.
            # With edges every eager node runs at its plan position (nothing outside the plan can
            # run micro-batch j's head between the plan's entries): each needs a callable
            # (step_edges(eager_kernels=...)); micro-batch j's seed comes from its norm backward
            self.boundaries = microbatch_boundaries(graph)
            if self.edges is not None:
                self.plan_eager = frozenset(nd.name for nd in graph.nodes if is_eager(dict(nd.attrs)))
            self.eager_kernels = self._kernels_with(eager_kernels)
            aux = set(self.edges.aux_stats) if self.edges is not None else set()   # read after the step
            self._release_step = _releases(graph, plan.entries, keep=set(graph.outputs) | aux)
            return
        # a model step graph's edges (moegraph.edges): the eager nodes are autograd's, not the plan's;
        # their outputs (the layers' seed, the partial gradients) come in as backward inputs, the
        # synchronised gradients and the gathered embedding-gradient rows go back out
        supplied = {*self.edges.seeds, *self.edges.backward_inputs} if self.edges is not None else set()
        self.plan_eager = _plan_run_eager(graph, supplied)
        self.fwd, self.bwd = (tuple(e for e in part if e.name in self.plan_eager
                                    or not is_eager(dict(graph.node[e.name].attrs)))
                              for part in plan.split(graph))
        self.eager_kernels = self._kernels_with(eager_kernels)
        acts = [v for v in graph.inputs if graph.value[v].kind is ValueKind.ACTIVATION]
        seeds = ([self.edges.seed] if self.edges is not None else
                 [v for v in graph.inputs if graph.value[v].kind is ValueKind.GRAD])
        if len(acts) != 1 or len(seeds) != 1:
            raise RuntimeFailure(f"graph {graph.name!r} has activation inputs {acts} and seed gradients {seeds}; "
                                 "the runtime runs layers with exactly one of each")
        self.input_name, self.seed_name = acts[0], seeds[0]
        self.output_name = graph.outputs[0]
        param_grads = set(graph.grad_of.values())
        rest = [o for o in graph.outputs[1:] if o not in param_grads]
        edge_in = frozenset(self.edges.backward_inputs) if self.edges else frozenset()
        edge_made = {o for n in graph.nodes if is_edge(dict(n.attrs)) for o in n.outputs}
        rest = [o for o in rest if o not in edge_made and o not in edge_in]
        self.input_grad_name = rest[0] if rest else None
        made_fwd = set(graph.inputs) | {o for e in self.fwd for o in graph.node[e.name].outputs}
        self.saved = frozenset(i for e in self.bwd for i in graph.node[e.name].inputs
                               if i in made_fwd and i != self.seed_name and i not in edge_in)
        self._release_fwd = _releases(graph, self.fwd, keep=self.saved | {self.output_name})
        self._release_bwd = _releases(graph, self.bwd, keep=set(graph.outputs[1:]))

    # -- public --------------------------------------------------------------------------------

    def set_eager_kernel(self, name: str, fn: EagerKernel) -> None:
        """Register the callable that runs the plan-run eager node ``name`` (module docstring)."""
        self._check_kernel(name, fn)
        self.eager_kernels[name] = fn

    def _kernels_with(self, extra: Mapping[str, EagerKernel] | None) -> dict[str, EagerKernel]:
        """The registered kernels, with one call's own (checked) beside and over them."""
        kernels = dict(self.eager_kernels)
        for name, fn in (extra or {}).items():
            self._check_kernel(name, fn)
            kernels[name] = fn
        return kernels

    def _check_kernel(self, name: str, fn: EagerKernel) -> None:
        if name not in self.plan_eager:
            raise RuntimeFailure(f"node {name!r} is not an eager node the plan of graph {self.graph.name!r} runs "
                                 f"(those: {sorted(self.plan_eager) or 'none'})")
        if not callable(fn):
            raise TypeError(f"eager kernel for {name!r} is {fn!r}, not a callable")

    def _check_eager_kernels(self, entries: Sequence[PlanEntry], kernels: Mapping[str, EagerKernel]) -> None:
        """Refuse, before running anything, a phase that reaches a plan-run eager node without its
        callable (the rest of the phase would read an output nothing makes)."""
        missing = [e.name for e in entries if e.name in self.plan_eager and e.name not in kernels]
        if missing:
            raise RuntimeFailure(f"the plan of graph {self.graph.name!r} runs eager node(s) {', '.join(missing)}, "
                                 "whose outputs it reads, but no callable is registered for them "
                                 "(Executor.set_eager_kernel, or backward_edges(eager_kernels=...) as "
                                 "CompiledModel's backward passes edges.embed.scatter's)")

    def forward(self, x: torch.Tensor, params: Sequence[torch.Tensor], *, keep_saved: bool = True,
                recorder: StepRecorder | None = None, also_keep: frozenset[str] = frozenset()
                ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Run the forward entries on this rank's input shard [b, s/n, h]; return the output shard
        and the values backward reads (empty when ``keep_saved`` is False), plus ``also_keep``."""
        self._refuse_merged("forward")
        expected = self.graph.value[self.input_name].shape
        if tuple(x.shape) != expected:
            raise ValueError(f"input shard has shape {tuple(x.shape)}, the graph expects {expected} "
                             f"(this rank's sequence shard [b, s/n, h] with n={self.n})")
        inputs = {self.input_name: x, **dict(zip(self.param_names, params))}
        keep = (self.saved if keep_saved else frozenset()) | {self.output_name} | also_keep
        env = self._run(self.fwd, inputs, self._release_fwd, recorder, keep)
        y = env.pop(self.output_name)
        return y, env

    def backward(self, saved: dict[str, Any], dy: torch.Tensor, params: Sequence[torch.Tensor], *,
                 recorder: StepRecorder | None = None) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Run backward and recompute entries; return (input-shard gradient, parameter-shard gradients
        in ``param_names`` order; replicated parameters' gradients already summed over ranks)."""
        if self.edges is not None:
            raise RuntimeFailure(f"graph {self.graph.name!r} carries a model's edges (moegraph.edges): its backward "
                                 "needs the edges' partial gradients: run it with backward_edges (CompiledModel)")
        dx, grads, _ = self._backward(saved, dy, params, {}, recorder)
        return dx, grads

    def backward_edges(self, saved: dict[str, Any], dy: torch.Tensor, params: Sequence[torch.Tensor],
                       partials: dict[str, torch.Tensor], *, recorder: StepRecorder | None = None,
                       eager_kernels: Mapping[str, EagerKernel] | None = None
                       ) -> tuple[torch.Tensor | None, list[torch.Tensor], dict[str, torch.Tensor]]:
        """``backward`` of a graph with edges (``moegraph.edges``): ``dy`` is the last layer's
        incoming gradient (``EdgeValues.seed``) and ``partials`` this rank's partial gradients
        (``EdgeValues.backward_inputs``: made by the eager head and norm backward, and the aux
        loss's seeds), all given by the caller; also returns the edges'
        outputs (``EdgeValues.outputs``: synchronised gradients, gathered embedding rows), run by
        the plan's edge collectives in its order. ``eager_kernels``: callables for this call's
        plan-run eager nodes (module docstring), beside and over the registered ones."""
        if self.edges is None:
            raise RuntimeFailure(f"graph {self.graph.name!r} has no edges (moegraph.passes.edges.add_edges): use backward")
        if set(partials) != set(self.edges.backward_inputs):
            raise RuntimeFailure(f"edge partial gradients {sorted(partials)} given, the graph reads "
                                 f"{sorted(self.edges.backward_inputs)}")
        for name, t in partials.items():
            if tuple(t.shape) != self.graph.value[name].shape:
                raise ValueError(f"edge partial gradient {name!r} has shape {tuple(t.shape)}, the graph expects "
                                 f"{self.graph.value[name].shape}")
        return self._backward(saved, dy, params, {k: v.contiguous() for k, v in partials.items()}, recorder,
                              self._kernels_with(eager_kernels))

    def _backward(self, saved, dy, params, partials, recorder, kernels=None):
        self._refuse_merged("backward")
        inputs = {**saved, **dict(zip(self.param_names, params)), self.seed_name: dy.contiguous(), **partials}
        edge_out = set(self.edges.outputs) if self.edges is not None else set()
        keep = set(self.graph.outputs[1:]) | edge_out
        env = self._run(self.bwd, inputs, self._release_bwd, recorder, keep, kernels)
        dx = self._made(env, self.input_grad_name, "input gradient") if self.input_grad_name else None
        # a buffer (ParamSpec.buffer) has no gradient: None, which autograd accepts for it
        grads = [env[self.graph.grad_of[p]] if p in self.graph.grad_of else None for p in self.param_names]
        return dx, grads, {k: env[k] for k in edge_out}

    def step(self, xs: Sequence[torch.Tensor], dys: Sequence[torch.Tensor], params: Sequence[torch.Tensor], *,
             recorder: StepRecorder | None = None
             ) -> tuple[list[torch.Tensor], list[torch.Tensor | None], list[torch.Tensor | None]]:
        """A merged step graph's whole step: micro-batch j's input shard ``xs[j]`` [b, s/n, h] and
        seed gradient ``dys[j]``; every plan entry in issue order, in one pass. Returns (outputs,
        input gradients, parameter-shard gradients in ``param_names`` order, summed over the
        micro-batches and synchronised; None for buffers)."""
        self._check_merged()
        if self.edges is not None:
            raise RuntimeFailure(f"graph {self.graph.name!r} carries a model's edges (moegraph.edges): its seeds are "
                                 "made by the edges' eager norm backward, not given: run it with step_edges "
                                 "(CompiledModel.train_step)")
        if len(dys) != self.micro_batches:
            raise ValueError(f"graph {self.graph.name!r} holds {self.micro_batches} micro-batches but got {len(xs)} "
                             f"inputs and {len(dys)} seed gradients")
        ys, dxs, grads, _ = self._step(xs, dys, params, recorder, {})
        return ys, dxs, grads

    def step_edges(self, xs: Sequence[torch.Tensor], params: Sequence[torch.Tensor], *,
                   eager_kernels: Mapping[str, EagerKernel], recorder: StepRecorder | None = None,
                   aux_seeds: Mapping[str, torch.Tensor] | None = None
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor | None], list[torch.Tensor | None],
                              dict[str, torch.Tensor]]:
        """``step`` of a merged graph with edges (``moegraph.edges``): every eager node (micro-batch
        j's norm and head forward and backward) runs at its plan position by its callable in
        ``eager_kernels`` (beside and over the registered ones; module docstring): the norm
        backward's makes micro-batch j's seed, the weight-gradient ones the partials the plan
        syncs. ``aux_seeds``: with the router's aux loss, each micro-batch's aux seed
        (``EdgeValues.aux_seeds``). Returns ``step``'s values and the edges' outputs
        (``EdgeValues.outputs``: the synchronised head and norm gradients, each micro-batch's
        gathered embedding rows; and ``EdgeValues.aux_stats``, the global router stats)."""
        self._check_merged()
        if self.edges is None:
            raise RuntimeFailure(f"graph {self.graph.name!r} has no edges (moegraph.passes.edges.add_edges): use step")
        if set(aux_seeds or {}) != set(self.edges.aux_seeds):
            raise RuntimeFailure(f"aux seeds {sorted(aux_seeds or {})} given, the graph reads "
                                 f"{sorted(self.edges.aux_seeds)}")
        return self._step(xs, [None] * len(xs), params, recorder, self._kernels_with(eager_kernels),
                          {k: v.reshape(1).float() for k, v in (aux_seeds or {}).items()})

    def _check_merged(self) -> None:
        if self.micro_batches == 1:
            raise RuntimeFailure(f"graph {self.graph.name!r} holds one micro-batch: run it with forward and backward "
                                 "(merge_microbatches builds a step graph of M >= 2)")

    def _step(self, xs, dys, params, recorder, kernels, extra=None):
        M = self.micro_batches
        if len(xs) != M:
            raise ValueError(f"graph {self.graph.name!r} holds {M} micro-batches but got {len(xs)} inputs")
        inputs: dict[str, Any] = dict(zip(self.param_names, params)) | dict(extra or {})
        for j, ((x_name, seed_name, _, _), x, dy) in enumerate(zip(self.boundaries, xs, dys)):
            expected = self.graph.value[x_name].shape
            for what, t in (("input", x), ("seed gradient", dy)):
                if t is not None and tuple(t.shape) != expected:
                    raise ValueError(f"micro-batch {j}'s {what} shard has shape {tuple(t.shape)}, the graph expects "
                                     f"{expected} (this rank's sequence shard [b, s/n, h] with n={self.n})")
            inputs[x_name] = x
            if dy is not None:
                inputs[seed_name] = dy.contiguous()
        edge_out = set(self.edges.outputs) | set(self.edges.aux_stats) if self.edges is not None else set()
        env = self._run(self.plan.entries, inputs, self._release_step, recorder, set(self.graph.outputs) | edge_out,
                        kernels)
        ys = [env[y] for _, _, y, _ in self.boundaries]
        dxs = [self._made(env, dx, f"micro-batch {j}'s input gradient")
               for j, (_, _, _, dx) in enumerate(self.boundaries)]
        grads = [env[self.graph.grad_of[p]] if p in self.graph.grad_of else None for p in self.param_names]
        return ys, dxs, grads, {k: env[k] for k in edge_out}

    def _made(self, env: dict[str, Any], name: str, what: str) -> Any:
        """``env[name]``, a value the phase's plan makes and keeps. Missing, it is a bug in the plan or
        its release lists, never a zero gradient (autograd would read a None as one)."""
        if name not in env:
            node = self.graph.producer.get(name)
            raise RuntimeError(f"graph {self.graph.name!r}: {what} {name!r} (made by node "
                               f"{node.name if node else None!r}) is missing after the run")
        return env[name]

    def _refuse_merged(self, what: str) -> None:
        if self.micro_batches > 1:
            raise RuntimeFailure(f"graph {self.graph.name!r} is a step of {self.micro_batches} micro-batches whose "
                                 f"forward and backward interleave: it has no separate {what}; run the whole step "
                                 "with CompiledLayer.train_step(xs, dys) (Executor.step)")

    def run_whole(self, inputs: dict[str, Any], keep: set[str]) -> dict[str, Any]:
        """The plan as one phase over named ``inputs``, returning ``keep``: the pipeline's F&B pair."""
        return self._run(self.plan.entries, inputs, self._release_step, None, keep)

    # -- one phase -------------------------------------------------------------------------------

    def _run(self, entries: Sequence[PlanEntry], inputs: dict[str, Any], release: list[list[str]],
             rec: StepRecorder | None, keep, kernels: Mapping[str, EagerKernel] | None = None) -> dict[str, Any]:
        cuda = self.cuda
        kernels = self.eager_kernels if kernels is None else kernels
        self._check_eager_kernels(entries, kernels)
        started, self._waited_ns = time.perf_counter_ns(), 0
        # torch.profiler names each node only while a profiler runs: a record_function costs the
        # host several microseconds per node, which a step of small kernels cannot afford
        named = torch._C._autograd._profiler_enabled()
        streams = {COMPUTE: torch.cuda.current_stream(self.device), **self.comm_streams} if cuda else {}
        ready = new_event(streams[COMPUTE]) if cuda else None       # inputs: made on the caller's stream
        env: dict[str, _Slot] = {k: _Slot(v, COMPUTE, ready) for k, v in inputs.items()}
        pending: list[Pending] = []
        inflight: list[Pending] = []          # CPU, recording: issued, completion not yet observed
        fences: list[Any] = []                # alone collectives the next compute node waits for
        for i, (e, node, comm, shapes, cross) in enumerate(self._program(entries)):
            if not comm and fences:
                self._await_fences(fences, streams, e.name, rec)
            ins = [self._get(env, v, e.stream, streams, e.name, rec) for v in node.inputs]
            if comm:
                if cuda:
                    if e.alone:  # start after the compute issued so far
                        streams[e.stream].wait_stream(streams[COMPUTE])
                    with torch.cuda.stream(streams[e.stream]):
                        t0 = new_event() if rec else None
                        if named:
                            with record_function(e.name):       # named in torch.profiler traces
                                p = self.comm.issue(node, ins, e.stream, e.sm_budget, shapes)
                        else:
                            p = self.comm.issue(node, ins, e.stream, e.sm_budget, shapes)
                        outs = p.wait(self.timeout_s, self.rank, block_host=False)
                        done = new_event()
                    for o, v in zip(node.outputs, outs):
                        env[o] = _Slot(v, e.stream, done)
                    if e.alone:
                        fences.append(done)
                    if rec:
                        rec.add(e.name, e.stream, e.sm_budget, node.phase.value, t0, done)
                else:
                    if named:
                        with record_function(e.name):
                            p = self.comm.issue(node, ins, e.stream, e.sm_budget, shapes)
                    else:
                        p = self.comm.issue(node, ins, e.stream, e.sm_budget, shapes)
                    if rec:
                        inflight.append(p)
                        rec.add(e.name, e.stream, e.sm_budget, node.phase.value, p.issued_ns, p)
                    for o in node.outputs:
                        env[o] = _Slot(None, e.stream, pending=p)
                    if e.alone:  # the host runs compute itself: it has finished what came before
                        fences.append(p)
                pending.append(p)
            else:
                t0 = (new_event(streams[COMPUTE]) if cuda else time.perf_counter_ns()) if rec else None
                if named:
                    with record_function(e.name):
                        outs = self._compute(node, ins, shapes, kernels)
                else:
                    outs = self._compute(node, ins, shapes, kernels)
                done = None
                if cuda and (rec or cross):
                    done = new_event(streams[COMPUTE])
                for o, v in zip(node.outputs, outs):
                    env[o] = _Slot(v, COMPUTE, done)
                if rec:
                    rec.add(e.name, e.stream, e.sm_budget, node.phase.value, t0,
                            done if cuda else time.perf_counter_ns())
            for v in release[i]:
                env.pop(v, None)
            if inflight:
                _poll(inflight)
        out = self._finish(env, pending, streams, keep)
        self.host.busy_ns += time.perf_counter_ns() - started - self._waited_ns
        self.host.nodes += len(entries)
        return out

    def _program(self, entries: Sequence[PlanEntry]) -> list["_Step"]:
        """Per entry what the phase loop reads of the graph, looked up once per entry sequence
        (the executor's phases, GraphedExecutor's segments): (entry, node, is a collective, output
        shapes, an output is read on another stream)."""
        hit = self._programs.get(id(entries))
        if hit is None or hit[0] is not entries:
            nodes = [self.graph.node[e.name] for e in entries]
            hit = (entries, [(e, nd, nd.is_comm, [self.graph.value[o].shape for o in nd.outputs],
                              any(o in self._cross for o in nd.outputs)) for e, nd in zip(entries, nodes)])
            self._programs[id(entries)] = hit       # holds ``entries``: its id is not reused while cached
        return hit[1]

    def _compute(self, node, ins: list[Any], shapes: list[tuple[int, ...]],
                 kernels: Mapping[str, EagerKernel]) -> list[Any]:
        """One compute node's outputs: a plan-run eager node by its callable, any other by its kernel."""
        if node.name in self.plan_eager:
            outs = list(kernels[node.name](ins))
            bad = [(o, tuple(v.shape)) for o, v, shp in zip(node.outputs, outs, shapes) if tuple(v.shape) != tuple(shp)]
            if bad:
                raise RuntimeFailure(f"eager kernel of {node.name!r} made {bad}, the graph expects "
                                     f"{dict(zip(node.outputs, shapes))}")
        else:
            outs = run_compute(self.node_ctx.get(node.name, self.ctx), node, ins, shapes)
        if len(outs) != len(node.outputs):
            raise RuntimeFailure(f"node {node.name!r} produced {len(outs)} outputs, expected {len(node.outputs)}")
        return outs

    def _wait(self, p: Pending) -> list[Any]:
        """CPU: host-wait for a collective (timeout names it); the time is not host overhead."""
        if p.waited:
            return p.outputs
        t0 = time.perf_counter_ns()
        try:
            return p.wait(self.timeout_s, self.rank)
        finally:
            self._waited_ns += time.perf_counter_ns() - t0

    def _await_fences(self, fences: list[Any], streams: dict, consumer: str, rec: StepRecorder | None) -> None:
        """Make the compute stream (GPU) or the host (CPU) wait for the alone collectives issued
        since the last compute node, so that no compute runs beside them."""
        for f in fences:
            if self.cuda:
                streams[COMPUTE].wait_event(f)
            elif not f.waited:
                t0 = time.perf_counter_ns()
                self._wait(f)
                if rec is not None:
                    rec.add_wait(f.node.name, consumer, t0, time.perf_counter_ns())
        fences.clear()

    def _finish(self, env: dict[str, _Slot], pending: list[Pending], streams: dict, keep) -> dict[str, Any]:
        """Complete every collective of the phase; return the kept values, ready on the compute stream."""
        if self.cuda:
            compute = streams[COMPUTE]
            for s in self.comm_streams.values():
                compute.wait_stream(s)
            # no host wait: the compute stream is ordered after every collective of the phase, and a
            # hang is left to the NCCL watchdog, which aborts after the process group's timeout_s
            out = {}
            for k in keep:
                slot = env.get(k)
                if slot is None:
                    continue
                for t in _device_tensors(slot.value) if slot.stream != COMPUTE else ():   # the caller reads it
                    t.record_stream(compute)
                out[k] = slot.value
            return out
        for p in pending:
            self._wait(p)
        out = {}
        for k in keep:
            slot = env.get(k)
            if slot is not None:
                out[k] = self._resolve(env, k, slot)
        return out

    def _resolve(self, env: dict[str, _Slot], name: str, slot: _Slot) -> Any:
        """CPU: the value of ``name``, waiting (with timeout) for the collective producing it."""
        if slot.pending is not None:
            p = slot.pending
            outs = self._wait(p)
            for o, v in zip(p.node.outputs, outs):
                if o in env and env[o].pending is p:
                    env[o].value, env[o].pending = v, None
        return slot.value

    def _get(self, env: dict[str, _Slot], name: str, stream: str, streams: dict, consumer: str,
             rec: StepRecorder | None) -> Any:
        slot = env.get(name)
        if slot is None:
            raise RuntimeFailure(f"node {consumer!r} reads {name!r}, which is not available on this rank "
                                 "(released too early or never produced: a runtime bug)")
        if not self.cuda:
            if slot.pending is not None and not slot.pending.waited and rec is not None:
                waited_on, t0 = slot.pending.node.name, time.perf_counter_ns()
                value = self._resolve(env, name, slot)
                rec.add_wait(waited_on, consumer, t0, time.perf_counter_ns())
                return value
            return self._resolve(env, name, slot)
        if slot.stream != stream and stream not in slot.synced:
            target = streams[stream]
            if slot.event is not None:      # order: read after the producer (module docstring)
                target.wait_event(slot.event)
            slot.synced.add(stream)
            for t in _device_tensors(slot.value):   # lifetime: no reuse before this stream's read
                t.record_stream(target)
        return slot.value


def _device_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors a value carries: itself, a list's or tuple's, a record's fields' (an IndexMap)."""
    if isinstance(value, torch.Tensor):
        return [value]
    parts = value if isinstance(value, (list, tuple)) else [getattr(value, f.name) for f in (
        fields(value) if is_dataclass(value) and not isinstance(value, type) else ())]
    return [t for v in parts for t in _device_tensors(v)]


def _plan_run_eager(graph: Graph, supplied: set[str]) -> frozenset[str]:
    """The eager nodes the plan must run itself: one of their outputs is read by a node the plan
    runs (not eager) and is not among the ``supplied`` inputs (the eager backward's seeds and
    partials)."""
    read = {i for nd in graph.nodes if not is_eager(dict(nd.attrs)) for i in nd.inputs}
    return frozenset(nd.name for nd in graph.nodes if is_eager(dict(nd.attrs))
                     and any(o in read and o not in supplied for o in nd.outputs))


def _poll(inflight: list[Pending]) -> None:
    """Stamp collectives seen complete since the last node (CPU): completion times are observed at
    node boundaries (or when the host waits), never through Python callbacks on gloo's threads,
    which would need the GIL and stall gloo's next collective behind the compute thread."""
    now = time.perf_counter_ns()
    still = []
    for p in inflight:
        if p.done_ns is None and p.outputs is None and all(w.is_completed() for w in p.works):
            p.done_ns = now
        if p.done_ns is None and p.outputs is None:
            still.append(p)
    inflight[:] = still


def _releases(graph: Graph, entries: Sequence[PlanEntry], keep) -> list[list[str]]:
    """For each entry, the values whose last reader in this phase it is (and that are not kept)."""
    last: dict[str, int] = {}
    for i, e in enumerate(entries):
        node = graph.node[e.name]
        for v in node.inputs:
            last[v] = i
        for v in node.outputs:
            last.setdefault(v, i)                  # produced and never read: drop right away
    out: list[list[str]] = [[] for _ in entries]
    for v, i in last.items():
        if v not in keep:
            out[i].append(v)
    return out


def _cross_stream_values(graph: Graph, plan: ExecutionPlan) -> frozenset[str]:
    """Values produced on one stream and read on another (GPU: they need a ready event)."""
    stream = {o: e.stream for e in plan.entries for o in graph.node[e.name].outputs}
    cross = set()
    for e in plan.entries:
        for v in graph.node[e.name].inputs:
            if v in stream and stream[v] != e.stream:
                cross.add(v)
    return frozenset(cross)
