"""Rank functions for tests/test_clip_grad_norm.py: one clipped SGD step of a compiled tiny causal
LM against the eager module's torch.nn.utils.clip_grad_norm_ on the same global batch."""

from __future__ import annotations

import copy
import hashlib

import torch

import moegraph
from moegraph.runtime.check import rel_err
from model_workers import VOCAB, mixtral_model


def _digest(tensors) -> str:
    h = hashlib.md5()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def clipped_step(rank: int, n: int, case: dict) -> dict:
    model = mixtral_model(case["seed"], 2)
    eager = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(case["seed"] + 1))
    compiled = moegraph.compile(model, ids, hardware="cpu-gloo", schedule="greedy", passes="",
                                attn=case["attn"], ffn=case["ffn"], timeout_s=60.0)
    oc, oe = torch.optim.SGD(compiled.parameters(), lr=1.0), torch.optim.SGD(eager.parameters(), lr=1.0)
    compiled(ids, labels=ids).loss.backward()
    eager(input_ids=ids, labels=ids).loss.backward()
    norm = case.get("norm_type", 2.0)
    got = compiled.clip_grad_norm_(case["max_norm"], norm_type=norm)
    want = torch.nn.utils.clip_grad_norm_(eager.parameters(), case["max_norm"], norm_type=norm)
    oc.step()
    oe.step()
    state = compiled.full_state_dict()
    errs = {k: rel_err(state[k], p.detach()) for k, p in eager.named_parameters()}
    layers = compiled.layers
    replicated = [compiled.embed, compiled.norm, compiled.lm_head] + \
        [layers.shard(p) for p, spec in layers.graph.params if spec.shard_dim is None and not spec.buffer]
    return {"total": float(got), "eager_total": float(want), "norm": rel_err(got.reshape(1), want.reshape(1)),
            "params": max(errs.values()), "worst": max(errs, key=errs.get), "replicated": _digest(replicated),
            "n_replicated": len(replicated)}


def cases(rank: int, n: int, cases: list[dict]) -> list[dict]:
    return [clipped_step(rank, n, c) for c in cases]
