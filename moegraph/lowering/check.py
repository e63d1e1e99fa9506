"""Never silently wrong by construction: each lowered layer is run against its eager module.

Before a compile schedules anything, ``check_layer`` lowers the layer's program for the compile's
strategy at a small batch (b=2, a short sequence), runs it in the reference interpreter
(``moegraph.interpreter``: n simulated ranks, the module's own weights and buffers) and runs the
eager module on the same random input, then compares, in program order: every block's output (the
norms, attention, MoE or MLP), the layer output, the input gradient and every parameter gradient
(``rel_err``: ||a - b|| / ||b||). The first value over the tolerance is refused in one line naming
it; nothing is scheduled for a module the graph does not reproduce.

The result is cached by a digest of what decides the numbers (``layer_digest``): the program, the
module's structure (every submodule's class, parameter and buffer names, shapes and dtypes, its
scalar attributes and its config) and the strategy's lowering fields, so a repeat compile pays
nothing. A module on the meta device (planning only: ``trace_model``) holds no values to run and
is not checked.

The eager call: a transformers decoder layer takes the position embeddings of its family's rotary
module and the attention mask its model builds for the layer's type (``eager_call``); any other
module is called on the hidden states alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import math
from typing import Callable

import torch
from torch import nn

from moegraph.ir import Dims, Strategy
from moegraph.lowering import LoweringError

TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-2}
"""Largest ||compiled - eager|| / ||eager|| accepted, by the module's dtype. fp32: the compiled
kernels differ from eager only in summation order (measured <= 1e-6 on every family here); half
precision: ~8 bits of mantissa through two matmul chains."""

CHECK_BATCH = 2
_CHECKED: dict[str, float] = {}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| (in fp64). The one copy: runtime.check imports it."""
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def checked_count() -> int:
    """Distinct layers checked in this process (a repeat compile adds none)."""
    return len(_CHECKED)


def layer_digest(module: nn.Module, program, strategy: Strategy) -> str:
    """sha256 of everything that decides what the checked layer computes (module docstring)."""
    h = hashlib.sha256(repr(program).encode())
    h.update(repr((strategy.attn, strategy.ffn, strategy.dispatch, strategy.n, strategy.chunks, strategy.gate)).encode())
    for name, m in module.named_modules():
        scalars = sorted((k, v) for k, v in vars(m).items()
                         if not k.startswith("_") and isinstance(v, (int, float, str, bool, type(None))))
        h.update(repr((name, type(m).__module__, type(m).__qualname__, scalars, m.training)).encode())
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "to_json_string"):
            h.update(cfg.to_json_string(use_diff=False).encode())
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        h.update(repr((name, tuple(t.shape), str(t.dtype))).encode())
    return h.hexdigest()


def _on_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def check_sequence(program, strategy: Strategy) -> int:
    """A short sequence the strategy can split (n * chunks divides it) that still shows each
    attention's window or chunk boundary: 16 positions, more for a window or chunk near that."""
    from moegraph.lowering.specs import AttentionSpec, LinearAttentionSpec
    want = 16
    for spec in program.specs(AttentionSpec):
        for size in (spec.window, spec.chunk):
            if size is not None:
                want = max(want, min(size + 8, 64))
    for spec in program.specs(LinearAttentionSpec):      # the delta rule's state handed across a chunk boundary
        want = max(want, spec.chunk_size + 8)
    step = strategy.n * strategy.chunks
    return step * math.ceil(want / step)


def check_layer(module: nn.Module, program, strategy: Strategy, *, name: str,
                call: Callable[[torch.Tensor], dict] | None = None) -> float | None:
    """Refuse (LoweringError, one line) unless ``program`` lowered for ``strategy`` reproduces the
    eager ``module``; returns the worst relative error seen (None when not run: a meta module)."""
    if _on_meta(module):
        return None
    key = layer_digest(module, program, strategy)
    if key in _CHECKED:
        return _CHECKED[key]
    call = call or eager_call(module)
    try:
        worst = _run_check(module, program, strategy, name, call)
    except _NotFinite:       # e.g. uninitialised weights (torch.empty): check the structure on random ones
        worst = _run_check(module, program, strategy, name, call, randomize=True)
    _CHECKED[key] = worst
    return worst


class _NotFinite(Exception):
    """The eager module's output or gradients on the check's input are not finite: its weights say nothing."""


def _run_check(module, program, strategy: Strategy, name: str, call, randomize: bool = False) -> float:
    from moegraph.interpreter import interpret
    from moegraph.tracer import dims_of, lower

    params = [*module.parameters(), *module.buffers()]
    dtype, device = params[0].dtype, params[0].device
    tol = TOLERANCE.get(dtype, 3e-2)
    s = check_sequence(program, strategy)
    dims: Dims = dims_of(program, CHECK_BATCH, s, strategy.n)
    check_strategy = dataclasses.replace(strategy, dtype="fp32" if dtype == torch.float32 else strategy.dtype, dp=1)
    step_values: dict[int, str] = {}
    graph = lower(program, dims, check_strategy, name, step_values=step_values, coverage=False)
    gen = torch.Generator().manual_seed(20261124)
    x = torch.randn(CHECK_BATCH, s, dims.h, generator=gen).to(device=device, dtype=dtype)
    dy = torch.randn(CHECK_BATCH, s, dims.h, generator=gen).to(device=device, dtype=dtype)

    eager_steps: dict[str, torch.Tensor] = {}
    hooks = [module.get_submodule(st.module).register_forward_hook(_recorder(eager_steps, st.module))
             for st in program.steps if st.module]
    held = check_tensors(module, gen, randomize)
    named = [(k, held[k].detach().requires_grad_(True)) for k, p in module.named_parameters() if p.requires_grad]
    try:
        with torch.enable_grad():
            xr = x.clone().requires_grad_(True)
            try:
                y = _first(torch.func.functional_call(module, {**held, **dict(named)}, (xr,), call(xr),
                                                      tie_weights=False))
            except Exception as err:  # noqa: BLE001 - the eager module fails as its model would call it
                raise LoweringError(f"{name}: the eager module cannot run on a [{CHECK_BATCH}, {s}, {dims.h}] input "
                                    f"as its model calls it ({type(err).__name__}: {err}), so the lowered graph "
                                    "cannot be checked against it") from None
            if not randomize and not bool(torch.isfinite(y).all()):
                raise _NotFinite()
            grads = torch.autograd.grad(y, [xr, *[p for _, p in named]], dy, allow_unused=True)
            # finite garbage (uninitialised expert weights of 1e30) can overflow in backward only
            if not randomize and not all(bool(torch.isfinite(g).all()) for g in grads if g is not None):
                raise _NotFinite()
    finally:
        for hk in hooks:
            hk.remove()
    held = {k: t.detach() for k, t in held.items()}
    with torch.no_grad():
        res = interpret(graph, held, x, dy)
    n = strategy.n
    where = f"{name}: the lowered graph differs from the eager module"
    worst = 0.0

    def compare(got, want, what: str) -> None:
        nonlocal worst
        if want is None:
            want = torch.zeros_like(got)
        if got is None:
            got = torch.zeros_like(want)
        if want.shape != got.shape and want.numel() == got.numel():
            want = want.reshape(got.shape)          # a block returning its tokens flattened [b*s, h] (Llama 4)
        err = rel_err(got, want) if want.abs().max() > 0 else float(got.abs().max() > 0)
        if not math.isfinite(err) or err > tol:
            raise LoweringError(f"{where} at {what}: relative error {err:.2e} > {tol:.0e}; the structural "
                                "reading of this module does not describe its forward, so it is refused (register "
                                "a rule that does, or report the module)")
        worst = max(worst, err)

    for i, st in enumerate(program.steps):
        if st.module and st.module in eager_steps and i in step_values:
            got = torch.cat([res.envs[r][step_values[i]] for r in range(n)], dim=1)
            compare(got, eager_steps[st.module], f"{st.module!r} ({type(module.get_submodule(st.module)).__name__}), "
                    f"its output")
    compare(res.output, y.detach(), "the layer output")
    compare(res.input_grad, grads[0], "the gradient of the layer input")
    for (pname, _), g in zip(named, grads[1:]):
        compare(res.param_grads.get(pname), g, f"the gradient of {pname!r}")
    return worst


def check_tensors(module: nn.Module, gen: torch.Generator, randomize: bool = False) -> dict[str, torch.Tensor]:
    """The module's own parameters and buffers, except those that cannot show how they are used:
    non-finite ones (uninitialised memory) and constant floating ones, to 1e-12 (a fresh model's zero
    biases and unit norm weights, uninitialised zeros: their misuse would give the same numbers); those
    are replaced, for the
    check only, by random values of the scale the layer works at (1/sqrt(fan_in) for matrices,
    value + N(0, 0.1) for vectors). ``randomize``: every floating tensor (when the module's own give
    a non-finite output, e.g. uninitialised expert weights). The module itself is not modified."""
    out = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        t = t.detach()
        if not t.is_floating_point() or t.numel() == 0:
            out[name] = t
            continue
        flat = t.reshape(-1)
        spread = float((flat.float() - flat[0].float()).abs().max()) if t.numel() > 1 else 1.0
        if not randomize and bool(torch.isfinite(flat).all()) and spread > 1e-12 * max(1.0, abs(float(flat[0]))):
            out[name] = t
            continue
        noise = torch.randn(t.shape, generator=gen).to(device=t.device, dtype=t.dtype)
        base = flat[0] if bool(torch.isfinite(flat[0])) and not randomize else torch.ones((), dtype=t.dtype,
                                                                                           device=t.device)
        out[name] = noise * t.shape[-1] ** -0.5 if t.dim() >= 2 else base + 0.1 * noise
    return out


def _recorder(store: dict, qualname: str):
    def hook(mod, inputs, output):
        store[qualname] = (output[0] if isinstance(output, tuple) else output).detach()
    return hook


# -- calling a transformers decoder layer as its model does ----------------------------------------

def eager_call(layer: nn.Module, rotary: nn.Module | None = None) -> Callable[[torch.Tensor], dict]:
    """The keyword arguments the layer's model passes besides the hidden states x [b, s, h]: for a
    transformers decoder layer, its family's rotary embedding of positions 0..s-1 and the attention
    mask of its layer type (full causal, sliding window or chunked, built by transformers'
    masking_utils from the layer's config); none for any other module."""
    from moegraph.lowering.rope import layer_rope_config, rotary_class
    from moegraph.lowering.structural import _ctx, _layer_type, family_of, layer_context
    if family_of(type(layer)) is None:
        return lambda x: {}
    with layer_context(layer):
        cfg, idx = _ctx().config, _ctx().layer_idx
        rope_cfg = layer_rope_config(cfg, idx)
        if rotary is None or rope_cfg is not cfg:      # a theta of its own (GraniteMoeSWA): its own module
            cls = rotary_class(_ctx().family)
            rotary = cls(rope_cfg) if cls is not None and rope_cfg is not None else None
    kind = _layer_type(cfg, idx)
    # a rotary module with frequencies per layer type takes the type (Laguna's forward(x, pos, layer_type))
    by_type = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
    # Gemma 4's layers store their keys and values for later kv-sharing layers (none is lowered: refused)
    shares = "shared_kv_states" in inspect.signature(type(layer).forward).parameters

    def kwargs(x: torch.Tensor) -> dict:
        from transformers import masking_utils as mu
        b, s = x.shape[:2]
        pos = torch.arange(s, device=x.device)[None].expand(b, s)
        emb = None if rotary is None else rotary.to(x.device)(x, pos, kind) if by_type else rotary.to(x.device)(x, pos)
        make = {"full_attention": mu.create_causal_mask, "sliding_attention": mu.create_sliding_window_causal_mask,
                "chunked_attention": mu.create_chunked_causal_mask}.get(kind, mu.create_causal_mask)
        # Gated DeltaNet's mask is a padding mask only: None for the check's unpadded batch (create_recurrent_attention_mask's)
        mask = None if kind == "linear_attention" else make(**mask_kwargs(make, config=cfg, inputs_embeds=x, position_ids=pos))
        return {"position_embeddings": emb, "attention_mask": mask, "position_ids": pos} | (
            {"shared_kv_states": {}} if shares else {})
    return kwargs


CACHE_KWARGS = ("cache", "past_key_values")
"""The no-cache argument of transformers' mask functions, by version: ``cache`` from 5.24 (which
still takes ``past_key_values``, deprecated), ``past_key_values`` before (5.17 on the GPU image)."""


def mask_kwargs(make: Callable, **given) -> dict:
    """``given`` plus no padding mask and no cache, named as ``make`` (a masking_utils function of
    the installed transformers) takes them; a LoweringError naming the function and its
    signature when it takes none of CACHE_KWARGS, or lacks a given argument."""
    params = inspect.signature(make).parameters
    cache = next((name for name in CACHE_KWARGS if name in params), None)
    missing = [name for name in given if name not in params]
    if cache is None or missing:
        what = f"no {' or '.join(map(repr, CACHE_KWARGS))}" if cache is None else f"no {missing[0]!r}"
        raise LoweringError(f"transformers.masking_utils.{make.__name__}{inspect.signature(make)} takes {what}: "
                            "this transformers is not one the numerical check can call a layer's mask builder in")
    return given | {"attention_mask": None, cache: None}


def _first(out):
    return out[0] if isinstance(out, tuple) else out
