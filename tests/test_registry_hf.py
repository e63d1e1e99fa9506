"""Hugging Face config.json files drive the registry and the CLI (issue 27, item 4): load_model reads
any family that compiles, the shipped published configs are registry entries, and ``moegraph tune
--model tests/assets/<x>.json`` ranks strategies. Sizes are typed here from the models' published
configs (tests/assets/README.md), not read back from the code under test.
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("transformers")

from moegraph.builder import ConfigError  # noqa: E402
from moegraph.cli import main  # noqa: E402
from moegraph.ir import OpKind, Phase, Strategy  # noqa: E402
from moegraph.registry import RegistryError, load_model, model_names  # noqa: E402
from moegraph.tracer import trace_model  # noqa: E402

# name: (layers, hidden, heads, kv_heads, head_dim, expert h_ffn, experts, top_k, shared, dense first layers)
PUBLISHED = {
    "qwen3-30b-a3b": (48, 2048, 32, 4, 128, 768, 128, 8, 0, 0),
    "qwen3-235b-a22b": (94, 4096, 64, 4, 128, 1536, 128, 8, 0, 0),
    "gpt-oss-120b": (36, 2880, 64, 8, 64, 2880, 128, 4, 0, 0),
    "llama-4-scout": (48, 5120, 40, 8, 128, 8192, 16, 1, 1, 0),
    "llama-4-maverick": (48, 5120, 40, 8, 128, 8192, 128, 1, 1, 1),     # MoE every 2nd layer: layer 0 dense
    "deepseek-v2": (60, 5120, 128, 128, 192, 1536, 160, 6, 1, 1),       # MLA: head dim 128 + 64
    "glm-4.5": (92, 5120, 96, 8, 128, 1536, 160, 8, 1, 3),
    "kimi-k2": (61, 7168, 64, 64, 192, 2048, 384, 8, 1, 1),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_entry_has_its_published_sizes(name):
    cfg = load_model(name)
    got = (cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffn_hidden, cfg.experts, cfg.top_k,
           cfg.shared_experts, cfg.first_k_dense_replace)
    assert got == PUBLISHED[name]
    assert name in model_names() and cfg.hf_config is not None


def test_the_traced_layer_is_the_familys_own():
    """GPT-OSS's sliding window (its layer 0), sinks and biases; DeepSeek-V3's YaRN frequencies; Qwen3's
    per-head q/k norms: parts the reference layer has not, planned from the config."""
    g = trace_model(load_model("tests/assets/gpt-oss-120b.json"), Strategy("tp", "ep", "a2a", 8), seq=4096)
    attn = g.node["attention"]
    assert attn.attr("window") == 128 and attn.attr("sinks") is True
    assert {"o_bias", "fc1_bias"} <= {nd.name for nd in g.nodes}
    g = trace_model(load_model("tests/assets/deepseek-v3.json"), Strategy("sp", "ep", "a2a", 8), seq=4096)
    assert len(g.node["mla_heads"].attr("inv_freq")) == 32
    g = trace_model(load_model("tests/assets/qwen3-30b-a3b.json"), Strategy("sp", "ep", "a2a", 4), seq=4096)
    norms = [nd for nd in g.nodes if nd.op is OpKind.NORM and nd.phase is Phase.FORWARD]
    assert {nd.attr("kind") for nd in norms} == {"head_rms"} and len(norms) == 2


def test_every_asset_plans_through_trace_model():
    """What tune lowers for each of tests/assets' configs (the CLI test below runs tune on one: ~10 s each)."""
    for asset, n in (("qwen3-30b-a3b", 4), ("gpt-oss-120b", 8), ("deepseek-v3", 8)):
        cfg = load_model(f"tests/assets/{asset}.json")
        for attn, ffn, dispatch in (("tp", "tp", "ag-rs"), ("sp", "ep", "a2a")):
            g = trace_model(cfg, Strategy(attn, ffn, dispatch, n), seq=1024)
            assert g.dims.experts == cfg.experts and g.forward_comm_bytes("ffn") > 0


@pytest.mark.parametrize("asset,kinds", [
    ("gpt-oss-120b", [("0, 2, 4", None), ("1, 3, 5", "self_attn: window 128 vs None")]),     # sliding / full
    ("deepseek-v3", [("0, 1, 2", None), ("3, 4, 5", "mlp")])])                              # dense first layers
@pytest.mark.slow
def test_trace_of_a_real_config_shows_its_mixed_layer_stack(asset, kinds, capsys):
    """--layers all of a Hugging Face config stacks every decoder layer, each kind lowered once."""
    assert main(["trace", "--model", f"tests/assets/{asset}.json", "--n", "8", "--seq", "1024", "--layers", "all",
                 "--passes", "", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["layers"] == load_model(f"tests/assets/{asset}.json").layers
    assert [(", ".join(map(str, k["layers"][:3])), k["differs_from_kind_0"]) for k in report["layer_kinds"]] == kinds
    assert len(report["nodes"]) == sum(k["nodes"] * len(k["layers"]) for k in report["layer_kinds"])


def test_a_pipeline_of_a_real_config_holds_its_own_layer_kinds():
    """The driver's per-layer graphs of a Hugging Face config (pipeline stages price them) are its
    own kinds: GPT-OSS's sliding-window and full attention alternate from layer 0 on; 'all' is every
    layer, with or without pp."""
    from moegraph.config import CompileConfig, config_layers
    from moegraph.cost import CostModel
    from moegraph.registry import load_hardware
    from moegraph.schedules.pipeline_model import model_layers
    cfg = load_model("tests/assets/gpt-oss-120b.json")
    assert [config_layers(CompileConfig(model=cfg, layers="all", **pp), cfg) for pp in ({}, {"pp": 4})] == [36, 36]
    graphs = model_layers(cfg, Strategy("sp", "ep", "ag-rs", 8), batch=1, seq=256, passes="",
                          cost=CostModel(load_hardware("h100")), layers=4)
    windows = [next(n.attr("window", None) for n in g.nodes if n.op is OpKind.ATTENTION) for g in graphs]
    assert windows == [128, None, 128, None]                  # published: sliding_window 128, layer 0 sliding
    assert graphs[0] is graphs[2] and graphs[1] is graphs[3]   # each kind lowered once


@pytest.mark.parametrize("asset,n", [("gpt-oss-120b", "8")])
def test_tune_ranks_strategies_for_a_hugging_face_config(asset, n, tmp_path, capsys):
    out = tmp_path / "best.json"
    assert main(["tune", "--model", f"tests/assets/{asset}.json", "--n", n, "--seq", "256", "--refine", "1",
                 "--time-limit", "0.1", "--cache", "", "-o", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == asset
    feasible = [c["predicted_us"] for c in report["candidates"] if c["feasible"]]
    assert len(feasible) >= 6 and feasible == sorted(feasible)
    assert report["best"]["predicted_us"] == feasible[0] and out.exists()


def test_a_family_that_does_not_compile_is_refused_naming_the_construct(tmp_path):
    path = tmp_path / "doge.json"
    path.write_text(json.dumps({"model_type": "doge", "num_hidden_layers": 2, "hidden_size": 64,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 16,
                                "num_experts_per_tok": 2, "intermediate_size": 32, "is_moe": True}))
    with pytest.raises(RegistryError) as err:
        load_model(str(path))
    assert "'self_attn.dt_proj' (Linear)" in str(err.value) and "does not model it" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_dense_layer_before_the_first_moe_layer_that_does_not_lower_names_the_file_and_layer(tmp_path):
    """Jamba: layer 0 (Mamba, dense MLP) before the first MoE layer (attention). The refusal was
    the bare construct, without the file or the layer it sits in."""
    path = tmp_path / "jamba.json"
    path.write_text(json.dumps({"model_type": "jamba", "num_hidden_layers": 4, "hidden_size": 64,
                                "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 1000,
                                "expert_layer_period": 2, "expert_layer_offset": 1, "attn_layer_period": 2,
                                "attn_layer_offset": 1, "mamba_d_state": 8, "mamba_expand": 2, "mamba_dt_rank": 8}))
    with pytest.raises(RegistryError) as err:
        load_model(str(path))
    assert str(err.value).startswith(f"{path}: layer 0 does not lower (")
    assert str(err.value).endswith("it comes before layer 1, the first whose MoE block lowers")
    assert "'mamba' (JambaMambaMixer) is not modelled" in str(err.value) and "\n" not in str(err.value)


def test_a_qwen3_next_config_plans_its_linear_and_full_attention_layers(tmp_path):
    """Qwen3-Next's first MoE layer is a linear-attention one (Gated DeltaNet): the model config's heads
    are its full-attention layers'; a plan lowers both kinds (meta device: no numbers are checked)."""
    from moegraph.layers import KINDS_META
    path = tmp_path / "next.json"
    path.write_text(json.dumps({"model_type": "qwen3_next", "num_hidden_layers": 4, "hidden_size": 64,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                "layer_types": ["linear_attention"] * 3 + ["full_attention"]}))
    cfg = load_model(str(path))
    assert (cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim) == (4, 4, 2, 16)
    for attn in ("sp", "tp"):
        g = trace_model(cfg, Strategy(attn, "ep", "a2a", 2), seq=256, layers=4)
        kinds = g.meta_get(KINDS_META)
        assert kinds.pattern == (0, 0, 0, 1)
        assert any(nd.op is OpKind.GATED_DELTA for nd in kinds.graphs[0].nodes)
    # n not dividing the linear attention's key heads (2; the full layers' kv heads are 4 here) is
    # refused naming them, not as "kv_heads" (the dims' field they sit in), with the fold that works
    wide = tmp_path / "wide_kv.json"
    wide.write_text(path.read_text().replace('"num_key_value_heads": 2', '"num_key_value_heads": 4'))
    with pytest.raises(ConfigError, match=r"n/attn_nodes=4 does not divide the linear attention's key heads \(2\): "
                                          r".*attn_nodes=2 \(--attn-nodes 2\)"):
        trace_model(load_model(str(wide)), Strategy("sp", "ep", "a2a", 4), seq=256, layers=4)
    # fuse=all over both kinds: the gated full-attention kind has no eligible group, the linear one
    # has; the stack's kinds must carry one strategy (the restack raised a traceback)
    from moegraph.cli import main
    assert main(["trace", "--model", str(path), "--layers", "4", "--n", "2", "--seq", "128", "--dispatch", "a2a",
                 "--passes", "fuse=all", "--json"]) == 0


# config.json values of the families the zoo's tests compile besides the shipped ones (sizes typed
# here): DBRX's nested sub-configs and base model transformer.blocks, Mistral 4 (its causal LM is
# not in transformers' auto mapping: the family module's own)
OTHER_FAMILIES = {
    "dbrx": ({"d_model": 1024, "n_heads": 16, "n_layers": 4, "vocab_size": 32000,
              "attn_config": {"clip_qkv": 8.0, "kv_n_heads": 8, "rope_theta": 500000.0},
              "ffn_config": {"ffn_hidden_size": 2048, "moe_num_experts": 16, "moe_top_k": 4}},
             (4, 1024, 16, 8, 64, 2048, 16, 4)),
    "mistral4": ({"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 4,
                  "vocab_size": 32000, "n_routed_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 512,
                  "first_k_dense_replace": 0},
                 (4, 1024, 16, 16, None, 512, 16, 4)),
}


@pytest.mark.parametrize("family", sorted(OTHER_FAMILIES))
def test_a_config_of_dbrx_or_mistral4_plans(family, tmp_path):
    values, sizes = OTHER_FAMILIES[family]
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": family, **values}))
    cfg = load_model(str(path))
    got = (cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim if sizes[4] else None, cfg.ffn_hidden,
           cfg.experts, cfg.top_k)
    assert got == sizes
    g = trace_model(cfg, Strategy("tp", "ep", "a2a", 8), seq=1024)
    if family == "dbrx":                  # clip_qkv: a clamp of the fused projection
        assert [(nd.attr("how"), nd.attr("limit")) for nd in g.nodes
                if nd.op is OpKind.LIMIT and nd.phase is Phase.FORWARD] == [("clamp", 8.0)]


@pytest.mark.parametrize("text,message", [
    ("{not json", "invalid JSON"),
    ('{"hidden_size": 64}', "not a Hugging Face config.json (no model_type)"),
    ('{"model_type": "no_such_family"}', "model_type 'no_such_family' is not a family the installed transformers knows"),
    ('{"model_type": "dbrx", "ffn_config": {"moe_normalize_expert_weights": 1}}',
     "the dbrx config refuses its values (Validation error for field 'moe_normalize_expert_weights'"),
])
def test_a_bad_config_json_is_one_line(text, message, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(RegistryError, match=re.escape(message)) as err:
        load_model(str(path))
    assert "\n" not in str(err.value)
