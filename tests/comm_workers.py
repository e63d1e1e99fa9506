"""Rank functions for tests/test_runtime_comm.py (spawned by moegraph.runtime.launch.spawn;
importable by name): routing that sends a rank zero rows, and counting split-size exchanges."""

from __future__ import annotations

import torch

import moegraph
from moegraph.models import MoETransformerLayer
from moegraph.runtime.check import check_against_eager
from runtime_workers import B, H, S, reference_layer


def skew_routing_to_rank0(module: MoETransformerLayer, experts_on_rank0: int) -> None:
    """Route every token to experts 0 .. experts_on_rank0-1 only (rank 0's, with ep over 2 ranks), so
    that rank 1 receives zero expert rows: a large hidden channel 0 (set in the input by
    ``skewed_input``) that only those experts' router rows read, through a norm weight of 1."""
    with torch.no_grad():
        module.post_attn_norm.weight[0] = 1.0
        w = module.moe.router.weight
        w.zero_()
        w[:experts_on_rank0, 0] = 5.0
        w[experts_on_rank0:, 0] = -5.0
        w[:experts_on_rank0, 1:] = 0.1 * torch.randn(experts_on_rank0, w.shape[1] - 1)


def skewed_input(gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(B, S, H, generator=gen)
    x[..., 0] = 20.0
    return x


def zero_rows_cases(rank: int, n: int, cases: list[dict], seed: int) -> list[dict]:
    """Each case (attn, ffn, dispatch, optional schedule) with every token routed to rank 0's
    experts: the compiled layer against the eager module."""
    out = []
    for i, case in enumerate(cases):
        module = reference_layer(seed + i)
        skew_routing_to_rank0(module, 4)
        gen = torch.Generator().manual_seed(seed + 1000 + i)
        x, dy = skewed_input(gen), torch.randn(B, S, H, generator=gen)
        layer = moegraph.compile(module, x, hardware="cpu-gloo", attn=case["attn"], ffn=case["ffn"],
                                 dispatch=case["dispatch"], passes="", schedule=case.get("schedule", "greedy"),
                                 timeout_s=60.0)
        out.append(check_against_eager(module, layer, x, dy) | {"case": case})
    return out


def count_exchanges(rank: int, n: int, seed: int, cases: list[dict]) -> list[int]:
    """Split-size exchanges (host-blocking gloo calls) in one step of each case (default passes)."""
    from moegraph.runtime.collectives import Comm
    out = []
    for case in cases:
        module = reference_layer(seed)
        gen = torch.Generator().manual_seed(seed)
        x, dy = torch.randn(B, S, H, generator=gen), torch.randn(B, S, H, generator=gen)
        layer = moegraph.compile(module, x, hardware="cpu-gloo", attn=case["attn"], ffn=case["ffn"],
                                 dispatch=case["dispatch"], schedule="greedy", timeout_s=60.0)
        calls = []
        orig = Comm.exchange

        def exchange(self, node, counts, _orig=orig):
            calls.append(node.name if node is not None else None)
            return _orig(self, node, counts)
        Comm.exchange = exchange
        try:
            xs = layer.shard_input(x).requires_grad_(True)
            layer(xs).backward(layer.shard_input(dy))
        finally:
            Comm.exchange = orig
        out.append(len(calls))
    return out
