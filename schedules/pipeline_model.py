"""A registry model's pipeline step: its layers' graphs, priced, balanced into stages, as a problem.

Notation: P pipeline ranks, V stages per rank, M micro-batches, n, dp as in passes/stages.py.

    layers = model_layers(cfg, strategy, batch=1, seq=4096, passes="gate-reorder,sar=paper", cost=cost)
    built = pipeline_problem(layers, cost, pp=16, vpp=2, placement="v", micro_batches=32, vocab=129280)
    result = solve_pipeline(built.problem, torch_warm_starts(built.problem))

``model_layers`` lowers each distinct layer once (DeepSeek-V3's dense first layers and its MoE
layers; the same graph object for identical layers), with the passes applied. ``pipeline_problem``
prices each distinct layer's units by the op-level schedule (``price_layer``), the edges from a
two-layer model step split by the stage-split pass (``boundary_step``, ``price_edges``), cuts
the layers into P*V stages (``balance``: the costliest stage, embedding and head priced with
theirs, as cheap as possible; uneven counts allowed) unless a layout is given, prices each
boundary transfer as that step's P2P nodes (``cost.node_time_us``), and adds each rank's states
(moegraph.memory) and optimizer step:

    optimizer  Adam over this rank's shard of the trained elements (trained / dp under the
               distributed optimizer), memory-bound: reads the fp32 gradient, master weight and
               two moments (16 bytes), writes the last three and the bf16 parameter (14): 30 bytes
               per element, priced as one memory-bound kernel. The distributed optimizer's
               parameter all-gather is the all-gather half of the layers' gradient all-reduce
               (moegraph.autodiff's sync; the same bytes for bf16), priced in each stage's sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from moegraph.config import CompileConfig
from moegraph.cost import CostModel
from moegraph.ir import Graph, Node, OpKind, Phase, Strategy, ValueKind
from moegraph.memory import (ADAM_DISTRIBUTED, OptimizerSpec, StageMemory, layer_params,
                             pipeline_memory, rank_memory)
from moegraph.pass_steps import parse_passes
from moegraph.passes import AddEdges, StackLayers, run_pipeline
from moegraph.passes.stages import Placement, SplitStages, StageLayout, balance
from moegraph.schedules.pipeline import PipelineProblem, StageWork
from moegraph.schedules.pipeline_price import ZERO, EdgePrices, UnitPrice, price_edges, price_layer, ticks
from moegraph.schedules.pipeline_torch import torch_orders, torch_schedules_for

__all__ = ["model_layers", "boundary_step", "pipeline_problem", "BuiltPipeline", "torch_warm_starts", "rank_memory_report",
           "ADAM_BYTES_PER_ELEMENT"]

ADAM_BYTES_PER_ELEMENT = 30
"""Bytes Adam moves per shard element (module docstring): 4 * 4 read, 3 * 4 + 2 written."""


def model_layers(cfg, strategy: Strategy, *, batch: int, seq: int, passes: str | tuple, cost: CostModel,
                 layers: int | None = None) -> tuple[Graph, ...]:
    """One graph per layer of ``cfg`` (dense first layers, then MoE; a Hugging Face config's own
    layer kinds; its first ``layers``, all by default), identical layers sharing one graph; ``passes`` (typed steps, or a pipeline's text
    form, '' for none) applied to each distinct layer: the driver's ``layer_graphs``."""
    from moegraph.schedules.driver import layer_graphs
    config = CompileConfig(model=cfg, strategy=strategy, passes=parse_passes(passes) if isinstance(passes, str)
                           else passes, batch=batch, seq=seq, edges="none", hardware=cost.hw)
    return layer_graphs(config, cfg, cfg.layers if layers is None else layers, cost)


def boundary_step(layer: Graph, vocab: int, cost: CostModel | None = None) -> Graph:
    """The two-layer model step of ``layer`` (one micro-batch, a causal LM's edges at ``vocab``)
    split at its layer boundary by the stage-split pass (``SplitStages``, run by the pass
    manager): its P2P nodes are the transfers every stage boundary makes (a layer's input
    [b, s/n, h] forward, its gradient backward), its edge nodes the embedding's and head's
    units (``price_edges``)."""
    graph, _ = run_pipeline(layer, (StackLayers(2), AddEdges(vocab), SplitStages(StageLayout(((0,), (1,)), 2))),
                            cost=cost)
    return graph


@dataclass(frozen=True)
class BuiltPipeline:
    problem: PipelineProblem
    layer_prices: tuple[UnitPrice, ...]
    edges: EdgePrices
    stage_memory: tuple[StageMemory, ...]
    """Per stage, its states and its activations per micro-batch (in_flight 1)."""
    p2p_us: float
    optimizer_us: tuple[float, ...]


def pipeline_problem(layers: Sequence[Graph], cost: CostModel, *, pp: int, vpp: int = 1,
                     placement: Placement = "loop", micro_batches: int, vocab: int, tied: bool = False,
                     layout: StageLayout | None = None, memory_cap_bytes: int | None = None, method: str = "greedy",
                     time_limit_s: float = 2.0, tick_us: float = 1.0,
                     optimizer: OptimizerSpec = ADAM_DISTRIBUTED, overlap_param_gather: bool = False,
                     step: Graph | None = None) -> BuiltPipeline:
    """The pipeline problem of ``layers`` (module docstring). ``step``: the split boundary step
    (``boundary_step`` of the last layer, built here when not given). ``overlap_param_gather``: the
    sync's all-gather half runs before the stage's first forward of the step, on its DP stream
    (Megatron's ``--overlap-param-gather``: the gather of the parameters the last optimizer step
    updated overlaps the next step's forward), the rest at the step's end."""
    prices: dict[int, UnitPrice] = {}
    for g in layers:
        if id(g) not in prices:
            prices[id(g)] = price_layer(g, cost, method=method, time_limit_s=time_limit_s)
    per_layer = tuple(prices[id(g)] for g in layers)
    step = boundary_step(layers[-1], vocab, cost) if step is None else step
    edges = price_edges(step, cost, method=method, time_limit_s=time_limit_s)
    if layout is None:
        cut = balance([p.f_us + p.b_us for p in per_layer], pp * vpp,
                      first_extra=edges.embedding.f_us + edges.embedding.b_us,
                      last_extra=edges.head.f_us + edges.head.b_us)
        layout = StageLayout(cut, pp, placement)
    elif layout.layers != len(layers):
        raise ValueError(f"layout holds {layout.layers} layers, the model {len(layers)}")
    S = len(layout.stages)
    # activations per micro-batch: the memory model's (a stage's chain of layers holds each boundary once)
    stage_mem = pipeline_memory([[layers[i] for i in s] for s in layout.stages], vocab=vocab, tied=tied,
                                dp=layers[0].strategy.dp, in_flight=[1] * S, head_activation_bytes=edges.head.held_bytes,
                                optimizer=optimizer)
    work = []
    for k, stage in enumerate(layout.stages):
        total = ZERO
        for i in stage:
            total = total + per_layer[i]
        if k == 0:
            total = total + edges.embedding
        if k == S - 1:
            total = total + edges.head
        held = stage_mem[k].activation_bytes_per_mb
        f, i, w, b, saving, sync = (ticks(v, tick_us) for v in total.astuple()[:6])
        gather = lead = tail = 0
        if overlap_param_gather:         # layer by layer: the first layer's part leads, the last layer's forward ends
            gather = ticks(total.gather_us, tick_us)
            lead = min(gather, ticks(per_layer[stage[0]].gather_us + (edges.embedding.gather_us if k == 0 else 0),
                                     tick_us))
            tail = min(f, ticks(per_layer[stage[-1]].f_us + (edges.head.f_us if k == S - 1 else 0), tick_us))
        work.append(StageWork(f, i, w, b, saving, max(0, sync - gather), held, min(held, total.held_for_w_bytes),
                              gather, lead, tail))
    p2p_us, back_us = (cost.node_time_us(_p2p(step, phase)) for phase in (Phase.FORWARD, Phase.BACKWARD))
    static, opt_us = [], []
    for r in range(layout.pp):
        mine = [stage_mem[s] for s in layout.stages_of(r)]
        static.append(rank_memory(mine, 0)["total"])
        trained = sum(_trained(layers, layout.stages[s], s == 0, s == S - 1, vocab, tied) for s in layout.stages_of(r))
        shard = -(-trained // layers[0].strategy.dp) if optimizer.distributed else trained
        adam = Node(name="optimizer.adam", op=OpKind.ADD, phase=Phase.BACKWARD, inputs=("g",), outputs=("p",),
                    mem_bytes=ADAM_BYTES_PER_ELEMENT * shard)
        opt_us.append(cost.node_time_us(adam))
    problem = PipelineProblem(layout, micro_batches, tuple(work), (ticks(p2p_us, tick_us),) * (S - 1),
                              (ticks(back_us, tick_us),) * (S - 1), tuple(ticks(u, tick_us) for u in opt_us),
                              tuple(static), memory_cap_bytes, tick_us, shared_link=cost.emulated_link(),
                              rendezvous=True)     # it runs in torch's runtime: receives posted where it posts them
    return BuiltPipeline(problem, per_layer, edges, stage_mem, p2p_us, tuple(opt_us))


def _p2p(step: Graph, phase: Phase) -> Node:
    """The split step's one P2P node of ``phase`` (``boundary_step``) that moves the layers'
    activation or its gradient; a model with the router's aux loss also sends its routers' [3, E]
    stats across (routing values, 12*E bytes: not priced)."""
    found = [n for n in step.nodes if n.op is OpKind.P2P and n.phase is phase
             and step.value[n.inputs[0]].kind is not ValueKind.ROUTING]
    if len(found) != 1:
        raise ValueError(f"graph {step.name!r} has {len(found)} {phase.value} P2P nodes; a boundary step "
                         "(boundary_step) has one each way")
    return found[0]


def rank_memory_report(built: BuiltPipeline, timeline) -> list[dict[str, int]]:
    """Per pipeline rank, its peak memory component by component (moegraph.memory.COMPONENTS):
    its stages' states, and the activations its timeline holds at the peak."""
    layout = built.problem.layout
    return [rank_memory([built.stage_memory[s] for s in layout.stages_of(r)],
                        timeline.peak_bytes[r] - built.problem.static_bytes[r]) | {"rank": r}
            for r in range(layout.pp)]


def _trained(layers: Sequence[Graph], stage: Sequence[int], first: bool, last: bool, vocab: int, tied: bool) -> int:
    h = layers[0].dims.h
    edge = (vocab * h if first else 0) + ((h + (0 if tied and first else vocab * h)) if last else 0)
    return sum(layer_params(layers[i]).trained for i in stage) + edge


def torch_warm_starts(problem: PipelineProblem, names: Sequence[str] | None = None) -> dict:
    """torch's generated schedules that fit ``problem``'s layout, as orders (name -> Orders)."""
    return {name: torch_orders(name, problem.layout, problem.micro_batches)
            for name in (names or torch_schedules_for(problem.layout))}
