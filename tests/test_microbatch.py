"""Merged step graphs of M micro-batches (moegraph.microbatch): structure, the per-micro-batch
barrier, and numerics: the interpreter's gradients of the merged graph equal eager gradient
accumulation over the M micro-batches (fp32, 1e-5)."""

import pytest
import torch
from torch import nn

from helpers import max_grad_err, rel_err, small_layer
from moegraph.passes.stack import stack_layers
from moegraph.cost import CostModel
from moegraph.interpreter import interpret, interpret_microbatches
from moegraph.ir import GraphError, OpKind, Phase, Role, Strategy, ValueKind
from moegraph.passes.microbatch import merge_microbatches
from moegraph.microbatch import (micro_batch_count, micro_batch_graph, micro_batch_of,
                                 microbatch_boundaries)
from moegraph.passes import run_pipeline
from moegraph.registry import load_hardware, load_model
from moegraph.tracer import trace_layers, trace_model

SMALL = load_model("small")


def _two_layers(seed: int) -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList([small_layer(1, seed=seed), small_layer(1, seed=seed + 1)])
    return model


def _eager_accumulated(model, xs, dys):
    """Eager gradient accumulation: M forward/backward passes into the same .grad buffers."""
    model.zero_grad()
    ys, dxs = [], []
    for x, dy in zip(xs, dys):
        xr = x.clone().requires_grad_(True)
        y = model.layers[1](model.layers[0](xr))
        y.backward(dy)
        ys.append(y.detach())
        dxs.append(xr.grad.clone())
    return ys, dxs, {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("M", [2, 4])
@pytest.mark.parametrize("strategy,passes", [
    (Strategy("sp", "ep", "ag-rs", 2, dtype="fp32"), "gate-reorder,sar=paper"),
    (Strategy("sp", "ep", "a2a", 2, dtype="fp32"), ""),
    (Strategy("tp", "tp", "ag-rs", 2, dtype="fp32", dp=2), ""),
    (Strategy("sp", "ep", "ag-rs", 2, dtype="fp32"), "dispatch=a2a,chunk=2"),   # per-chunk accumulate chains
])
@pytest.mark.slow
def test_merged_gradients_equal_eager_accumulation(M, strategy, passes, rng):
    model = _two_layers(int(torch.randint(0, 2**31 - 2, (1,), generator=rng)))
    b, s = 1, 16
    xs = [torch.randn(b, s, 64, generator=rng) for _ in range(M)]
    dys = [torch.randn(b, s, 64, generator=rng) for _ in range(M)]
    ys_ref, dxs_ref, grads_ref = _eager_accumulated(model, xs, dys)
    graph = stack_layers(trace_layers(model.layers, strategy, batch=b, seq=s), len(model.layers))
    if passes:
        graph, _ = run_pipeline(graph, passes, cost=CostModel(load_hardware("h800")))
    merged = merge_microbatches(graph, M)
    res = interpret_microbatches(merged, {k: p.detach() for k, p in model.named_parameters()}, xs, dys)
    for j in range(M):
        assert rel_err(res.outputs[j], ys_ref[j]) < 1e-5
        assert rel_err(res.input_grads[j], dxs_ref[j]) < 1e-5
    assert set(res.param_grads) == set(grads_ref)
    name, err = max_grad_err(res.param_grads, grads_ref)
    assert err < 1e-5, f"gradient of {name}: relative error {err:.2e}"
    # the comparison can fail: one micro-batch's gradient alone is far from the accumulated one
    one = interpret(graph, {k: p.detach() for k, p in model.named_parameters()}, xs[0], dys[0])
    assert max_grad_err(one.param_grads, grads_ref)[1] > 1e-2


def test_merged_graph_structure():
    one = stack_layers(trace_model(SMALL, Strategy("sp", "ep", "ag-rs", 2), seq=64), 2)
    merged = merge_microbatches(one, 3)
    assert micro_batch_count(merged) == 3 and micro_batch_graph(merged) is one
    assert merge_microbatches(one, 1) is one
    # parameters shared: the same inputs, once; per micro-batch its own input and seed gradient
    assert [p for p, _ in merged.params] == [p for p, _ in one.params]
    acts = [v for v in merged.inputs if merged.value[v].kind is ValueKind.ACTIVATION]
    seeds = [v for v in merged.inputs if merged.value[v].kind is ValueKind.GRAD]
    assert acts == ["mb0.l0.hidden", "mb1.l0.hidden", "mb2.l0.hidden"]
    assert seeds == ["mb0.l1.d_hidden_next", "mb1.l1.d_hidden_next", "mb2.l1.d_hidden_next"]
    assert [b[0] for b in microbatch_boundaries(merged)] == acts
    # every node of the micro-batch graph appears once per micro-batch, tagged with its index,
    # except the gradient synchronisation (sp attention's replicated weights), which runs once
    sync = [n for n in one.nodes if n.op is OpKind.ALL_REDUCE and n.role is Role.WGRAD]
    assert sync
    for n in one.nodes:
        if n in sync:
            assert merged.node[n.name] .attr("mb", None) is None
            assert not any(f"mb{j}.{n.name}" in merged.node for j in range(3))
        else:
            assert all(micro_batch_of(merged.node[f"mb{j}.{n.name}"]) == j for j in range(3))
    # micro-batch j's backward reads nothing of another micro-batch's forward
    for n in merged.nodes:
        j = micro_batch_of(n)
        for v in n.inputs:
            p = merged.producer.get(v)
            if p is not None and p.phase is Phase.FORWARD and j is not None:
                assert micro_batch_of(p) == j, (n.name, p.name)
    # accumulation: micro-batch j >= 1 adds into micro-batch j-1's total (in place or by ADD)
    acc = [n for n in merged.nodes if n.attr("accumulate", False) and micro_batch_of(n) == 2]
    assert acc and all(any(i.startswith("mb1.") and merged.value[i].kind is ValueKind.PARAM_GRAD
                           for i in n.inputs) for n in acc)
    with pytest.raises(GraphError, match="already holds 3 micro-batches"):
        merge_microbatches(merged, 2)
    with pytest.raises(ValueError, match="micro_batches=0"):
        merge_microbatches(one, 0)


def test_passes_refuse_a_merged_graph():
    from moegraph.passes import PassError
    merged = merge_microbatches(stack_layers(trace_model(SMALL, Strategy("sp", "ep", "ag-rs", 2), seq=64), 2), 2)
    with pytest.raises(PassError, match="merged step of 2 micro-batches"):
        run_pipeline(merged, "sar=paper", cost=CostModel(load_hardware("h800")))


def test_gradient_sum_falls_back_to_an_add_node():
    """A partial gradient that is not a weight-gradient kernel's single output cannot add into
    the running sum in place: an ADD node sums it (here forced by relabelling the router's
    weight-gradient kernel as a data-gradient one)."""
    import dataclasses
    g = trace_model(load_model("tiny"), Strategy("sp", "ep", "ag-rs", 2), seq=64)
    nodes = tuple(dataclasses.replace(n, role=Role.DGRAD) if n.name == "router.wgrad" else n for n in g.nodes)
    merged = merge_microbatches(dataclasses.replace(g, nodes=nodes), 3)
    raw = g.node["router.wgrad"].outputs[0]
    add = merged.node[f"mb2.{raw}.accumulate"]
    assert add.op is OpKind.ADD and add.inputs == (f"mb1.{raw}", f"mb2.{raw}.partial") and add.outputs == (f"mb2.{raw}",)
    assert merged.node["mb2.router.wgrad"].outputs == (f"mb2.{raw}.partial",)
    assert not merged.node["mb2.router.wgrad"].attr("accumulate", False)
    # the step's one all-reduce of the (replicated) router weight reads the last total
    (ar,) = [n for n in merged.nodes if n.op is OpKind.ALL_REDUCE and n.inputs == (f"mb2.{raw}",)]
    assert micro_batch_of(ar) is None
