"""Numerical check of a compiled layer against its eager module (used by ``moegraph run --check``
and the tests).

Error metric: norm-wise relative error ||actual - expected|| / ||expected|| per tensor; the
report gives the output's and the worst gradient's (layer input and every module parameter).
A gradient whose eager norm is below ``NOISE_FLOOR`` x the largest gradient norm is the rounding
noise of an analytically zero gradient (the router's under top-1: the renormalised weight is
always 1). A relative error of noise against noise means nothing, so such gradients are left out
of the maximum and reported apart: their error ||a - e|| divided by the largest gradient norm.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn


NOISE_FLOOR = 1e-6


from moegraph.lowering.check import rel_err  # noqa: E402,F401 - the one copy (the compile's check uses it too)


def grad_report(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """Worst relative error over gradients (actual, expected), near-zero gradients apart."""
    norms = {k: e.double().norm().item() for k, (_, e) in pairs.items()}
    top = max(norms.values())
    near_zero = sorted(k for k, v in norms.items() if v < NOISE_FLOOR * top)
    errs = {k: rel_err(a, e) for k, (a, e) in pairs.items() if k not in near_zero}
    worst = max(errs, key=errs.get)
    out = {"max_rel_err_grads": errs[worst], "worst_grad": worst, "rel_err_input_grad": errs.get("<input>")}
    if near_zero:
        out["near_zero_grads"] = near_zero
        out["max_err_near_zero_grads"] = max((pairs[k][0].double() - pairs[k][1].double()).norm().item() / top
                                             for k in near_zero)
    return out


def eager_step(module: nn.Module, x: torch.Tensor, dy: torch.Tensor, call: Callable | None = None):
    """Output, input gradient and parameter gradients of the eager module on the full input."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = call(module, x) if call else module(x)
    y.backward(dy)
    grads = {k: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for k, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return y.detach(), x.grad.detach().clone(), grads


def compiled_step(layer: Any, x: torch.Tensor, dy: torch.Tensor):
    """One scheduled forward+backward on this rank's shards; full output, input grad and module
    grads, identical on every rank (collective)."""
    for p in layer.parameters():
        p.grad = None
    xs = layer.shard_input(x).requires_grad_(True)
    y = layer(xs)
    y.backward(layer.shard_input(dy))
    return layer.unshard_output(y.detach()), layer.unshard_output(xs.grad.contiguous()), layer.full_grads()


def check_against_eager(module: nn.Module, layer: Any, x: torch.Tensor, dy: torch.Tensor, *,
                        call: Callable | None = None) -> dict[str, Any]:
    """Run both on the same full x, dy; return the errors (collective: call on every rank)."""
    y, dx, grads = compiled_step(layer, x, dy)
    y_ref, dx_ref, grads_ref = eager_step(module, x, dy, call)
    dp = layer.layout.dp
    if dp > 1:    # x is the global batch; the DP sync averages parameter gradients over the replicas
        grads_ref = {k: g / dp for k, g in grads_ref.items()}
    missing = sorted(set(grads_ref) - set(grads))
    if missing:
        raise KeyError(f"the compiled layer has no gradient for module parameters {missing}")
    report = grad_report({"<input>": (dx, dx_ref), **{k: (grads[k], g) for k, g in grads_ref.items()}})
    return {"max_rel_err_output": rel_err(y, y_ref), **report}


def check_against_interpreter(layer: Any, module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict[str, Any]:
    """Compare with the simulated-rank interpreter on the same graph (collective). Exact even for
    lossy passes (compression), which change the function the graph computes on purpose."""
    from moegraph.interpreter import interpret
    from moegraph.runtime import RuntimeFailure
    if layer.layout.dp > 1:
        raise RuntimeFailure("check_against_interpreter runs dp=1 layers: the interpreter gives every replica the "
                             "same input, the runtime each replica its own rows; use check_against_eager")
    y, dx, grads = compiled_step(layer, x, dy)
    ref = interpret(layer.graph, {k: p.detach() for k, p in [*module.named_parameters(), *module.named_buffers()]}, x, dy)
    report = grad_report({"<input>": (dx, ref.input_grad), **{k: (grads[k], g) for k, g in ref.param_grads.items()}})
    return {"max_rel_err_output": rel_err(y, ref.output), **report}


def train_against_eager(eager: nn.Module, compiled: Any, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                        *, lr: float = 1e-4) -> dict[str, Any]:
    """Train ``compiled`` and (then) ``eager`` one AdamW step per (input_ids, labels) batch from the
    same starting weights; compare every step's loss and the final parameters (collective: every
    rank calls it with the same batches). ``eager`` must hold the weights ``compiled`` was built from."""
    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        loss = model(input_ids=batch[0], labels=batch[1]).loss
        loss.backward()
        return loss.item()
    return _train_and_compare(eager, compiled, batches, step, step, lr)


def eager_accumulate(model: nn.Module, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
                     ) -> list[float]:
    """Eager gradient accumulation over (input_ids, labels) micro-batches, the usual loop:
    ``(loss / M).backward()`` per micro-batch, into the ``.grad`` already there (the convention
    ``CompiledModel.train_step`` follows). Returns the M losses."""
    losses = []
    for ids, labels in micro_batches:
        loss = model(input_ids=ids, labels=labels).loss
        (loss / len(micro_batches)).backward()
        losses.append(loss.item())
    return losses


def train_microbatches_against_eager(eager: nn.Module, compiled: Any,
                                     steps: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]], *,
                                     lr: float = 1e-4) -> dict[str, Any]:
    """``train_against_eager`` for a model compiled with ``micro_batches=M``: one AdamW step per
    entry of ``steps`` (M (input_ids, labels) micro-batches), the compiled model by
    ``train_step``, the eager one by ``eager_accumulate``; every micro-batch's loss, the first
    step's gradients and the final parameters compared (collective)."""
    def compiled_step(model: Any, batch) -> list[float]:
        return [x.item() for x in model.train_step([ids for ids, _ in batch], [lab for _, lab in batch])]
    return _train_and_compare(eager, compiled, steps, compiled_step, eager_accumulate, lr)


def _train_and_compare(eager: nn.Module, compiled: Any, steps: Sequence[Any], compiled_step: Callable,
                       eager_step: Callable, lr: float) -> dict[str, Any]:
    """One AdamW step per entry of ``steps`` on each model (``*_step(model, entry)`` leaves the
    gradients and returns the loss, or the micro-batches' losses); the report of
    ``train_against_eager``."""
    def train(model: nn.Module, step_fn, grads) -> tuple[list[Any], dict[str, torch.Tensor]]:
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        losses, first = [], {}
        for step, entry in enumerate(steps):
            opt.zero_grad()
            losses.append(step_fn(model, entry))
            if step == 0:           # AdamW's update is nearly scale-free: compare the gradients too
                first = grads(model)
            opt.step()
        return losses, first

    got, grads = train(compiled, compiled_step, lambda m: m.full_grads())
    expected, grads_ref = train(eager, eager_step,
                                lambda m: {k: (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
                                           for k, p in m.named_parameters()})
    full, ref = compiled.full_state_dict(), eager.state_dict()
    missing = sorted((set(grads_ref) - set(grads)) | (set(ref) - set(full)))
    if missing:
        raise KeyError(f"the compiled model has no gradient or state for {missing}")
    param_errs = {k: rel_err(full[k], t) for k, t in ref.items() if t.is_floating_point()}
    worst_param = max(param_errs, key=param_errs.get)
    report = grad_report({k: (grads[k], g) for k, g in grads_ref.items()})
    report.pop("rel_err_input_grad")
    return {"losses": got, "eager_losses": expected,
            "max_rel_err_loss": max(rel_err(torch.tensor(a), torch.tensor(b)) for a, b in zip(got, expected)),
            "max_rel_err_params": param_errs[worst_param], "worst_param": worst_param, **report}


def check_microbatches_against_eager(module: Any, layer: Any, batches: list[tuple[Any, Any]], *,
                                     call: Any = None) -> dict[str, Any]:
    """One ``train_step`` against eager gradient accumulation (M forward/backward passes of the
    eager module into the same .grad) on the same full micro-batches (collective). Worst relative
    error over the micro-batches' outputs; over their input gradients and every parameter gradient."""
    import torch
    for p in layer.parameters():
        p.grad = None
    ys, dxs = layer.train_step([layer.shard_input(x) for x, _ in batches], [layer.shard_input(dy) for _, dy in batches])
    grads = layer.full_grads()
    module.zero_grad(set_to_none=True)
    errs_y, pairs = [], {}
    for j, ((x, dy), y, dx) in enumerate(zip(batches, ys, dxs)):
        xr = x.detach().clone().requires_grad_(True)
        y_ref = call(module, xr) if call else module(xr)
        y_ref.backward(dy)
        errs_y.append(rel_err(layer.unshard_output(y), y_ref.detach()))
        pairs[f"<input mb{j}>"] = (layer.unshard_output(dx.contiguous()), xr.grad)
    dp = layer.layout.dp    # the DP sync averages parameter gradients over the replicas
    ref = {k: (p.grad if p.grad is not None else torch.zeros_like(p)) / dp for k, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    missing = sorted(set(ref) - set(grads))
    if missing:
        raise KeyError(f"the compiled layer has no gradient for module parameters {missing}")
    report = grad_report({**pairs, **{k: (grads[k], g) for k, g in ref.items()}})
    report.pop("rel_err_input_grad")
    return {"max_rel_err_output": max(errs_y), **report}
