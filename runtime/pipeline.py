"""Pipelined execution on torch.distributed.pipelining's runtime, from a moegraph stage-level order.

Notation: P pipeline ranks, V stages per rank, M micro-batches; b (one micro-batch's rows), s, h,
n (ranks of a stage's group) as in moegraph.ir; V_ocab the vocabulary.

The order a schedule gives (moegraph.schedules.pipeline: torch's generated tables or CP-SAT's) is
written as torch's compute-only action CSV (``moegraph.schedules.pipeline_torch.write_csv``); each
pipeline rank wraps its stages' modules in ``PipelineStage``, loads the CSV into
``_PipelineScheduleRuntime`` (which adds the sends and receives and runs F, I, W, B and
OVERLAP_F_B actions) and steps (``TorchPipeline``).
torch scales the accumulated gradients by 1/M (``scale_grads``), so a step's gradients are those
of the mean micro-batch loss.

Two kinds of stage module:

  * eager (``stage_modules``): a MoETransformer's parts as they are ([embedding], its layers,
    [final norm, LM head]); n = 1. Any order runs, I/W splits included (torch splits the
    autograd graph).
  * compiled (``compile_stages``): moegraph's own (the final norm an RMSNorm or a bias-free
    LayerNorm, the logits times the model's logit_scale: ``moegraph.edges.EdgeHead``). Each
    stage's decoder layers are lowered as one multi-layer graph (``moegraph.tracer.trace_layers``), the passes applied, scheduled
    (``make_plan``) and run by one ``CompiledLayer`` (its plan: collectives of the stage's
    n-rank group overlapped with compute as the op-level schedule says); the embedding (first
    stage) and the final norm and LM head (last stage) run eagerly around it on this rank's
    sequence shard. A stage's backward is the plan's one backward: orders run B, never I and W
    apart (``TorchPipeline`` refuses them; ``solve_pipeline(split=False)``). An OVERLAP_F_B
    pair of a stage's F and its own B runs as moegraph's merged F&B (``compile_stages(pairs=
    True)``: the op-level schedule of the pair graph, registered with torch's
    ``register_custom_function``; runtime.pipeline_pair), and so does a V-shape's pair of two
    stages on one rank (``compile_stages(cross_pairs=...)``: passes/stage_pairs.py).
    Eager stages run a pair's two parts one after the other (torch's default).

World (compiled stages, dp = 1): P x n ranks in moegraph's order (moegraph.passes.stages:
r = p*n + i): stage p's group is ranks p*n .. p*n + n - 1, and member i of every stage forms one
pipeline group (``pipeline_group``) in which each sends its own sequence shard [b, s/n, h] to
its counterpart: the n pipeline groups run the same action table side by side. The first stage
takes the full input_ids [b, s] and embeds its shard; the last stage's loss on each rank is its
shard's term of the micro-batch's mean next-token loss (``ShardLoss``: summed cross-entropy over
its positions / the micro-batch's scored-token count), so the n terms sum to the loss and each
rank's backward from its own term is exact without communication (as ``runtime.model``). The
edges' parameters (embedding, final norm, head) are replicated on the n ranks and get each
rank's partial gradient: ``CompiledStage.sync_edge_grads`` sums them over the group after the
step (the layers' replicated parameters are summed by their plan).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from moegraph.pass_steps import DEFAULT_PASSES
from moegraph.ir import Strategy
from moegraph.layers import PARAM_PREFIX, layer_count
from moegraph.models import IGNORE_INDEX, MoETransformer, causal_lm_loss, shift_labels
from moegraph.edges import AuxLoss, EdgeHead, embed_rows
from moegraph.passes.stage_aux import StageAux, stage_aux
from moegraph.passes.stages import StageLayout, rank_coords, world_rank
from moegraph.runtime import RuntimeFailure
from moegraph.runtime.autograd import ScheduledLayerFunction
from moegraph.runtime.model_steps import batch_layout, final_norm, head_logits
from moegraph.runtime.module import DTYPES, CompiledLayer, build_layer, comm_axes, make_plan, shard_input
from moegraph.runtime.options import RuntimeOptions
from moegraph.runtime.pipeline_aux import StageLayersAux, aux_term
from moegraph.runtime.pipeline_pair import PairRunner, check_merged_pairs, overlap_f_b
from moegraph.tokens import BatchForms, Tokens, batch_forms, micro_batch_forms
from moegraph.token_layout import local_tokens

__all__ = ["StageModule", "stage_modules", "CompiledStage", "compile_stages", "pipeline_group", "ShardLoss",
           "TorchPipeline", "run_torch_schedule"]


class StageModule(nn.Module):
    """One pipeline stage of a MoETransformer: [embedding], its layers, [final norm, LM head].
    forward: input ids [b, s] (first stage) or hidden [b, s, h] -> hidden [b, s, h] or logits
    [b, s, V] (last stage)."""

    def __init__(self, model: MoETransformer, layers: Sequence[int], first: bool, last: bool):
        super().__init__()
        self.embed = model.embed if first else None
        self.layers = nn.ModuleList(model.layers[i] for i in layers)
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)                      # [b, s] -> [b, s, h]
        for layer in self.layers:
            x = layer(x)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))         # [b, s, h] -> [b, s, V]
        return x


def stage_modules(model: MoETransformer, layout: StageLayout) -> tuple[StageModule, ...]:
    """Every stage's module, sharing ``model``'s parameters."""
    if layout.layers != len(model.layers):
        raise ValueError(f"layout holds {layout.layers} layers; the model has {len(model.layers)}")
    S = len(layout.stages)
    return tuple(StageModule(model, s, k == 0, k == S - 1) for k, s in enumerate(layout.stages))


class CompiledStage(nn.Module):
    """One stage on this rank (module docstring): [embedding], a CompiledLayer of its decoder
    layers, [final norm, LM head]. forward: input_ids [b, s] (first stage) or this rank's hidden
    shard [b, s/n, h] -> hidden shard [b, s/n, h], or logits shard [b, s/n, V] (last stage)."""

    def __init__(self, layers: CompiledLayer, original: Mapping[str, str], *, embed: torch.Tensor | None,
                 norm: torch.Tensor | None, head: torch.Tensor | None, names: Mapping[str, str],
                 padding_idx: int | None, final: EdgeHead,
                 pair: "PairRunner | None" = None, forms: BatchForms = BatchForms(),
                 aux_loss: AuxLoss | None = None, aux: StageAux | None = None):
        """``original``: the layer graph's parameter source names -> the model's; ``names``: the
        model's names of embed, norm and head (those given); ``final``: the final norm (RMSNorm or
        a bias-free LayerNorm) and the logits' scale and soft cap (``moegraph.edges.EdgeHead``),
        which the last stage computes; ``pair``: the layers' merged F&B runner
        (runtime.pipeline_pair; None: the stage runs no OVERLAP_F_B); ``forms``: what the original
        does with a padded or packed batch (``moegraph.tokens.batch_forms``); ``aux_loss``: the
        model's router aux loss (None: none), ``aux`` the stage graph's stats (None: it has no
        router; ``moegraph.passes.stage_aux``)."""
        super().__init__()
        self.layers, self.original = layers, dict(original)
        self.names, self.padding_idx = dict(names), padding_idx
        self.final = final
        self.pair, self.forms = pair, forms
        self.replicas, self.dp = None, 1        # the data-parallel group (compile_stages(dp=...))
        self.aux_loss, self.aux = aux_loss, aux
        self.layouts: list[Tokens | None] | None = None
        """The step's micro-batch layouts (``set_layouts``), read by the micro-batch index each call gets."""
        self._prepared: tuple[torch.Tensor, torch.Tensor] | None = None

        def own(t):
            return None if t is None else nn.Parameter(t.detach().clone())
        self.embed, self.norm, self.lm_head = own(embed), own(norm), own(head)

    @property
    def rank(self) -> int:
        return self.layers.rank

    @property
    def n(self) -> int:
        return self.layers.n

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is None:
            return x
        return embed_rows(shard_input(x, self.layers.graph.strategy, self.rank), self.embed, self.final,
                          self.padding_idx)                                  # [b, s] -> [b/N, s/G, h]

    def set_layouts(self, forms: Sequence[tuple[Any, Any]] | None) -> None:
        """A step's per-micro-batch (attention_mask, position_ids), each None or micro-batch j's
        full [b, s] (``moegraph.tokens.micro_batch_forms``), checked as the original takes them
        (``BatchForms.layout``, use_cache=False as training runs; refused in one line naming the
        micro-batch); None: plain batches."""
        if forms is None:
            self.layouts = None
            return
        d = self.layers.graph.dims
        layouts = []
        for j, (mask, positions) in enumerate(forms):
            try:
                layouts.append(self.forms.layout(mask, positions, d.b, d.s, self.layers.executor.device))
            except ValueError as err:
                raise type(err)(f"micro-batch {j}'s {err}") from None
        self.layouts = layouts

    def _layout(self, micro_batch: torch.Tensor | None) -> "Tokens | None":
        if micro_batch is None:
            return None
        if self.layouts is None:
            raise RuntimeFailure("a micro-batch index reached the stage outside a step with batch layouts "
                                 "(TorchPipeline.step(attention_mask=..., position_ids=...))")
        return self.layouts[int(micro_batch)]

    def prepare_pair(self, x: torch.Tensor, micro_batch: torch.Tensor | None = None,
                     backward: "CompiledStage | None" = None) -> None:
        """A merged F&B pair's forward input (runtime.pipeline_pair): its layers' input now, for
        the pair's backward on ``backward``'s stage (None: this one); the next ``forward(x)`` of
        this very ``x`` takes the pair's output. ``micro_batch``: the forward's index (its batch
        layout), as ``forward``'s."""
        backward = self if backward is None else backward
        for stage in (self, backward):
            if stage.pair is None:
                raise RuntimeFailure(f"stage layers {stage.layers.graph.name!r} have no merged F&B plan "
                                     "(compile_stages(pairs=True))")
        h = self._embed(x)
        self._prepared = (x, h)
        backward.pair.arm(h, self._layout(micro_batch), forward=self.pair)

    def forward(self, x: torch.Tensor, stats: torch.Tensor | None = None,
                micro_batch: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``stats``: with the router's aux loss, the stages before's router stats [3, E] (None on
        the first stage); the output is then (output, stats with this stage's routers' added:
        runtime.pipeline_aux). ``micro_batch``: the micro-batch's index [1] (torch chunks the
        step's ``arange(M)`` keyword into every stage's call, ``TorchPipeline.step``): its batch
        layout; None: plain."""
        if self._prepared is not None and self._prepared[0] is x:
            (_, x), self._prepared = self._prepared, None
        else:
            x = self._embed(x)
        tokens = self._layout(micro_batch)
        runner = self.pair if self.pair is not None else self.layers
        if tokens is not None:                  # the forward and, later, its backward run with its layout
            runner = LayoutRunner(runner, self.layers.executor, tokens)
        params = self.layers.params()
        mine = None                             # this stage's routers' stats [3, E]
        if torch.is_grad_enabled() and self.aux is not None:
            y, mine = StageLayersAux.apply(runner, self.aux, x, *params)                 # [b, s/n, h], [3, E]
        elif torch.is_grad_enabled() and runner is not self.layers:
            y = ScheduledLayerFunction.apply(runner, x, *params)                         # [b, s/n, h]
        elif self.aux is not None:              # no gradient: the forward alone, its stats kept
            with batch_layout(self.layers.executor, tokens):
                y, kept = self.layers.forward_only(x, keep=(self.aux.stats,))
            mine = kept[self.aux.stats]
        else:
            with batch_layout(self.layers.executor, tokens):
                y = self.layers(x)                                                       # [b, s/n, h]
        if self.lm_head is not None:
            y = head_logits(final_norm(y, self.norm, self.final), self.lm_head, self.final)   # -> [b, s/n, V]
        if self.aux_loss is None:
            return y
        parts = [t for t in (stats, mine) if t is not None]
        return y, (sum(parts[1:], parts[0]) if parts else torch.zeros(3, self.aux_loss.experts, requires_grad=True))

    def io_examples(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, output) of one micro-batch, for ``PipelineStage``'s static shapes (no
        inference forward on empty tensors, which would run the plan's collectives on garbage)."""
        d, st = self.layers.graph.dims, self.layers.graph.strategy
        rows, seq = local_tokens(d.b, d.s, st)                                  # [b/N, s/G]: moegraph.token_layout
        hidden = torch.empty(rows, seq, d.h, dtype=self.layers.params()[0].dtype)
        x = torch.empty(d.b, d.s, dtype=torch.int64) if self.embed is not None else hidden.clone().requires_grad_()
        y = (torch.empty(rows, seq, self.lm_head.shape[0], dtype=hidden.dtype) if self.lm_head is not None
             else hidden.clone()).requires_grad_()
        if self.aux_loss is None:
            return x, y
        stats = torch.empty(3, self.aux_loss.experts, requires_grad=True)      # the routers' stats, fp32
        return (x if self.embed is not None else (x, stats.clone())), (y, stats)

    def _edges(self) -> list[tuple[str, nn.Parameter]]:
        return [(self.names[k], p) for k, p in (("embed", self.embed), ("norm", self.norm), ("head", self.lm_head))
                if p is not None]

    @torch.no_grad()
    def sync_edge_grads(self) -> None:
        """Sum the edges' partial gradients over the stage's n ranks (module docstring; collective)."""
        if self.n > 1:
            import torch.distributed as dist
            for _, p in self._edges():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.layers.executor.comm.mp_group)

    @torch.no_grad()
    def sync_grads(self) -> None:
        """The step's end (collective): the edges' partial gradients summed over the stage's n ranks
        (``sync_edge_grads``), then every gradient averaged over the dp replicas (``replicas``,
        ``compile_stages(dp=...)``): each replica's is the mean over its M micro-batches, so the
        average is the mean over the global batch's dp x M, eager's on it."""
        import torch.distributed as dist
        self.sync_edge_grads()
        if self.dp > 1:
            for p in self.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.replicas)
                    p.grad /= self.dp

    @torch.no_grad()
    def full_state(self) -> dict[str, torch.Tensor]:
        """The stage's parameters, full, under the model's names (collective over the stage's ranks)."""
        out = {self.original[q]: t for q, t in self.layers.full_params().items()}
        return out | {k: p.detach().clone() for k, p in self._edges()}

    @torch.no_grad()
    def full_grads(self) -> dict[str, torch.Tensor]:
        """The stage's parameters' gradients, full, under the model's names (collective over the
        stage's ranks; after ``sync_edge_grads``; a missing one counts as zero)."""
        out = {self.original[q]: g for q, g in self.layers.full_grads().items()}
        return out | {k: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for k, p in self._edges()}

    @torch.no_grad()
    def load_full(self, state: Mapping[str, torch.Tensor]) -> None:
        """Cut this rank's shards out of the model's full parameters (not a collective)."""
        self.layers.load_full({q: state[k] for q, k in self.original.items()})
        for k, p in self._edges():
            p.copy_(state[k])


class LayoutRunner:
    """A compiled stage's layers runner (``runtime.autograd.Runner``: the layer's own, or its
    ``PairRunner``) run with one micro-batch's batch layout, forward and, whenever autograd reaches
    it, backward (other micro-batches' forwards run between them)."""

    def __init__(self, runner: Any, executor: Any, tokens: Tokens):
        self.runner, self.executor, self.tokens = runner, executor, tokens

    def run_forward(self, x: torch.Tensor, params: Sequence[torch.Tensor]):
        with batch_layout(self.executor, self.tokens):
            return self.runner.run_forward(x, params)

    def run_backward(self, state, dy: torch.Tensor, params: Sequence[torch.Tensor]):
        with batch_layout(self.executor, self.tokens):
            return self.runner.run_backward(state, dy, params)


def pipeline_group(pp: int, n: int, dp: int = 1) -> Any:
    """This rank's pipeline group: member i of replica d of every stage, ranks (p*dp + d)*n + i for
    p = 0..P-1 (moegraph.passes.stages' order; None: the world, n = dp = 1). Collective: every
    rank creates every group."""
    if n * dp == 1:
        return None
    return _groups([[world_rank(p, d, i, n=n, dp=dp) for p in range(pp)] for d in range(dp) for i in range(n)])


def replica_group(pp: int, n: int, dp: int) -> Any:
    """This rank's data-parallel group: member i of pipeline rank p's dp replicas, ranks
    (p*dp + d)*n + i for d = 0..dp-1 (None: dp = 1). Collective: every rank creates every group."""
    if dp == 1:
        return None
    return _groups([[world_rank(p, d, i, n=n, dp=dp) for d in range(dp)] for p in range(pp) for i in range(n)])


def _groups(every: list[list[int]]) -> Any:
    """Create ``every`` group, in one order on every rank (new_group is collective); this rank's."""
    import torch.distributed as dist
    here, mine = dist.get_rank(), None
    for members in every:
        group = dist.new_group(ranks=members)
        if here in members:
            mine = group
    return mine


class ShardLoss:
    """The last stage's loss on one of its n ranks: its positions' term of the micro-batch's mean
    next-token cross-entropy (module docstring). labels: the micro-batch's full [b, s]; ``items``
    (transformers' ``num_items_in_batch`` N, the step's scored tokens): its summed cross-entropy / N
    instead of the micro-batch's own count."""

    def __init__(self, member: int, strategy: Strategy, aux: AuxLoss | None = None):
        self.member, self.strategy, self.n, self.aux = member, strategy, strategy.n, aux

    @classmethod
    def for_stages(cls, member: int, stages: Mapping[int, "CompiledStage"], aux: AuxLoss | None = None) -> "ShardLoss":
        """The loss of member ``member`` of the last stage's n ranks, laid out as ``stages``' layers
        hold their tokens (``moegraph.token_layout``)."""
        return cls(member, next(iter(stages.values())).layers.graph.strategy, aux)

    def __call__(self, output: torch.Tensor | tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor,
                 items: int | None = None) -> torch.Tensor:
        """``output``: the logits shard [b, s/n, V], or with ``aux`` (the model's router aux loss)
        (logits, the whole model's router stats [3, E]): + coef * aux (runtime.pipeline_aux)."""
        from moegraph.runtime.model import CompiledModel
        logits, stats = output if self.aux is not None else (output, None)
        shifted = shift_labels(labels)                                                   # [b, s]
        count = (shifted != IGNORE_INDEX).sum() if items is None else torch.tensor(items)
        term = CompiledModel._loss_term(logits, shard_input(shifted, self.strategy, self.member), count)
        return term if stats is None else term + aux_term(stats, self.aux, self.n)


class _StepLoss:
    """The schedule's loss function: ``loss_fn`` with the running step's ``items`` (None: its own
    reduction); torch calls it with (output, target) only, also from the merged F&B."""

    def __init__(self, loss_fn: Callable):
        self.loss_fn, self.items = loss_fn, None

    def __call__(self, output, target):
        return self.loss_fn(output, target) if self.items is None else self.loss_fn(output, target, items=self.items)


def compile_stages(model: nn.Module, layout: StageLayout, input_ids: torch.Tensor, *, n: int = 1,
                   hardware: Any = "cpu-gloo", attn: str = "sp", ffn: str = "ep", dispatch: str = "ag-rs",
                   passes: str | Sequence[Any] = DEFAULT_PASSES, schedule: str = "greedy", time_limit_s: float = 10.0,
                   timeout_s: float = 300.0, emulate: frozenset[str] = frozenset(), pairs: bool = False,
                   dp: int = 1, cross_pairs: Sequence[tuple[int, int]] = (), ep_nodes: int = 1,
                   attn_nodes: int = 1) -> dict[int, CompiledStage]:
    """This rank's stages (stage index -> CompiledStage) of a causal LM recognised by its model
    rule, for one micro-batch's ``input_ids`` [b, s] (module docstring). ``passes``: typed steps
    (moegraph.pass_steps) or their text form. Collective: every one of the P x n x dp ranks calls
    it with the same arguments (``dp`` replicas of the pipeline, moegraph.passes.stages' rank
    order: each replica's stage p on its own n ranks; ``CompiledStage.sync_grads`` averages the
    replicas' gradients after a step).

    The driver lowers the model (``moegraph.schedules.driver.lower``: the model rule, every
    parameter placed, the passes applied to its layer once); each stage's graph is that layer
    stacked to the stage's layer count (``moegraph.passes.stack``), scheduled by ``schedule``.
    ``pairs``: each stage also gets its merged F&B (``pair_graph`` of its graph, scheduled
    likewise) for the order's OVERLAP_F_B actions (runtime.pipeline_pair); ``cross_pairs``
    (forward stage, backward stage), pairs of two stages on one rank (a V-shape's turn; with
    ``pairs``): the rank holding both gets that pair's plan (``cross_pair_graph``). ``ep_nodes``,
    ``attn_nodes``: the node-spanning dispatch and the folded attention (Strategy's fields)."""
    import torch.distributed as dist
    from moegraph.config import CompileConfig, SolverEffort
    from moegraph.layers import layer_kinds
    from moegraph.pass_steps import parse_passes
    from moegraph.passes.microbatch import pair_graph
    from moegraph.passes.stage_pairs import cross_pair_graph
    from moegraph.passes.stack import stack_kinds
    from moegraph.schedules.driver import lower

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != layout.pp * n * dp:
        raise RuntimeFailure(f"the world has {world} ranks; pp={layout.pp} stages of n={n} ranks x dp={dp} replicas "
                             f"need {layout.pp * n * dp}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    p = rank_coords(rank, n=n, dp=dp)[0]
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"input_ids must be one micro-batch's token ids [b, s], got {input_ids.dtype} "
                         f"{list(input_ids.shape)}")
    b, s = input_ids.shape
    dtype = next(model.parameters()).dtype
    if dtype not in DTYPES:
        raise ValueError(f"model parameters are {dtype}: pipeline stages compile {sorted(map(str, DTYPES))}")
    steps = parse_passes(passes) if isinstance(passes, str) else tuple(passes)
    lowered = lower(CompileConfig(model=model, strategy=Strategy(attn=attn, ffn=ffn, dispatch=dispatch, n=n,
                                                                 dtype=DTYPES[dtype], dp=1, ep_nodes=ep_nodes,
                                                                 attn_nodes=attn_nodes),
                                  passes=steps, batch=b, seq=s, edges="none", hardware=hardware,
                                  solver=SolverEffort(time_limit_s=time_limit_s)))
    spec, cost = lowered.spec, lowered.cost
    why = ("its LM head is tied to the embedding (the first and last stage would share one parameter)" if spec.tied
           else "it has no LM head" if spec.head is None else None)
    if why:
        raise ValueError(f"{type(model).__name__} cannot be split into pipeline stages: {why}")
    decoder = model.get_submodule(spec.layers)
    if layout.layers != len(decoder):
        raise ValueError(f"layout holds {layout.layers} layers; the model has {len(decoder)}")
    kinds = layer_kinds(lowered.graph)          # one, or a mixed stack's (moegraph.layers.LayerKinds)
    built, paired, auxes = {}, {}, {}
    for k in layout.stages_of(p):
        graph = stack_kinds(kinds.sub(layout.stages[k]))
        if spec.aux_loss is not None:           # its routers' share of the aux loss (passes/stage_aux.py)
            graph, auxes[k] = stage_aux(graph, spec.aux_loss)
        built[k] = (graph, make_plan(graph, cost, schedule, time_limit_s=time_limit_s))
        if pairs:
            pg = pair_graph(graph)
            paired[k] = (pg, make_plan(pg, cost, schedule, time_limit_s=time_limit_s))
    if cross_pairs and not pairs:
        raise ValueError(f"cross_pairs={list(cross_pairs)} run as merged F&B plans: pass pairs=True too")
    crossed = {}
    for kf, kb in cross_pairs:
        if kf != kb and kf in built and kb in built:
            cg = cross_pair_graph(built[kf][0], built[kb][0])
            crossed[kf, kb] = (cg, make_plan(cg, cost, schedule, time_limit_s=time_limit_s))
    # every block creates every group its peers need (new_group is collective): the union of plans'
    plans = [*built.values(), *paired.values(), *crossed.values()]
    keys = {key for g, plan in plans for key in plan.comm_keys(g)}
    axes = {a for g, _ in plans for a in comm_axes(g)}
    if world > 1:
        everyone: list = [None] * world
        dist.all_gather_object(everyone, (sorted(keys), sorted(axes)))
        keys = {tuple(key) for e in everyone for key in e[0]}
        axes = {a for e in everyone for a in e[1]}
    full = dict(model.named_parameters()) | dict(model.named_buffers())
    forms = batch_forms(model)
    replicas = replica_group(layout.pp, n, dp)      # every rank creates every group: before the stages
    S = len(layout.stages)
    out = {}
    for k, (graph, plan) in built.items():
        original = {q: _model_name(spec.layers, graph, q, layout.stages[k][0])
                    for q in {src.qualname for _, ps in graph.params for src in ps.sources}}
        layer = build_layer(graph, plan, {q: full[o].detach() for q, o in original.items()}, rank=rank, n=n,
                            options=RuntimeOptions(timeout_s=timeout_s, record=False, emulate=emulate), pp=layout.pp * dp,
                            comm=(tuple(sorted(keys)), tuple(sorted(axes))))
        first, last = k == 0, k == S - 1
        names = {"embed": spec.embed} if first else {}
        if last and spec.norm_bias is not None:
            raise RuntimeFailure(f"the final norm's bias {spec.norm_bias!r}: a LayerNorm with a bias is not run by a "
                                 "pipeline's last stage (one stage: compile without pipeline stages)")
        names |= {"norm": spec.norm, "head": spec.head} if last else {}
        out[k] = CompiledStage(layer, original, embed=full[spec.embed] if first else None,
                               norm=full[spec.norm] if last else None,
                               head=full[spec.head] if last else None, names=names,
                               padding_idx=spec.padding_idx, final=spec.edge_head,
                               pair=PairRunner(layer, *paired[k]) if pairs else None, forms=forms,
                               aux_loss=spec.aux_loss, aux=auxes.get(k))
        out[k].replicas, out[k].dp = replicas, dp
    for (kf, kb), (cg, plan) in crossed.items():
        out[kb].pair.add_cross(out[kf].pair, cg, plan)
    return out


def _model_name(layers: str, graph, qualname: str, first_layer: int) -> str:
    """The model's name of a stage graph's parameter source: ``layers.{j}.<name>`` in the stage's
    stack (``moegraph.layers``; a one-layer graph: ``<name>``) is the model's layer first + j."""
    if layer_count(graph) == 1:
        return f"{layers}.{first_layer}.{qualname}"
    j, rest = qualname[len(PARAM_PREFIX) + 1:].split(".", 1)
    return f"{layers}.{first_layer + int(j)}.{rest}"


class TorchPipeline:
    """This rank's stages in torch's ``_PipelineScheduleRuntime``, one action table, any number of
    steps (module docstring). ``modules``: stage index -> module, at least this rank's stages
    (``layout.stages_of(rank)``, rank in ``group``); ``static``: stage -> (input, output) examples
    (``CompiledStage.io_examples``) to skip torch's shape inference."""

    def __init__(self, modules: Mapping[int, nn.Module] | Sequence[nn.Module], layout: StageLayout,
                 csv_path: str | Path, *, micro_batches: int, loss_fn: Callable = causal_lm_loss, group: Any = None,
                 static: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None = None):
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

        from moegraph.schedules.pipeline import parts
        from moegraph.schedules.pipeline_torch import read_csv
        if dist.get_world_size(group) != layout.pp:
            raise ValueError(f"the pipeline group has {dist.get_world_size(group)} ranks; the layout pp={layout.pp}")
        self.rank, self.layout, self.S = dist.get_rank(group), layout, len(layout.stages)
        self.mine = layout.stages_of(self.rank)
        self.merged_pairs = 0
        """This rank's OVERLAP_F_B actions per step run as moegraph's merged F&B (compiled stages;
        eager stages run a pair's parts one after the other, torch's default)."""
        compiled = any(isinstance(modules[k], CompiledStage) for k in self.mine)
        if compiled:
            orders = read_csv(csv_path)
            split = [str(a) for row in orders for i in row for a in parts(i) if a.kind in ("I", "W")]
            if split:
                raise RuntimeFailure(f"the order splits backwards ({', '.join(split[:4])}{', ...' if len(split) > 4 else ''}"
                                     "): a compiled stage runs its backward as one plan (B); solve with split=False")
            self.merged_pairs = check_merged_pairs(orders, modules, self.mine)
        kw = lambda k: {"input_args": static[k][0], "output_args": static[k][1]} if static else {}  # noqa: E731
        self.stages = [PipelineStage(modules[k], k, self.S, torch.device("cpu"), group=group, **kw(k))
                       for k in self.mine]
        self.modules, self.M = {k: modules[k] for k in self.mine}, micro_batches
        self.loss = _StepLoss(loss_fn)
        self.schedule = _PipelineScheduleRuntime(self.stages, micro_batches, loss_fn=self.loss)
        self.schedule._load_csv(str(csv_path))
        if self.merged_pairs:
            from torch.distributed.pipelining.schedules import OVERLAP_F_B
            self.schedule.register_custom_function(OVERLAP_F_B, overlap_f_b)

    def step(self, input_ids: torch.Tensor | None, labels: torch.Tensor | None, *,
             attention_mask: Sequence[torch.Tensor | None] | None = None,
             position_ids: Sequence[torch.Tensor | None] | None = None,
             num_items_in_batch: int | None = None) -> list[torch.Tensor]:
        """One step: ``input_ids`` [M*b, s] on the rank of stage 0, ``labels`` on the last stage's
        (None elsewhere). Returns the per-micro-batch losses (loss_fn's) on the last stage's rank
        ([] elsewhere); parameter gradients accumulate in the modules, scaled by 1/M: the gradient
        of the mean micro-batch loss.

        As ``CompiledModel.train_step`` (compiled stages; every rank passes the same): per
        micro-batch a right-padded ``attention_mask`` or packed ``position_ids`` [b, s]
        (``moegraph.tokens``: each argument None or M entries, each None or a tensor);
        ``num_items_in_batch`` N (transformers' Trainer's, the step's scored tokens): each loss is
        its summed cross-entropy / N and the gradients are those of the losses' SUM (not scaled by
        1/M; ``loss_fn`` takes ``items``, as ``ShardLoss``)."""
        forms = micro_batch_forms(attention_mask, position_ids, self.M)
        laid = any(f != (None, None) for f in forms)
        eager = [k for k, m in self.modules.items() if not isinstance(m, CompiledStage)]
        if laid and eager:
            raise RuntimeFailure(f"attention_mask / position_ids run on compiled stages (compile_stages); stage "
                                 f"{eager[0]} is {type(self.modules[eager[0]]).__name__}")
        if num_items_in_batch is not None and (isinstance(num_items_in_batch, bool)
                                               or not isinstance(num_items_in_batch, int) or num_items_in_batch < 1):
            raise ValueError(f"num_items_in_batch={num_items_in_batch!r}: pass the step's count of scored tokens, "
                             "a positive integer")
        losses: list[torch.Tensor] = []
        last = self.S - 1 in self.mine
        args = (input_ids,) if 0 in self.mine else ()
        # every stage's call gets its micro-batch's index (torch chunks arange(M) as it chunks input_ids)
        kwargs = {"micro_batch": torch.arange(self.M)} if laid else {}
        for m in self.modules.values():
            if isinstance(m, CompiledStage):
                m.set_layouts(forms if laid else None)
        self.loss.items, self.schedule.scale_grads = num_items_in_batch, num_items_in_batch is None
        try:
            self.schedule.step(*args, target=labels if last else None, losses=losses if last else None, **kwargs)
        finally:
            self.loss.items, self.schedule.scale_grads = None, True
            for m in self.modules.values():
                if isinstance(m, CompiledStage):
                    m.set_layouts(None)
        return losses


def run_torch_schedule(modules: Sequence[nn.Module], layout: StageLayout, csv_path: str | Path, *,
                       micro_batches: int, input_ids: torch.Tensor | None, labels: torch.Tensor | None,
                       group=None) -> list[torch.Tensor]:
    """One step of this rank's eager stages in torch's runtime (``TorchPipeline``)."""
    return TorchPipeline(modules, layout, csv_path, micro_batches=micro_batches, group=group).step(input_ids, labels)
