"""Never silently wrong by construction (issue 27, item 2): every compile runs each lowered layer
against its eager module (moegraph.lowering.check). With the structural guard switched off, so that
only the numbers can refuse, modules that resemble a supported one but compute something else are
refused in one line naming the first value that diverges; a supported one compiles; a repeat
compile pays nothing.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moegraph.ir import OpKind, Role, Strategy
from moegraph.lowering import LoweringError
from moegraph.lowering.check import checked_count, layer_digest
from moegraph.lowering.structural import structural_guard
from moegraph.tracer import extract_program, trace_module

transformers = pytest.importorskip("transformers")
from transformers import Qwen2MoeConfig  # noqa: E402
from transformers.models.mixtral import modeling_mixtral as mx  # noqa: E402
from transformers.models.qwen2_moe import modeling_qwen2_moe as qw  # noqa: E402

import near_misses  # noqa: E402
from near_misses import HalfPlusRMSNorm, NoisyRouter, OnePlusRMSNorm, SharedExpertMoe  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
STRATEGY = Strategy("sp", "ep", "ag-rs", 2, dtype="fp32")


def mixtral(**overrides) -> mx.MixtralDecoderLayer:
    """near_misses.mixtral with every weight drawn (replaced parts come as torch.empty)."""
    torch.manual_seed(0)
    layer = near_misses.mixtral(**overrides)
    for p in layer.parameters():
        nn.init.normal_(p, std=0.2)
    return layer


def refusal(layer: nn.Module) -> str:
    """The one line the numerical check refuses ``layer`` with, the structural guard off."""
    torch.manual_seed(1)
    for p in layer.parameters():          # replaced parts come uninitialised (torch.empty): weights as trained
        nn.init.normal_(p, std=0.2)
    with structural_guard(False), pytest.raises(LoweringError) as info:
        trace_module(layer, STRATEGY, batch=1, seq=16)
    text = str(info.value)
    assert "\n" not in text and "the lowered graph differs from the eager module at" in text, text
    return text


# -- the five modified modules of the guard tests: three shared (tests/near_misses.py), the attention
# variant below, and a q bias ---------------------------------------------------------------------

class QKNormAfterRopeAttention(mx.MixtralAttention):
    """Per-head norms named q_norm and k_norm, but the second one normalises v, not k: the structural
    reading (HunYuan's, norms after RoPE) applies them to q and k."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.q_norm, self.k_norm = mx.MixtralRMSNorm(self.head_dim), mx.MixtralRMSNorm(self.head_dim)

    def forward(self, hidden_states, position_embeddings, attention_mask, **kwargs):
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = mx.apply_rotary_pos_emb(q, k, *position_embeddings)
        q, v = self.q_norm(q), self.k_norm(v)
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1)), None


def test_a_shared_expert_the_block_does_not_describe_is_refused_at_the_block():
    layer = mixtral()
    layer.mlp = SharedExpertMoe(layer.self_attn.config)
    assert "at 'mlp' (SharedExpertMoe), its output" in refusal(layer)


def test_an_rmsnorm_of_an_unknown_offset_is_refused_at_the_norm():
    layer = mixtral()
    layer.post_attention_layernorm = HalfPlusRMSNorm(64)
    assert "at 'post_attention_layernorm' (HalfPlusRMSNorm), its output" in refusal(layer)


def test_a_one_plus_w_rmsnorm_is_read_with_its_offset_and_passes_the_check():
    """Gemma's 1 + w (MiniMax-M3's norms) is found by running the norm: the check, which refused it
    before 2026-11-28, passes, and the norm node carries offset 1."""
    layer = mixtral()
    layer.post_attention_layernorm = OnePlusRMSNorm(64)
    torch.manual_seed(1)
    for p in layer.parameters():
        nn.init.normal_(p, std=0.2)
    with structural_guard(False):
        graph = trace_module(layer, STRATEGY, batch=1, seq=16)
    offsets = {nd.name: nd.attr("offset", 0.0) for nd in graph.nodes if nd.op is OpKind.RMSNORM and nd.role is Role.FORWARD}
    assert offsets == {"input_norm": 0.0, "post_attn_norm": 1.0}, offsets


def test_a_norm_of_v_named_k_norm_is_refused_at_the_attention():
    layer = mixtral()
    layer.self_attn = QKNormAfterRopeAttention(layer.self_attn.config, 0)
    assert "at 'self_attn' (QKNormAfterRopeAttention), its output" in refusal(layer)


def test_a_q_bias_without_k_and_v_biases_is_refused_at_the_attention():
    layer = mixtral()
    layer.self_attn.q_proj = nn.Linear(64, 64, bias=True)
    assert "at 'self_attn' (MixtralAttention), its output" in refusal(layer)


def test_a_router_shifting_its_input_is_refused_at_the_block():
    layer = mixtral()
    layer.mlp.gate = NoisyRouter(layer.self_attn.config)
    assert "at 'mlp' (MixtralSparseMoeBlock), its output" in refusal(layer)


# -- new near misses: an extra bias, a changed activation, norm, router normalisation ---------------

class BiasedRMSNorm(mx.MixtralRMSNorm):
    """An RMSNorm plus a bias (no mean removed): the structural reading of a norm with a bias its
    forward reads is a LayerNorm."""

    def __init__(self, hidden):
        super().__init__(hidden)
        self.bias = nn.Parameter(torch.zeros(hidden))

    def forward(self, x):
        return super().forward(x) + self.bias


class GeluExperts(mx.MixtralExperts):
    """act_fn still says SiLU; the forward applies GELU."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for t in range(hidden_states.shape[0]):
            for slot in range(top_k_index.shape[1]):
                e = int(top_k_index[t, slot])
                gate, up = F.linear(hidden_states[t], self.gate_up_proj[e]).chunk(2, dim=-1)
                out[t] += F.linear(F.gelu(gate) * up, self.down_proj[e]) * top_k_weights[t, slot]
        return out


class MeanSquareNorm(mx.MixtralRMSNorm):
    """Divides by the mean square instead of its square root."""

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf / (xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)


class RenormalisingRouter(qw.Qwen2MoeTopKRouter):
    """Divides its top-k weights by their largest (not by their sum, nor leaves them): no router the
    structural reading knows (running the router shows neither softmax nor sigmoid weights)."""

    def forward(self, hidden_states):
        logits, weights, experts = super().forward(hidden_states)
        return logits, weights / weights.amax(-1, keepdim=True), experts


def qwen2_moe() -> qw.Qwen2MoeDecoderLayer:
    cfg = Qwen2MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=3,
                         num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=1, norm_topk_prob=False,
                         attn_implementation="sdpa")
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    layer = qw.Qwen2MoeDecoderLayer(cfg, 0)
    for p in layer.parameters():
        nn.init.normal_(p, std=0.2)
    return layer


def test_an_extra_bias_in_a_norm_is_refused_at_the_norm():
    layer = mixtral()
    layer.input_layernorm = BiasedRMSNorm(64)
    assert "at 'input_layernorm' (BiasedRMSNorm), its output" in refusal(layer)


def test_a_changed_expert_activation_is_refused_at_the_block():
    layer = mixtral()
    layer.mlp.experts = GeluExperts(layer.self_attn.config)
    assert "at 'mlp' (MixtralSparseMoeBlock), its output" in refusal(layer)


def test_a_changed_norm_is_refused_at_the_norm():
    layer = mixtral()
    layer.post_attention_layernorm = MeanSquareNorm(64)
    assert "at 'post_attention_layernorm' (MeanSquareNorm), its output" in refusal(layer)


def test_a_changed_router_normalisation_is_refused_at_the_block():
    layer = qwen2_moe()
    layer.mlp.gate = RenormalisingRouter(layer.self_attn.config)
    assert "at 'mlp' (Qwen2MoeSparseMoeBlock), its output" in refusal(layer)


class HandGatedAttention(nn.Module):
    """Laguna's attention with a per-feature softplus output gate, its forward written out: the gate
    before o_proj (as Laguna) or, a near miss, after it (one gate per output feature: H*d = h)."""

    after = False

    def forward(self, hidden_states, position_embeddings, attention_mask, **kwargs):
        from transformers.models.laguna.modeling_laguna import apply_rotary_pos_emb
        b, s, _ = hidden_states.shape
        shape = (b, s, -1, self.head_dim)
        q = self.q_norm(self.q_proj(hidden_states).view(shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden_states).view(shape)).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling, enable_gqa=True)
        out = out.transpose(1, 2).reshape(b, s, -1)
        gate = F.softplus(self.g_proj(hidden_states))
        return (self.o_proj(out) * gate if self.after else self.o_proj(out * gate)), None


@pytest.mark.parametrize("after", [False, True])
def test_an_attention_gate_after_o_proj_is_refused_at_the_attention(after):
    """Read as Laguna's gated output (a g_proj the forward reads, softplus); applied after o_proj
    instead of before, the numbers refuse it. The same forward with the gate before o_proj passes:
    the hand-written attention itself is faithful."""
    from family_zoo import moe_causal_lms, tiny_model
    lms = dict(moe_causal_lms())
    if "laguna" not in lms:
        pytest.skip(f"transformers {transformers.__version__} has no model type 'laguna'")
    layer = tiny_model("laguna", lms["laguna"], gating="per-element").model.layers[0]
    cls = type("GateAfterOutputAttention" if after else "GateBeforeOutputAttention",
               (HandGatedAttention, type(layer.self_attn)), {"after": after})
    layer.self_attn.__class__ = cls
    if after:
        assert "at 'self_attn' (GateAfterOutputAttention), its output" in refusal(layer)
        return
    with structural_guard(False):
        trace_module(layer, STRATEGY, batch=1, seq=16)


def test_with_the_guard_on_the_same_modules_are_named_before_any_numbers():
    """The structural guard stays: the subclass is named (not just its numbers)."""
    layer = mixtral()
    layer.post_attention_layernorm = MeanSquareNorm(64)
    with pytest.raises(LoweringError, match=r"MeanSquareNorm\) subclasses MixtralRMSNorm but overrides forward"):
        trace_module(layer, STRATEGY, batch=1, seq=16)


def test_the_unmodified_families_pass_with_the_guard_off():
    with structural_guard(False):
        trace_module(mixtral(), STRATEGY, batch=1, seq=16)
        trace_module(qwen2_moe(), STRATEGY, batch=1, seq=16)


# -- what the check compares, and its cache -------------------------------------------------------

def test_a_gradient_only_difference_names_the_parameter():
    """A router whose forward detaches its weight: outputs agree, the router weight's gradient does not."""
    class DetachedRouter(mx.MixtralTopKRouter):
        def forward(self, hidden_states):
            hidden_states = hidden_states.reshape(-1, self.hidden_dim)
            logits = F.linear(hidden_states, self.weight.detach())
            probs = torch.softmax(logits.float(), dim=-1)
            top, idx = torch.topk(probs, self.top_k, dim=-1)
            return logits, top / top.sum(-1, keepdim=True), idx
    layer = mixtral()
    layer.mlp.gate = DetachedRouter(layer.self_attn.config)
    text = refusal(layer)
    assert "at the gradient of 'mlp.gate.weight'" in text, text


def test_a_repeat_compile_pays_nothing(monkeypatch):
    """The same structure again (other weights) is answered by the cache: the check does not run a
    second time. (Asserted on the check itself, not on wall time: a timing ratio flaked in CI under
    the other shard's load; speed targets live in benchmarks/.)"""
    import moegraph.lowering.check as check
    layer = mixtral(rope_theta=12345.0)          # a structure no other test checks
    runs = []
    real = check._run_check
    monkeypatch.setattr(check, "_run_check", lambda *a, **k: runs.append(1) or real(*a, **k))
    trace_module(layer, STRATEGY, batch=1, seq=16)
    count = checked_count()
    assert len(runs) == 1
    other = mixtral(rope_theta=12345.0)          # the same structure, other weights: the cache answers
    trace_module(other, STRATEGY, batch=1, seq=16)
    assert checked_count() == count and len(runs) == 1


def test_the_digest_tells_structures_and_strategies_apart():
    a, b = mixtral(), mixtral()
    pa, pb = extract_program(a), extract_program(b)
    assert layer_digest(a, pa, STRATEGY) == layer_digest(b, pb, STRATEGY)
    assert layer_digest(a, pa, STRATEGY) != layer_digest(a, pa, Strategy("tp", "tp", "ag-rs", 2, dtype="fp32"))
    b.mlp.gate.top_k = 3                        # a scalar the forward reads
    assert layer_digest(a, pa, STRATEGY) != layer_digest(b, extract_program(b), STRATEGY)


def test_a_meta_module_is_planned_without_a_check():
    with torch.device("meta"):
        layer = mx.MixtralDecoderLayer(mixtral().self_attn.config, 0)
    count = checked_count()
    trace_module(layer, STRATEGY, batch=1, seq=16)
    assert checked_count() == count


# -- the transformers versions the check calls layers of ---------------------------------------------

def _as_in_5_17(fn):
    """transformers 5.17's signature of a masking_utils function (its no-cache argument named
    past_key_values; 5.24 renamed it cache), forwarding to the installed one."""
    def make(config, inputs_embeds, attention_mask, past_key_values, position_ids=None, or_mask_function=None,
             and_mask_function=None, block_sequence_ids=None):
        calls.append(fn.__name__)
        return fn(config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=past_key_values,
                  position_ids=position_ids)
    make.__name__ = fn.__name__
    return make


calls: list[str] = []


def test_the_check_builds_masks_with_the_older_mask_signature(monkeypatch):
    """On 5.17 every HF layer was refused: "create_causal_mask() got an unexpected keyword
    argument 'cache'" (GPU session 2026-11-27). The eager call now names the argument as the
    installed function declares it."""
    from transformers import masking_utils as mu
    for name in ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask"):
        monkeypatch.setattr(mu, name, _as_in_5_17(getattr(mu, name)))
    calls.clear()
    count = checked_count()
    trace_module(mixtral(rope_theta=5170.0), STRATEGY, batch=1, seq=16)      # a structure no other test checks
    assert checked_count() == count + 1 and calls == ["create_causal_mask"]


def test_a_mask_function_without_a_cache_argument_is_one_error():
    from moegraph.lowering.check import mask_kwargs

    def create_causal_mask(config, inputs_embeds, attention_mask, position_ids=None):
        raise AssertionError("not called")
    with pytest.raises(LoweringError, match=r"create_causal_mask\(config, .*\) takes no 'cache' or 'past_key_values'"):
        mask_kwargs(create_causal_mask, config=None, inputs_embeds=None, position_ids=None)


@pytest.mark.parametrize("version,ok", [("4.57.1", False), ("5.16.2", False), ("5.17.0", True), ("5.24.0.dev0", True),
                                        ("6.0.0", False)])
def test_an_unsupported_transformers_is_refused_in_one_line(monkeypatch, version, ok):
    """Before any module is read: the installed version and the supported range, one line."""
    from moegraph.lowering import structural
    monkeypatch.setattr(structural, "installed_transformers", lambda: version)
    if ok:
        trace_module(mixtral(), STRATEGY, batch=1, seq=16)
        return
    with pytest.raises(LoweringError) as info:
        trace_module(mixtral(), STRATEGY, batch=1, seq=16)
    assert str(info.value) == (f"transformers {version} is not supported: moegraph lowers transformers models with "
                               "transformers>=5.17,<6.0 (pip install 'transformers>=5.17,<6.0')")


def test_pyproject_extras_name_the_supported_range():
    import tomllib
    from pathlib import Path

    from moegraph.lowering.structural import transformers_range
    extras = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert f"transformers{transformers_range()}" in extras["hf"] and f"transformers{transformers_range()}" in extras["test"]
