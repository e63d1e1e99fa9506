"""A decoder layer whose router and experts are its own children, beside a dense MLP (Gemma 4).

Gemma 4's MoE decoder layer (``enable_moe_block``) computes, on the residual r after attention:

    dense  = post_1(mlp(pre(r)))                      the dense MLP on its own norm, with its own output norm
    routed = post_2(experts(pre_2(r), router(r)))     the routed experts on another norm of r
    out    = post(dense + routed);  r + out           (then the layer's own scalar)

and its router reads r itself: logits = proj(rmsnorm(r) * scale * h^-0.5), softmax, top-k,
renormalised, each chosen weight times ``per_expert_scale[expert]``.

The traced layer (``moegraph.tracer``) records the router and the experts as two steps ("router",
"experts"); ``fold_routed_experts`` rewrites them, with the dense branch and the norms around them,
into ONE MoE step of the block input r: the dense MLP is the MoE's shared expert with a norm of its
own on each side (``MLPSpec.input_norm``/``output_norm``), the routed experts get theirs
(``MoESpec.routed_norm``/``routed_post_norm``) and the router its norm and constant
(``MoESpec.router_norm``/``router_input_scale``) and per-expert scale (``expert_scale``). So every
strategy, pass and cost rule that knows an MoE block with a shared expert knows this one; the
parts a Mixtral-style block lacks are norms, a SCALE and one more ROUTER input. A layout that does
not match this dataflow exactly is refused naming the step; the numerical check has the last word.

What the layer reads besides, and is not modelled, is refused by name (``refuse_unmodelled``):
per-layer inputs (``hidden_size_per_layer_input``).

Notation: h hidden, E experts, f expert h_ffn, k top-k.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from moegraph.lowering import LoweringError
from moegraph.lowering.families import family_row
from moegraph.lowering.specs import ExpertsSpec, MLPSpec, MoESpec, NormSpec, RouterSpec
from moegraph.lowering.structural import (_ctx, _src, family_of, forward_reads, weightless_rms_eps)
from moegraph.lowering.structural_ffn import _expert_biases, _expert_weights, router_behaviour

ROUTER_READS = frozenset({"norm", "proj", "scale", "scalar_root_size", "per_expert_scale", "config", "hidden_size",
                          "eps"})
"""What a layer router's forward may read: its norm, projection, learned scale, the constant, the
per-expert scale and the config (top_k_experts)."""


def router_spec(module: nn.Module, qualname: str) -> RouterSpec:
    """A layer's own router (module docstring), read by structure; anything else its forward reads is
    refused by name."""
    reads = forward_reads(type(module))
    where = f"{qualname} ({type(module).__name__})"
    other = sorted(reads - ROUTER_READS - {n for n in reads if callable(getattr(type(module), n, None))})
    if other:
        raise LoweringError(f"{where}: its forward reads {', '.join(other)}: a router other than Gemma 4's "
                            "(norm, scale, constant, proj, per-expert scale) is not modelled")
    proj = module.proj
    if proj.bias is not None:
        raise LoweringError(f"{where}: a bias on its proj is not modelled")
    E, h = proj.weight.shape
    norm = None
    if "norm" in reads:
        eps = weightless_rms_eps(module.norm)
        scale = module._parameters.get("scale")
        if eps is None or scale is None or tuple(scale.shape) != (h,) or "scale" not in reads:
            raise LoweringError(f"{where}: its norm is not a weightless RMSNorm followed by a learned scale [{h}]: "
                                "not modelled")
        norm = NormSpec(_src(qualname, "scale"), eps)
    elif "scale" in module._parameters:
        raise LoweringError(f"{where}: a learned input scale without its norm is not modelled")
    const = getattr(module, "scalar_root_size", 1.0) if "scalar_root_size" in reads else 1.0
    if isinstance(const, bool) or not isinstance(const, (int, float)):
        raise LoweringError(f"{where}: scalar_root_size={const!r}: only a constant input scale is modelled")
    cfg = getattr(module, "config", None) or _ctx().config
    top_k = getattr(cfg, "top_k_experts", None) or getattr(cfg, "num_experts_per_tok", None)
    if not isinstance(top_k, int):
        raise LoweringError(f"{where}: no top_k_experts or num_experts_per_tok in its config")
    pes = module._parameters.get("per_expert_scale")
    if pes is None or tuple(pes.shape) != (E,) or "per_expert_scale" not in reads:
        raise LoweringError(f"{where}: per_expert_scale must be a [{E}] parameter its forward reads")
    seen = router_behaviour(type(module))
    if not isinstance(seen["normalize"], bool):
        raise LoweringError(f"{where}: its renormalisation reads {seen['normalize']}: not modelled for a layer router")
    return RouterSpec(proj=_src(qualname, "proj.weight"), experts=E, top_k=top_k, hidden=h, norm=norm,
                      input_scale=float(const), expert_scale=_src(qualname, "per_expert_scale"),
                      scoring=seen["scoring"], normalize=seen["normalize"])


def experts_spec(module: nn.Module, qualname: str) -> ExpertsSpec:
    """A layer's own routed experts: fused 3-D weights and an activation (as an MoE block's experts)."""
    row = family_row(family_of(type(module)) or _ctx().family)
    h = module.gate_up_proj.shape[-1]
    w1, w3, w2, f, act, extra = _expert_weights(module, qualname, h, row)
    if extra or _expert_biases(module, qualname, f, row) is not None:
        raise LoweringError(f"{qualname} ({type(module).__name__}): layer experts with a clamped SwiGLU or biases are "
                            "not modelled")
    return ExpertsSpec(w1=w1, w3=w3, w2=w2, experts=module.gate_up_proj.shape[0], ffn_hidden=f, hidden=h,
                       activation=act)


def refuse_unmodelled(layer: nn.Module) -> None:
    """Name what a Gemma 4 decoder layer reads that is not modelled: per-layer inputs."""
    size = getattr(layer, "hidden_size_per_layer_input", 0)
    if size and "hidden_size_per_layer_input" in forward_reads(type(layer)):
        raise LoweringError(f"the layer ({type(layer).__name__}): per-layer inputs (hidden_size_per_layer_input={size}: a gated "
                            "projection of the model's per-layer embeddings added to each layer's output) are not "
                            "modelled; a config with hidden_size_per_layer_input=0 is")


# -- folding the traced steps ----------------------------------------------------------------------

def fold_routed_experts(steps: list, output: int) -> tuple[list, int]:
    """Each "experts" step, with its "router" step and the norms and dense branch around them
    (module docstring), rewritten as one "moe" step of the router's input; other steps renumbered.
    Returns (steps, output index)."""
    while any(st.kind == "experts" for st in steps):
        steps, output = _fold_one(steps, output)
    if any(st.kind == "router" for st in steps):
        raise LoweringError("a router child of the layer whose top-k reaches no experts child is not modelled")
    return steps, output


def _uses(steps: list, output: int) -> dict[int, list[int]]:
    uses: dict[int, list[int]] = {i: [] for i in range(-1, len(steps))}
    for i, st in enumerate(steps):
        for a in st.args:
            uses[a].append(i)
    uses[output].append(len(steps))           # the layer output counts as a use
    return uses


def _fold_one(steps: list, output: int) -> tuple[list, int]:
    uses = _uses(steps, output)
    e = next(i for i, st in enumerate(steps) if st.kind == "experts")
    x_e, r = steps[e].args
    router: RouterSpec = steps[r].spec
    experts: ExpertsSpec = steps[e].spec
    (block_in,) = steps[r].args
    drop = {e, r}

    def only_use(i: int, by: int) -> bool:
        return uses[i] == [by]

    def norm_of(i: int, src: int) -> NormSpec | None:
        st = steps[i]
        return st.spec if st.kind == "norm" and st.args == (src,) else None

    routed_norm = None
    if x_e != block_in:                       # the experts read their own norm of the router's input
        routed_norm = norm_of(x_e, block_in)
        if routed_norm is None or not only_use(x_e, e):
            raise LoweringError(f"{steps[e].module!r}: the routed experts read neither the router's input nor one norm "
                                "of it: not modelled")
        drop.add(x_e)
    if uses[r] != [e]:
        raise LoweringError(f"{steps[r].module!r}: the router's top-k feeds more than its experts: not modelled")
    end, routed_post = e, None
    if len(uses[e]) == 1 and uses[e][0] < len(steps) and norm_of(uses[e][0], e) is not None:
        end = uses[e][0]
        routed_post = steps[end].spec
        drop.add(end)
    shared, final = _dense_branch(steps, uses, end, block_in, drop)
    spec = MoESpec(router=router.proj, w1=experts.w1, w3=experts.w3, w2=experts.w2, experts=experts.experts,
                   top_k=router.top_k, ffn_hidden=experts.ffn_hidden, hidden=experts.hidden,
                   normalize=router.normalize, shared=shared, scoring=router.scoring, activation=experts.activation,
                   router_norm=router.norm, router_input_scale=router.input_scale, expert_scale=router.expert_scale,
                   routed_norm=routed_norm, routed_post_norm=routed_post)
    if experts.experts != router.experts or experts.hidden != router.hidden:
        raise LoweringError(f"{steps[e].module!r}: {experts.experts} experts of width {experts.hidden} behind a router "
                            f"of {router.experts} experts of width {router.hidden}")
    folded = dataclasses.replace(steps[final], kind="moe", args=(block_in,), spec=spec, module="")
    keep = [i for i in range(len(steps)) if i not in drop or i == final]
    new = {-1: -1} | {old: j for j, old in enumerate(keep)}
    out = []
    for i in keep:
        st = folded if i == final else steps[i]
        missing = [a for a in st.args if a not in new]
        if missing:
            raise LoweringError(f"{steps[missing[0]].module or steps[missing[0]].kind!r}: a value inside the routed "
                                "experts' branch is read outside it: not modelled")
        out.append(dataclasses.replace(st, args=tuple(new[a] for a in st.args)))
    if output not in new:
        raise LoweringError("the layer returns a value inside its routed experts' branch: not modelled")
    return out, new[output]


def _dense_branch(steps: list, uses: dict, end: int, block_in: int, drop: set) -> tuple[MLPSpec | None, int]:
    """(the shared expert, the step the folded MoE replaces): where the routed branch's end is added to
    [norm] <- mlp <- [norm] <- the block input, that MLP with its norms, and the add; else (None, end)."""
    if len(uses[end]) != 1 or uses[end][0] >= len(steps) or steps[uses[end][0]].kind != "add":
        return None, end
    add = uses[end][0]
    (other,) = [a for a in steps[add].args if a != end] or [None]
    chain, i, out_norm = [], other, None
    if i is not None and i >= 0 and steps[i].kind == "norm" and uses[i] == [add]:
        out_norm, chain = steps[i].spec, [i]
        i = steps[i].args[0]
    if i is None or i < 0 or steps[i].kind != "mlp" or uses[i] != [chain[0] if chain else add]:
        return None, end
    mlp, chain = steps[i], chain + [i]
    j, in_norm = mlp.args[0], None
    if j != block_in:
        if j < 0 or steps[j].kind != "norm" or steps[j].args != (block_in,) or uses[j] != [i]:
            return None, end
        in_norm, chain = steps[j].spec, chain + [j]
    if mlp.spec.gate is not None:
        raise LoweringError(f"{mlp.module!r}: a gated dense MLP beside the routed experts is not modelled")
    drop.update(chain)
    drop.add(end)
    return dataclasses.replace(mlp.spec, input_norm=in_norm, output_norm=out_norm), add
