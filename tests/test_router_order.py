"""The router's order of top-k and softmax (``RouterRow.order``): GPT-OSS takes the top-k of its logits
and the softmax over those k, so the experts no token picks get exactly zero bias gradient in eager;
the compiled router must too (softmax over all experts, top-k, renormalise is equal in value but
leaves +-2e-10 rounding there, which AdamW's normalised step turned into 1e-3 drift in 3 steps)."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

import moegraph
from family_zoo import VOCAB, tiny_model
from moegraph.ir import OpKind

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed")


def _ids():
    return torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


def test_gpt_oss_router_bias_follows_eager_under_adamw():
    model = tiny_model("gpt_oss", "GptOssForCausalLM", seed=0)
    eager = copy.deepcopy(model)
    ids = _ids()
    compiled = moegraph.compile(model, ids, hardware="cpu-gloo", schedule="greedy")
    routers = [nd for nd in compiled.layers.graph.nodes if nd.op is OpKind.ROUTER and nd.attr("wrt", None) is None]
    assert routers and all(nd.attr("topk_first", False) for nd in routers)
    oc = torch.optim.AdamW(compiled.parameters(), lr=1e-2, weight_decay=0.01)
    oe = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.01)
    biases = [k for k, _ in eager.named_parameters() if k.endswith("router.bias")]
    for _ in range(3):
        oc.zero_grad()
        oe.zero_grad()
        compiled(ids, labels=ids).loss.backward()
        eager(input_ids=ids, labels=ids).loss.backward()
        grads, ref = compiled.full_grads(), dict(eager.named_parameters())
        for k in biases:                    # no token picks them: exactly zero in both
            unpicked = ref[k].grad == 0
            assert unpicked.any() and bool((grads[k][unpicked] == 0).all()), k
        oc.step()
        oe.step()
    state, ref = compiled.full_state_dict(), dict(eager.named_parameters())
    for k in biases:
        assert (state[k] - ref[k].detach()).abs().max() < 1e-6, k


def test_softmax_first_families_keep_their_order():
    """Mixtral's and Qwen3-MoE's eager routers take the softmax over every expert first: no topk_first."""
    for family, cls in (("mixtral", "MixtralForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM")):
        compiled = moegraph.compile(tiny_model(family, cls, seed=0), _ids(), hardware="cpu-gloo", schedule="greedy")
        routers = [nd for nd in compiled.layers.graph.nodes if nd.op is OpKind.ROUTER]
        assert routers and not any(nd.attr("topk_first", False) for nd in routers), family
