"""Lower an nn.Module MoE layer into the IR for a parallel strategy.

torch.fx traces the layer's forward with every module that has a lowering rule kept as a
leaf; the residual additions between them are the only free functions allowed. Each leaf's
rule yields a block spec; the block emitters turn specs into forward nodes for the strategy;
autodiff appends the explicit backward; ``verify`` checks the result.

Anything else (an unknown module, an op between blocks) is an error naming the module's
qualified name and type: never a silently wrong graph.
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
import os
import traceback
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from moegraph.autodiff import add_backward
from moegraph.builder import ConfigError, GraphBuilder, check_strategy, fold_hint
from moegraph.edges import AUX_META, AuxLoss
from moegraph.ir import Dims, Graph, ParamSource, Strategy, verify
from moegraph.token_layout import local_tokens
from moegraph.layers import KINDS_META, LayerKinds, layer_count, layer_kinds
from moegraph.limits import check_graph_size
from moegraph.lowering import LoweringError, ModelSpec, check_patches_and_hooks, find_model_rule, find_rule
from moegraph.lowering.blocks import (AttentionSpec, MLASpec, MLPSpec, MoESpec, NormSpec, emit_add, emit_attention, emit_mla,
                                      emit_mlp, emit_moe, emit_rmsnorm)
from moegraph.lowering.blocks_ext import emit_scale, emit_scale_by
from moegraph.lowering.blocks_linear import emit_linear_attention
from moegraph.lowering.specs import ExpertsSpec, LinearAttentionSpec, RouterSpec
from moegraph.lowering.check import check_layer, eager_call
from moegraph.lowering.coverage import check_coverage
from moegraph.lowering.parallel_ffn import fold_routed_experts, refuse_unmodelled
from moegraph.lowering.structural import guard_on, layer_context


# Fig 9 names, by order of appearance in a pre-norm layer; later ones get numbered.
NORM_NAMES = (("input_norm", "ln1_out"), ("post_attn_norm", "ln2_out"))
ADD_NAMES = (("attn_residual", "ln2_in"), ("ffn_residual", "hidden_next"))


class _LeafTracer(fx.Tracer):
    def __init__(self, tuple_leaves: dict[int, int]):
        super().__init__()
        self.tuple_leaves = tuple_leaves     # id -> arity of leaf modules returning (output, extra, ...)
        # modules without a rule fx is tracing into, outermost first; left as it is on a failure
        self.open_modules: list[tuple[str, type]] = []

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return find_rule(m, qualname) is not None or super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        qualname = self.path_of_module(m)
        opened = not self.is_leaf_module(m, qualname)
        if opened:
            self.open_modules.append((qualname, type(m)))
        out = super().call_module(m, forward, args, kwargs)
        if opened:
            self.open_modules.pop()
        if id(m) in self.tuple_leaves:
            # a real tuple, so `out, _ = attn(...)` unpacks without fx inspecting bytecode
            return tuple(out[i] for i in range(self.tuple_leaves[id(m)]))
        return out


def _fx_graph(module: nn.Module) -> fx.Graph:
    """Trace forward(hidden_states) alone: every other argument keeps its default.

    The module's class is swapped for a one-off subclass whose forward takes just the hidden
    states, because fx cannot trace through *args/**kwargs (transformers' layers have both).
    A failure inside fx becomes one LoweringError line naming the deepest module without a
    rule that fx was tracing into and the source line it stopped at, never fx's own text.
    """
    original_cls = module.__class__
    forward = inspect.unwrap(original_cls.forward)
    shim = type(original_cls.__name__, (original_cls,), {})
    # an argument without a default besides the hidden states (Qwen3-Next's position_embeddings) is None
    # here: only the leaf blocks it is handed to read it, and they are not run while tracing
    required = {p.name: None for p in list(inspect.signature(forward).parameters.values())[2:]
                if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    shim.forward = lambda self, hidden_states: forward(self, hidden_states, **required)
    # rules run before tracing: during it, fx turns parameter reads into graph nodes
    tuple_leaves, leaves = {}, []
    for name, m in module.named_modules():       # the leaves fx will call: none inside another leaf
        if any(name.startswith(f"{leaf}.") for leaf in leaves) or (rule := find_rule(m, name)) is None:
            continue
        leaves.append(name)
        if arity := getattr(rule.spec(m, name), "tuple_output", False):
            tuple_leaves[id(m)] = 2 if arity is True else arity
    tracer = _LeafTracer(tuple_leaves)
    module.__class__ = shim
    try:
        return tracer.trace(module)
    except LoweringError:
        raise
    except Exception as err:  # fx's own errors name no module; say which module and line failed
        raise LoweringError(_trace_failure(tracer, original_cls, err)) from err
    finally:
        module.__class__ = original_cls


def _module_name(qualname: str, cls: type) -> str:
    return f"{qualname!r} ({cls.__module__}.{cls.__name__})" if qualname else f"the layer ({cls.__module__}.{cls.__name__})"


def _trace_failure(tracer: _LeafTracer, layer_cls: type, err: Exception) -> str:
    qualname, cls = tracer.open_modules[-1] if tracer.open_modules else ("", layer_cls)
    torch_dir, here = os.path.dirname(torch.__file__), os.path.abspath(__file__)
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not os.path.abspath(f.filename).startswith(torch_dir) and os.path.abspath(f.filename) != here]
    # the module's own source line says more than fx's message; with no such frame, fx failed
    # calling the forward itself (e.g. a required argument besides hidden_states): say that
    at = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno} `{frames[-1].line}`" if frames else f": {err}"
    made = [nd for nd in tracer.graph.nodes if nd.op not in ("placeholder", "get_attr")]
    after = f" after {made[-1].op} {_target_name(made[-1].target)}" if made else ""
    return (f"cannot lower {_module_name(qualname, cls)}: it has no lowering rule and torch.fx could not trace "
            f"its forward; stopped{at}{after} ({type(err).__name__}); register a rule for {cls.__name__}")


def _target_name(target) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", repr(target))


def _owner(node: fx.Node, layer: nn.Module) -> str:
    """The deepest module a traced operation came from (fx records the module stack)."""
    inside = _enclosing(node, layer)
    return f"{inside}, which has no lowering rule" if inside else type(layer).__name__


def _enclosing(node: fx.Node, layer: nn.Module) -> str:
    """The deepest module fx traced into around ``node`` (not the node's own module), or ""."""
    stack = [qualname for qualname, _ in (node.meta.get("nn_module_stack") or {}).values()
             if qualname and qualname != node.target]
    return _module_name(stack[-1], type(layer.get_submodule(stack[-1]))) if stack else ""


STEP_KINDS = {NormSpec: "norm", AttentionSpec: "attention", MLASpec: "attention", LinearAttentionSpec: "attention",
              MoESpec: "moe", MLPSpec: "mlp",
              RouterSpec: "router", ExpertsSpec: "experts"}   # the last two folded into "moe" (parallel_ffn)
ATTENTION_EMITTERS = {AttentionSpec: emit_attention, MLASpec: emit_mla, LinearAttentionSpec: emit_linear_attention}


@dataclass(frozen=True)
class Step:
    """One call in the layer's forward: a block (by its spec) or a residual addition.

    args index earlier steps' outputs; -1 is the layer input.
    """

    kind: str                     # "norm" | "attention" | "moe" | "mlp" | "add" | "scale"
    args: tuple[int, ...]
    spec: NormSpec | AttentionSpec | MLASpec | LinearAttentionSpec | MoESpec | MLPSpec | None = None
    module: str = ""
    factor: float = 1.0           # "scale": the constant multiplier (Granite's residual_multiplier)
    by: str | None = None         # "scale": the layer's [1] buffer it multiplies by too (Gemma 4's layer_scalar)


@dataclass(frozen=True)
class LayerProgram:
    """What the tracer learned from the module: enough to lower it again for any strategy.

    reads: every parameter and buffer of the layer (qualified name, shape) that the lowered
    graph must read, i.e. all of them except those a rule declares unused.
    """

    steps: tuple[Step, ...]
    output: int
    reads: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def specs(self, cls) -> list:
        return [st.spec for st in self.steps if isinstance(st.spec, cls)]


def extract_program(module: nn.Module) -> LayerProgram:
    """Trace ``module`` with torch.fx, rule-backed modules as leaves, into a LayerProgram."""
    with layer_context(module):
        return _extract_program(module)


def _extract_program(module: nn.Module) -> LayerProgram:
    check_patches_and_hooks(module)
    if find_rule(module) is not None:     # a rule describes one block inside a layer, never a layer
        cls = type(module)
        raise LoweringError(f"{cls.__module__}.{cls.__name__} is one block of a decoder layer, not a layer (its "
                            "lowering rule describes it inside one): compile the decoder layer that holds it (e.g. "
                            "model.model.layers[0] of a transformers causal LM) or the whole model instead")
    refuse_unmodelled(module)
    _check_blocks(module)
    graph = _fx_graph(module)
    index: dict[fx.Node, object] = {}
    steps: list[Step] = []
    unused: set[str] = set()
    output = None
    for node in graph.nodes:
        if node.op == "placeholder":
            index[node] = -1 if not index else None
        elif node.op == "call_module":
            sub = module.get_submodule(node.target)
            rule = find_rule(sub, node.target)
            if rule is None:
                inside = _enclosing(node, module)
                raise LoweringError(f"no lowering rule for module {node.target!r} "
                                    f"({type(sub).__module__}.{type(sub).__name__})"
                                    + (f" inside {inside}, which has no rule either" if inside else ""))
            spec = rule.spec(sub, node.target)
            unused.update(f"{node.target}.{name}" for name in rule.unused)
            x = node.args[0] if node.args else node.kwargs.get("hidden_states")
            kind = STEP_KINDS.get(type(spec))
            if kind is None:
                raise LoweringError(f"the rule for {node.target!r} returned a {type(spec).__name__}, not one of "
                                    f"{', '.join(t.__name__ for t in STEP_KINDS)}")
            args = (_index(index, x, node),) if kind != "experts" else _experts_args(index, node)
            steps.append(Step(kind, args, spec, node.target))
            index[node] = (len(steps) - 1, None) if getattr(spec, "tuple_output", False) is True else len(steps) - 1
            if kind == "router":     # (probabilities, top-k weights, top-k experts): read by the experts only
                index[node] = tuple(("routing", len(steps) - 1, j) for j in range(spec.tuple_output))
        elif node.op == "call_function" and node.target in (operator.add, torch.add):
            steps.append(Step("add", tuple(_index(index, a, node) for a in node.args[:2])))
            index[node] = len(steps) - 1
        elif node.op == "call_function" and node.target in (operator.mul, torch.mul) and _scalar_mul(node):
            tensor, factor = _scalar_mul(node)
            steps.append(Step("scale", (_index(index, tensor, node),), factor=factor))
            index[node] = len(steps) - 1
        elif node.op == "get_attr" and _scalar_buffer(module, node.target):
            index[node] = ("buffer", node.target)                          # the layer's [1] buffer (layer_scalar)
        elif node.op == "call_function" and node.target in (operator.mul, operator.imul) and \
                isinstance(index.get(node.args[1]), tuple) and index[node.args[1]][0] == "buffer":
            steps.append(Step("scale", (_index(index, node.args[0], node),), by=index[node.args[1]][1]))
            index[node] = len(steps) - 1
        elif node.op == "call_function" and node.target is getattr and node.args[1:] == ("shape",):
            index[node] = ("shape", _index(index, node.args[0], node))     # a layer value's own [b, s, h]
        elif node.op == "call_function" and node.target is getattr and node.args[1:] == ("dtype",):
            index[node] = ("dtype", _index(index, node.args[0], node))     # every layer value has the layer's dtype
        elif node.op == "call_method" and node.target == "to" and _same_dtype(index, node):
            index[node] = _index(index, node.args[0], node)                # x.to(residual.dtype): no-op
        elif node.op == "call_function" and node.target is F.dropout:
            index[node] = _index(index, _no_dropout(node, module), node)    # p = 0 or eval: the identity
        elif node.op == "call_method" and node.target in ("view", "reshape") and (_same_shape(index, node) or
                                                                               _token_rows(index, node)):
            index[node] = _index(index, node.args[0], node)                # x.view(residual.shape): no-op
        elif node.op == "call_function" and node.target is operator.getitem and _is_shape(index.get(node.args[0])):
            index[node] = ("shape_dim", index[node.args[0]][1], node.args[1])     # x.shape[-1]
        elif node.op == "call_function" and node.target is operator.getitem:
            index[node] = _getitem(index[node.args[0]], node.args[1], node)
        elif node.op == "output":
            if isinstance(node.args[0], (tuple, list)):
                raise LoweringError(f"{type(module).__name__} returns {len(node.args[0])} values (an auxiliary loss or "
                                    "router logits beside the hidden states?): only a layer returning its hidden "
                                    "states can be lowered")
            output = _index(index, node.args[0], node)
        else:
            raise LoweringError(f"cannot lower {node.op} {_target_name(node.target)!r} in {_owner(node, module)}: "
                                "only rule-backed modules and residual additions are supported")
    held = [*module.named_parameters(), *module.named_buffers()]
    reads = tuple((name, tuple(t.shape)) for name, t in held if name not in unused)
    steps, output = fold_routed_experts(steps, output)
    return LayerProgram(tuple(steps), output, reads)


def _check_blocks(layer: nn.Module) -> None:
    """A transformers decoder layer's children holding parameters must each be a block with a rule
    (the structural ones: attention, latent attention, MoE, MLP, norm): a Mamba mixer or a linear
    attention is named before tracing, not as a tracing failure inside it."""
    from moegraph.lowering.structural import classify, family_of
    if family_of(type(layer)) is None:
        return
    for name, child in layer.named_children():
        kinds = [classify(c) for c in child.children()] if isinstance(child, nn.ModuleList) else []
        if kinds and all(k in ("attention", "mla") for k in kinds):
            raise LoweringError(f"{name!r} (ModuleList): {len(kinds)} attention sublayers ({type(child[0]).__name__}) in "
                                "one decoder layer (LongCat-Flash's dual sublayers, its MoE on a shortcut across "
                                "them) are not modelled: one attention block per layer is")
    for name, child in _blocks_of(layer):
        if next(child.parameters(), None) is not None and find_rule(child, name) is None:
            raise LoweringError(f"{name!r} ({type(child).__name__}) is not modelled: the structural lowering reads "
                                "attention (GQA or latent), MoE, MLP and norm blocks")


def _blocks_of(layer: nn.Module, prefix: str = ""):
    """(qualname, module) of the layer's children, and of the children of a container among them: a
    transformers module without a rule or parameters of its own whose every child holding
    parameters has a rule (DBRX's norm_attn_norm: norm_1, attn, norm_2), which fx traces into."""
    from moegraph.lowering.structural import family_of
    for name, child in layer.named_children():
        qualname = f"{prefix}{name}"
        inner = [(n, c) for n, c in child.named_children() if next(c.parameters(), None) is not None]
        if (find_rule(child, qualname) is None and family_of(type(child)) is not None and inner
                and not dict(child.named_parameters(recurse=False))
                and all(find_rule(c, f"{qualname}.{n}") is not None for n, c in inner)):
            yield from _blocks_of(child, f"{qualname}.")
        else:
            yield qualname, child


def _same_shape(index, node: fx.Node) -> bool:
    """Whether ``x.view(y.shape)`` reshapes one layer value to another's shape: every value between
    the blocks is [b, s, h], so it changes nothing (Llama 4's decoder layer writes it)."""
    args = node.args[1:]
    return (len(args) == 1 and isinstance(args[0], fx.Node) and isinstance(index.get(args[0]), tuple)
            and len(index[args[0]]) == 2 and index[args[0]][0] == "shape" and isinstance(index.get(node.args[0]), int))


def _same_dtype(index, node: fx.Node) -> bool:
    """Whether ``x.to(y.dtype)`` casts one layer value to another's dtype: every value between the
    blocks has the layer's dtype, so it changes nothing (DBRX's ``norm_1(x).to(x.dtype)``)."""
    args = node.args[1:]
    return (len(args) == 1 and not node.kwargs and isinstance(args[0], fx.Node)
            and isinstance(index.get(args[0]), tuple) and index[args[0]][0] == "dtype"
            and isinstance(index.get(node.args[0]), int))


def _no_dropout(node: fx.Node, layer: nn.Module) -> fx.Node:
    """The input of ``F.dropout(x, p, training)`` between blocks when it is the identity (p = 0, or
    not training: DBRX's resid_pdrop); a dropout that drops is random per step: refused by name."""
    bound = inspect.signature(F.dropout).bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    p, training = bound.arguments["p"], bound.arguments["training"]
    if isinstance(p, (int, float)) and not isinstance(p, bool) and (p == 0 or training is False):
        return bound.arguments["input"]
    raise LoweringError(f"{_enclosing(node, layer) or type(layer).__name__}: dropout with p={p!r} in training mode between its blocks is random "
                        "per step and not modelled; set it to 0 (e.g. config.resid_pdrop) or call .eval()")


def _is_shape(entry) -> bool:
    return isinstance(entry, tuple) and len(entry) == 2 and entry[0] == "shape"


def _token_rows(index, node: fx.Node) -> bool:
    """Whether ``x.reshape(-1, x.shape[-1])`` flattens a layer value's tokens to rows [b*s, h] (Gemma 4's
    router and experts read them so): a no-op for the row-wise blocks that read it (norms, router,
    experts), which the numerical check confirms."""
    args = node.args[1:]
    return (len(args) == 2 and args[0] == -1 and isinstance(index.get(node.args[0]), int)
            and isinstance(args[1], fx.Node) and isinstance(index.get(args[1]), tuple)
            and index[args[1]][0] == "shape_dim" and index[args[1]][2] == -1)


def _scalar_buffer(layer: nn.Module, target: str) -> bool:
    """Whether ``target`` is a buffer of one element of the layer (Gemma 4's layer_scalar)."""
    buf = layer._buffers.get(target)
    return buf is not None and buf.numel() == 1 and buf.is_floating_point()


def _experts_args(index, node: fx.Node) -> tuple[int, int]:
    """(input step, router step) of ``experts(x, top_k_index, top_k_weights)`` (Gemma 4): the index and
    weights must be the one router's outputs 2 and 1."""
    x, idx, w = (list(node.args) + [node.kwargs.get(k) for k in ("top_k_index", "top_k_weights")])[:3]
    ok = (isinstance(index.get(idx), tuple) and isinstance(index.get(w), tuple) and len(index[idx]) == 3
          and index[idx][0] == index[w][0] == "routing" and index[idx][1] == index[w][1]
          and (index[idx][2], index[w][2]) == (2, 1))
    if not ok:
        raise LoweringError(f"{node.target!r}: experts called with other than (x, top_k_index, top_k_weights) of one "
                            "router of the layer: not modelled")
    return _index(index, x, node), index[idx][1]


def _scalar_mul(node: fx.Node) -> tuple[fx.Node, float] | None:
    """(tensor, factor) of ``tensor * factor`` with a Python number (a residual multiplier), else None."""
    a, b = (node.args + (None, None))[:2]
    if isinstance(a, fx.Node) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return a, float(b)
    if isinstance(b, fx.Node) and isinstance(a, (int, float)) and not isinstance(a, bool):
        return b, float(a)
    return None


def _index(index, a, node) -> int:
    if not isinstance(a, fx.Node) or not isinstance(index.get(a), int):
        raise LoweringError(f"cannot lower argument {a!r} of {node.name!r}: expected one tensor from an earlier block")
    return index[a]


def dims_of(program: LayerProgram, batch: int, seq: int, n: int) -> Dims:
    """Layer sizes from its one attention block (GQA or MLA) and its one FFN block (MoE, or a dense
    MLP: then k = experts = 0). MLA: kv_heads = heads (every head has its own k and v after the up
    projection) and head_dim is the q/k head dim dn + dr."""
    attn = program.specs(AttentionSpec) + program.specs(MLASpec) + program.specs(LinearAttentionSpec)
    moe, mlp = program.specs(MoESpec), program.specs(MLPSpec)
    if len(attn) != 1 or len(moe) + len(mlp) != 1:
        raise LoweringError(f"expected one attention block and one MoE or dense MLP block per layer, found "
                            f"{len(attn)} attention, {len(moe)} MoE and {len(mlp)} MLP blocks")
    a = attn[0]
    heads, kv_heads, head_dim = ((a.heads, a.heads, a.qk_dim) if isinstance(a, MLASpec)
                                 else (a.v_heads, a.k_heads, a.k_dim) if isinstance(a, LinearAttentionSpec)
                                 else (a.heads, a.kv_heads, a.head_dim))
    if moe:
        e = moe[0]
        return Dims(b=batch, s=seq, h=e.hidden, n=n, k=e.top_k, heads=heads, kv_heads=kv_heads,
                    head_dim=head_dim, ffn=e.ffn_hidden, experts=e.experts)
    return Dims(b=batch, s=seq, h=mlp[0].hidden, n=n, k=0, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                ffn=mlp[0].ffn_hidden, experts=0)


def lower(program: LayerProgram, dims: Dims, strategy: Strategy, name: str, *,
          step_values: dict[int, str] | None = None, coverage: bool = True) -> Graph:
    """Emit forward nodes for ``strategy``, append the backward, verify; ``step_values`` (when given)
    receives each step's output value name (the numerical check compares them); ``coverage``: run
    the structural guard's check that every parameter is read (skipped when the guard is off)."""
    if linear := program.specs(LinearAttentionSpec):      # its key heads are the dims' kv_heads: say which
        if linear[0].k_heads % strategy.attn_ranks:
            raise ConfigError(f"{name}: n/attn_nodes={strategy.attn_ranks} does not divide the linear attention's key "
                              f"heads ({linear[0].k_heads}): each rank's key heads carry their value heads"
                              + fold_hint(dims, strategy, "kv_heads"))
    check_strategy(dims, strategy)
    g = GraphBuilder(name, dims, strategy)
    outs: dict[int, str] = {-1: g.input("hidden", (*local_tokens(dims.b, dims.s, strategy), dims.h))}  # [b/N, s/G, h]
    norms = adds = 0
    for i, st in enumerate(program.steps):
        x = outs[st.args[0]]
        if st.kind == "norm":
            nname, out = NORM_NAMES[norms] if norms < len(NORM_NAMES) else (f"norm{norms + 1}", f"norm{norms + 1}_out")
            norms += 1
            outs[i] = emit_rmsnorm(g, st.spec, x, name=nname, out=out, module=st.module, block="")
        elif st.kind == "attention":
            emit = ATTENTION_EMITTERS[type(st.spec)]
            with g.attention_group():
                outs[i] = emit(g, st.spec, x, module=st.module)
        elif st.kind == "moe":
            outs[i] = emit_moe(g, st.spec, x, module=st.module)
        elif st.kind == "mlp":
            outs[i] = emit_mlp(g, st.spec, x, module=st.module)
        elif st.kind == "scale" and st.by is not None:
            outs[i] = emit_scale_by(g, x, ParamSource(st.by), name=f"scale{i}", out=f"scale{i}_out", module="", block="")
        elif st.kind == "scale":
            outs[i] = emit_scale(g, x, st.factor, name=f"scale{i}", out=f"scale{i}_out", module="", block="")
        elif st.kind == "add":
            nname, out = ADD_NAMES[adds] if adds < len(ADD_NAMES) else (f"add{adds + 1}", f"add{adds + 1}_out")
            adds += 1
            outs[i] = emit_add(g, x, outs[st.args[1]], name=nname, out=out, module="", block="")
        else:
            raise LoweringError(f"unknown step kind {st.kind!r}; valid: norm, attention, moe, mlp, add, scale")
    g.outputs.append(outs[program.output])
    if step_values is not None:
        step_values.update(outs)
    _assign_block_of_unassigned(g)
    g.saved = {v for node in g.nodes for v in node.outputs} | {"hidden"}
    add_backward(g, g.outputs[0])
    graph = verify(g.build(program=program))
    if coverage and guard_on():
        check_coverage(graph, program)
    return graph


def relower(graph: Graph, **strategy_changes) -> Graph:
    """Lower the same layer again with some strategy fields changed (used by strategy passes).
    One layer: a stack's layers are re-lowered by the pass manager, which restacks them."""
    if layer_count(graph) > 1:
        raise LoweringError(f"graph {graph.name!r} holds {layer_count(graph)} layers: re-lower its one-layer graph "
                            "(moegraph.layers.layer_graph); the pass manager restacks it")
    program = graph.meta_get("program")
    if program is None:
        raise LoweringError(f"graph {graph.name!r} carries no layer program to re-lower")
    strategy = dataclasses.replace(graph.strategy, **strategy_changes)
    layer = lower(program, dataclasses.replace(graph.dims, n=strategy.n), strategy, graph.name)
    if graph.meta_get(AUX_META) is not None:                # the model's aux loss (trace_model) stays
        layer = layer.with_meta(**{AUX_META: graph.meta_get(AUX_META)})
    return layer


def trace_module(module: nn.Module, strategy: Strategy, *, batch: int, seq: int, name: str | None = None) -> Graph:
    """Lower ``module`` (one MoE decoder layer) for ``strategy``; forward and backward, verified, and
    checked against the eager module (``moegraph.lowering.check``; cached)."""
    program = extract_program(module)
    graph = lower(program, dims_of(program, batch, seq, strategy.n), strategy, name or type(module).__name__)
    check_layer(module, program, strategy, name=_module_name("", type(module)))
    return graph


def trace_layers(layers: Sequence[nn.Module], strategy: Strategy, *, batch: int, seq: int,
                 name: str | None = None, rotary: nn.Module | None = None) -> Graph:
    """Lower a stack of decoder layers (an ``nn.ModuleList``, applied in order, each reading the
    previous one's output): each distinct program (blocks, sizes, parameter names) is lowered and
    checked against its first layer once. Identical layers: the one-layer graph of the first,
    its parameters named as in the layer. Layers of several kinds (GPT-OSS's sliding and full
    attention, DeepSeek's dense first layers): kind 0's graph carrying the kinds and the pattern
    (``moegraph.layers.LayerKinds`` in its meta, ``KINDS_META``). The stack pass
    (``moegraph.passes.stack``, run by the driver) chains len(layers) layers, layer i's parameters
    read as ``layers.{i}.<name in the layer>``. ``rotary``: the model's rotary module, for the
    eager call of each checked layer (``moegraph.lowering.check.eager_call``)."""
    layers = list(layers)
    if not layers:
        raise LoweringError("trace_layers needs at least one layer")
    programs = []
    for i, m in enumerate(layers):
        try:
            programs.append(extract_program(m))
        except LoweringError as err:          # named once: some rules name their layer already
            said = str(err).startswith(f"layer {i}: ")
            raise LoweringError(str(err) if said else f"layer {i}: {err}") from None
    distinct: list[LayerProgram] = []
    pattern = []
    for p in programs:
        if p not in distinct:
            distinct.append(p)
        pattern.append(distinct.index(p))
    name = name or type(layers[0]).__name__
    graphs = []
    for k, program in enumerate(distinct):
        i = pattern.index(k)
        graphs.append(lower(program, dims_of(program, batch, seq, strategy.n), strategy,
                            name if k == 0 else f"{name}.layer{i}"))
        check_layer(layers[i], program, strategy, name=f"layer {i} ({type(layers[i]).__name__})",
                    call=eager_call(layers[i], rotary=rotary))
    if len(graphs) == 1:
        return graphs[0]
    return graphs[0].with_meta(**{KINDS_META: LayerKinds(tuple(graphs), tuple(pattern))})


def trace_causal_lm(model: nn.Module, strategy: Strategy, *, batch: int, seq: int,
                    name: str | None = None) -> tuple[Graph, ModelSpec]:
    """Recognise a whole causal LM by its model rule (``moegraph.lowering.register_model``), never
    tracing it as a whole: lower its decoder layers (``trace_layers``: each distinct kind once;
    the driver stacks ``len(model.get_submodule(spec.layers))`` of them) and return that
    graph with the ModelSpec naming the parts that run around it (embedding, final norm,
    LM head). Every parameter and buffer of the model
    must belong to a layer or to one of those parts, or be declared unused by the rule."""
    check_patches_and_hooks(model)
    spec = find_model_rule(model).spec(model)
    layers = model.get_submodule(spec.layers)
    rotary = next((m for qn, m in model.named_modules() if qn.split(".")[-1] == "rotary_emb"), None)
    graph = trace_layers(layers, strategy, batch=batch, seq=seq, name=name or type(model).__name__, rotary=rotary)
    around = {spec.embed, *spec.norm_names, *([spec.head] if spec.head else []), *spec.unused}
    stray = [k for k, _ in [*model.named_parameters(), *model.named_buffers()]
             if k not in around and not k.startswith(f"{spec.layers}.")]
    if stray:
        raise LoweringError(f"{type(model).__name__}: {', '.join(stray)} belong to no decoder layer, embedding, final "
                            "norm or LM head: the model rule does not model them")
    return graph, spec


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
    for i, node in enumerate(g.nodes):
        if node.block:
            continue
        following = next((n.block for n in g.nodes[i + 1:] if n.block), "ffn")
        block = {"input_norm": "attention", "attn_residual": "attention", "post_attn_norm": "ffn",
                 "ffn_residual": "ffn"}.get(node.name, following)
        g.nodes[i] = dataclasses.replace(node, block=block)


def trace_model(cfg, strategy: Strategy, *, batch: int = 1, seq: int = 8192, layers: int = 1) -> Graph:
    """Trace the layers of a registry ModelConfig, without allocating weights. A registry model:
    one MoE reference layer (DeepSeek-V3's dense first layers are ``MoETransformerLayer.from_config(
    cfg, layer=i)``), which the stack pass (``moegraph.passes.stack``) chains ``layers`` times. A
    Hugging Face config: the family's own decoder layers a stack of ``layers`` holds
    (``moegraph.registry.hf.hf_stack``), through ``trace_layers`` (its kinds, when they differ). A
    model with ``router_aux_loss_coef`` > 0 carries its aux loss in ``graph.meta`` for the edges pass."""
    from moegraph.models import MoETransformerLayer
    check_graph_size(chunks=strategy.chunks, n=strategy.n, dp=strategy.dp)    # before tracing
    if cfg.hf_config is not None:             # read from a Hugging Face config: the family's own layers
        from moegraph.registry.hf import hf_stack
        graph = trace_layers(hf_stack(cfg, layers), strategy, batch=batch, seq=seq, name=cfg.name)
    else:
        with torch.device("meta"):
            layer = MoETransformerLayer.from_config(cfg)
        graph = trace_module(layer, strategy, batch=batch, seq=seq, name=cfg.name)
    if cfg.router_aux_loss_coef > 0:        # the model step's edges add it (moegraph.edges, AUX_META)
        graph = graph.with_meta(**{AUX_META: AuxLoss(cfg.router_aux_loss_coef, cfg.experts, cfg.top_k)})
    return graph


__all__ = ["trace_module", "trace_layers", "trace_causal_lm", "trace_model", "extract_program", "lower", "relower", "LoweringError", "ConfigError"]
