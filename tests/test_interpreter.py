"""The reference interpreter reproduces the eager module, forward and backward, on n simulated ranks."""

import dataclasses

import pytest
import torch

from helpers import eager_step, max_grad_err, rel_err, small_layer
from moegraph.interpreter import interpret
from moegraph.ir import Strategy
from moegraph.tracer import trace_module

COMBOS = [("tp", "ep", "a2a"), ("tp", "ep", "ag-rs"), ("tp", "tp", "ag-rs"),
          ("sp", "ep", "a2a"), ("sp", "ep", "ag-rs"), ("sp", "tp", "ag-rs")]
TOL = 1e-5


@pytest.mark.parametrize("n", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("attn,ffn,dispatch", COMBOS)
def test_interpreter_matches_eager(n, attn, ffn, dispatch, rng):
    layer = small_layer(n, seed=int(torch.randint(0, 2**31, (1,), generator=rng)))
    b, s = 2, 16
    x = torch.randn(b, s, 64, generator=rng)
    dy = torch.randn(b, s, 64, generator=rng)
    y_ref, dx_ref, grads_ref = eager_step(layer, x, dy)
    graph = trace_module(layer, Strategy(attn, ffn, dispatch, n, dtype="fp32"), batch=b, seq=s)
    res = interpret(graph, {k: p.detach() for k, p in layer.named_parameters()}, x, dy)
    assert rel_err(res.output, y_ref) < TOL
    assert rel_err(res.input_grad, dx_ref) < TOL
    name, err = max_grad_err(res.param_grads, grads_ref)
    assert err < TOL, f"gradient of {name}: relative error {err:.2e}"


@pytest.mark.slow
def test_interpreter_detects_a_wrong_kernel(monkeypatch, rng):
    """The comparison can fail: a slightly wrong SwiGLU kernel is caught."""
    from moegraph import kernels
    from moegraph.ir import OpKind, Role
    layer = small_layer(2)
    x, dy = torch.randn(2, 16, 64, generator=rng), torch.randn(2, 16, 64, generator=rng)
    y_ref, _, _ = eager_step(layer, x, dy)
    graph = trace_module(layer, Strategy("sp", "ep", "ag-rs", 2, dtype="fp32"), batch=2, seq=16)
    bad = lambda ctx, node, ins, shapes: [torch.sigmoid(ins[0]) * ins[1]]  # noqa: E731  (not SiLU)
    monkeypatch.setitem(kernels.KERNELS, (OpKind.SWIGLU, Role.FORWARD), bad)
    res = interpret(graph, {k: p.detach() for k, p in layer.named_parameters()}, x, dy)
    assert rel_err(res.output, y_ref) > TOL


@pytest.mark.parametrize("op, role, key, ins", [
    ("split", "forward", "mode", lambda: [torch.zeros(1, 2, 4)]),
    ("split", "dgrad", "mode", lambda: [torch.zeros(1, 2, 2), torch.zeros(1, 2, 2)]),
    ("permute", "forward", "index", lambda: [torch.zeros(2, 4), _index_map()]),
    ("permute", "dgrad", "index", lambda: [torch.zeros(4, 4), _index_map()]),
    ("router", "forward", "scoring", lambda: [torch.zeros(2, 4), torch.zeros(3, 4)]),
    ("router", "dgrad", "scoring", lambda: [torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(2, 2)]),
    ("router", "wgrad", "scoring", lambda: [torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(2, 2)]),
])
@pytest.mark.parametrize("value", [None, "other"])
def test_a_kernel_switch_ends_in_an_error_naming_the_node(op, role, key, ins, value):
    """Kernels read SPLIT's mode, PERMUTE's index and ROUTER's scoring from the node's typed record
    (moegraph.node_attrs), with no default: a node the verifier never saw (missing or unknown value)
    is refused by name, not run as split/token/softmax."""
    from moegraph.ir import GraphError, Node, OpKind, Phase, Role, freeze_attrs
    from moegraph.kernels import RankContext, run_compute
    attrs = {"split": {"dim": 2, "sizes": (2, 2)}, "permute": {}, "router": {"top_k": 2, "experts": 3}}[op]
    attrs = attrs | ({} if value is None else {key: value})
    node = Node("bad", OpKind(op), Phase.FORWARD if role == "forward" else Phase.BACKWARD, (), ("y",), Role(role),
                attrs=freeze_attrs(attrs))
    with pytest.raises(GraphError, match=rf"node 'bad' \({op}/{role}\): {key}={value!r} is not one of"):
        run_compute(RankContext(0, 1, 2), node, ins(), [(2, 4)])


def _index_map():
    from moegraph.index_map import build_index_map
    return build_index_map(torch.tensor([[0, 1], [2, 0]]), "all", 3, 0, 1)


def test_an_averaging_all_reduce_is_refused_by_both_backends():
    """ALL_REDUCE sums; reduce="mean" (which REDUCE_SCATTER honours) is refused, not ignored."""
    from moegraph.interpreter import run_collective
    from moegraph.ir import Node, OpKind, Phase, freeze_attrs
    from moegraph.runtime import RuntimeFailure
    from moegraph.runtime.collectives import Comm
    ins = [[torch.ones(2)], [3 * torch.ones(2)]]
    node = Node("ar", OpKind.ALL_REDUCE, Phase.FORWARD, ("x",), ("y",), group=2)
    assert [r[0].tolist() for r in run_collective(node, ins)] == [[4.0, 4.0], [4.0, 4.0]]
    mean = dataclasses.replace(node, attrs=freeze_attrs({"reduce": "mean"}))
    with pytest.raises(ValueError, match=r"node 'ar': reduce='mean': an all_reduce only sums"):
        run_collective(mean, ins)
    with pytest.raises(RuntimeFailure, match=r"all_reduce 'ar': reduce='mean': an all_reduce only sums"):
        Comm._all_reduce(None, mean, torch.ones(2), None)      # refused before any process group is used
