"""Lower an nn.Module MoE layer into the IR for a parallel strategy.

torch.fx traces the layer's forward with every module that has a lowering rule kept as a
leaf; the residual additions between them are the only free functions allowed. Each leaf's
rule yields a block spec; the block emitters turn specs into forward nodes for the strategy;
autodiff appends the explicit backward; ``verify`` checks the result.

Anything else (an unknown module, an op between blocks) is an error naming the module's
qualified name and type: never a silently wrong graph.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch import nn

from moegraph.autodiff import add_backward
from moegraph.builder import ConfigError, GraphBuilder, check_strategy
from moegraph.ir import Dims, Graph, Strategy, verify
from moegraph.lowering import find_rule
from moegraph.lowering.blocks import AttentionSpec, MoESpec, NormSpec, emit_add, emit_attention, emit_moe, emit_rmsnorm


class LoweringError(NotImplementedError):
    """A module or operation with no lowering rule; names its qualified name and type."""


# Fig 9 names, by order of appearance in a pre-norm layer; later ones get numbered.
NORM_NAMES = (("input_norm", "ln1_out"), ("post_attn_norm", "ln2_out"))
ADD_NAMES = (("attn_residual", "ln2_in"), ("ffn_residual", "hidden_next"))


class _LeafTracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return find_rule(m) is not None or super().is_leaf_module(m, qualname)


def _fx_graph(module: nn.Module) -> fx.Graph:
    import inspect
    params = list(inspect.signature(module.forward).parameters.values())[1:]
    concrete = {p.name: p.default for p in params
                if p.default is not inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD}
    try:
        return _LeafTracer().trace(module, concrete_args=concrete or None)
    except Exception as err:  # fx's own errors name no module; say which layer failed
        raise LoweringError(f"torch.fx could not trace {type(module).__name__}: {err}") from err


def block_specs(module: nn.Module) -> list[tuple[str, nn.Module, object]]:
    """(qualname, module, spec) for every leaf with a rule, in call order."""
    graph = _fx_graph(module)
    out = []
    for node in graph.nodes:
        if node.op == "call_module":
            sub = module.get_submodule(node.target)
            rule = find_rule(sub)
            if rule is None:
                raise LoweringError(f"no lowering rule for module {node.target!r} ({type(sub).__module__}.{type(sub).__name__})")
            out.append((node.target, sub, rule(sub, node.target)))
    return out


def dims_from_specs(specs, batch: int, seq: int, n: int) -> Dims:
    attn = [s for _, _, s in specs if isinstance(s, AttentionSpec)]
    moe = [s for _, _, s in specs if isinstance(s, MoESpec)]
    norms = [m for _, m, s in specs if isinstance(s, NormSpec)]
    if len(attn) != 1 or len(moe) != 1:
        raise LoweringError(f"expected one attention and one MoE block per layer, found {len(attn)} and {len(moe)}")
    a, e = attn[0], moe[0]
    hidden = next(iter(norms[0].parameters())).shape[0] if norms else a.heads * a.head_dim
    return Dims(b=batch, s=seq, h=hidden, n=n, k=e.top_k, heads=a.heads, kv_heads=a.kv_heads,
                head_dim=a.head_dim, ffn=e.ffn_hidden, experts=e.experts)


def trace_module(module: nn.Module, strategy: Strategy, *, batch: int, seq: int, name: str | None = None) -> Graph:
    """Lower ``module`` (one MoE decoder layer) for ``strategy``; forward and backward, verified."""
    specs = block_specs(module)
    dims = dims_from_specs(specs, batch, seq, strategy.n)
    check_strategy(dims, strategy)
    g = GraphBuilder(name or type(module).__name__, dims, strategy)
    env: dict[fx.Node, object] = {}
    norm_i = add_i = 0
    spec_of = {q: s for q, _, s in specs}
    for node in _fx_graph(module).nodes:
        if node.op == "placeholder":
            env[node] = g.input("hidden", (dims.b, dims.s // strategy.n, dims.h)) if not env else None
        elif node.op == "call_module":
            spec, args = spec_of[node.target], [_arg(env, a) for a in node.args]
            kwargs = {k: _arg(env, v) for k, v in node.kwargs.items()}
            x = args[0] if args else kwargs.get("hidden_states")
            if isinstance(spec, NormSpec):
                nname, out = NORM_NAMES[norm_i] if norm_i < len(NORM_NAMES) else (f"norm{norm_i + 1}", f"norm{norm_i + 1}_out")
                norm_i += 1
                env[node] = emit_rmsnorm(g, spec, x, name=nname, out=out, module=node.target, block="")
            elif isinstance(spec, AttentionSpec):
                out = emit_attention(g, spec, x, module=node.target)
                env[node] = (out, None) if spec.tuple_output else out
            else:
                env[node] = emit_moe(g, spec, x, module=node.target)
        elif node.op == "call_function" and node.target in (operator.add, torch.add):
            a, b = (_arg(env, x) for x in node.args[:2])
            nname, out = ADD_NAMES[add_i] if add_i < len(ADD_NAMES) else (f"add{add_i + 1}", f"add{add_i + 1}_out")
            add_i += 1
            env[node] = emit_add(g, a, b, name=nname, out=out, module="", block="")
        elif node.op == "call_function" and node.target is operator.getitem:
            env[node] = _getitem(env[node.args[0]], node.args[1], node)
        elif node.op == "output":
            result = _arg(env, node.args[0])
            if not isinstance(result, str):
                raise LoweringError(f"layer output must be one tensor, got {result!r}")
            g.outputs.append(result)
        else:
            raise LoweringError(f"cannot lower {node.op} {node.target!r} in {type(module).__name__}: "
                                "only rule-backed modules and residual additions are supported")
    _assign_block_of_unassigned(g)
    g.saved = {name for n in g.nodes for name in n.outputs} | {"hidden"}
    add_backward(g, g.outputs[0])
    return verify(g.build())


def _arg(env, a):
    if isinstance(a, fx.Node):
        return env[a]
    if isinstance(a, (tuple, list)):
        return type(a)(_arg(env, x) for x in a)
    return a


def _getitem(value, index, node):
    if isinstance(value, tuple):
        return value[index]
    raise LoweringError(f"cannot lower indexing {node.name!r}: only tuple outputs of blocks may be indexed")


def _assign_block_of_unassigned(g: GraphBuilder) -> None:
    """Norms and residuals belong to the block whose input they prepare or finish."""
    import dataclasses
    for i, node in enumerate(g.nodes):
        if node.block:
            continue
        following = next((n.block for n in g.nodes[i + 1:] if n.block), "ffn")
        block = {"input_norm": "attention", "attn_residual": "attention", "post_attn_norm": "ffn",
                 "ffn_residual": "ffn"}.get(node.name, following)
        g.nodes[i] = dataclasses.replace(node, block=block)


def trace_model(cfg, strategy: Strategy, *, batch: int = 1, seq: int = 8192) -> Graph:
    """Trace the reference layer sized from a registry ModelConfig, without allocating weights."""
    from moegraph.models import MoETransformerLayer
    with torch.device("meta"):
        layer = MoETransformerLayer.from_config(cfg)
    return trace_module(layer, strategy, batch=batch, seq=seq, name=cfg.name)


__all__ = ["trace_module", "trace_model", "LoweringError", "ConfigError", "block_specs"]
