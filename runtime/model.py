"""The compiled causal LM: a training-loop nn.Module around one scheduled multi-layer executor.

Every rank of the group calls it with the same arguments as the original model (the full
``input_ids`` [b, s] and ``labels``) and gets what the original returns (``.loss``; ``.logits``
on request or without labels; a base model's ``.last_hidden_state``). Inside, rank r works on
its sequence shard, positions r*s/n .. (r+1)*s/n - 1:

  * embedding, final norm (RMSNorm, or a bias-free LayerNorm), LM head (its logits times the
    model's logit_scale, where it has one: ``moegraph.edges.EdgeHead``) and loss run eagerly on
    the shard;
  * the decoder layers run as ONE CompiledLayer over the stacked graph (``moegraph.layers``):
    one plan for all layers, so a layer's collectives may overlap other layers' compute;
  * the loss is the global mean over the non-ignored next-token labels: each rank divides its
    shard's summed cross-entropy by the global label count (every rank holds all labels, so the
    count needs no communication) and an all-reduce sums the shards' terms;
  * labels shift across shard boundaries: position t predicts labels[t + 1], which for the
    shard's last position is the next shard's first label: the shift is taken on the full
    labels before they are cut;
  * the replicated eager parameters (embedding, final norm, head) get their gradients from the
    SCHEDULED PLAN, not from eager collectives (design below).

The edges in the schedule (``moegraph.edges``, added to the stacked graph after the passes).
The graph the plan schedules holds, besides the layers:
  * the eager compute, priced (nodes with attr ``eager``, which the executor skips: autograd
    runs them): forward ``edges.norm`` (RMSNORM, 4*T*h FLOPs; a LayerNorm's NORM, 7*T*h) and
    ``edges.lm_head`` (GEMM, 2*T*h*V; then ``edges.logit_scale``, SCALE, with a logit scale) after
    the last layer's forward; backward (``.logit_scale.dgrad``,) ``edges.lm_head.dgrad`` / ``.wgrad``
    (2*T*h*V each) and ``edges.norm.dgrad`` / ``.wgrad``, which make the last layer's incoming
    gradient (the layers' seed) and the partial gradients: every layer's backward is scheduled
    after them, as autograd runs it (T = b*s/n tokens on this rank);
  * the head and norm gradient sync: the partials' all-reduce (``edges.lm_head.grad_allreduce``,
    ``edges.norm.grad_allreduce``; with dp > 1 ``autodiff._dp_sync``'s hierarchical
    reduce-scatter / all-gather; at dp == 1 a head gradient over 25 MiB in row buckets,
    ``edges.lm_head.bucket{i}.*``, joined into the same synced value), read by nothing else, so
    it may run under any layer's backward;
  * the embedding gradient: ``edges.embed.grad_gather`` all-gathers layer 0's input gradient
    [b, s/n, h] -> [b, s, h] (then over the replicas to [dp*b, s, h]) after layer 0's backward;
    each rank scatters the rows into the FULL embedding gradient by the global input_ids it
    holds ((n-1)/n*b*s*h bytes per rank instead of an all-reduce's 2(n-1)/n*V*h). With dp > 1
    and fewer inter-node bytes (``moegraph.edges.EmbedGrad.PARTIAL``) the plan instead runs
    ``edges.embed.scatter`` after layer 0's backward: the kernel the backward passes it
    (``Executor.backward_edges(eager_kernels=...)``) index_adds this rank's rows [b, s/n, h] by its own input_ids
    shard into a partial [V, h] (padding row zeroed), which the plan's ``_dp_sync`` sums over the
    n ranks and averages over the replicas; the synchronised [V, h] is the embedding gradient.
Runtime: ONE autograd Function (``ScheduledStep``) runs embedding -> the plan's forward -> norm
-> head. Its backward runs the head and norm backward eagerly (``torch.autograd.grad`` on the
graph its forward recorded), then the plan's backward (``Executor.backward_edges``) with the
seed and the partials as inputs; the plan issues the edge collectives in its order on its
streams and returns the synchronised gradients and the gathered rows. If the plan lacked them
the edges' gradients would be each rank's partials (tests/test_edges.py makes them no-ops and
sees the gradients go wrong). Without gradients (``torch.no_grad``) the same parts run as plain
eager code around ``CompiledLayer.forward``.

Data parallelism (dp = D > 1, n x D ranks, replica-major as ``layout.Layout``): every rank
still gets the GLOBAL batch (input_ids, labels [D*b, s]); replica p takes rows p*b .. (p+1)*b - 1
(``CompiledLayer.shard_input``), rank r of it its sequence shard. The loss is the global mean
over ALL replicas' non-ignored tokens (the count comes from the full labels every rank holds), so
it equals eager on the global batch even when replicas hold different numbers of ignored labels
(a mean of replica means would not). Its terms are summed over all n x D ranks (the default
group). The graph's DP sync averages the layer parameters' gradients over replicas (a MEAN,
docs/runtime.md "Data parallelism"), so every global-to-local backward boundary here (the loss
all-reduce, the logits / hidden-state gather) seeds this rank's part with D x the incoming
gradient: the
replica-mean of D x each replica's gradient is the sum over replicas, i.e. after backward every
parameter gradient equals eager's on the global batch (not divided by D, unlike a bare
CompiledLayer). The head and norm partials take the same replica-mean (``_dp_sync``); the
embedding's rows, gathered from all n x D ranks, are scattered and divided by D (ROWS), or its
partials take the replica-mean of the sync (PARTIAL: no division here). Logits [D*b, s, V] are
gathered from all n x D ranks.

Micro-batches (``compile_model(..., micro_batches=M)``, M >= 2, a causal LM): the stack is
merged over M micro-batches (``moegraph.microbatch``) before ``add_edges``, so ONE plan holds the
optimizer step's M forwards and backwards and every micro-batch's edges. ``train_step(input_ids,
labels)`` (M of each) runs it: the embedding forward per micro-batch before the plan (its input
shard); inside, the executor runs every eager edge node at its plan position as a plan-run
eager kernel (``EdgeStep``: norm, head and loss forward under autograd, kept per micro-batch;
their backward makes micro-batch j's seed and adds its head and norm partials into the previous
micro-batch's); the plan syncs the summed partials once and gathers each micro-batch's layer-0
input gradient, which scatters into the embedding gradient after the plan (ROWS), or (PARTIAL,
``moegraph.edges.EmbedGrad``) runs each micro-batch's ``mb{j}.edges.embed.scatter`` after its
layer 0's backward, bound to its input_ids shard and adding into micro-batch j-1's partial, and
syncs the last partial once (the synchronised [V, h] is the embedding gradient). Loss
convention: the gradient of the MEAN of the M micro-batch losses, eager's ``(loss / M).backward()``
per micro-batch, added to ``.grad`` (given ``num_items_in_batch``, transformers' Trainer's: the SUM of
each summed cross-entropy / N); ``forward`` refuses such a model. Each micro-batch may be right-padded
or packed (its own ``attention_mask`` / ``position_ids``: its nodes read its layout, ``step_layouts``).

``parameters()`` are this rank's shards (any torch optimizer works on them). Checkpoints use
the ORIGINAL module's names: ``full_state_dict()`` gathers full tensors (a collective),
``load_state_dict(original_state_dict)`` cuts this rank's shards.

Notation: b batch (one replica's rows), s sequence, h hidden, n ranks per replica, dp replicas, V vocabulary,
T = b*s/n tokens on this rank.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moegraph.config import CompileConfig
from moegraph.edges import EmbedGrad, aux_loss_value, edge_values, embed_rows
from moegraph.interpreter import unshard_grad, writes_region
from moegraph.ir import Graph
from moegraph.layers import PARAM_PREFIX, layer_count
from moegraph.lowering import ModelOutput, ModelSpec, train_only_settings
from moegraph.models import IGNORE_INDEX, shift_labels
from moegraph.runtime import RuntimeFailure
from moegraph.runtime.module import (DTYPES, CompiledLayer, accumulate_grads, build_layer, compiled_plan,
                                     frozen_sources, refuse_autocast, refuse_cast, replica_batch)
from moegraph.runtime.grad_norm import clip_grad_norm
from moegraph.runtime.model_result import ModelResult
from moegraph.runtime.options import RuntimeOptions
from moegraph.runtime.native_budgets import runnable_config, world_backend
from moegraph.runtime.plan import ExecutionPlan
from moegraph.runtime.model_steps import (EdgeStep, GatherSequence, ScheduledStep, SumOverRanks, batch_layout,
                                         check_edge_head, check_same_inputs, final_norm, head_logits, norm_params,
                                         split_norm, step_layouts)
from moegraph.tokens import Tokens, batch_forms, micro_batch_forms
from moegraph.token_layout import gathered_tokens

if TYPE_CHECKING:
    from moegraph.schedules.schedule_file import Schedule


class LoadResult(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


class CompiledModel(nn.Module):
    """A causal LM on this rank (module docstring). Build it with ``moegraph.compile(model, input_ids)``."""

    def _apply(self, fn, recurse: bool = True):
        refuse_cast(self, fn)
        return super()._apply(fn, recurse)

    def __init__(self, spec: ModelSpec, layers: CompiledLayer, full: Mapping[str, torch.Tensor],
                 state_keys: Sequence[str], *, batch: int, seq: int,
                 positional: Sequence[str] = ("labels",), frozen: frozenset[str] = frozenset()):
        """``batch``: b, one replica's rows (the global batch is dp*b); rank, n and dp come from
        ``layers.layout``. ``frozen``: the original's parameter names with requires_grad=False."""
        super().__init__()
        # the original forward's parameters after input_ids, so positional calls mean what they
        # meant there (transformers: attention_mask comes second, labels much later)
        self.positional = tuple(positional)
        self.spec, self.layers = spec, layers
        # rank: within the replica (the sequence shard); the world is n x dp ranks
        self.rank, self.n, self.dp = layers.layout.mp_rank, layers.layout.n, layers.layout.dp
        self.batch, self.seq = batch, seq
        # a frozen (requires_grad=False) original parameter stays frozen: no gradient reaches its .grad
        trains = lambda k: k not in frozen  # noqa: E731
        self.embed = nn.Parameter(full[spec.embed].detach().clone(), requires_grad=trains(spec.embed))
        # the final norm's weight (and bias) as one vector, as the edges' one partial (norm_params)
        if len({trains(k) for k in spec.norm_names}) > 1:
            raise RuntimeFailure(f"the final norm's {' and '.join(spec.norm_names)}: one frozen, one trained is not "
                                 "supported (the compiled model holds them as one vector)")
        self.norm = nn.Parameter(norm_params(full, spec).clone(), requires_grad=trains(spec.norm))
        # tied (spec.tied): the head IS the embedding, one parameter; autograd and accumulate_grads
        # add the head's synced gradient and the embedding's into its .grad, as in the original
        self.lm_head = (self.embed if spec.tied else
                        nn.Parameter(full[spec.head].detach().clone(), requires_grad=trains(spec.head))
                        if spec.head is not None else None)
        self._state_keys = list(state_keys)
        # the original's shapes, which load_state_dict holds every tensor to (a [1] would broadcast)
        self._state_shapes = {k: tuple(full[k].shape) for k in self._state_keys if k in full}
        # persistent state no part reads (declared unused by the model rule): kept as it was
        self._constants = {k: full[k].detach().clone() for k in self._state_keys if k in spec.unused}
        edges = edge_values(layers.graph)
        if edges is None or (edges.head_partial is None) != (self.lm_head is None):
            raise RuntimeFailure(f"graph {layers.graph.name!r} carries no edges matching the model (head: "
                                 f"{self.lm_head is not None}): build it with moegraph.passes.edges.add_edges after the passes")
        check_edge_head(edges, spec.edge_head, layers.graph.name)
        self.edges = edges
        self.micro_batches = layers.micro_batches
        if self.micro_batches > 1 and self.lm_head is None:
            raise RuntimeFailure(f"a step of {self.micro_batches} micro-batches trains a causal LM: its loss seeds "
                                 "each micro-batch's backward, and this model has no LM head")

    def _embed_scatter(self, ids: torch.Tensor, ins: list[torch.Tensor], *,
                       accumulate: bool = False) -> list[torch.Tensor]:
        """``edges.embed.scatter`` (PARTIAL): this rank's layer-0 input gradient rows [b, s/n, h]
        index_add-ed by its input_ids shard ``ids`` [b, s/n] into a partial [V, h]; the padding row
        gets no gradient (nn.Embedding). Run by the executor at the node's plan position (the step's
        backward passes it, bound to its ids, as an eager kernel). ``accumulate`` (a merged step's
        micro-batch j >= 1): ins are (rows, micro-batch j-1's partial), added into a copy of it."""
        if len(ins) != 1 + accumulate:
            raise RuntimeFailure(f"the embedding scatter takes {1 + accumulate} input(s) (rows"
                                 f"{', the previous partial' if accumulate else ''}), got {len(ins)}")
        rows = ins[0]
        base = ins[1].clone() if accumulate else rows.new_zeros(tuple(self.embed.shape))
        return [self._scatter_rows(base, ids, rows)]

    def _embed_grad(self, synced: dict[str, torch.Tensor], input_ids: Sequence[torch.Tensor]) -> torch.Tensor:
        """The embedding's gradient from the plan's edge outputs ``synced``: PARTIAL's synchronised
        [V, h] (scattered by ``_embed_scatter``, summed and replica-averaged by the plan), or ROWS:
        every micro-batch's gathered rows [dp*b, s, h] scattered by its full ``input_ids[j]``
        [dp*b, s] on every rank, divided by dp (the rows hold dp x each replica's: module docstring)."""
        edges = self.edges
        if edges.embed_grad is EmbedGrad.PARTIAL:
            return synced[edges.embed_synced].to(self.embed.dtype)
        if edges.embed_grad is EmbedGrad.ROWS:
            d_embed = torch.zeros_like(self.embed)
            st = self.layers.graph.strategy
            for ids, rows in zip(input_ids, edges.embed_gathered, strict=True):     # ids [dp*b, s]
                ids = torch.cat([gathered_tokens(part, st) for part in ids.chunk(self.dp)])   # as the rows gathered
                self._scatter_rows(d_embed, ids, synced[rows])
            return d_embed / self.dp if self.dp > 1 else d_embed
        raise RuntimeFailure(f"embedding gradient pattern {edges.embed_grad!r} is not one of "
                             f"{[p.value for p in EmbedGrad]}")

    def _scatter_rows(self, base: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``base`` [V, h] += the gradient rows [..., h] index_add-ed by their token ``ids`` [...],
        in place; the padding row gets no gradient (nn.Embedding); rows of a scaled embedding times its scale."""
        scale = self.spec.edge_head.embed_scale
        base.index_add_(0, ids.flatten(), (rows.flatten(0, -2) * scale if scale != 1 else rows.flatten(0, -2)).to(base.dtype))
        if self.spec.padding_idx is not None:
            base[self.spec.padding_idx] = 0
        return base

    # -- running ---------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, *args: Any, output_logits: bool = True, **kwargs: Any) -> ModelResult:
        """Called as the original: input_ids and labels the full [dp*b, s] on every rank (the same
        on each); positional arguments follow the original forward's order. Returns ``.loss`` when
        labels are given and ``.logits`` [b, s, V], as transformers does (``output_logits=False``
        skips gathering them when only the loss is wanted; a base model: ``.last_hidden_state`` [b, s, h]).
        attention_mask: None, all ones, or right padding [dp*b, s]; position_ids: None, or packed
        documents' positions [dp*b, s] or [1, s] (``moegraph.tokens``: either, not both). The
        original's switches are accepted when they ask for what is compiled (use_cache=False,
        output_attentions=False, output_hidden_states=False, return_dict=True, logits_to_keep=0,
        output_router_logits as compiled); any other value, and any other argument of the original
        (past_key_values, ...) unless None, raises naming it."""
        if self.micro_batches > 1:
            raise RuntimeFailure(f"the model was compiled for a step of {self.micro_batches} micro-batches "
                                 "(micro_batches=M): run it with train_step(input_ids, labels), one tensor of each "
                                 "per micro-batch, not by calling it")
        if len(args) > len(self.positional):
            raise TypeError(f"{len(args) + 1} positional arguments; the original takes at most "
                            f"{len(self.positional) + 1}")
        for name, value in zip(self.positional, args):
            if name in kwargs:
                raise TypeError(f"got {name!r} both by position and by name")
            kwargs[name] = value
        labels, attention_mask = kwargs.pop("labels", None), kwargs.pop("attention_mask", None)
        position_ids = kwargs.pop("position_ids", None)
        # switches of the original's forward, accepted when they ask for what the compiled model does
        does = {"use_cache": False, "output_attentions": False, "output_hidden_states": False, "return_dict": True,
                "logits_to_keep": 0, "output_router_logits": bool(self.edges.aux_stats)}
        for name, value in kwargs.items():
            if name in does and value is not None and (not isinstance(value, (bool, int)) or value != does[name]):
                raise ValueError(f"{name}={value!r}: the model was compiled to run as {name}={does[name]!r} "
                                 + ("(compile it from a config with the same output_router_logits)"
                                    if name == "output_router_logits" else "(pass it so, or leave it out)"))
        other = sorted(k for k, v in kwargs.items() if v is not None and k not in does)
        if other:
            raise ValueError(f"argument(s) {', '.join(other)} are not supported by the compiled model "
                             "(only input_ids, labels, a right-padding attention_mask or packed position_ids, and "
                             f"{', '.join(f'{k}={v!r}' for k, v in does.items())})")
        if labels is not None and self.spec.output is not ModelOutput.CAUSAL_LM:
            raise ValueError("labels given, but the compiled model is a base model without an LM head")
        if not torch.is_tensor(input_ids):
            raise TypeError(f"input_ids is {type(input_ids).__name__}: the compiled model takes token ids [b, s]")
        refuse_autocast(input_ids.device.type, "the compiled model")
        if tuple(input_ids.shape) != (self.dp * self.batch, self.seq):
            what = "[b, s]" if self.dp == 1 else f"[dp*b, s] (dp={self.dp} replicas of b={self.batch} rows)"
            raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}; the model was compiled for "
                             f"{what} = {[self.dp * self.batch, self.seq]}")
        tokens = self._tokens(attention_mask, position_ids, kwargs.get("use_cache"))
        if labels is not None and tuple(labels.shape) != tuple(input_ids.shape):
            raise ValueError(f"labels has shape {tuple(labels.shape)}, input_ids {tuple(input_ids.shape)}")
        check_same_inputs((input_ids, labels, attention_mask, position_ids), "input_ids, labels and masks",
                          self.layers.executor.device)
        aux = None
        if torch.is_grad_enabled():
            out, aux = ScheduledStep.apply(self, input_ids, tokens, self.embed, self.norm, self.lm_head,
                                            *self.layers.params())
        else:
            x = embed_rows(self.layers.shard_input(input_ids), self.embed, self.spec.edge_head, self.spec.padding_idx)
            with batch_layout(self.layers.executor, tokens):
                y, kept = self.layers.forward_only(x, keep=self.edges.aux_stats)   # the aux stats, if any
            aux = self._aux_value(kept)
            out = final_norm(y, self.norm, self.spec.edge_head)                # [b, s/n, h]
            if self.lm_head is not None:
                out = head_logits(out, self.lm_head, self.spec.edge_head)       # [b, s/n, V]
        aux = aux if self.edges.aux_stats else None
        if self.spec.output is ModelOutput.HIDDEN:
            return ModelResult(last_hidden_state=self._gather(out))
        if self.spec.output is not ModelOutput.CAUSAL_LM:
            raise RuntimeFailure(f"model output {self.spec.output} is not one of {[o.value for o in ModelOutput]}")
        logits = out
        loss = None
        if labels is not None:
            term = self._loss_term(logits, *self._shard_labels(labels))
            loss = SumOverRanks.apply(term, self.dp) if self.layers.layout.world > 1 else term
            if aux is not None:                             # transformers: loss += coef * aux_loss
                loss = loss + self.edges.aux_coef * aux
        full_logits = self._gather(logits) if output_logits or labels is None else None   # transformers: both
        return ModelResult(loss=loss, logits=full_logits, aux_loss=aux)

    def _tokens(self, attention_mask, position_ids, use_cache) -> Tokens | None:
        """This replica's batch layout (``moegraph.tokens``: right padding or packed documents), or
        None for a plain batch; refused by name where the compiled step would differ from eager
        (transformers masks packed documents apart only without a cache: ``use_cache=False``)."""
        tokens = self.forms.layout(attention_mask, position_ids, self.dp * self.batch, self.seq, self.embed.device,
                                   use_cache)
        if tokens is None:
            return None
        if self.layers.cuda_graphs != "off":
            raise ValueError(f"attention_mask / position_ids with cuda_graphs={self.layers.cuda_graphs!r}: the "
                             "captured kernels hold no batch layout (run without CUDA graphs)")
        r = self.layers.layout.replica
        return tokens.rows(slice(r * self.batch, (r + 1) * self.batch))

    @torch.no_grad()
    def train_step(self, input_ids: Sequence[torch.Tensor], labels: Sequence[torch.Tensor], *,
                   attention_mask: Sequence[torch.Tensor | None] | None = None,
                   position_ids: Sequence[torch.Tensor | None] | None = None,
                   num_items_in_batch: int | torch.Tensor | None = None) -> list[torch.Tensor]:
        """One optimizer step of M micro-batches (``micro_batches=M`` >= 2 at compile time) in the
        merged schedule's order: ``input_ids[j]``, ``labels[j]`` are micro-batch j's full [b, s]
        (the same on every rank, as ``forward`` takes them); ``attention_mask[j]`` (right padding)
        or ``position_ids[j]`` (packed documents), each None or M entries (an entry None: a plain
        batch), as ``forward`` takes them, run as use_cache=False (a training step builds no
        cache: packed documents attend within themselves). Returns the M losses (each what
        ``model(input_ids[j], labels=labels[j], ...).loss`` returns: the mean over its scored
        tokens, labels -100 ignored), detached. Loss convention: the MEAN over micro-batches, the
        usual gradient-accumulation loop's ``(loss / M).backward()``: the gradients ADDED to every
        parameter's ``.grad`` (embedding, layer shards, final norm, head; as backward, on top of
        what is there) are the gradient of sum_j loss_j / M, each micro-batch weighted 1/M whatever
        its count of scored tokens. ``num_items_in_batch`` N (transformers' Trainer's: the step's
        scored tokens, every micro-batch's shifted labels not -100): each loss is instead its summed
        cross-entropy / N (``model(..., num_items_in_batch=N).loss``) and the step adds the gradient
        of their SUM, as the Trainer's loop (it divides by no M then). Every rank must call it
        (collective)."""
        M = self.micro_batches
        if M == 1:
            raise RuntimeFailure("the model was compiled for one micro-batch: call it (model(input_ids, labels=...)"
                                 ".loss.backward()); train_step runs a step compiled with micro_batches=M >= 2")
        refuse_autocast(self.layers.executor.device.type, "the compiled model's train_step")
        shape = (self.dp * self.batch, self.seq)
        for what, seq in (("input_ids", input_ids), ("labels", labels)):
            if isinstance(seq, torch.Tensor) or not isinstance(seq, Sequence) or len(seq) != M:
                got = (f"one tensor {list(seq.shape)}" if isinstance(seq, torch.Tensor) else
                       f"{len(seq)}" if isinstance(seq, Sequence) else type(seq).__name__)
                raise ValueError(f"train_step takes {what} as a sequence of {M} tensors (one per micro-batch, "
                                 f"micro_batches={M}), got {got}")
            for j, t in enumerate(seq):
                ok = isinstance(t, torch.Tensor) and t.dtype in (torch.int32, torch.int64) and tuple(t.shape) == shape
                if not ok:
                    desc = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ValueError(f"micro-batch {j}'s {what} is {desc}; the model was compiled for integer "
                                     f"[b, s] = {list(shape)} per micro-batch")
        layouts = self._step_tokens(attention_mask, position_ids)
        check_same_inputs((*input_ids, *labels, *(attention_mask or ()), *(position_ids or ())),
                          "train_step's input_ids, labels and masks", self.layers.executor.device)
        shards = [self._shard_labels(lab) for lab in labels]
        weight = 1.0 / M
        if num_items_in_batch is not None:     # transformers' fixed_cross_entropy: sum / N, the losses summed
            items = torch.as_tensor(num_items_in_batch)
            if items.dim() != 0 or items.dtype not in (torch.int32, torch.int64) or int(items) < 1:
                raise ValueError(f"num_items_in_batch={num_items_in_batch!r}: pass the step's count of scored tokens, "
                                 "a positive integer (or a 0-d integer tensor)")
            shards, weight = [(mine, items.to(mine.device)) for mine, _ in shards], 1.0
        layers, edges = self.layers, self.edges
        params = layers.params()
        step = EdgeStep(self, shards, [layers.shard_input(ids) for ids in input_ids], weight)
        xs = [embed_rows(layers.shard_input(ids), self.embed, self.spec.edge_head, self.spec.padding_idx) for ids in input_ids]
        rec = layers._new_recorder()
        # each micro-batch's aux loss seeded as its LM loss: weight (1/M, the mean), x dp (the DP sync
        # averages) (on the model's device: the routers' backward multiplies it into their device stats)
        aux_seeds = {name: torch.full((1,), edges.aux_coef * self.dp * weight, device=self.embed.device)
                     for name in edges.aux_seeds}
        with step_layouts(layers.executor, layouts):
            _, _, grads, synced = layers.executor.step_edges(xs, [p.detach() for p in params],
                                                             eager_kernels=step.kernels(layers.graph), recorder=rec,
                                                             aux_seeds=aux_seeds)
        layers._keep(rec)
        step.check_done()
        accumulate_grads((*params, self.embed, self.norm, self.lm_head),
                         (*grads, self._embed_grad(synced, input_ids), synced[edges.norm_synced].to(self.norm.dtype),
                          synced[edges.head_synced].to(self.lm_head.dtype)))
        terms = torch.stack(step.terms)                    # this rank's terms of the M losses
        if layers.layout.world > 1:
            dist.all_reduce(terms)
        if edges.aux_stats:                                 # + coef * each micro-batch's aux loss
            terms = terms + edges.aux_coef * torch.stack([aux_loss_value(synced[name], edges.aux_experts)
                                                     for name in edges.aux_stats])
        return list(terms.unbind())

    def _step_tokens(self, attention_mask, position_ids) -> list[Tokens | None]:
        """Each micro-batch's batch layout (``_tokens``, as use_cache=False) of train_step's
        per-micro-batch attention_mask / position_ids (None, or M entries each None or a tensor)."""
        layouts = []
        for j, (mask, positions) in enumerate(micro_batch_forms(attention_mask, position_ids, self.micro_batches)):
            try:
                layouts.append(self._tokens(mask, positions, use_cache=False))
            except ValueError as err:
                raise type(err)(f"micro-batch {j}'s {err}") from None
        return layouts

    def _aux_value(self, saved: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The router's aux loss from the plan's global stats (kept by its forward: the routers'
        backward reads them), a scalar; 0 without an aux loss."""
        edges = self.edges
        if not edges.aux_stats:
            return torch.zeros((), device=self.embed.device)
        stats = saved[edges.aux_stats[0]]
        return aux_loss_value(stats, edges.aux_experts)

    def _shard_labels(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's shifted labels [b, s/n], the global count of scored tokens) of the full
        labels [dp*b, s]: the shift is taken before the cut (it crosses shards), the count over
        every replica's tokens (module docstring)."""
        shifted = shift_labels(labels)
        return self.layers.shard_input(shifted), (shifted != IGNORE_INDEX).sum()

    @staticmethod
    def _loss_term(logits: torch.Tensor, mine: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """This rank's term of the global mean cross-entropy: its shard's sum / the global count."""
        return F.cross_entropy(logits.float().flatten(0, 1), mine.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum") / count

    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        return GatherSequence.apply(shard, self.layers) if self.layers.layout.world > 1 else shard

    # -- checkpoints -----------------------------------------------------------------------------

    def original_name(self, graph_qualname: str) -> str:
        return original_name(self.spec, self.layers.graph, graph_qualname)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors under the original module's state_dict names, in its order, on every rank
        (a collective: every rank must call it; the shards are gathered within each replica)."""
        graph, rank, n = self.layers.graph, self.rank, self.n
        regions: dict[str, torch.Tensor] = {}
        for pname, spec in graph.params:
            shard = self.layers.shard(pname)
            for src in spec.sources:
                regions.setdefault(src.qualname, shard.new_zeros(self.layers.full_shapes[src.qualname]))
        for pname, spec in graph.params:
            if not writes_region(spec, rank, n):          # identical on the ranks that skip it
                continue
            unshard_grad(spec, self.layers.shard(pname).detach(), rank, n, regions)
        if n > 1:
            for t in regions.values():                    # within the replica: each holds every shard
                dist.all_reduce(t, group=self.layers.executor.comm.mp_group)
        out = {self.original_name(q): t for q, t in regions.items()}
        out[self.spec.embed] = self.embed.detach().clone()
        out |= split_norm(self.norm.detach().clone(), self.spec)
        if self.lm_head is not None:
            out[self.spec.head] = self.lm_head.detach().clone()
        out |= {k: v.clone() for k, v in self._constants.items()}
        missing = [k for k in self._state_keys if k not in out]
        if missing:
            raise RuntimeFailure(f"full_state_dict cannot rebuild {', '.join(missing)} (a runtime bug)")
        return {k: out[k] for k in self._state_keys}

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ of the original module, on this rank's pieces: the GLOBAL
        gradient norm (each region of the original's parameters counted once), the same scale on
        every rank; returns the total norm. A collective. Not torch's utility on ``parameters()``:
        that takes one rank's shards' norm (``moegraph.runtime.grad_norm``)."""
        return clip_grad_norm(self, max_norm, norm_type, error_if_nonfinite)

    @torch.no_grad()
    def full_grads(self) -> dict[str, torch.Tensor]:
        """Full gradients under the original module's parameter names, on every rank (a collective;
        parameters without a gradient count as zero)."""
        out = {self.original_name(q): g for q, g in self.layers.full_grads().items()}
        for name, p in ((self.spec.embed, self.embed), (self.spec.head, self.lm_head)):
            if p is not None:
                out[name] = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        out |= split_norm(self.norm.grad.clone() if self.norm.grad is not None else torch.zeros_like(self.norm),
                          self.spec)
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> LoadResult:
        """Load the ORIGINAL module's state dict (e.g. ``model.state_dict()`` or a
        ``full_state_dict()``): cut this rank's shards. Not a collective. ``strict``: keys the
        original model does not have raise; missing keys always raise (no shard may stay stale)."""
        if assign:
            raise ValueError("assign=True is not supported: the compiled model's tensors are shards, not the originals")
        missing = [k for k in self._state_keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in set(self._state_keys)]
        if missing or (strict and unexpected):
            raise KeyError(f"state_dict: missing {missing}, unexpected {unexpected} (the original model's names)")
        for k, want in self._state_shapes.items():
            got = tuple(torch.as_tensor(state_dict[k]).shape)
            if got != want:
                raise ValueError(f"state_dict: size mismatch for {k}: a tensor of shape {list(got)}, where the "
                                 f"original model's is {list(want)}")
        graph = self.layers.graph
        sources = {src.qualname for _, spec in graph.params for src in spec.sources}
        self.layers.load_full({q: state_dict[self.original_name(q)] for q in sources})
        self.embed.copy_(state_dict[self.spec.embed])
        self.norm.copy_(norm_params(state_dict, self.spec))
        if self.lm_head is not None:
            self.lm_head.copy_(state_dict[self.spec.head])
        return LoadResult([], unexpected)

    def extra_repr(self) -> str:
        return (f"output={self.spec.output.value}, layers={layer_count(self.layers.graph)}, b={self.batch}, "
                f"s={self.seq}, n={self.n}, dp={self.dp}")


def compile_model(model: nn.Module, input_ids: torch.Tensor, config: CompileConfig,
                  options: RuntimeOptions = RuntimeOptions(), *, n: int | None = None,
                  given: "Schedule | ExecutionPlan | None" = None) -> CompiledModel:
    """See ``moegraph.compile``: a causal LM (recognised by its model rule) and its input_ids
    [b, s] ([dp*b, s], the global batch, with dp replicas). The world and the input decide n
    (``n``, default the world size / dp), b, s and the dtype (the parameters'), replacing the
    config's; ``config.micro_batches`` M >= 2: one merged step plan of M micro-batches of that
    shape (``CompiledModel.train_step``). The driver compiles the config (the stack, its passes,
    the merge, the edges), or lowers it for ``given`` (a Schedule or ExecutionPlan, e.g. from a
    schedule file with ``config.passes`` RECORDED); the layers run the plan with ``options``."""
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"example input_ids must be integer token ids [b, s], got {input_ids.dtype} "
                         f"{list(input_ids.shape)}")
    rank, n, b = replica_batch(input_ids.shape[0], n, config.strategy.dp, "input_ids [dp*b, s]")
    s = input_ids.shape[1]
    if s % n:
        raise ValueError(f"sequence length {s} is not divisible by n={n}")
    full = {k: t.detach() for k, t in [*model.named_parameters(), *model.named_buffers()]}
    if meta := next((k for k, t in full.items() if t.is_meta), None):
        raise ValueError(f"{meta} is on the meta device (no values): materialise the model (to_empty, then load "
                         "its weights) before compiling it; the compile checks each layer against it numerically")
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    if len(dtypes) != 1 or next(model.parameters()).dtype not in DTYPES:
        raise ValueError(f"model parameters have dtypes {dtypes}: compile needs one of "
                         f"{sorted(map(str, DTYPES))} for all of them")
    # the module brings its layers, sizes and edges (its head): a registry model's do not apply
    config = runnable_config(config.replace(model=model, layers=1, top_k=None, edges="auto", batch=b, seq=s,
                                            strategy=dataclasses.replace(config.strategy, n=n,
                                                                         dtype=DTYPES[next(model.parameters()).dtype])),
                             world_backend())
    lowered, plan = compiled_plan(config, given)
    graph, spec = lowered.graph, lowered.spec
    layer_full = {q: full[original_name(spec, graph, q)]
                  for q in {src.qualname for _, ps in graph.params for src in ps.sources}}
    cold = frozen_sources(model.named_parameters())
    layers = build_layer(graph, plan, layer_full, rank=rank, n=n, options=options,
                         frozen=frozenset(q for q in layer_full if original_name(spec, graph, q) in cold))
    positional = [q.name for q in inspect.signature(model.forward).parameters.values()
                  if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)][1:]
    layers.train_only = train_only_settings(model)
    compiled = CompiledModel(spec, layers, full, list(model.state_dict()), batch=b, seq=s, positional=positional,
                             frozen=cold).train(model.training)    # the source's mode: eval stays eval
    # transformers builds a cache unless use_cache=False, and then ignores packed documents; some
    # families build their masks without position_ids at all (hf_common.masks_by_position)
    compiled.forms = batch_forms(model)
    return compiled


def original_name(spec: ModelSpec, graph: Graph, graph_qualname: str) -> str:
    """The original model's name of a stacked graph's parameter source (``moegraph.layers``:
    ``layers.{i}.<name>``; a one-layer graph keeps the layer's own names)."""
    if layer_count(graph) == 1:
        return f"{spec.layers}.0.{graph_qualname}"
    return spec.layers + graph_qualname[len(PARAM_PREFIX):]


__all__ = ["CompiledModel", "ModelResult", "compile_model"]
