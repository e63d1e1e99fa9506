"""Shared test helpers: eager reference runs and relative errors."""

from __future__ import annotations

import torch

from moegraph.models import MoETransformerLayer


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def small_layer(n: int, seed: int = 0, **features) -> MoETransformerLayer:
    """A layer every n in {1, 2, 4} can split: 8 heads, 4 kv heads, 8 experts, top-3.
    ``features``: the layer's optional parts (qkv_bias, qk_norm, shared_ffn_hidden, ...)."""
    torch.manual_seed(seed)
    layer = MoETransformerLayer(hidden=64, heads=8, kv_heads=4, ffn_hidden=96, experts=8, top_k=3, **features)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return layer


def eager_step(module, x: torch.Tensor, dy: torch.Tensor, call=None):
    """Output, input gradient and parameter gradients of the eager module."""
    module.zero_grad()
    x = x.clone().requires_grad_(True)
    y = call(module, x) if call else module(x)
    y.backward(dy)
    grads = {k: p.grad.clone() for k, p in module.named_parameters()}
    return y.detach(), x.grad.clone(), grads


def max_grad_err(grads: dict, expected: dict) -> tuple[str, float]:
    errs = {k: rel_err(grads[k], expected[k]) for k in expected}
    worst = max(errs, key=errs.get)
    return worst, errs[worst]


def assert_interpreted_matches_eager(layer, strategy, x: torch.Tensor, dy: torch.Tensor, tol: float = 1e-5) -> None:
    """Trace ``layer`` for ``strategy`` and run it through the interpreter: output, input gradient
    and every parameter gradient within ``tol`` (relative) of the eager module's."""
    from moegraph.interpreter import interpret
    from moegraph.tracer import trace_module
    y_ref, dx_ref, grads_ref = eager_step(layer, x, dy)
    graph = trace_module(layer, strategy, batch=x.shape[0], seq=x.shape[1])
    held = {k: t.detach() for k, t in [*layer.named_parameters(), *layer.named_buffers()]}
    res = interpret(graph, held, x, dy)
    assert rel_err(res.output, y_ref) < tol
    assert rel_err(res.input_grad, dx_ref) < tol
    assert set(res.param_grads) == set(grads_ref)
    name, err = max_grad_err(res.param_grads, grads_ref)
    assert err < tol, f"gradient of {name}: {err:.2e}"


def held_for_backward(graph) -> int:
    """Bytes of the values the forward must leave for backward, counted from the graph alone:
    produced in forward (or the activation input) and read, directly or through a view, by a
    backward or recompute node. What any schedule holds at the barrier."""
    from moegraph.ir import Phase, ValueKind

    def base(v):
        while graph.value[v].alias_of is not None:
            v = graph.value[v].alias_of
        return v
    forward = {o for n in graph.nodes if n.phase is Phase.FORWARD for o in n.outputs}
    forward |= {v for v in graph.inputs if graph.value[v].kind is ValueKind.ACTIVATION}
    read = {base(v) for n in graph.nodes if n.phase is not Phase.FORWARD for v in n.inputs if v in forward}
    return sum(graph.value[v].nbytes for v in read if graph.value[v].kind is not ValueKind.PARAM)
