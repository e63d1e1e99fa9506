"""Rank functions for tests/test_edges.py (spawned by moegraph.runtime.launch.spawn): one
training step's gradients of a compiled tiny causal LM against eager, with the plan's edge
collectives as compiled and with them replaced by local no-ops (no communication)."""

from __future__ import annotations

import torch

import moegraph
from moegraph.runtime.check import rel_err
from moegraph.runtime.collectives import Comm, Pending
from model_workers import batches, reference_model

EDGE_PARTS = {"embed": "embed.weight", "norm": "norm.weight", "head": "lm_head.weight"}


def _grads(model, compiled, ids, labels) -> dict[str, float]:
    """Relative error of the compiled model's full gradients against eager's: the edges' three
    parameters by name, every layer parameter as one maximum."""
    model.zero_grad()
    compiled.zero_grad()
    model(ids, labels=labels).loss.backward()
    compiled(ids, labels=labels).loss.backward()
    full = compiled.full_grads()
    eager = {k: p.grad for k, p in model.named_parameters()}
    out = {part: rel_err(full[name], eager[name]) for part, name in EDGE_PARTS.items()}
    out["layers"] = max(rel_err(full[k], g) for k, g in eager.items() if k.startswith("layers."))
    return out


def _local_noop(node, ins, stream, shapes, rank: int) -> Pending:
    """What an edge collective would give if it communicated nothing: an all-reduce keeps this
    rank's partial, a gather holds only this rank's own rows (zeros elsewhere)."""
    if node.op.value == "all_reduce":
        outs = [ins[0].clone()]
    else:
        full = ins[0].new_zeros(shapes[0])
        full.chunk(node.group, dim=node.attr("dim"))[rank].copy_(ins[0])
        outs = [full]
    return Pending(node, stream, [], lambda: outs)


def edge_grad_checks(rank: int, n: int, seed: int) -> dict:
    model = reference_model(seed, 2)
    ids, labels = batches(seed + 1, 1)[0]
    compiled = moegraph.compile(model, ids, hardware="cpu-gloo", attn="sp", ffn="ep", passes="",
                                schedule="greedy", timeout_s=60.0)
    edge_nodes = [e.name for e in compiled.layers.plan.entries if e.name.startswith("edges.")]
    scheduled = _grads(model, compiled, ids, labels)
    issue = Comm.issue

    def patched(self, node, ins, stream, budget, shapes=None):
        if node.name.startswith("edges."):
            return _local_noop(node, ins, stream, shapes, self.layout.mp_rank)
        return issue(self, node, ins, stream, budget, shapes)

    Comm.issue = patched
    try:
        removed = _grads(model, compiled, ids, labels)
    finally:
        Comm.issue = issue
    return {"edge_nodes": edge_nodes, "scheduled": scheduled, "removed": removed}


def base_model_grad_checks(rank: int, n: int, seed: int) -> dict:
    """A base model (transformers' MixtralModel: no LM head, last_hidden_state out): the gradient
    of a fixed linear function of the hidden states, compiled against eager."""
    from model_workers import mixtral_model
    base = mixtral_model(seed, 2).model
    ids, _ = batches(seed + 1, 1)[0]
    compiled = moegraph.compile(base, ids, hardware="cpu-gloo", passes="", schedule="greedy", timeout_s=60.0)
    weight = torch.randn(base.config.hidden_size, generator=torch.Generator().manual_seed(seed + 2))
    (base(input_ids=ids).last_hidden_state * weight).sum().backward()
    (compiled(ids).last_hidden_state * weight).sum().backward()
    full = compiled.full_grads()
    return {"edge_nodes": [e.name for e in compiled.layers.plan.entries if e.name.startswith("edges.")],
            "errors": {k: rel_err(full[k], p.grad) for k, p in base.named_parameters()}}


def dp_bf16_edge_grads(rank: int, world: int, seed: int, dp: int) -> dict:
    """n x dp = ``world`` ranks, compress=dp-bf16: one step's gradients against eager on the
    global batch, and the edge nodes the plan runs compressed (the edges follow the passes' wire
    format, moegraph.passes.compress)."""
    from model_workers import dp_batches
    model = reference_model(seed, 2)
    ids, labels = dp_batches(seed + 1, 1, dp)[0]
    compiled = moegraph.compile(model, ids, hardware="cpu-gloo", attn="sp", ffn="ep", passes="compress=dp-bf16",
                                schedule="greedy", timeout_s=60.0, dp=dp)
    graph = compiled.layers.graph
    planned = {e.name for e in compiled.layers.plan.entries}
    compressed = sorted(nd.name for nd in graph.nodes if nd.name.startswith("edges.") and nd.name in planned
                        and nd.attr("compressed", None) == "bf16")
    from moegraph.edges import edge_values
    return {"compressed": compressed, "errors": _grads(model, compiled, ids, labels),
            "pattern": edge_values(graph).embed_grad.value}


def partial_embed_grads(rank: int, world: int, seed: int, dp: int) -> dict:
    """n x dp = ``world`` ranks, replicas of 2B rows (the ROWS gather's inter-node bytes, (dp-1)*2B*s*h*4,
    exceed PARTIAL's, (dp-1)/dp * V*h/n * 8, so add_edges picks PARTIAL itself): one step's gradients
    against eager on the global batch; then the same step with the plan's edges.embed.scatter kernel
    (CompiledModel._embed_scatter) replaced by zeros (the embedding gradient must then be wrong: the
    plan's result is what is used)."""
    from moegraph.edges import edge_values
    model = reference_model(seed, 2)
    gen = torch.Generator().manual_seed(seed + 1)
    vocab = model.embed.num_embeddings
    ids = torch.randint(0, vocab, (dp * 2 * 2, 16), generator=gen)
    labels = ids.clone()
    labels[:4, :10] = -100                    # replica 0 scores fewer tokens: the global token count matters
    compiled = moegraph.compile(model, ids, hardware="cpu-gloo", attn="sp", ffn="ep", passes="",
                                schedule="greedy", timeout_s=60.0, dp=dp)
    planned = [e.name for e in compiled.layers.plan.entries if e.name.startswith("edges.embed.")]
    errors = _grads(model, compiled, ids, labels)
    # the kernel CompiledModel's backward hands the executor for EMBED_SCATTER, made to scatter nothing
    compiled._embed_scatter = lambda ids, ins: [ins[0].new_zeros(vocab, ins[0].shape[-1])]
    zeroed = _grads(model, compiled, ids, labels)
    return {"pattern": edge_values(compiled.layers.graph).embed_grad.value, "planned": planned,
            "errors": errors, "zeroed": zeroed}


def partial_embed_padding(rank: int, world: int, seed: int, dp: int) -> dict:
    """As ``partial_embed_grads`` on a transformers Mixtral whose embedding has a padding row
    (pad_token_id=0, in every row of the batch): every gradient against eager's, whose padding
    row of the embedding gradient is zero."""
    from model_workers import mixtral_model
    from moegraph.edges import edge_values
    model = mixtral_model(seed, 2, pad_token_id=0)
    vocab = model.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, vocab, (dp * 2 * 2, 16), generator=gen)
    ids[:, ::5] = 0                           # the padding token in every row, on every rank's shard
    compiled = moegraph.compile(model, ids, hardware="cpu-gloo", passes="", schedule="greedy", timeout_s=60.0,
                                dp=dp)
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    compiled(ids, labels=ids).loss.backward()
    full = compiled.full_grads()
    embed = "model.embed_tokens.weight"
    return {"pattern": edge_values(compiled.layers.graph).embed_grad.value,
            "errors": {k: rel_err(full[k], p.grad) for k, p in model.named_parameters()},
            "pad_row": float(full[embed][0].abs().max()),
            "eager_pad_row": float(model.get_parameter(embed).grad[0].abs().max())}


def bucketed_edge_grads(rank: int, world: int, seed: int, dp: int, bucket: int) -> dict:
    """The public compile path with the edges' gradient buckets forced small
    (``moegraph.passes.edges.GRAD_BUCKET_BYTES`` and ``DP_GRAD_BUCKET_BYTES`` = ``bucket`` while compiling): one step's gradients
    against eager. dp == 1: the head's sync in blocks (the embedding gathers its rows); then the
    same step with bucket 1's all-reduce made a local no-op, per row of the head gradient (only
    that block's rows may go wrong). dp > 1: replicas of 2B rows, so PARTIAL (as
    ``partial_embed_grads``): the head's and the embedding's syncs both in blocks."""
    import moegraph.passes.edges as edges_mod
    from model_workers import batches
    from moegraph.edges import edge_values
    model = reference_model(seed, 2)
    if dp == 1:
        ids, labels = batches(seed + 1, 1)[0]
    else:
        gen = torch.Generator().manual_seed(seed + 1)
        ids = torch.randint(0, model.embed.num_embeddings, (dp * 2 * 2, 16), generator=gen)
        labels = ids.clone()
    saved = edges_mod.GRAD_BUCKET_BYTES, edges_mod.DP_GRAD_BUCKET_BYTES
    edges_mod.GRAD_BUCKET_BYTES = edges_mod.DP_GRAD_BUCKET_BYTES = bucket
    try:
        compiled = moegraph.compile(model, ids, hardware="cpu-gloo", attn="sp", ffn="ep", passes="",
                                    schedule="greedy", timeout_s=60.0, dp=dp)
    finally:
        edges_mod.GRAD_BUCKET_BYTES, edges_mod.DP_GRAD_BUCKET_BYTES = saved
    graph = compiled.layers.graph
    planned = [e.name for e in compiled.layers.plan.entries if e.name.startswith("edges.")]
    sizes = {part: graph.node[f"edges.{part}.grad_concat"].attr("sizes")
             for part in ("lm_head", "embed") if f"edges.{part}.grad_concat" in graph.node}
    out = {"pattern": edge_values(graph).embed_grad.value, "planned": planned, "sizes": sizes,
           "errors": _grads(model, compiled, ids, labels)}
    if dp == 1:
        issue = Comm.issue

        def patched(self, node, ins, stream, budget, shapes=None):
            if node.name == "edges.lm_head.bucket1.grad_allreduce":
                return _local_noop(node, ins, stream, shapes, self.layout.mp_rank)
            return issue(self, node, ins, stream, budget, shapes)

        Comm.issue = patched
        try:
            _grads(model, compiled, ids, labels)
        finally:
            Comm.issue = issue
        full, eager = compiled.full_grads()[EDGE_PARTS["head"]], model.lm_head.weight.grad
        out["row_errors"] = [rel_err(full[r], eager[r]) for r in range(full.shape[0])]
    return out
