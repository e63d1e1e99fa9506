"""Rank functions for tests/test_dp.py (spawned on n x dp gloo ranks; importable by name).

Expected values come from the eager module on the concatenated (global) batch, computed here
independently of moegraph.runtime.check: the graph's DP sync averages parameter gradients over
the replicas, so the eager reference is the gradient of the global batch with the seed gradient
divided by dp (equivalently, the mean over replicas of each replica's gradient).
"""

from __future__ import annotations

import torch

import moegraph
from moegraph.interpreter import interpret
from moegraph.runtime.check import compiled_step      # the compiled side only; expected values are computed here
from runtime_workers import B, H, S, reference_layer


def _rel(a: torch.Tensor, e: torch.Tensor) -> float:
    return ((a.double() - e.double()).norm() / e.double().norm().clamp_min(1e-30)).item()


def _data(seed: int, dp: int, step: int = 0):
    gen = torch.Generator().manual_seed(seed * 100 + step + 1)
    return torch.randn(dp * B, S, H, generator=gen), torch.randn(dp * B, S, H, generator=gen)


def _compile(module, x, case: dict, n: int, dp: int):
    return moegraph.compile(module, x, hardware="cpu-gloo", attn=case["attn"], ffn=case["ffn"],
                            dispatch=case["dispatch"], passes=case.get("passes", ""),
                            schedule=case.get("schedule", "greedy"), n=n, dp=dp, timeout_s=60.0, record=False,
                            time_limit_s=1.0)


def grad_cases(rank: int, world: int, cases: list[dict], seed: int, n: int) -> list[dict]:
    """Per case: relative errors of output, input gradient and every parameter gradient against eager
    (distinct data per replica); with ``interpreter``: also against the simulated-rank interpreter on
    identical replicas (exact even for lossy compression)."""
    dp = world // n
    out = []
    for i, case in enumerate(cases):
        module = reference_layer(seed + i)
        x, dy = _data(seed + i, dp)
        layer = _compile(module, x, case, n, dp)
        y, dx, grads = compiled_step(layer, x, dy)
        xe = x.clone().requires_grad_(True)
        ye = module(xe)
        ye.backward(dy)
        ref = {k: p.grad / dp for k, p in module.named_parameters()}
        row = {"output": _rel(y, ye.detach()), "input_grad": _rel(dx, xe.grad),
               "grads": {k: _rel(grads[k], g) for k, g in ref.items()},
               "dp_nodes": sorted(nd.name for nd in layer.graph.nodes if nd.attr("axis", "mp") == "dp"),
               "compressed": sorted(nd.name for nd in layer.graph.nodes if nd.attr("compressed", None) == "bf16")}
        if case.get("interpreter"):
            x1, dy1 = x[:B], dy[:B]                 # every replica the same rows: the interpreter's set-up
            _, _, grads_same = compiled_step(layer, x1.repeat(dp, 1, 1), dy1.repeat(dp, 1, 1))
            sim = interpret(layer.graph, {k: p.detach() for k, p in module.named_parameters()}, x1, dy1)
            row["vs_interpreter"] = {k: _rel(grads_same[k], g) for k, g in sim.param_grads.items()}
        out.append(row)
    return out


def adamw_steps(rank: int, world: int, case: dict, seed: int, n: int, steps: int, lr: float,
                eps: float = 1e-2) -> dict:
    """``steps`` AdamW steps on the compiled layer (this rank's shards) and on the eager module (the
    global batch, seed gradient / dp); per step the output error, then every parameter's error.

    eps: Adam moves a weight by lr * m / (sqrt(v) + eps), whose slope at g = 0 is lr / eps. fp32
    summation order leaves ~3e-7 of a tensor's largest gradient as rounding noise in every element,
    which for a near-zero element is a large *relative* difference. The input norm's weight
    gradient sums over every token: up to 10.4, so 3.3e-6 of noise (measured, seed 1431253982), on
    an element of 1.7e-5. eps=1e-4 turned that into 2.4e-4 of one update and 2.1e-5 of the tensor
    after 3 steps (torch's default 1e-8 did worse on expert weights). eps=1e-2 makes the slope
    lr / eps = 1: each element's update differs by at most its gradient's difference (~5e-6 at a
    largest gradient of 16), 2e-6 relative on the norm's 64 ones after 3 steps, while gradients
    above ~1e-2 still get Adam's normalised step."""
    dp = world // n
    module = reference_layer(seed)
    x0, _ = _data(seed, dp)
    layer = _compile(module, x0, case, n, dp)
    opt_c = torch.optim.AdamW(layer.parameters(), lr=lr, eps=eps)
    opt_e = torch.optim.AdamW(module.parameters(), lr=lr, eps=eps)
    out_err = []
    for step in range(steps):
        x, dy = _data(seed, dp, step)
        opt_c.zero_grad(set_to_none=True)
        ys = layer(layer.shard_input(x))
        ys.backward(layer.shard_input(dy))
        opt_c.step()
        opt_e.zero_grad(set_to_none=True)
        ye = module(x)
        ye.backward(dy / dp)
        opt_e.step()
        out_err.append(_rel(layer.unshard_output(ys.detach()), ye.detach()))
    full = layer.full_params()
    start = reference_layer(seed)
    return {"output": out_err,
            "params": {k: _rel(full[k], p.detach()) for k, p in module.named_parameters()},
            "moved": {k: _rel(p.detach(), q.detach()) for (k, p), q in zip(module.named_parameters(),
                                                                           start.parameters())}}


def grads_then_adamw(rank: int, world: int, cases: list[dict], adam_case: dict, seed: int, n: int) -> dict:
    """Both checks on one process group (starting 4 ranks costs seconds): ``grad_cases``, then
    3 AdamW steps (lr 1e-2) of ``adamw_steps``."""
    return {"grads": grad_cases(rank, world, cases, seed, n),
            "adamw": adamw_steps(rank, world, adam_case, seed + len(cases), n, 3, 1e-2)}
