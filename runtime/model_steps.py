"""The autograd glue of a compiled causal LM (``moegraph.runtime.model.CompiledModel``).

``ScheduledStep`` runs the layers' scheduled plan as one autograd function around the eager
edges (embedding, final norm, head, loss); ``EdgeStep`` gives a merged micro-batch step's plan
the eager kernels it runs at their scheduled positions (``Executor.step_edges``);
``SumOverRanks`` and ``GatherSequence`` are the two collectives autograd sees. Each passes its
state explicitly (ctx, arguments): nothing rides on the model between calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from moegraph.edges import EMBED_SCATTER, EdgeHead, EdgeValues, EmbedGrad, embed_rows, is_eager
from moegraph.family_kernels import layer_norm, limit
from moegraph.ir import Graph, OpKind, Role
from moegraph.lowering import ModelSpec
from moegraph.microbatch import mb_name, micro_batch_of
from moegraph.models import rms_norm
from moegraph.token_layout import batch_rows
from moegraph.tokens import Tokens
from moegraph.runtime import RuntimeFailure
from moegraph.runtime.autograd import once_only
from moegraph.runtime.executor import EagerKernel
from moegraph.runtime.module import CompiledLayer

if TYPE_CHECKING:
    from moegraph.runtime.model import CompiledModel



def norm_params(full: Mapping[str, torch.Tensor], spec: ModelSpec) -> torch.Tensor:
    """The final norm's parameters as the compiled model holds them, one vector [h] ([2h]: the
    weight, then a LayerNorm's bias), as the edges' one partial gradient (``EdgeHead.bias``)."""
    return torch.cat([full[name].detach().reshape(-1) for name in spec.norm_names])


def split_norm(params: torch.Tensor, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """``norm_params``' vector (or its gradient) back under the model's names."""
    return dict(zip(spec.norm_names, params.chunk(len(spec.norm_names))))


def final_norm(y: torch.Tensor, params: torch.Tensor, head: EdgeHead) -> torch.Tensor:
    """The model edges' final norm of this rank's rows [b, s/n, h] (``head``: ``moegraph.edges.EdgeHead``):
    an RMSNorm, or a LayerNorm computed as the NORM op's kind 'layer', then its bias; ``params`` the
    weight [h] (then the bias [h]: ``norm_params``)."""
    h = y.shape[-1]
    if params.shape[0] != head.norm_params * h or head.eps is None:
        raise RuntimeFailure(f"final norm parameters [{params.shape[0]}] for {head} of width {h} (a runtime bug)")
    if head.norm == "rms":
        return rms_norm(y, params + head.offset if head.offset else params, head.eps)
    if head.norm == "layer":
        out = layer_norm(y, params[:h], head.eps)
        return out + params[h:] if head.bias else out
    raise RuntimeFailure(f"final norm {head.norm!r} is not one of 'rms', 'layer'")


def head_logits(normed: torch.Tensor, weight: torch.Tensor, head: EdgeHead) -> torch.Tensor:
    """The LM head's logits [b, s/n, V] of the normed rows [b, s/n, h], times the model's
    ``logit_scale``, then soft-capped (``moegraph.edges.EdgeHead``: each only where it has it)."""
    logits = F.linear(normed, weight)                                                # [b, s/n, V]
    if head.logit_scale != 1:
        logits = logits * head.logit_scale
    return logits if head.softcap is None else limit(logits, "softcap", head.softcap)


def check_edge_head(edges: EdgeValues, head: EdgeHead, graph: str) -> None:
    """The graph's edge nodes price the final norm, logit scale and soft cap the eager edges compute
    (else the plan was built for another model's edges)."""
    if edges.head != head:
        raise RuntimeFailure(f"graph {graph!r} prices the model edges {edges.head}; the model computes {head}: lower "
                             "the graph from this model (AddEdges(head=spec.edge_head))")


class SumOverRanks(torch.autograd.Function):
    """Forward: all-reduce (sum, all n x dp ranks) of each rank's term of a global scalar.
    Backward: dp x identity. Every rank holds the same sum L = sum_r l_r and seeds its backward
    with the same dL; the gradient of L by rank r's own term l_r is dL, which rank r already has
    (no communication); x dp because the gradients are then averaged over replicas (module
    docstring)."""

    @staticmethod
    def forward(ctx, term: torch.Tensor, dp: int) -> torch.Tensor:
        ctx.dp = dp
        total = term.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.dp if ctx.dp > 1 else grad, None


def check_same_inputs(tensors: Sequence[torch.Tensor | None], what: str, device: torch.device) -> None:
    """Every rank must pass the same global batch (each takes its own shard of it): a fingerprint
    of ``tensors`` (token ids, labels, masks, positions), its MAX and MIN over the world, one
    small all-reduce on ``device`` (the ranks' own: NCCL reduces CUDA tensors). A data-parallel
    habit (each rank its own batch) would otherwise train on rows spliced from several ranks'
    batches, with no error."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    present = [t for t in tensors if t is not None]
    mix = torch.zeros((), dtype=torch.int64, device=device)
    for i, t in enumerate(present):       # position-weighted (a permutation changes it), wrapping int64
        flat = t.reshape(-1).to(device=device, dtype=torch.int64)
        weights = torch.arange(flat.numel(), dtype=torch.int64, device=device) % 1_000_003 + 1 + i
        mix += (flat * weights).sum()
    both = torch.stack([mix, -mix])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    if int(both[0]) != -int(both[1]):
        raise ValueError(f"{what} differ between ranks: every rank passes the same global batch (the compiled "
                         "model takes each rank's shard of it), not a batch of its own")


@contextlib.contextmanager
def batch_layout(executor, tokens: Tokens | None):
    """Run ``executor``'s kernels with the batch layout ``tokens`` (padding, packed documents:
    ``moegraph.tokens``; the RankContext they read), then restore the plain one."""
    if tokens is None:
        yield
        return
    plain = executor.ctx
    executor.ctx = dataclasses.replace(plain, tokens=rank_rows(executor, tokens))
    try:
        yield
    finally:
        executor.ctx = plain


def rank_rows(executor, tokens: Tokens) -> Tokens:
    """The layout of the batch rows this rank holds (all b, or a node's b/N under Strategy.attn_nodes:
    ``moegraph.token_layout``)."""
    st = executor.graph.strategy
    if st.attn_nodes == 1:
        return tokens
    return tokens.rows(batch_rows(st, executor.rank, executor.graph.dims.b))


@contextlib.contextmanager
def step_layouts(executor, tokens: Sequence[Tokens | None]):
    """Run a merged step's kernels with micro-batch j's batch layout ``tokens[j]`` (None: a plain
    batch): the RankContext its nodes read (``Executor.node_ctx``; the step-level nodes, gradient
    sums and syncs, read none), then restore the plain one."""
    if all(t is None for t in tokens):
        yield
        return
    ctxs = [None if t is None else dataclasses.replace(executor.ctx, tokens=rank_rows(executor, t)) for t in tokens]
    executor.node_ctx = {nd.name: ctxs[j] for nd in executor.graph.nodes
                         if (j := micro_batch_of(nd)) is not None and ctxs[j] is not None}
    try:
        yield
    finally:
        executor.node_ctx = {}


class ScheduledStep(torch.autograd.Function):
    """embedding -> the plan's layers -> final norm (-> LM head), with the edges' gradients
    synchronised by the plan (module docstring). Forward returns this rank's logits shard
    [b, s/n, V] (a base model: the normed hidden shard [b, s/n, h]) and the router's aux loss
    (a scalar, the global batch's, identical on every rank; 0 without one). Backward: the aux
    loss's gradient (x dp, as the loss's) is the plan's aux seed (moegraph.edges); the eager head and
    norm backward give dy and their partial gradients; the plan's backward takes dy and the
    partials and returns the layer gradients, the synchronised head and norm gradients and the
    gathered layer-0 input gradient rows [dp*b, s, h], which scatter into the full embedding
    gradient by the global input_ids (every rank holds them)."""

    @staticmethod
    def forward(ctx, model: "CompiledModel", input_ids: torch.Tensor, tokens: Tokens | None, embed: torch.Tensor,
                norm: torch.Tensor, head: torch.Tensor | None, *params: torch.Tensor) -> torch.Tensor:
        layers = model.layers
        x = embed_rows(layers.shard_input(input_ids), embed, model.spec.edge_head, model.spec.padding_idx)  # [b, s/n, h]
        rec = layers._new_recorder()
        with batch_layout(layers.executor, tokens):
            y, saved = layers.executor.forward(x, params, recorder=rec)
        aux = model._aux_value(saved)
        with torch.enable_grad():
            y_in = y.detach().requires_grad_()
            leaves = [y_in, norm.detach().requires_grad_()]
            out = final_norm(y_in, leaves[1], model.spec.edge_head)              # [b, s/n, h]
            if head is not None:
                leaves.append(head.detach().requires_grad_())
                out = head_logits(out, leaves[2], model.spec.edge_head)           # [b, s/n, V]
        # the backward runs with this step's layout, whatever forwards ran since
        ctx.model, ctx.state, ctx.eager, ctx.tokens = model, (saved, rec), (out, leaves), tokens
        ctx.save_for_backward(input_ids, embed, *params)   # version-checked: no in-place update before backward
        return out.detach(), aux

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out: torch.Tensor, d_aux: torch.Tensor):
        model, layers, edges = ctx.model, ctx.model.layers, ctx.model.edges
        input_ids, embed, *params = ctx.saved_tensors
        once_only(ctx.state)
        (saved, rec), ctx.state = ctx.state, None          # free the saved activations as backward starts
        (out, leaves), ctx.eager = ctx.eager, None
        dy, *partial = torch.autograd.grad(out, leaves, d_out)
        partials = dict(zip(edges.partials, partial))      # (norm, head) in EdgeValues.partials order
        for seed in edges.aux_seeds:                        # x dp: the plan's DP sync averages (module docstring)
            partials[seed] = (d_aux * model.dp).float().reshape(1)
        if rec is not None:
            rec.mark_backward(torch.cuda.current_stream(dy.device) if dy.is_cuda else None)
        # PARTIAL: the plan's edges.embed.scatter runs on this step's input_ids shard [b, s/n]
        kernels = ({EMBED_SCATTER: functools.partial(model._embed_scatter, layers.shard_input(input_ids))}
                   if edges.embed_grad is EmbedGrad.PARTIAL else {})
        with batch_layout(layers.executor, ctx.tokens):
            _, grads, synced = layers.executor.backward_edges(saved, dy, params, partials, recorder=rec,
                                                              eager_kernels=kernels)
        layers._keep(rec)
        d_embed = model._embed_grad(synced, [input_ids])
        d_norm = synced[edges.norm_synced].to(leaves[1].dtype)     # _dp_sync's main gradients are fp32
        d_head = synced[edges.head_synced].to(leaves[2].dtype) if edges.head_synced is not None else None
        return None, None, None, d_embed, d_norm, d_head, *grads


class EdgeStep:
    """One merged step's eager edge kernels (``CompiledModel.train_step``), run by the executor at
    their plan positions (``Executor.step_edges``), each ins -> outs. Micro-batch j's

      norm          (RMSNORM or NORM 'layer', forward)  y -> normed: the final norm (``final_norm``)
                                        under autograd, on fresh leaves (y, the norm weight); the
                                        graph is kept here;
      lm_head       (GEMM, forward)     normed -> logits, and (without a logit scale) this rank's
                                        loss term (its shard's summed cross-entropy / the
                                        micro-batch's global count);
      logit_scale   (SCALE, forward)    logits -> logits x the model's logit_scale, and, last, the loss term;
      logit_softcap (LIMIT, forward)    (scaled) logits -> c tanh(. / c), and the loss term (``EdgeHead``);
      logit_softcap.dgrad, logit_scale.dgrad, lm_head.dgrad / .wgrad
                                        the term's backward to (the logits, normed, the head weight),
                                        seeded with ``weight`` (1/M: the mean over micro-batches), run
                                        by whichever of them the plan reaches first; they return
                                        d_logits, d_normed and the head's partial (+ the previous
                                        micro-batch's, attr accumulate);
      norm.dgrad / .wgrad               normed's backward from the d_normed the plan hands them to
                                        (y, the norm weight): micro-batch j's seed, the norm's partial
                                        (+ the previous one's);
      embed.scatter (PARTIAL)           layer 0's input gradient rows [b, s/n, h] -> the embedding's
                                        partial [V, h] by micro-batch j's input_ids shard
                                        (``CompiledModel._embed_scatter``; + the previous one's).

    A micro-batch's autograd graph is dropped once its backward kernels ran."""

    KINDS = {(OpKind.RMSNORM, Role.FORWARD): "norm", (OpKind.NORM, Role.FORWARD): "norm",
             (OpKind.GEMM, Role.FORWARD): "head", (OpKind.SCALE, Role.FORWARD): "scale",
             (OpKind.SCALE, Role.DGRAD): "scale_dgrad", (OpKind.GEMM, Role.DGRAD): "head_dgrad",
             (OpKind.GEMM, Role.WGRAD): "head_wgrad", (OpKind.RMSNORM, Role.DGRAD): "norm_dgrad",
             (OpKind.NORM, Role.DGRAD): "norm_dgrad", (OpKind.RMSNORM, Role.WGRAD): "norm_wgrad",
             (OpKind.NORM, Role.WGRAD): "norm_wgrad", (OpKind.LIMIT, Role.FORWARD): "softcap",
             (OpKind.LIMIT, Role.DGRAD): "softcap_dgrad"}

    def __init__(self, model: "CompiledModel", labels: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 ids: Sequence[torch.Tensor], weight: float):
        """``labels``: per micro-batch (this rank's shifted labels [b, s/n], the global count);
        ``ids``: per micro-batch this rank's input_ids shard [b, s/n] (the PARTIAL scatter's);
        ``weight``: each micro-batch loss's in the step's (1/M, or 1 for num_items_in_batch)."""
        self.model, self.labels, self.ids, self.M = model, list(labels), list(ids), len(labels)
        self.weight = weight
        self.head = head = model.spec.edge_head
        # the logits' ops after the head's product, in order (each kernel's input: the previous one's output)
        self.tail = tuple(k for k, on in (("scale", head.logit_scale != 1), ("softcap", head.softcap is not None)) if on)
        self.backward = ("head_dgrad", "head_wgrad", "norm_dgrad", "norm_wgrad") + tuple(f"{k}_dgrad" for k in self.tail)
        self.state: list[dict[str, Any] | None] = [{} for _ in labels]
        self.terms: list[torch.Tensor | None] = [None] * self.M
        self.ran: list[set[str]] = [set() for _ in labels]
        self.scattered: list[bool] = [False] * self.M
        self.scatters = model.edges.embed_grad is EmbedGrad.PARTIAL

    def kernels(self, graph: Graph) -> dict[str, EagerKernel]:
        """A callable for every eager node of the merged ``graph`` (an unknown one raises, naming it)."""
        out = {}
        for nd in graph.nodes:
            if not is_eager(dict(nd.attrs)):
                continue
            j, kind = micro_batch_of(nd), self.KINDS.get((nd.op, nd.role))
            if self.scatters and j is not None and j < self.M and nd.name == mb_name(j, EMBED_SCATTER):
                out[nd.name] = functools.partial(self._scatter, j, nd.attr("accumulate", False) is True)
                continue
            if j is None or kind is None or j >= self.M:
                raise RuntimeFailure(f"eager node {nd.name!r} ({nd.op.value}, {nd.role.value}, micro-batch {j}) has "
                                     f"no kernel in a merged model step (those: micro-batch 0..{self.M - 1}'s "
                                     f"{', '.join(f'({o.value}, {r.value})' for o, r in self.KINDS)})")
            out[nd.name] = functools.partial(self._run, kind, j, nd.attr("accumulate", False) is True)
        return out

    def _run(self, kind: str, j: int, accumulate: bool, ins: list[torch.Tensor]) -> list[torch.Tensor]:
        st = self.state[j]
        if st is None or kind in self.ran[j]:
            raise RuntimeFailure(f"micro-batch {j}'s eager edge kernel {kind!r} ran twice or after its backward "
                                 "finished (a runtime bug)")
        self.ran[j].add(kind)
        out = getattr(self, f"_{kind}")(st, j, ins)
        if accumulate:                                      # the previous micro-batches' sum, read last
            out = out + ins[-1]
        if self.ran[j].issuperset(self.backward):
            self.state[j] = None                            # free micro-batch j's autograd graph
        return [out]

    def _scatter(self, j: int, accumulate: bool, ins: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.scattered[j]:
            raise RuntimeFailure(f"micro-batch {j}'s embedding scatter ran twice (a runtime bug)")
        self.scattered[j] = True
        return self.model._embed_scatter(self.ids[j], ins, accumulate=accumulate)

    def _norm(self, st, j, ins):
        (y,) = ins
        with torch.enable_grad():
            st["y"], st["norm_w"] = y.detach().requires_grad_(), self.model.norm.detach().requires_grad_()
            st["normed"] = final_norm(st["y"], st["norm_w"], self.head)
        return st["normed"].detach()

    def _head(self, st, j, ins):
        with torch.enable_grad():
            st["head_w"] = self.model.lm_head.detach().requires_grad_()
            st["logits"] = [F.linear(st["normed"], st["head_w"])]                   # [b, s/n, V]
            if not self.tail:
                self._loss(st, j, st["logits"][-1])
        return st["logits"][-1].detach()

    def _tail_step(self, kind, st, j):
        if len(st["logits"]) != 1 + self.tail.index(kind):
            raise RuntimeFailure(f"micro-batch {j}'s logit {kind} ran out of order (a runtime bug)")
        with torch.enable_grad():
            x = st["logits"][-1]
            y = x * self.head.logit_scale if kind == "scale" else limit(x, "softcap", self.head.softcap)
            st["logits"].append(y)                                                  # [b, s/n, V]
            if kind == self.tail[-1]:
                self._loss(st, j, y)
        return y.detach()

    def _scale(self, st, j, ins):
        return self._tail_step("scale", st, j)

    def _softcap(self, st, j, ins):
        return self._tail_step("softcap", st, j)

    def _loss(self, st, j, logits):
        st["term"] = self.model._loss_term(logits, *self.labels[j])
        self.terms[j] = st["term"].detach()

    def _head_backward(self, st):
        if "d_normed" not in st:
            term = st.pop("term")
            # weight (1/M: the mean over micro-batches); x dp: the plan's DP sync averages over
            # the replicas (module docstring, as SumOverRanks' backward)
            # the tail's inputs: each tail kernel's backward returns its input's gradient
            wrt = [st["normed"], st["head_w"]] + st["logits"][:len(self.tail)]
            grads = torch.autograd.grad(term, wrt, torch.full_like(term, self.model.dp * self.weight))
            st["d_normed"], st["d_head"] = grads[:2]
            st["d_tail"] = dict(zip(self.tail, grads[2:]))
            del st["logits"]
        return st

    def _scale_dgrad(self, st, j, ins):
        return self._head_backward(st)["d_tail"]["scale"]

    def _softcap_dgrad(self, st, j, ins):
        return self._head_backward(st)["d_tail"]["softcap"]

    def _head_dgrad(self, st, j, ins):
        return self._head_backward(st)["d_normed"]

    def _head_wgrad(self, st, j, ins):
        return self._head_backward(st)["d_head"]

    def _norm_backward(self, st, d_normed):
        if "dy" not in st:
            st["dy"], st["d_norm"] = torch.autograd.grad(st["normed"], [st["y"], st["norm_w"]], d_normed)
        return st

    def _norm_dgrad(self, st, j, ins):
        return self._norm_backward(st, ins[1])["dy"]

    def _norm_wgrad(self, st, j, ins):
        return self._norm_backward(st, ins[1])["d_norm"]

    def check_done(self) -> None:
        """Every micro-batch's kernels ran (else its seed or partials were never made)."""
        left = [j for j in range(self.M) if self.state[j] is not None or self.terms[j] is None
                or (self.scatters and not self.scattered[j])]
        if left:
            raise RuntimeFailure(f"the plan did not run every eager edge kernel of micro-batch(es) {left} "
                                 f"(ran: {[sorted(r) for r in self.ran]}; a runtime bug)")


class GatherSequence(torch.autograd.Function):
    """Forward: every rank's shard [b, s/n, ...] -> the global [dp*b, s, ...] (all n x dp ranks:
    ``CompiledLayer.unshard_output``). Backward: this rank's part of the incoming gradient
    (``CompiledLayer.shard_input``; every rank computes the same function of the global tensor and
    seeds it with the same gradient), x dp as the loss (module docstring)."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, layers: CompiledLayer) -> torch.Tensor:
        ctx.layers = layers
        return layers.unshard_output(shard)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        part = ctx.layers.shard_input(grad)
        dp = ctx.layers.layout.dp
        return (part * dp if dp > 1 else part), None
