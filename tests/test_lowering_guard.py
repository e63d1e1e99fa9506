"""Never a silently wrong graph (issue 12, item 1): every module the tracer lowers computes what its
rule says, and every parameter the layer holds reaches the graph; otherwise one LoweringError line
names the class, parameter or attribute.

Each case below compiled and ran before with 1-89% output error and no error at all.
"""

import functools
import re

import pytest
import torch
from torch import nn

from helpers import small_layer
from moegraph.ir import ParamSource, Strategy
from moegraph.lowering import LoweringError, check_patches_and_hooks, register
from moegraph.lowering.blocks import MoESpec, NormSpec, RopeSpec
from moegraph.models import MoE, RMSNorm
from moegraph.tracer import extract_program, trace_module

transformers = pytest.importorskip("transformers")
from transformers import MixtralConfig  # noqa: E402
from transformers.models.mixtral import modeling_mixtral as hf  # noqa: E402

from near_misses import NoisyRouter, OnePlusRMSNorm, SharedExpertMoe, mixtral  # noqa: E402

STRATEGY = Strategy("sp", "ep", "ag-rs", 2, dtype="fp32")


def lowering_error(layer: nn.Module) -> str:
    with pytest.raises(LoweringError) as info:
        trace_module(layer, STRATEGY, batch=1, seq=16)
    text = str(info.value)
    assert "\n" not in text, text
    return text


class QKNormAttention(hf.MixtralAttention):
    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.q_norm = hf.MixtralRMSNorm(self.head_dim)
        self.k_norm = hf.MixtralRMSNorm(self.head_dim)

    def forward(self, hidden_states, *args, **kwargs):  # q/k normed per head before RoPE (OLMo-2 style)
        return super().forward(hidden_states, *args, **kwargs)


def test_moe_subclass_with_a_shared_expert_names_the_class():
    layer = mixtral()
    layer.mlp = SharedExpertMoe(layer.self_attn.config)
    text = lowering_error(layer)
    assert "'mlp' (" in text and "SharedExpertMoe) subclasses MixtralSparseMoeBlock but overrides forward" in text


def test_rmsnorm_subclass_computing_one_plus_w_names_the_class():
    layer = mixtral()
    layer.post_attention_layernorm = OnePlusRMSNorm(64)
    text = lowering_error(layer)
    assert "'post_attention_layernorm' (" in text and "OnePlusRMSNorm) subclasses MixtralRMSNorm but overrides forward" in text


def test_attention_subclass_with_qk_norm_names_the_class():
    layer = mixtral()
    layer.self_attn = QKNormAttention(layer.self_attn.config, 0)
    assert "QKNormAttention) subclasses MixtralAttention but overrides forward" in lowering_error(layer)


def test_q_proj_bias_is_named():
    layer = mixtral()
    layer.self_attn.q_proj = nn.Linear(64, 64, bias=True)
    text = lowering_error(layer)
    assert "does not read self_attn.q_proj.bias:" in text


def test_attention_dropout_in_training_mode_is_named():
    layer = mixtral(attention_dropout=0.5)
    assert layer.training
    assert lowering_error(layer).startswith("self_attn.attention_dropout=0.5 in training mode")
    trace_module(layer.eval(), STRATEGY, batch=1, seq=16)     # no dropout in eval mode: lowers


def test_a_sliding_window_lowers_to_a_windowed_attention():
    """Mixtral with config.sliding_window: its model builds a sliding-window mask for every layer,
    so the attention keeps keys in (q - 8, q]; the numerical check ran the layer with that mask."""
    g = trace_module(mixtral(sliding_window=8), STRATEGY, batch=1, seq=16)
    assert g.node["attention"].attr("window") == 8


def test_a_replaced_router_inside_a_rule_backed_block_is_named():
    layer = mixtral()
    layer.mlp.gate = NoisyRouter(layer.self_attn.config)
    assert lowering_error(layer).startswith("'mlp.gate' (near_misses.NoisyRouter) subclasses MixtralTopKRouter "
                                            "but overrides forward")


def test_a_subclass_that_changes_nothing_keeps_its_parents_rule():
    class Renamed(hf.MixtralRMSNorm):
        pass
    layer = mixtral()
    layer.input_layernorm = Renamed(64)
    g = trace_module(layer, STRATEGY, batch=1, seq=16)
    assert any(src.qualname == "input_layernorm.weight" for _, spec in g.params for src in spec.sources)


def test_reference_layer_with_an_extra_parameter_names_it():
    layer = small_layer(2)
    layer.moe.expert_bias = nn.Parameter(torch.zeros(8))
    assert "does not read moe.expert_bias:" in lowering_error(layer)


def test_reference_layer_with_an_extra_buffer_names_it():
    layer = small_layer(2)
    layer.attn.register_buffer("alibi", torch.zeros(8))
    assert "does not read attn.alibi:" in lowering_error(layer)


def test_every_missing_parameter_is_named_in_one_line():
    layer = mixtral()
    layer.self_attn.q_proj = nn.Linear(64, 64, bias=True)
    layer.self_attn.v_proj = nn.Linear(64, 32, bias=True)
    assert "does not read self_attn.q_proj.bias, self_attn.v_proj.bias:" in lowering_error(layer)


def test_qk_norm_added_without_overriding_forward_is_named_by_its_weights():
    class QKNormOnly(hf.MixtralAttention):
        def __init__(self, config, layer_idx):
            super().__init__(config, layer_idx)
            self.q_norm, self.k_norm = hf.MixtralRMSNorm(64), hf.MixtralRMSNorm(32)
    layer = mixtral()
    layer.self_attn = QKNormOnly(layer.self_attn.config, 0)
    assert "does not read self_attn.q_norm.weight, self_attn.k_norm.weight:" in lowering_error(layer)


# -- item 2: no torch.fx internals reach a user ---------------------------------------------

def _moe_decoder_layers() -> list[tuple[str, str]]:
    """(family, class) for every *DecoderLayer in an installed transformers modeling file that
    also defines an MoE block (found by reading the source: importing ~400 models is slow)."""
    import pathlib
    import re
    moe, dec = re.compile(r"^class \w*(Experts|SparseMoe|MoE|Moe)\w*\(", re.M), re.compile(r"^class (\w+DecoderLayer)\(", re.M)
    found = []
    for f in sorted((pathlib.Path(transformers.__file__).parent / "models").glob("*/modeling_*.py")):
        text = f.read_text() if f.stem == f"modeling_{f.parent.name}" else ""
        if "experts" in text and moe.search(text):
            found += [(f.parent.name, cls) for cls in dec.findall(text)]
    return found


FX_INTERNALS = ("Proxy", "symbolically traced", "torch.fx.proxy", "fx/_symbolic_trace", "TraceError:")


# families whose decoder layers at their default (real) sizes must lower, not merely be named
RULED_FAMILIES = ("deepseek_v3", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "gpt_oss", "glm4_moe",
                  "minimax_m2", "ernie4_5_moe", "granitemoe", "solar_open")


def test_the_ruled_families_are_among_the_installed_moe_layers():
    assert set(RULED_FAMILIES) <= {family for family, _ in _moe_decoder_layers()}


@pytest.mark.parametrize("family,cls_name", _moe_decoder_layers(), ids=lambda v: v)
@pytest.mark.slow
def test_every_moe_decoder_layer_lowers_or_names_a_module(family, cls_name):
    import importlib
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    try:
        config_cls = next(v.config_class for v in vars(mod).values()
                          if isinstance(v, type) and getattr(v, "config_class", None) is not None)
        cfg = config_cls()
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        with torch.device("meta"):       # the default (real) sizes, without allocating them
            layer = getattr(mod, cls_name)(cfg, max(0, getattr(cfg, "num_hidden_layers", 1) - 1))
    except Exception as err:  # noqa: BLE001 - this transformers class cannot be built from its default config
        if family in RULED_FAMILIES:
            raise
        pytest.skip(f"{cls_name} cannot be built from {family}'s default config offline: {type(err).__name__}: {err}")
    if family in RULED_FAMILIES:
        trace_module(layer, Strategy("sp", "ep", "ag-rs", 1), batch=1, seq=8)
        return
    try:
        trace_module(layer, Strategy("sp", "ep", "ag-rs", 1), batch=1, seq=8)
    except LoweringError as err:
        text = str(err)
        assert "\n" not in text and not any(s in text for s in FX_INTERNALS), text
        assert re.search(r"('[\w.]+'|[\w.]+|the layer) \([\w.]+\)|^layer \d+: ", text), f"names no module: {text}"


@pytest.mark.slow
def test_a_lowering_error_on_ranks_reaches_the_user_as_one_line():
    import runtime_workers as workers
    from moegraph.runtime import RankFailure
    from moegraph.runtime.launch import spawn
    with pytest.raises(RankFailure) as info:
        spawn(workers.compile_unlowerable, 2, args=(0,), timeout_s=120)
    text = str(info.value)
    assert info.value.error_type == "LoweringError" and "\n" not in text, text
    assert "does not read self_attn.q_proj.bias:" in text


def test_a_layer_returning_an_auxiliary_loss_is_named():
    class WithAux(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = small_layer(2)

        def forward(self, x):
            h = x + self.inner.attn(self.inner.input_norm(x))
            y = self.inner.post_attn_norm(h)
            return h + self.inner.moe(y), y
    assert lowering_error(WithAux()).startswith("WithAux returns 2 values (an auxiliary loss")


# -- the registry's own guarantees, on rules registered here ---------------------------------

class CountingNorm(RMSNorm):
    """An RMSNorm that counts its calls in a buffer (not numerics) and has a helper its rule stands for."""

    def __init__(self, hidden):
        super().__init__(hidden)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def scale(self):
        return self.weight


class HalfFusedMoE(MoE):
    """Its rule (below) wrongly reads only half of w1 and never w3."""


register(CountingNorm, methods=("scale",), unused={"calls": "a call counter: no numerics"})(
    lambda module, qualname: NormSpec(ParamSource(f"{qualname}.weight"), module.eps))


@register(HalfFusedMoE)
def _half_moe(module, qualname):
    e, f, h = module.w1.shape
    half = ParamSource(f"{qualname}.w1", narrow=(1, 0, f // 2))
    return MoESpec(router=ParamSource(f"{qualname}.router.weight"), w1=half, w3=half,
                   w2=ParamSource(f"{qualname}.w2", narrow=(2, 0, f // 2)), experts=e, top_k=module.top_k,
                   ffn_hidden=f // 2, hidden=h)


def test_a_buffer_declared_unused_with_a_reason_lowers():
    layer = small_layer(2)
    layer.input_norm = CountingNorm(64)
    reads = dict(extract_program(layer).reads)          # what the coverage check demands the graph read
    assert "input_norm.weight" in reads and "input_norm.calls" not in reads
    trace_module(layer, STRATEGY, batch=1, seq=16)


def test_overriding_a_method_the_rule_stands_for_names_it():
    class Rescaled(CountingNorm):
        def scale(self):
            return 2 * self.weight
    layer = small_layer(2)
    layer.input_norm = Rescaled(64)
    assert "Rescaled) subclasses CountingNorm but overrides scale:" in lowering_error(layer)


def test_a_fused_parameter_read_only_in_part_is_named():
    layer = small_layer(2)
    layer.moe = HalfFusedMoE(64, 96, 8, 3)
    assert "does not read moe.w1 (only partly), moe.w3, moe.w2 (only partly):" in lowering_error(layer)


# -- DeepSeek-V3: what its rules do not model is named --------------------------------------

def test_deepseek_v3_attention_bias_is_named():
    import runtime_workers as workers
    layer, _ = workers.deepseek_v3_layer(0, attention_bias=True)
    assert lowering_error(layer).startswith("self_attn (DeepseekV3Attention): config.attention_bias=True ")


def test_deepseek_v3_attention_overriding_expand_kv_names_it():
    import runtime_workers as workers
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    class OtherExpansion(ds.DeepseekV3Attention):
        def expand_kv(self, kv_nope, k_rot):
            return super().expand_kv(kv_nope, k_rot * 2)
    layer, _ = workers.deepseek_v3_layer(0)
    layer.self_attn = OtherExpansion(layer.self_attn.config, 1)
    assert "OtherExpansion) subclasses DeepseekV3Attention but overrides expand_kv" in lowering_error(layer)


def test_deepseek_v3_yarn_rope_lowers_with_its_frequencies_and_scale():
    """YaRN (DeepSeek-V3's published rope_scaling): the rotary module's frequencies and attention
    factor reach the MLA_HEADS node, and the attention's mscale^2 softmax scale the ATTENTION node."""
    import runtime_workers as workers
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
    layer, _ = workers.deepseek_v3_layer(0, rope_parameters=yarn)
    g = trace_module(layer, STRATEGY, batch=1, seq=16)
    heads = g.node["mla_heads"]
    assert len(heads.attr("inv_freq")) == 4 and heads.attr("inv_freq") != RopeSpec.default_inv_freq(10000.0, 8)
    assert g.node["attention"].attr("scale") == layer.self_attn.scaling != 20 ** -0.5


def test_rope_scaling_that_depends_on_the_sequence_is_named():
    layer = mixtral(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0})
    assert "rope_type 'dynamic' recomputes its frequencies from the sequence length" in lowering_error(layer)


def test_an_attention_kernel_registered_in_the_attention_interface_is_named():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def tripled_attention(module, q, k, v, mask, **kw):      # any non-standard kernel
        out, w = sdpa_attention_forward(module, q, k, v, mask, **kw)
        return out * 3.0, w
    AttentionInterface.register("moegraph_test_tripled", tripled_attention)
    layer = mixtral()
    layer.self_attn.config._attn_implementation = "moegraph_test_tripled"
    text = lowering_error(layer)
    assert re.search(r"self_attn \(MixtralAttention\): attn_implementation='moegraph_test_tripled' runs "
                     r".*tripled_attention, which the compiler does not model", text), text
    layer = mixtral()
    layer.self_attn.config._attn_implementation = "flex_attention"      # a kernel whose math is not checked here
    assert "attn_implementation='flex_attention'" in lowering_error(layer)
    for impl in ("eager", "sdpa"):                                         # the modelled ones still lower
        layer.self_attn.config._attn_implementation = impl
        trace_module(layer, STRATEGY, batch=1, seq=16)


def test_a_forward_replaced_on_the_instance_is_named():
    layer = mixtral()
    original = layer.mlp.forward
    layer.mlp.forward = lambda h: 50 * original(h)          # a monkeypatched MoE block
    assert re.search(r"'mlp' \(MixtralSparseMoeBlock\)\.forward is replaced on the instance \(.*<lambda>\)",
                     lowering_error(layer))
    layer = mixtral()
    layer.forward = lambda h, **kw: h                        # the layer itself (fx reads the class's forward)
    assert "the compiled MixtralDecoderLayer.forward is replaced on the instance" in lowering_error(layer)


def test_a_class_level_forward_swap_is_named(monkeypatch):
    def zero_centred(self, h):                               # a Liger/unsloth-style kernel swap
        v = h.float().pow(2).mean(-1, keepdim=True)
        return (h.float() * torch.rsqrt(v + self.variance_epsilon)).to(h.dtype) * (self.weight + 1)
    monkeypatch.setattr(hf.MixtralRMSNorm, "forward", zero_centred)
    assert re.search(r"'input_layernorm' \(MixtralRMSNorm\): .*MixtralRMSNorm\.forward is replaced by "
                     r".*zero_centred \(a class-level patch\)", lowering_error(mixtral()))


def test_a_class_level_swap_disguised_by_functools_wraps_is_named(monkeypatch):
    original = hf.MixtralSparseMoeBlock.forward

    @functools.wraps(original)                               # copies __module__, __qualname__, __wrapped__
    def doubled(self, h):
        return 2 * original(self, h)
    monkeypatch.setattr(hf.MixtralSparseMoeBlock, "forward", doubled)
    assert re.search(r"'mlp' \(MixtralSparseMoeBlock\): .*MixtralSparseMoeBlock\.forward is replaced by "
                     r".*\(a class-level patch\)", lowering_error(mixtral()))


def _logged(fn):                                             # a decorator defined in the model's own file
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        return fn(self, *args, **kwargs)
    return wrapper


class DecoratedNorm(RMSNorm):
    @_logged
    def forward(self, x):
        return super().forward(x)


register(DecoratedNorm)(lambda module, qualname: NormSpec(ParamSource(f"{qualname}.weight"), module.eps))


def test_a_decorator_from_the_classs_own_file_is_not_a_patch():
    layer = small_layer(2)
    layer.input_norm = DecoratedNorm(64)
    check_patches_and_hooks(layer)


def test_transformers_own_forward_decorators_pass_the_guard():
    """MixtralForCausalLM (can_return_tuple), MixtralModel (two wrappers), the decoder layer
    (checkpointing wrapper) and the rotary embedding (torch.no_grad over dynamic_rope_update)
    all keep transformers' decorators on the class's forward: none is a patch."""
    config = MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, num_local_experts=2)
    check_patches_and_hooks(hf.MixtralForCausalLM(config))


@pytest.mark.parametrize("register, kind", [
    (lambda m: m.mlp.register_forward_hook(lambda mod, inp, out: out), "'mlp' (MixtralSparseMoeBlock) has a forward hook"),
    (lambda m: m.post_attention_layernorm.register_forward_pre_hook(lambda mod, inp: inp),
     "'post_attention_layernorm' (MixtralRMSNorm) has a forward pre hook"),
    (lambda m: m.self_attn.o_proj.register_full_backward_hook(lambda mod, gi, go: None),
     "'self_attn.o_proj' (Linear) has a backward hook"),
    (lambda m: m.register_forward_hook(lambda mod, inp, out: out), "the compiled MixtralDecoderLayer has a forward hook"),
    (lambda m: torch.nn.modules.module.register_module_forward_hook(lambda mod, inp, out: out),
     "a global module forward hook is registered"),
])
def test_module_hooks_are_named(register, kind):
    layer = mixtral()
    handle = register(layer)
    try:
        assert kind in lowering_error(layer)
    finally:
        handle.remove()
    trace_module(layer, STRATEGY, batch=1, seq=16)           # removed: it lowers
