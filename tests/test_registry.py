"""Registries: paper numbers typed in by hand, every user-facing error text pinned."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import yaml

from moegraph.registry import loading
from moegraph.registry import (Hardware, ModelConfig, RegistryError, hardware_names, load_hardware,
                               load_model, model_names)

# MegaScale-MoE Table 2: #layers, h, #heads, m, h_ffn, #experts, top-k
TABLE2 = {
    "internal-352b": (60, 4096, 32, 4, 14336, 32, 3),
    "mixtral-8x7b": (32, 4096, 32, 4, 14336, 8, 2),
    "mixtral-8x22b": (56, 6144, 48, 6, 16384, 8, 2),
    "hunyuan-large": (64, 6400, 80, 10, 18304, 16, 1),
    "phi-3.5-moe": (32, 4096, 32, 4, 6400, 16, 2),
    "deepseek-moe": (28, 2048, 16, 1, 1408, 64, 6),
}

# MegaScale-MoE Table 4: TFLOPS, capacity GB, HBM TB/s, NVLink GB/s (bidirectional)
TABLE4 = {"h800": (989, 80, 3.4, 400), "a100": (312, 80, 2.0, 600), "h20": (148, 96, 4.0, 900)}
# MoNTA Table 5: NVLink GB/s, unidirectional
MONTA_T5 = {"b200": 900, "h100": 450, "h20": 450, "h800": 200, "a800": 200, "a100": 300}
SMS = {"h800": 132, "h100": 132, "a100": 108, "a800": 108, "h20": 78, "b200": 148}

MINIMAL_MODEL = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 128,
                 "experts": 4, "top_k": 2}


def write_yaml(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_every_entry_loads():
    hf = {"qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-120b", "llama-4-scout", "llama-4-maverick", "deepseek-v2",
          "glm-4.5", "kimi-k2"}          # shipped Hugging Face configs (registry/hf/*.json)
    assert set(model_names()) == set(TABLE2) | {"tiny", "tiny-top1", "small", "qwen2-57b-a14b", "olmoe-1b-7b",
                                                "deepseek-v3"} | hf
    assert set(hardware_names()) == {"h800", "h800-megascale", "a100", "h20", "h100", "h200", "a800", "b200", "cpu-gloo",
                                   "cpu-2core-gloo",
                                   "cpu-2core-gloo-1gbit", "nvidia-h200-2026-11-27"}
    for name in model_names():
        assert load_model(name).name == name
    for name in hardware_names():
        assert load_hardware(name).name == name


@pytest.mark.parametrize("name", sorted(TABLE2))
def test_table2(name):
    layers, h, heads, m, h_ffn, experts, k = TABLE2[name]
    cfg = load_model(name)
    assert (cfg.layers, cfg.hidden, cfg.heads, cfg.ffn_hidden, cfg.experts, cfg.top_k) == \
        (layers, h, heads, h_ffn, experts, k)
    assert cfg.m == m and cfg.kv_heads * m == heads
    assert cfg.f == h_ffn / h
    assert cfg.head_dim * heads == h


def test_small_entries():
    tiny, top1, small = load_model("tiny"), load_model("tiny-top1"), load_model("small")
    assert (tiny.layers, tiny.hidden, tiny.heads, tiny.kv_heads, tiny.ffn_hidden, tiny.experts,
            tiny.top_k) == (1, 64, 4, 2, 128, 4, 2)
    assert (top1.experts, top1.top_k, top1.hidden) == (8, 1, 64)
    assert (small.hidden, small.heads, small.kv_heads, small.ffn_hidden, small.experts,
            small.top_k) == (512, 8, 4, 1024, 8, 2)


@pytest.mark.parametrize("name", sorted(TABLE4))
def test_table4(name):
    tflops, cap_gb, tb_s, nvlink_bidir = TABLE4[name]
    hw = load_hardware(name)
    assert hw.peak_flops_bf16 == tflops * 1e12
    assert hw.hbm_capacity_bytes == cap_gb * 10**9
    assert hw.hbm_bw_bytes_s == pytest.approx(tb_s * 1e12)
    assert hw.nvlink_bw_bytes_s == nvlink_bidir / 2 * 1e9  # ours is unidirectional


@pytest.mark.parametrize("name", sorted(MONTA_T5))
def test_nvlink_unidirectional_and_sms(name):
    hw = load_hardware(name)
    assert hw.nvlink_bw_bytes_s == MONTA_T5[name] * 1e9
    assert hw.sm_count == SMS[name]
    assert hw.nic_bw_bytes_s == (25e9 if name in ("a100", "a800") else 50e9)
    assert hw.gpus_per_node == 8


def test_public_datasheets():
    assert load_hardware("h100").hbm_bw_bytes_s == pytest.approx(3.35e12)
    b200 = load_hardware("b200")
    assert (b200.peak_flops_bf16, b200.hbm_capacity_bytes, b200.hbm_bw_bytes_s) == (2250e12, 180 * 10**9, 8e12)


def test_hardware_defaults_model_no_shape_or_size_effect():
    """A profile written before the shape and size curves (every calibrated one) prices as it did:
    each new field's default switches its effect off."""
    f = {x.name: x.default for x in dataclasses.fields(Hardware)}
    assert (f["gemm_tiles"], f["gemm_wave_exponent"], f["gemm_k_half"], f["attention_seq_half"]) == ((), 0.0, 0.0, 0.0)
    assert (f["attention_head_dim_eff"], f["attention_bwd_factor"]) == ((), 1.0)
    assert all(f[k] == 0.0 for k in ("ring_half_bytes_intra", "ring_half_bytes_inter", "a2a_half_bytes_intra",
                                     "a2a_half_bytes_inter"))
    assert (f["gemm_eff"], f["grouped_gemm_eff"], f["attention_eff"], f["mem_eff"]) == (0.75, 0.65, 0.55, 0.8)


def test_cpu_gloo_has_copy_engine_budget_only():
    hw = load_hardware("cpu-gloo")
    assert hw.comm_sm_budgets == (0,) and hw.copy_engine_eff > 0


def test_frozen():
    cfg = load_model("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden = 7


# --- user YAML ------------------------------------------------------------------------------

def test_user_model_round_trip(tmp_path):
    original = load_model("mixtral-8x22b")
    path = write_yaml(tmp_path, "copy.yaml", original.to_dict())
    assert load_model(str(path)) == original
    assert load_model(path) == original  # PathLike too


def test_user_model_name_defaults_to_stem(tmp_path):
    path = write_yaml(tmp_path, "my-moe.yaml", MINIMAL_MODEL)
    cfg = load_model(str(path))
    assert cfg.name == "my-moe" and cfg.head_dim == 16 and cfg.rope_theta == 1e6 and cfg.rms_eps == 1e-5


def test_user_hardware_round_trip_with_curves(tmp_path):
    hw = dataclasses.replace(load_hardware("h100"), name="lab-h100",
                             curves={"gemm_eff": [[1.0e9, 0.3], [1.0e12, 0.8]]},
                             measured={"date": "2025-01-31", "machine": "node7", "notes": "x"})
    path = write_yaml(tmp_path, "lab.yaml", hw.to_dict())
    again = load_hardware(str(path))
    assert again == hw
    assert again.curve("gemm_eff") == ((1e9, 0.3), (1e12, 0.8))
    assert again.curve("a2a_eff") is None


def test_measured_date_from_yaml_becomes_text(tmp_path):
    data = load_hardware("h800").to_dict() | {"measured": {"date": "2025-01-31"}}
    text = yaml.safe_dump(data).replace("'2025-01-31'", "2025-01-31")  # an unquoted YAML date
    hw = load_hardware(str(write_yaml(tmp_path, "m.yaml", text)))
    assert dict(hw.measured) == {"date": "2025-01-31"}


def test_fingerprint_is_sha256_of_canonical_json():
    cfg = load_model("mixtral-8x7b")
    blob = json.dumps(cfg.to_dict(), sort_keys=True, separators=(",", ":")).encode()
    assert cfg.fingerprint() == hashlib.sha256(blob).hexdigest()
    assert cfg.fingerprint() == load_model("mixtral-8x7b").fingerprint()
    assert dataclasses.replace(cfg, layers=31).fingerprint() != cfg.fingerprint()
    hw = load_hardware("h800")
    assert dataclasses.replace(hw, ring_eff_intra=0.7).fingerprint() != hw.fingerprint()


# --- error texts ----------------------------------------------------------------------------

def test_unknown_names():
    with pytest.raises(RegistryError) as e:
        load_model("foo")
    assert str(e.value) == ("unknown model 'foo'; known: deepseek-moe, deepseek-v3, hunyuan-large, internal-352b, "
                            "mixtral-8x22b, mixtral-8x7b, olmoe-1b-7b, phi-3.5-moe, qwen2-57b-a14b, small, tiny, tiny-top1, "
                            "deepseek-v2, glm-4.5, gpt-oss-120b, kimi-k2, llama-4-maverick, llama-4-scout, "
                            "qwen3-235b-a22b, qwen3-30b-a3b")
    with pytest.raises(RegistryError) as e:
        load_hardware("v100")
    assert str(e.value) == ("unknown hardware 'v100'; known: a100, a800, b200, cpu-gloo, h100, h20, h200, h800, "
                            "h800-megascale, cpu-2core-gloo, cpu-2core-gloo-1gbit, nvidia-h200-2026-11-27")
    assert load_hardware("cpu-2core-gloo").name == "cpu-2core-gloo"      # shipped calibrated profile by name
    assert load_hardware("cpu-2core-gloo-1gbit").link_bit_s == 1e9        # calibrated on the emulated link


def test_missing_user_file(tmp_path):
    with pytest.raises(RegistryError) as e:
        load_model(str(tmp_path / "nope.yaml"))
    assert str(e.value) == f"model file '{tmp_path / 'nope.yaml'}' does not exist"


def user_error(tmp_path, data, loader=load_model) -> str:
    path = write_yaml(tmp_path, "my.yaml", data)
    with pytest.raises(RegistryError) as e:
        loader(str(path))
    message = str(e.value)
    assert "\n" not in message
    return message.replace(str(path), "my.yaml")


def test_user_yaml_errors(tmp_path):
    m = MINIMAL_MODEL
    assert user_error(tmp_path, {k: v for k, v in m.items() if k != "hidden"}) == \
        "my.yaml: missing field 'hidden'"
    assert user_error(tmp_path, {"layers": 1}) == \
        "my.yaml: missing fields 'hidden', 'heads', 'kv_heads', 'ffn_hidden', 'experts', 'top_k'"
    assert user_error(tmp_path, m | {"hiden": 64}) == (
        "my.yaml: unknown field 'hiden'; valid: dense_ffn_hidden, experts, ffn_hidden, first_k_dense_replace, "
        "head_dim, heads, hf_config, hidden, kv_heads, kv_lora_rank, layers, n_group, name, normalize_topk, q_lora_rank, "
        "qk_nope_head_dim, qk_norm, qk_rope_head_dim, qkv_bias, rms_eps, rope_theta, routed_scaling_factor, "
        "router_aux_loss_coef, router_scoring, score_correction_bias, shared_experts, shared_ffn_hidden, shared_gate, top_k, "
        "topk_group, v_head_dim")
    assert user_error(tmp_path, m | {"heads": "x"}) == "my.yaml: heads: expected a positive int, got 'x'"
    assert user_error(tmp_path, m | {"heads": True}) == "my.yaml: heads: expected a positive int, got True"
    assert user_error(tmp_path, m | {"layers": 0}) == "my.yaml: layers: expected a positive int, got 0"
    assert user_error(tmp_path, m | {"rms_eps": -1.0}) == "my.yaml: rms_eps: expected a positive number, got -1.0"
    assert user_error(tmp_path, m | {"kv_heads": 3}) == "my.yaml: heads=4 is not divisible by kv_heads=3"
    assert user_error(tmp_path, m | {"top_k": 5}) == "my.yaml: top_k=5 exceeds experts=4"
    assert user_error(tmp_path, m | {"heads": 3, "kv_heads": 1}) == \
        "my.yaml: hidden=64 is not divisible by heads=3; set head_dim explicitly"
    assert user_error(tmp_path, "- 1\n- 2\n") == "my.yaml: expected a mapping of fields, got list"


def test_head_dim_explicit_lifts_divisibility(tmp_path):
    path = write_yaml(tmp_path, "odd.yaml", MINIMAL_MODEL | {"heads": 3, "kv_heads": 1, "head_dim": 32})
    assert load_model(str(path)).head_dim == 32


def test_malformed_yaml(tmp_path):
    assert user_error(tmp_path, "layers: [1, 2\nhidden: 3\n") == \
        "my.yaml: invalid YAML: expected ',' or ']', but got ':' (line 2, column 7)"
    assert user_error(tmp_path, "layers: 1\nlayers: 2\n") == \
        "my.yaml: invalid YAML: duplicate key 'layers' (line 2, column 1)"


def test_yaml_exponent_trap_is_explained(tmp_path):
    data = load_hardware("h800").to_dict()
    text = yaml.safe_dump(data).replace("peak_flops_bf16: 989000000000000.0", "peak_flops_bf16: 989e12")
    assert user_error(tmp_path, text, load_hardware) == (
        "my.yaml: peak_flops_bf16: expected a positive number, got '989e12' "
        "(a string: write exponents as 1.0e+12 so YAML reads a number)")


def test_every_sourced_field_names_its_source():
    """Issue 29 item 6 (replaces issue 14's comment check): every registry entry sets each
    efficiency, curve parameter and stretch explicitly and names its source: a paper table or
    figure, a public benchmark, a fit ("fitted to ...") or, visibly, an assumption."""
    import re
    import yaml
    from moegraph.registry.fields import SOURCED_FIELDS
    from moegraph.registry.loading import _REGISTRY_DIR
    raw = yaml.safe_load((_REGISTRY_DIR / "hardware.yaml").read_text())
    for name, entry in raw.items():
        sources = entry.get("sources", {})
        for field in SOURCED_FIELDS:
            assert field in entry, f"{name}.{field} is not set (a default would carry no source)"
            assert field in sources, f"{name}.{field} has no source line"
            assert re.search(r"Table|Fig|README|report|measured|fitted|transferred|assumed|guess|placeholder|Guide|paper|"
                             r"FlashAttention|nccl-tests", sources[field]), f"{name}.{field}: {sources[field]}"


def test_hardware_errors(tmp_path):
    h = load_hardware("h800").to_dict()
    assert user_error(tmp_path, h | {"ring_eff_intra": 1.5}, load_hardware) == \
        "my.yaml: ring_eff_intra: expected a number in (0, 1], got 1.5"
    # the collective efficiencies have no default: a YAML missing one names it
    assert user_error(tmp_path, {k: v for k, v in h.items() if k != "a2a_eff_inter"}, load_hardware) == \
        "my.yaml: missing field 'a2a_eff_inter'"
    # the old single fields are gone, not silently mapped to one scope
    assert user_error(tmp_path, h | {"a2a_eff": 0.5}, load_hardware).startswith(
        "my.yaml: unknown field 'a2a_eff'; valid: ")
    assert user_error(tmp_path, h | {"comm_sm_budgets": [16, 8]}, load_hardware) == \
        "my.yaml: comm_sm_budgets: expected strictly increasing SM counts, got [16, 8]"
    assert user_error(tmp_path, h | {"copy_engine_eff": 0.0}, load_hardware) == \
        "my.yaml: comm_sm_budgets=[0, 8, 16, 24, 32] contains 0 (copy engines) but copy_engine_eff=0.0"
    assert user_error(tmp_path, h | {"comm_sm_budgets": [8, 132]}, load_hardware) == \
        "my.yaml: comm_sm_budgets max 132 leaves no SMs for compute (sm_count=132)"
    assert user_error(tmp_path, h | {"a2a_sm_saturation": 200}, load_hardware) == \
        "my.yaml: a2a_sm_saturation=200 exceeds sm_count=132"
    assert user_error(tmp_path, h | {"curves": {"gemm": [[1, 0.5]]}}, load_hardware) == (
        "my.yaml: curves: unknown curve 'gemm'; valid: gemm_eff, grouped_gemm_eff, attention_eff, "
        "mem_eff, ring_eff, a2a_eff, all_reduce_eff")
    assert user_error(tmp_path, h | {"curves": {"ring_eff": [[2.0e+6, 0.5], [1.0e+6, 0.6]]}},
                      load_hardware) == \
        "my.yaml: curves: ring_eff: sizes must increase strictly, got [2000000.0, 1000000.0]"
    assert user_error(tmp_path, h | {"curves": {"ring_eff": [[1.0e+6, 1.2]]}}, load_hardware) == \
        "my.yaml: curves: ring_eff: point [1000000.0, 1.2]: expected a number in (0, 1], got 1.2"
    assert user_error(tmp_path, h | {"measured": {"when": "today"}}, load_hardware) == \
        "my.yaml: measured: unknown key 'when'; valid: date, machine, notes"


def test_registry_file_errors_name_the_entry(tmp_path, monkeypatch):
    """Registry messages read 'models.yaml: <entry>.<field>: ...'."""
    good = load_model("mixtral-8x7b").to_dict()
    del good["name"]
    monkeypatch.setattr(loading, "_REGISTRY_DIR", tmp_path)
    cases = [
        ({"mixtral-8x7b": good | {"heads": "x"}}, "models.yaml: mixtral-8x7b.heads: expected a positive int, got 'x'"),
        ({"mixtral-8x7b": good | {"kv_heads": 5}}, "models.yaml: mixtral-8x7b: heads=32 is not divisible by kv_heads=5"),
        ({"m1": {"layers": 1}}, "models.yaml: m1: missing fields 'hidden', 'heads', 'kv_heads', 'ffn_hidden', "
                               "'experts', 'top_k'"),
        ({"m1": good | {"name": "m2"}}, "models.yaml: m1.name: 'm2' differs from its key 'm1'"),
    ]
    for i, (data, expected) in enumerate(cases):
        sub = tmp_path / str(i)
        sub.mkdir()
        write_yaml(sub, "models.yaml", data)
        monkeypatch.setattr(loading, "_REGISTRY_DIR", sub)
        with pytest.raises(RegistryError) as e:
            model_names()
        assert str(e.value) == expected
    (tmp_path / "bad").mkdir()
    write_yaml(tmp_path / "bad", "hardware.yaml", "h800: {peak: [}\n")
    monkeypatch.setattr(loading, "_REGISTRY_DIR", tmp_path / "bad")
    with pytest.raises(RegistryError, match=r"^hardware\.yaml: invalid YAML: "):
        load_hardware("h800")


def test_direct_construction_validates():
    with pytest.raises(RegistryError) as e:
        ModelConfig(name="x", **(MINIMAL_MODEL | {"heads": 32, "kv_heads": 5}))
    assert str(e.value) == "heads=32 is not divisible by kv_heads=5"
    with pytest.raises(RegistryError) as e:
        dataclasses.replace(load_hardware("h800"), gemm_eff=0)
    assert str(e.value) == "gemm_eff: expected a number in (0, 1], got 0" and e.value.field == "gemm_eff"
    with pytest.raises(ValueError, match="unknown curve 'gemm'"):
        load_hardware("h800").curve("gemm")


FLOAT_FIELDS = [f.name for f in dataclasses.fields(Hardware) if f.type == "float"]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_every_number_field_rejects_non_finite_values(value):
    """Direct construction runs every float field's check: NaN and inf are refused by name."""
    hw = load_hardware("h800")
    assert len(FLOAT_FIELDS) >= 15
    for name in FLOAT_FIELDS:
        with pytest.raises(RegistryError) as e:
            dataclasses.replace(hw, **{name: value})
        assert e.value.field == name and str(e.value).startswith(f"{name}: ") and "not a finite number" in str(e.value)
    for name in ("rope_theta", "rms_eps"):
        with pytest.raises(RegistryError) as e:
            ModelConfig(name="x", **(MINIMAL_MODEL | {name: value}))
        assert e.value.field == name


def test_non_finite_yaml_values_name_file_field_and_value(tmp_path):
    h = load_hardware("h800").to_dict()
    assert user_error(tmp_path, yaml.safe_dump(h | {"nic_bw_bytes_s": 1.0}).replace(
        "nic_bw_bytes_s: 1.0", "nic_bw_bytes_s: .inf"), load_hardware) == \
        "my.yaml: nic_bw_bytes_s: expected a positive number, got inf (not a finite number)"
    assert user_error(tmp_path, yaml.safe_dump(h | {"ring_eff_inter": 0.5}).replace("ring_eff_inter: 0.5",
                      "ring_eff_inter: .nan"), load_hardware) == \
        "my.yaml: ring_eff_inter: expected a number in (0, 1], got nan (not a finite number)"
    text = yaml.safe_dump(MINIMAL_MODEL)
    assert user_error(tmp_path, text + "rope_theta: .nan\n") == \
        "my.yaml: rope_theta: expected a positive number, got nan (not a finite number)"
    assert user_error(tmp_path, text + "rms_eps: .nan\n") == \
        "my.yaml: rms_eps: expected a positive number, got nan (not a finite number)"


def test_model_sizes_are_bounded(tmp_path):
    m = MINIMAL_MODEL
    assert user_error(tmp_path, m | {"hidden": 10**12}) == \
        "my.yaml: hidden: expected a positive int <= 1,048,576, got 1000000000000"
    assert user_error(tmp_path, m | {"experts": 2**17}) == \
        "my.yaml: experts: expected a positive int <= 65,536, got 131072"
    # every size within its own bound, but one layer's parameters beyond 2**44 bytes (16 TiB)
    big = m | {"hidden": 2**20, "heads": 2**10, "kv_heads": 2**10, "ffn_hidden": 2**20, "experts": 64}
    msg = user_error(tmp_path, big)
    assert msg.startswith("my.yaml: one layer's parameters take ") and "over the 17,592,186,044,416 bytes" in msg
    # the largest registry model is far inside the bound
    assert max(load_model(n).layer_param_bytes for n in model_names()) < 2**44 // 250   # kimi-k2: 68 GB


def test_h800_megascale_is_h800_with_the_fitted_step_factor():
    """h800-megascale (hardware.yaml: `<<: *h800`) is h800's operator pricing with one compute
    in-step factor fitted to MegaScale-MoE Table 3; the merge key inherits every other field."""
    a, b = load_hardware("h800"), load_hardware("h800-megascale")
    differ = {f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)}
    assert differ == {"name", "description", "sources", "in_step_factors"}
    assert dict(b.in_step_factors) == {c: 2.03 for c in ("gemm", "grouped_gemm", "attention", "memory")}
    assert a.in_step_factors == () and "Table 3" in dict(b.sources)["in_step_factors"]
    assert dict(a.sources)["gemm_eff"] == dict(b.sources)["gemm_eff"]
