"""Structural lowering of a decoder layer's feed-forward blocks: routed experts with their router and
shared experts (MoE), and dense gated MLPs. See ``moegraph.lowering.structural`` for how blocks are
recognised and the guard; this module reads the two FFN kinds.

Notation: h hidden, E experts, f expert h_ffn, k top-k.
"""

from __future__ import annotations

import functools
import inspect

from torch import nn

from moegraph.ir import ParamSource
from moegraph.lowering import LoweringError
from moegraph.lowering.families import Family, family_row
from moegraph.lowering.specs import MLPSpec, MoESpec, NormSpec
from moegraph.lowering.structural import (SHARED_NAMES, _child_class_check, _ctx, _router_name, _router_weight, _src,
                                          check_children, family_of, forward_reads, norm_spec, returns_tuple)


def activation_of(module: nn.Module, qualname: str) -> str:
    """'silu' | 'gelu' | 'gelu_tanh' from the module's act_fn / activation_fn."""
    act = getattr(module, "act_fn", None) or getattr(module, "activation_fn", None)
    name = type(act).__name__
    if name in ("SiLU", "SiLUActivation"):
        return "silu"
    if name in ("GELUActivation", "GELU") and getattr(act, "approximate", "none") == "none":
        return "gelu"
    if name in ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "GELUPytorchTanh") or \
            (name == "GELU" and getattr(act, "approximate", "") == "tanh"):
        return "gelu_tanh"
    raise LoweringError(f"{qualname}: activation {act!r} is not modelled (SiLU, GELU, tanh-GELU are)")


def mlp_spec(module: nn.Module, qualname: str) -> MLPSpec:
    """A dense gated MLP: down(act(gate(x)) * up(x)), no biases; gate and up as two linears, or as
    one fused ``gate_up_proj`` [2f, h] halved as the family stores its experts' (MiniMax-M3's shared
    expert, with GPT-OSS's clamped SwiGLU: ``swiglu_alpha`` and ``swiglu_limit``)."""
    fused = isinstance(module._modules.get("gate_up_proj"), nn.Linear) and "gate_up_proj" in forward_reads(type(module))
    names = ("gate_up_proj", "down_proj") if fused else ("gate_proj", "up_proj", "down_proj")
    missing = [n for n in names if not isinstance(module._modules.get(n), nn.Linear)]
    if missing:
        held = ", ".join(n for n, _ in module.named_children()) or "no children"
        raise LoweringError(f"{qualname!r} ({type(module).__name__}): a gated MLP without {', '.join(missing)} (it "
                            f"holds {held}) is not modelled: gate_proj, up_proj and down_proj linears (or a fused "
                            "gate_up_proj and down_proj) are")
    for name in names:
        _child_class_check(module, qualname, name)
        if getattr(module, name).bias is not None:
            raise LoweringError(f"{qualname}.{name}.bias: a dense MLP with biases is not modelled")
    check_children(module, qualname, set(names) | {"act_fn", "activation_fn"})
    q = functools.partial(lambda qn, n: _src(qn, f"{n}.weight"), qualname)
    down = module.down_proj
    activation, clamp = _mlp_activation(module, qualname)
    if not fused:
        return MLPSpec(w1=q("gate_proj"), w3=q("up_proj"), w2=q("down_proj"), ffn_hidden=module.gate_proj.out_features,
                       hidden=module.gate_proj.in_features, activation=activation, **clamp)
    two_f, h = module.gate_up_proj.weight.shape
    if two_f != 2 * down.in_features or down.out_features != h:
        raise LoweringError(f"{qualname} ({type(module).__name__}): gate_up_proj {tuple(module.gate_up_proj.weight.shape)} "
                            f"and down_proj {tuple(down.weight.shape)} are not [2f, h] and [h, f]")
    f, row = down.in_features, family_row(family_of(type(module)) or _ctx().family).experts
    gu = f"{qualname}.gate_up_proj.weight"
    step, second = (2, 1) if row.gate_up == "interleaved" else (1, f)
    first, other = ParamSource(gu, narrow=(0, 0, f), step=step), ParamSource(gu, narrow=(0, second, f), step=step)
    w1, w3 = (other, first) if row.order == "up-gate" else (first, other)
    return MLPSpec(w1=w1, w3=w3, w2=q("down_proj"), ffn_hidden=f, hidden=h, activation=activation, **clamp)


def _mlp_activation(module: nn.Module, qualname: str) -> tuple[str, dict]:
    """(activation, clamp fields of MLPSpec): the module's act_fn, or the clamped SwiGLU its forward
    computes from ``swiglu_alpha`` / ``alpha`` and ``swiglu_limit`` / ``limit``."""
    reads = forward_reads(type(module))
    alpha = next((getattr(module, a) for a in ("swiglu_alpha", "alpha") if a in reads), None)
    limit = next((getattr(module, a) for a in ("swiglu_limit", "limit") if a in reads), None)
    if alpha is None and limit is None:
        return activation_of(module, qualname), {}
    if not (isinstance(alpha, float) and isinstance(limit, float)):
        raise LoweringError(f"{qualname} ({type(module).__name__}): its forward reads alpha={alpha!r} and "
                            f"limit={limit!r}; a clamped SwiGLU needs both as floats")
    return "clamped_swiglu", {"swiglu_alpha": alpha, "swiglu_limit": limit}


def _lookup(root, path: str):
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _setting(name: str, *where, default=None):
    for obj in where:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return default


JITTER_NAMES = ("jitter_noise", "router_jitter_noise", "moe_jitter_eps")    # DBRX's: moe_jitter_eps
SCALE_NAMES = ("routed_scaling_factor", "router_scaling_factor", "route_scale")


def moe_spec(module: nn.Module, qualname: str) -> MoESpec:
    """Top-k routed experts (+ shared experts, + their sigmoid gate) read by structure and the family row."""
    ctx = _ctx()
    row: Family = family_row(family_of(type(module)) or ctx.family)
    cfg = ctx.config
    rname = _router_name(module)
    router = _child_class_check(module, qualname, rname)
    sampler = sampling_call(type(router))
    if sampler is not None:
        mode = ("samples the experts at random in training mode (Gumbel sampling, random per step, with its own "
                "gradient estimator)" if router.training else "picks and weighs the experts in eval mode by a masked "
                "softmax around the best score, not a top-k of softmax or sigmoid scores")
        raise LoweringError(f"{qualname}.{rname} ({type(router).__name__}): its routing function {sampler} {mode}: "
                            "not modelled")
    for owner in (module, router):
        jitter = next((j for a in JITTER_NAMES if (j := getattr(owner, a, 0))), 0)
        if module.training and isinstance(jitter, float) and jitter > 0:
            raise LoweringError(f"{qualname} ({type(module).__name__}): router_jitter_noise={jitter} is random per "
                                "step and cannot be reproduced; set it to 0")
    experts = module.experts
    wpath, weight = _router_weight(router)
    E, h = weight.shape
    top_k = _setting("top_k", router, module, default=None) or _setting("num_experts_per_tok", cfg)
    if not isinstance(top_k, int):
        raise LoweringError(f"{qualname} ({type(module).__name__}): no top_k on {rname}, the block or the config")
    rr = row.router
    seen = router_behaviour(type(router))
    probed = probe_router(router, weight, top_k, module, qualname)
    normalize = rr.normalize if rr.normalize is not None else seen["normalize"]
    if isinstance(normalize, str):
        how = _setting(normalize, router, module, cfg, default=False)
        if not isinstance(how, bool) and how not in (1, 0):     # DBRX: divided by their p-norm, p = how
            raise LoweringError(f"{qualname} ({type(module).__name__}): {normalize}={how!r} divides the top-k weights "
                                "by their p-norm with p != 1: not modelled (p=1, their sum, is)")
        normalize = bool(how)
    scoring = rr.scoring or seen["scoring"]
    if probed is not None and rr.scoring is None and rr.normalize is None:
        scoring, normalize = probed
    choice_path = rr.choice_bias or (f"{rname}.{CHOICE_BIAS}" if _holds_choice_bias(router)
                                     else CHOICE_BIAS if _holds_choice_bias(module) else None)
    for attr in forward_reads(type(router)):
        cap = getattr(router, attr, None)
        if "softcap" in attr and cap not in (None, 0, 0.0):
            raise LoweringError(f"{qualname}.{rname}.{attr}={cap}: a tanh soft cap on the router logits is not "
                                "modelled; set it to 0")
    choice = None
    if choice_path is not None:
        if _lookup(module, choice_path) is None:
            raise LoweringError(f"{qualname}: the family's router reads {choice_path}, which is missing")
        choice = _src(qualname, choice_path)
    groups = int(_setting("num_group", router, default=None) or _setting("n_group", cfg, default=1) or 1)
    topk_groups = int(_setting("topk_group", router, cfg, default=1) or 1)
    if rr.grouped is not None and _setting(rr.grouped[0], router, cfg) != rr.grouped[1]:
        groups = topk_groups = 1
    # routed scaling: DeepSeek's routed_scaling_factor, HY-V3's router_scaling_factor, AFMoE's route_scale
    scale_name = next((n for n in SCALE_NAMES if n in forward_reads(type(router)) | forward_reads(type(module))),
                      None)                # None: a config field the router never applies
    scale = float(_setting(scale_name, router, module, cfg, default=1.0) or 1.0) if scale_name else 1.0
    known = {rname, "experts"}
    shared = None
    for name in SHARED_NAMES:
        if getattr(module, name, None) is not None and name in forward_reads(type(module)):
            known.add(name)
            shared = mlp_spec(_child_class_check(module, qualname, name), f"{qualname}.{name}")
    gate_name = "shared_expert_gate"
    if getattr(module, gate_name, None) is not None and gate_name in forward_reads(type(module)):
        known.add(gate_name)
        if module.shared_expert_gate.out_features != 1:
            raise LoweringError(f"{qualname}.shared_expert_gate has {module.shared_expert_gate.out_features} "
                                "outputs, not 1")
        shared = _replace(shared, gate=_src(qualname, "shared_expert_gate.weight"))
    post_norm = _post_norm(module, qualname, known)
    check_children(module, qualname, known)
    average = _shared_combination(module, qualname) if shared is not None else False
    w1, w3, w2, f, act, layout = _expert_weights(experts, f"{qualname}.experts", h, row)
    router_bias = _src(qualname, f"{rname}.bias") if router._parameters.get("bias") is not None else None
    topk_first = rr.order == "topk-softmax"
    if topk_first and not (scoring == "softmax" and normalize and choice is None and groups == 1 and scale == 1.0):
        raise LoweringError(f"{qualname}.{rname}: its family's router takes the softmax over the top-k logits; "
                            "with a choice bias, expert groups, a scale, sigmoid scores or unnormalised weights that "
                            "is not modelled")
    expert_bias = _expert_biases(experts, f"{qualname}.experts", f, row)
    return MoESpec(router=_src(qualname, f"{rname}.{wpath}"), w1=w1, w3=w3, w2=w2, experts=E, top_k=top_k,
                   ffn_hidden=f, hidden=h, normalize=normalize, shared=shared, shared_average=average, scoring=scoring, score_bias=choice,
                   bias_on_logits=choice is not None and rr.choice_on == "logits",
                   groups=groups, topk_groups=topk_groups, scale=scale, group_score=rr.group_score,
                   activation=act, router_bias=router_bias, topk_first=topk_first, expert_bias=expert_bias,
                   tuple_output=returns_tuple(type(module)), swiglu_limit=layout.get("limit"),
                   swiglu_alpha=layout.get("alpha"), weighted_input=row.weighted_input, post_norm=post_norm)


def _post_norm(module: nn.Module, qualname: str, known: set[str]) -> NormSpec | None:
    """The norm a block's forward applies to its output before the residual add (A.X-K1's
    post_mlp_layernorm): the one norm child the forward reads (added to ``known``). Where the forward
    applies it is not read here: the numerical check compares the block with eager."""
    reads = forward_reads(type(module))
    names = [n for n, c in module.named_children() if n in reads and n not in known and "norm" in type(c).__name__.lower()]
    if not names:
        return None
    if len(names) > 1:
        raise LoweringError(f"{qualname} ({type(module).__name__}): its forward reads {len(names)} norms "
                            f"({', '.join(names)}); one on the block's output is modelled")
    known.add(names[0])
    return norm_spec(_child_class_check(module, qualname, names[0]), f"{qualname}.{names[0]}")


CHOICE_BIAS = "e_score_correction_bias"


def _holds_choice_bias(module: nn.Module) -> bool:
    """A score-correction bias for the expert choice: a buffer (DeepSeek-V3), or a parameter that
    is never trained (Laguna's, requires_grad=False: the choice's top-k passes it no gradient)."""
    p = module._parameters.get(CHOICE_BIAS)
    return CHOICE_BIAS in module._buffers or (p is not None and not p.requires_grad)


COMBINATION = "shared_expert_combination_strategy"


def _shared_combination(module: nn.Module, qualname: str) -> bool:
    """Whether the block averages its routed and shared experts' outputs (Cohere2-MoE's
    ``shared_expert_combination_strategy='average'``) rather than adding them ('sum', every other)."""
    if COMBINATION not in forward_reads(type(module)):
        return False
    how = getattr(module, COMBINATION, None)
    if how not in ("sum", "average"):
        raise LoweringError(f"{qualname} ({type(module).__name__}): {COMBINATION}={how!r} is not modelled "
                            "('sum' and 'average' are)")
    return how == "average"


def probe_router(router: nn.Module, weight, top_k: int, block: nn.Module, qualname: str):
    """(scoring, normalize) of a router, found by running it: its top-k weights on 32 random tokens
    compared with softmax or sigmoid scores of x W^T, renormalised or not. None when it cannot run
    (meta), returns no (weights, indices) pair, or matches none (the family row or the source then
    decides, and the numerical check has the last word). Routers with a choice bias, groups or a
    logit bias are left to the row."""
    import torch
    if weight.is_meta or _holds_choice_bias(router) or router._parameters.get("bias") is not None:
        return None
    if int(getattr(router, "num_group", None) or 1) > 1:
        return None
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(32, weight.shape[1], generator=gen).to(dtype=weight.dtype, device=weight.device)
    try:
        with torch.no_grad():
            out = router(x)
    except Exception:  # noqa: BLE001 - a router that cannot run alone: its row or source decides
        return None
    out = out if isinstance(out, tuple) else (out,)
    idx = next((t for t in out if torch.is_tensor(t) and not t.is_floating_point() and t.shape == (32, top_k)), None)
    wts = next((t for t in out if torch.is_tensor(t) and t.is_floating_point() and t.shape == (32, top_k)), None)
    if idx is None or wts is None:
        return None
    logits = x.float() @ weight.detach().float().T   # a probe: no graph for autograd to keep
    got = torch.zeros_like(logits).scatter(1, idx.long(), wts.float())
    for scoring in ("softmax", "sigmoid"):
        scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
        chosen = scores.gather(1, idx.long())
        for normalize in (True, False):
            w = chosen / chosen.sum(-1, keepdim=True) if normalize else chosen
            want = torch.zeros_like(logits).scatter(1, idx.long(), w)
            if float((got - want).norm() / want.norm().clamp_min(1e-30)) < 1e-3:
                return scoring, normalize
    return None


RANDOM_CALLS = ("exponential_(", "rand_like(", "multinomial(", "bernoulli(", "randn_like(")


@functools.lru_cache(maxsize=None)
def sampling_call(cls: type) -> str | None:
    """The name of a module-level function a router's forward calls that draws random numbers
    (PhiMoE's ``sparsemixer``: Gumbel sampling of the experts in training), read from the sources;
    None when it calls none."""
    import re
    import sys
    try:
        src = inspect.getsource(inspect.unwrap(cls.forward))
    except (OSError, TypeError):
        return None
    namespace = vars(sys.modules[cls.__module__])
    for name in dict.fromkeys(re.findall(r"(?<![.\w])(\w+)\(", src)):
        fn = namespace.get(name)
        if not inspect.isfunction(fn):
            continue
        try:
            body = inspect.getsource(fn)
        except (OSError, TypeError):
            continue
        if any(call in body for call in RANDOM_CALLS):
            return name
    return None


@functools.lru_cache(maxsize=None)
def router_behaviour(cls: type) -> dict:
    """What a router's forward does, read from its source: sigmoid or softmax scores; whether it
    renormalises the chosen weights (it reads norm_topk_prob: that attribute decides; it divides by
    their sum, or takes a softmax of the top-k logits: always)."""
    try:
        src = inspect.getsource(inspect.unwrap(cls.forward))
    except (OSError, TypeError):
        src = ""
    scoring = "sigmoid" if "sigmoid" in src else "softmax"
    if "norm_topk_prob" in src:
        normalize: bool | str = "norm_topk_prob"
    else:
        topk, soft = src.find("topk("), src.find("softmax(")
        normalize = ".sum(" in src or (0 <= topk < soft)
    return {"scoring": scoring, "normalize": normalize}


def _replace(spec, **changes):
    import dataclasses
    return dataclasses.replace(spec, **changes)


def _expert_weights(experts: nn.Module, qualname: str, h: int, row: Family):
    """(w1, w3, w2, f, activation, extra) from fused 3-D weights: gate_up_proj [E, 2f, h] (or [E, h, 2f],
    then read transposed) and down_proj [E, h, f] (or [E, f, h]); or the family row's three flat
    tensors (``ExpertRow.separate``)."""
    if row.experts.separate is not None:
        return _separate_expert_weights(experts, qualname, h, row.experts.separate)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3):
        raise LoweringError(f"{qualname} ({type(experts).__name__}): only fused 3-D expert weights (gate_up_proj, "
                            "down_proj) are modelled")
    _, a, b = gate_up.shape
    transposed = b != h and a == h or (a == h and b == 2 * down.shape[1] and down.shape[2] == h)
    two_f = b if transposed else a
    f = two_f // 2
    gu = f"{qualname}.gate_up_proj"
    if row.experts.gate_up == "interleaved":
        first, second = ParamSource(gu, narrow=(1, 0, f), step=2, transpose=transposed), \
            ParamSource(gu, narrow=(1, 1, f), step=2, transpose=transposed)
    else:
        first, second = ParamSource(gu, narrow=(1, 0, f), transpose=transposed), \
            ParamSource(gu, narrow=(1, f, f), transpose=transposed)
    w1, w3 = (second, first) if row.experts.order == "up-gate" else (first, second)
    w2 = ParamSource(f"{qualname}.down_proj", transpose=down.shape[1] == f and down.shape[2] == h and f != h)
    extra = {}
    if getattr(experts, "act_fn", None) is not None:
        act = activation_of(experts, qualname)
    elif isinstance(alpha := getattr(experts, "alpha", getattr(experts, "swiglu_alpha", None)), float) and \
            isinstance(limit := getattr(experts, "limit", getattr(experts, "swiglu_limit", None)), float):
        act, extra = "clamped_swiglu", {"alpha": alpha, "limit": limit}
    else:
        raise LoweringError(f"{qualname} ({type(experts).__name__}): no act_fn and no (alpha, limit) of a clamped "
                            "SwiGLU: its activation is not modelled")
    return w1, w3, w2, f, act, extra


def _separate_expert_weights(experts: nn.Module, qualname: str, h: int, paths: tuple[str, str, str]):
    """Gate, up and down as three flat tensors [E*f, h] (DBRX: ``mlp.w1``, ``mlp.v1``, ``mlp.w2``), each
    viewed as [E, f, h]; the down projection computes rows @ w2 (w2 [f, h] per expert), so it is read
    transposed, as down_proj's [E, h, f]. The activation is the module holding them's."""
    tensors = [_lookup(experts, p) for p in paths]
    E = getattr(experts, "num_experts", None)
    if not isinstance(E, int) or any(not isinstance(t, nn.Parameter) or t.dim() != 2 or t.shape[1] != h
                                     or t.shape != tensors[0].shape or t.shape[0] % E for t in tensors):
        shapes = ", ".join(f"{p} {None if t is None else tuple(t.shape)}" for p, t in zip(paths, tensors))
        raise LoweringError(f"{qualname} ({type(experts).__name__}): {shapes}: not three flat [E*f, {h}] expert "
                            f"tensors of num_experts={E!r} experts")
    f = tensors[0].shape[0] // E
    w1, w3, w2 = (ParamSource(f"{qualname}.{p}", unflatten=E, transpose=i == 2) for i, p in enumerate(paths))
    holder = _lookup(experts, paths[0].rpartition(".")[0]) if "." in paths[0] else experts
    return w1, w3, w2, f, activation_of(holder, f"{qualname}.{paths[0].rpartition('.')[0]}"), {}


def _expert_biases(experts: nn.Module, qualname: str, f: int, row: Family):
    b13, b2 = getattr(experts, "gate_up_proj_bias", None), getattr(experts, "down_proj_bias", None)
    if b13 is None and b2 is None:
        return None
    if b13 is None or b2 is None:
        raise LoweringError(f"{qualname}: a bias on only one of gate_up_proj and down_proj is not modelled")
    src = f"{qualname}.gate_up_proj_bias"
    if row.experts.gate_up == "interleaved":
        first, second = ParamSource(src, narrow=(1, 0, f), step=2), ParamSource(src, narrow=(1, 1, f), step=2)
    else:
        first, second = ParamSource(src, narrow=(1, 0, f)), ParamSource(src, narrow=(1, f, f))
    b1, b3 = (second, first) if row.experts.order == "up-gate" else (first, second)
    return b1, b3, ParamSource(f"{qualname}.down_proj_bias")


