"""The driver: one ``CompileConfig`` -> trace -> passes -> schedule, composed here and nowhere else.

    from moegraph.schedules.driver import build
    compiled = build(CompileConfig(model="mixtral-8x7b", strategy=Strategy("sp", "ep", "ag-rs", 8)))
    compiled.graph, compiled.schedule, compiled.report

``lower(config)`` traces the model source and runs the pass pipeline (the config's own passes,
and the model-level rewrites its fields ask for: the stack of ``layers``, the merge of
``micro_batches``, the causal LM's edges), in the pass manager's stage order. ``build(config)``
schedules what ``lower`` gives. Every front door calls them: each CLI command, ``tune`` per
candidate, calibration per measured layer, ``moegraph.compile``, and the runtime's layer and
model compilation (which then get an execution plan of ``compiled.schedule``, never options).

With ``config.pp`` > 1 the driver composes the pipeline step instead (docs/pipeline.md):
``lower`` lowers each distinct decoder layer once (the passes applied) and the two-layer model
step split at its boundary by the stage-split pass (``SplitStages``, a registered step-scope
pass); ``build`` prices each layer's units by the op-level schedule, cuts the layers into
P x V stages balanced by that price, adds the whole-step memory of each rank (moegraph.memory),
and orders the stages' units by CP-SAT against torch.distributed.pipelining's generated
schedules, all under ``memory_budget`` per rank (``CompiledPipeline``).

Why here: the driver reaches the tracer (``moegraph``), the passes and the scheduler, so this
stage (``schedules``) is the earliest that may import all three at module level without a
backward import (tests/test_layering.py); the runtime imports it forward, and the front doors in
``moegraph`` (the CLI, ``moegraph.compile``) import it lazily, as they import every later stage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from moegraph.config import RECORDED, CompileConfig, ModelEdges, PipelineSearch, config_layers, is_module
from moegraph.cost import CostModel
from moegraph.ir import ConfigError, Graph
from moegraph.lowering import ModelSpec, has_model_rule
from moegraph.passes import AddEdges, MergeMicroBatches, StackLayers, rewrite_as, run_pipeline
from moegraph.passes.strategy import lowering_strategy
from moegraph.registry import Hardware, ModelConfig, load_hardware, load_model
from moegraph.schedules.api import CompileResult, compile_graph
from moegraph.schedules.problem import DEFAULT_COMM_STREAMS
from moegraph.schedules.schedule_file import Schedule
from moegraph.tracer import trace_causal_lm, trace_model, trace_module

__all__ = ["Compiled", "CompiledPipeline", "Lowered", "build", "comm_stream_names", "layer_graphs", "load_config_model",
           "lower", "pipeline_vocab", "pipeline_warm_starts", "price_pipeline", "check_pipeline_budget"]

COMM_STREAMS = {1: DEFAULT_COMM_STREAMS, 2: ("comm.intra", "comm.inter")}
"""``CompileConfig.comm_streams`` -> the scheduler's stream names (docs/scheduler.md)."""


@dataclass(frozen=True)
class Lowered:
    """A config's graph after its passes: what ``lower`` returns and ``build`` schedules."""

    config: CompileConfig
    graph: Graph
    report: dict[str, Any]
    """What the user's passes chose and predicted (``moegraph.passes.run_pipeline``'s report)."""
    model: ModelConfig | None
    """The registry model (None for a module source)."""
    hardware: Hardware
    cost: CostModel
    spec: ModelSpec | None = None
    """A causal LM module's parts around its layers (embedding, final norm, head), else None."""
    layers: tuple[Graph, ...] = ()
    """pp > 1: one graph per decoder layer (identical layers share one object), the passes
    applied; ``graph`` is then the two-layer boundary step split into two stages
    (``moegraph.schedules.pipeline_model.boundary_step``). pp = 1: ()."""


@dataclass(frozen=True)
class Compiled:
    """A config's compiled artefact: its graph, its schedule and what was decided on the way."""

    lowered: Lowered
    result: CompileResult = field(repr=False)

    @property
    def config(self) -> CompileConfig:
        return self.lowered.config

    @property
    def graph(self) -> Graph:
        return self.lowered.graph

    @property
    def schedule(self) -> Schedule:
        return self.result.schedule

    @property
    def report(self) -> dict[str, Any]:
        """The passes' report, and the schedule's source and status."""
        return {"passes": self.lowered.report, "source": self.result.source, "status": self.result.status}

    @property
    def cost(self) -> CostModel:
        return self.lowered.cost


SCHEDULING_FIELDS = ("schedule", "memory_budget", "solver", "comm_streams", "launch_order")
"""The CompileConfig fields ``build`` reads and ``lower`` does not."""


def _lowering_part(config: CompileConfig) -> CompileConfig:
    default = CompileConfig(model=config.model)
    return dataclasses.replace(config, **{f: getattr(default, f) for f in SCHEDULING_FIELDS})


def comm_stream_names(config: CompileConfig) -> tuple[str, ...]:
    return COMM_STREAMS[config.comm_streams]


def load_config_model(config: CompileConfig) -> tuple[ModelConfig, int]:
    """The registry model a config names (its top-k override applied) and its layer count
    ('all' resolved); ConfigError when either does not fit the model. With pp > 1 the layers
    are the model's own, its dense first layers included, at least one per stage."""
    model = config.model if isinstance(config.model, ModelConfig) else load_model(config.model)
    if config.top_k is not None:
        if not 1 <= config.top_k <= model.experts:
            raise ConfigError(f"top_k={config.top_k} must be between 1 and the expert count {model.experts} "
                              f"of {model.name}")
        model = dataclasses.replace(model, top_k=config.top_k)
    return model, config_layers(config, model)


def check_node_size(strategy, hw: Hardware) -> None:
    """The nodes of a node-spanning dispatch or a node's attention (n / ep_nodes or n / attn_nodes
    ranks) must fit the hardware's nodes: their in-node collectives are priced on NVLink, which a
    larger group would not have."""
    for field in ("ep_nodes", "attn_nodes"):
        nodes = getattr(strategy, field)
        if nodes > 1 and strategy.n // nodes > hw.gpus_per_node:
            raise ConfigError(f"{field}={nodes} puts n/{field} = {strategy.n // nodes} ranks in a node, but {hw.name} "
                              f"has {hw.gpus_per_node} GPUs per node: use {field} >= {-(-strategy.n // hw.gpus_per_node)}")


def lower(config: CompileConfig) -> Lowered:
    """Trace ``config.model`` for ``config.strategy`` and run the pipeline (module docstring).

    The pipeline: the stack of L layers first (the user's passes rewrite its layer once and
    restack it), the user's passes, the merge of M micro-batches, the edges last (per
    micro-batch, after compress=dp-bf16 chose their wire format): the pass manager's stage
    table (moegraph.passes.manager). With pp > 1: the pipeline's layers and boundary step
    (module docstring)."""
    hw = config.hardware if isinstance(config.hardware, Hardware) else load_hardware(config.hardware)
    hw = hw.for_group(config.strategy.n)        # a group of one rank runs without collective skew
    check_node_size(config.strategy, hw)
    if not config.copy_engines:
        hw = hw.without_copy_engines()
    cost = CostModel(hw)
    if config.pp > 1:
        return _lower_pipeline(config, hw, cost)
    recorded = config.passes == RECORDED
    traced_for = lowering_strategy(config.strategy) if recorded else config.strategy
    model, spec, edges = None, None, None
    if is_module(config.model):
        if isinstance(config.edges, ModelEdges):
            raise ConfigError(f"edges={config.edges!r}: a module brings its own edges (a causal LM's head) or has "
                              "none (a layer); leave edges='auto'")
        name = type(config.model).__name__
        if has_model_rule(config.model):            # a causal LM: its layers, stacked, with its edges
            graph, spec = trace_causal_lm(config.model, traced_for, batch=config.batch, seq=config.seq, name=name)
            layers = len(config.model.get_submodule(spec.layers))
            vocab = config.model.get_parameter(spec.head).shape[0] if spec.head is not None else None
            if config.micro_batches > 1 and vocab is None:
                raise ConfigError(f"micro_batches={config.micro_batches}: {name} is a base model without an LM "
                                  "head; a merged step trains a causal LM (its loss seeds each micro-batch's backward)")
            edges = AddEdges(vocab, aux=spec.aux_loss, head=spec.edge_head) if config.edges == "auto" else None
        else:                                       # one decoder layer
            graph, layers = trace_module(config.model, traced_for, batch=config.batch, seq=config.seq, name=name), 1
    else:
        model, layers = load_config_model(config)
        graph = trace_model(model, traced_for, batch=config.batch, seq=config.seq, layers=layers)
        if isinstance(config.edges, ModelEdges):
            edges = AddEdges(config.edges.vocab)
        elif config.edges == "auto" and layers > 1:     # a model step at its own or the default vocabulary
            edges = AddEdges(pipeline_vocab(config, model))
    stack = (StackLayers(layers),) if layers > 1 else ()
    step = ((MergeMicroBatches(config.micro_batches),) if config.micro_batches > 1 else ()) + \
        ((edges,) if edges is not None else ())
    if recorded:        # the strategy's own rewrites, its labels kept as the record (rewrite_as)
        graph, _ = run_pipeline(graph, stack, cost=cost)
        graph, report = rewrite_as(graph, config.strategy, cost)
        graph, _ = run_pipeline(graph, step, cost=cost)
    else:
        graph, report = run_pipeline(graph, stack + config.passes + step, cost=cost)
    return Lowered(config, graph, report, model, hw, cost, spec)


def build(config: CompileConfig, *, lowered: Lowered | None = None) -> Compiled | CompiledPipeline:
    """``config`` compiled: ``lower(config)``, scheduled by ``config.schedule`` under its memory
    budget, solver effort and launch order (``moegraph.schedules.api.compile_graph``). ``lowered``: the
    config's ``lower`` result when the caller already has it (tune keys its cache by the graph
    before it schedules): lowered from a config that differs from this one at most in how it is
    scheduled (``SCHEDULING_FIELDS``). With pp > 1: a ``CompiledPipeline`` (module docstring)."""
    if lowered is None:
        lowered = lower(config)
    elif _lowering_part(lowered.config) != _lowering_part(config):
        raise ValueError("build(config, lowered=...): the lowered graph was built from a config that lowers "
                         "differently (only schedule, memory_budget, solver, comm_streams and launch_order may differ)")
    lowered = dataclasses.replace(lowered, config=config)
    if config.pp > 1:
        return _build_pipeline(config, lowered)
    result = compile_graph(lowered.graph, lowered.cost, memory_budget_bytes=config.memory_budget,
                           time_limit_s=config.solver.time_limit_s, workers=config.solver.workers,
                           comm_streams=comm_stream_names(config), method=config.schedule,
                           launch_order=config.launch_order)
    return Compiled(lowered, result)



# -- the pipeline step (pp > 1) ------------------------------------------------------------------

def pipeline_vocab(config: CompileConfig, model: ModelConfig | None = None) -> int:
    """The LM head's vocabulary a model step or a pipeline prices: ModelEdges' (--vocab), else the
    model's own (a Hugging Face config's vocab_size), else the registry's default VOCAB."""
    if isinstance(config.edges, ModelEdges) and config.edges.vocab is not None:
        return config.edges.vocab
    if model is not None and model.hf_vocab is not None:
        return model.hf_vocab
    from moegraph.models import VOCAB           # torch-bearing module: only when a pipeline needs it
    return VOCAB


def layer_graphs(config: CompileConfig, model: ModelConfig, layers: int, cost: CostModel) -> tuple[Graph, ...]:
    """One graph per layer of ``model``'s first ``layers`` (its dense first layers, then its MoE
    layers; a Hugging Face config's own layer kinds), each distinct one lowered once by ``lower`` with ``config``'s strategy, passes and
    sizes (identical layers share one graph object)."""
    return _layer_lowerings(config, model, layers, cost)[0]


def _layer_lowerings(config: CompileConfig, model: ModelConfig, layers: int,
                     cost: CostModel) -> tuple[tuple[Graph, ...], dict[str, Any]]:
    """``layer_graphs`` and the MoE layer's pass report (a Hugging Face config: its whole stack's,
    each of its layer kinds lowered and rewritten once, ``moegraph.layers.LayerKinds``)."""
    one = dataclasses.replace(config, model=model, top_k=None, layers=1, micro_batches=1, edges="none", pp=1,
                              vpp=1, placement="loop", pipeline=PipelineSearch(), memory_budget=None, hardware=cost.hw)
    if model.hf_config is not None:         # the family's own layers: every layer, its first ``layers``
        from moegraph.layers import layer_kinds
        stack = lower(one.replace(layers="all"))
        return layer_kinds(stack.graph).per_layer()[:layers], stack.report
    moe = lower(one)
    dense: Graph | None = None
    if model.first_k_dense_replace and layers > 0:
        import torch

        from moegraph.models import MoETransformerLayer
        with torch.device("meta"):              # sizes only: the dense layer is traced without weights
            layer = MoETransformerLayer.from_config(model, layer=0)
        dense = dataclasses.replace(lower(one.replace(model=layer)).graph, name=f"{model.name}.dense")
    graphs = tuple(dense if i < model.first_k_dense_replace else moe.graph for i in range(layers))
    return graphs, moe.report


def _lower_pipeline(config: CompileConfig, hw: Hardware, cost: CostModel) -> Lowered:
    """``lower`` for pp > 1: torch's schedules checked against P, V, M first (no work when torch
    generates none), then the layers and the split boundary step."""
    from moegraph.passes.stages import StageLayout
    from moegraph.schedules.pipeline_model import boundary_step
    from moegraph.schedules.pipeline_torch import torch_baselines
    model, layers = load_config_model(config)
    torch_baselines(StageLayout.even(layers, config.pp, config.vpp, config.placement), config.micro_batches)
    graphs, report = _layer_lowerings(config, model, layers, cost)
    step = boundary_step(graphs[-1], pipeline_vocab(config, model), cost)
    return Lowered(config, step, report, model, hw, cost, None, graphs)


@dataclass(frozen=True)
class CompiledPipeline:
    """A pipeline config's compiled step (pp > 1): the stage-level problem its layers price to,
    and the order CP-SAT returned beside torch's generated schedules."""

    lowered: Lowered
    built: Any = field(repr=False)
    """The priced problem (``moegraph.schedules.pipeline_model.BuiltPipeline``)."""
    result: Any = field(repr=False)
    """The stage-level solve (``moegraph.schedules.pipeline_cpsat.PipelineResult``)."""
    refused: dict[str, str] = field(default_factory=dict)
    """torch schedules torch does not generate for this P, V, M: name -> torch's reason."""

    @property
    def config(self) -> CompileConfig:
        return self.lowered.config

    @property
    def graph(self) -> Graph:
        return self.lowered.graph

    @property
    def cost(self) -> CostModel:
        return self.lowered.cost

    @property
    def timeline(self):
        """The returned order's timeline (``moegraph.schedules.pipeline.Timeline``)."""
        return self.result.timeline

    @property
    def orders(self):
        return self.result.timeline.orders

    @property
    def hash(self) -> str:
        """The schedule's hash: sha256 of its torch action CSV (``pipeline_torch.orders_hash``)."""
        from moegraph.schedules.pipeline_torch import orders_hash
        return orders_hash(self.orders)

    @property
    def report(self) -> dict[str, Any]:
        return {"passes": self.lowered.report, "source": self.result.source, "status": self.result.status}

    def memory(self, timeline=None) -> list[dict[str, int]]:
        """Per pipeline rank, the peak of ``timeline`` (the returned one by default) component by
        component (moegraph.memory.COMPONENTS), with the rank's stages."""
        from moegraph.schedules.pipeline_report import memory_rows
        return memory_rows(self.built, timeline or self.timeline)

    def write_csv(self, path) -> Any:
        """The returned order as torch's action CSV (``_PipelineScheduleRuntime._load_csv``)."""
        from moegraph.schedules.pipeline_torch import write_csv
        return write_csv(self.orders, path)


def price_pipeline(config: CompileConfig, lowered: Lowered, *, method: str | None = None):
    """The priced stage-level problem of a lowered pipeline config (``pipeline_problem``: the
    units by the op-level schedule ``method``, the config's by default; the balanced layout;
    each rank's states; ``memory_budget`` as the cap per rank)."""
    from moegraph.schedules.pipeline_model import pipeline_problem
    return pipeline_problem(lowered.layers, lowered.cost, pp=config.pp, vpp=config.vpp, placement=config.placement,
                            micro_batches=config.micro_batches, vocab=pipeline_vocab(config, lowered.model),
                            memory_cap_bytes=config.memory_budget, method=method or config.schedule,
                            time_limit_s=config.pipeline.unit_time_limit_s,
                            overlap_param_gather=config.pipeline.overlap_param_gather, step=lowered.graph)


def check_pipeline_budget(problem) -> None:
    """MemoryBudgetError (one line naming the smallest feasible budget) when the cap is below the
    least peak any order reaches (``moegraph.schedules.pipeline.least_peak_bytes``)."""
    from moegraph.options import format_bytes
    from moegraph.schedules.pipeline import least_peak_bytes
    from moegraph.schedules.problem import MemoryBudgetError
    cap = problem.memory_cap_bytes
    least = least_peak_bytes(problem)
    need = max(least)
    if cap is None or need <= cap:
        return
    r = least.index(need)
    raise MemoryBudgetError(
        f"memory budget {format_bytes(cap)} per rank: no pipeline schedule fits; the smallest feasible budget is "
        f"{format_bytes(need)} (rank {r}: parameters, gradients, optimizer states and p2p buffers "
        f"{format_bytes(problem.static_bytes[r])} plus one micro-batch's activations of each of its stages "
        f"{format_bytes(need - problem.static_bytes[r])})", need, True)


def pipeline_warm_starts(problem) -> tuple[dict[str, Any], dict[str, str]]:
    """The orders a pipeline step starts from: torch's generated schedules for its layout (and
    those torch refuses for P, V, M, with why); when none of them fits the memory cap, also the
    least-memory order (``moegraph.schedules.pipeline.least_memory_orders``), which fits every
    cap ``check_pipeline_budget`` lets through."""
    from moegraph.schedules.pipeline import least_memory_orders, simulate
    from moegraph.schedules.pipeline_torch import torch_baselines
    warm, refused = torch_baselines(problem.layout, problem.micro_batches)
    if not any(simulate(problem, o).fits for o in warm.values()):
        warm["least-memory"] = least_memory_orders(problem.layout, problem.micro_batches)
    return warm, refused


def _build_pipeline(config: CompileConfig, lowered: Lowered) -> CompiledPipeline:
    """``build`` for pp > 1 (module docstring)."""
    from moegraph.schedules.pipeline_cpsat import solve_pipeline
    built = price_pipeline(config, lowered)
    problem = built.problem
    check_pipeline_budget(problem)
    warm, refused = pipeline_warm_starts(problem)
    search = config.pipeline
    result = solve_pipeline(problem, warm, time_limit_s=config.solver.time_limit_s, workers=config.solver.workers,
                            windows=search.windows, window=search.window, window_limit_s=search.window_limit_s,
                            split=not search.runnable)
    return CompiledPipeline(lowered, built, result, refused)
