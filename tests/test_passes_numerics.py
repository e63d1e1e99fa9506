"""Every pass and pipeline computes the same function: outputs and all gradients of the rewritten
graph match the unrewritten graph and the eager module (fp32, reference interpreter).

Parametrized over n in {1, 2, 4}, the six valid attn x ffn x dispatch combinations and chunk
counts 1, 2, 4; fresh random inputs and weights per test. Compression changes the numbers on
purpose and is checked against its explicit rounding bound instead (passes/compress.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import eager_step, max_grad_err, rel_err, small_layer
from moegraph.cost import CostModel
from moegraph.interpreter import interpret
from moegraph.ir import OpKind, Phase, Strategy
from moegraph.registry import load_hardware
from moegraph.tracer import trace_module
from moegraph.passes import run_pipeline
from moegraph.passes.sar import plan, unit_of

COMBOS = [("tp", "ep", "a2a"), ("tp", "ep", "ag-rs"), ("tp", "tp", "ag-rs"),
          ("sp", "ep", "a2a"), ("sp", "ep", "ag-rs"), ("sp", "tp", "ag-rs")]
TOL = 1e-5
B, S, H = 2, 16, 64
COST = CostModel(load_hardware("h800"))


pytestmark = pytest.mark.usefixtures("one_thread")      # conftest: tiny tensors, one torch thread


def setup(n, attn, ffn, dispatch, rng, dp=1):
    layer = small_layer(n, seed=int(torch.randint(0, 2**31, (1,), generator=rng)))
    x, dy = torch.randn(B, S, H, generator=rng), torch.randn(B, S, H, generator=rng)
    graph = trace_module(layer, Strategy(attn, ffn, dispatch, n, dtype="fp32", dp=dp), batch=B, seq=S)
    params = {k: p.detach() for k, p in layer.named_parameters()}
    return layer, graph, params, x, dy


def assert_same(res, ref, what):
    assert rel_err(res.output, ref[0]) < TOL, f"{what}: output"
    assert rel_err(res.input_grad, ref[1]) < TOL, f"{what}: input gradient"
    name, err = max_grad_err(res.param_grads, ref[2])
    assert err < TOL, f"{what}: gradient of {name}: relative error {err:.2e}"


def mid_budget(graph) -> int:
    """Half-way between rebuilding everything and holding everything that backward reads."""
    least = plan(graph, frozenset(), None).graph.activation_bytes()
    most = plan(graph, frozenset(unit_of(v) for v in graph.saved), None).graph.activation_bytes()
    return (least + most) // 2


@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("attn,ffn,dispatch", COMBOS)
@pytest.mark.slow
def test_pipelines_preserve_outputs_and_gradients(n, attn, ffn, dispatch, chunks, rng):
    layer, graph, params, x, dy = setup(n, attn, ffn, dispatch, rng)
    eager = eager_step(layer, x, dy)
    base = interpret(graph, params, x, dy)
    assert_same(base, eager, "unrewritten graph vs eager")
    unrewritten = (base.output, base.input_grad, base.param_grads)
    for spec in (f"chunk={chunks},gate-reorder,sar=paper",
                 f"chunk={chunks},gate-reorder=after-fc2,sar=budget:{mid_budget(graph)}"):
        out, _ = run_pipeline(graph, spec, cost=COST)
        assert out.strategy.chunks == chunks and out.nodes_in(Phase.RECOMPUTE)
        res = interpret(out, params, x, dy)
        assert_same(res, unrewritten, f"{spec} vs unrewritten")
        assert_same(res, eager, f"{spec} vs eager")


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("attn,ffn,dispatch", COMBOS)
@pytest.mark.slow
def test_auto_passes_and_full_recompute_preserve_the_function(n, attn, ffn, dispatch, rng):
    """dispatch=auto and chunk=auto (whatever they pick), and the smallest budget: every activation
    but the layer input rebuilt, attention and expert GEMMs included."""
    layer, graph, params, x, dy = setup(n, attn, ffn, dispatch, rng)
    eager = eager_step(layer, x, dy)
    least = plan(graph, frozenset(), None).graph.activation_bytes()
    for spec in ("dispatch=auto,chunk=auto,gate-reorder,sar=paper", f"sar=budget:{least}"):
        out, _ = run_pipeline(graph, spec, cost=COST)
        assert_same(interpret(out, params, x, dy), eager, spec)
    assert out.activation_bytes() == least


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("attn,ffn,dispatch", [("sp", "ep", "a2a"), ("tp", "ep", "ag-rs")])
@pytest.mark.slow
def test_data_parallel_sync_is_exact_for_identical_replicas(n, attn, ffn, dispatch, rng):
    layer, graph, params, x, dy = setup(n, attn, ffn, dispatch, rng, dp=2)
    assert any(nd.attr("axis", None) == "dp" for nd in graph.nodes)
    out, _ = run_pipeline(graph, "chunk=2,gate-reorder,sar=paper", cost=COST)
    assert_same(interpret(out, params, x, dy), eager_step(layer, x, dy), "dp=2")


@pytest.mark.parametrize("attn,ffn,dispatch", [("sp", "ep", "a2a"), ("tp", "tp", "ag-rs")])
def test_hugging_face_mixtral_survives_the_pipeline(attn, ffn, dispatch, rng):
    """The passes work on the IR, not on a model family: HF's fused gate_up lowers the same way."""
    pytest.importorskip("transformers")
    from test_hf_mixtral import hf_call, hf_layer
    cfg, layer = hf_layer(seed=int(torch.randint(0, 2**31, (1,), generator=rng)))
    x, dy = torch.randn(B, S, H, generator=rng), torch.randn(B, S, H, generator=rng)
    graph = trace_module(layer, Strategy(attn, ffn, dispatch, 2, dtype="fp32", dp=2), batch=B, seq=S)
    out, _ = run_pipeline(graph, "chunk=2,gate-reorder,sar=paper", cost=COST)
    res = interpret(out, {k: p.detach() for k, p in layer.named_parameters()}, x, dy)
    assert_same(res, eager_step(layer, x, dy, call=hf_call(cfg)), "hf mixtral")


def test_a_broken_rewrite_is_caught(rng):
    """The equivalence check can fail: a recompute node fed its operands swapped is detected."""
    layer, graph, params, x, dy = setup(2, "sp", "ep", "ag-rs", rng)
    out, _ = run_pipeline(graph, "sar=paper", cost=COST)
    bad = dataclasses.replace(out.node["swiglu.re"], inputs=("fc3_out", "fc1_out"))
    broken = dataclasses.replace(out, nodes=tuple(bad if nd.name == bad.name else nd for nd in out.nodes))
    _, _, grads = eager_step(layer, x, dy)
    assert max_grad_err(interpret(broken, params, x, dy).param_grads, grads)[1] > TOL


# -- compression: an explicit bound per compressed collective ---------------------------------

def _groups(node, n, d):
    if node.attr("axis", "mp") == "dp":
        return [list(range(r, n * d, n)) for r in range(n)]
    return [list(range(p * n, (p + 1) * n)) for p in range(d)]


def check_compressed_collectives(graph, res, n, d, unit_roundoff, subnormal):
    """For each compressed all-to-all: |out - exact| <= u * sum_r |x_r| + floor, element-wise, where
    x_r are the exact (pre-cast) inputs on the group's ranks and exact is their sum (or mean)."""
    checked = set()
    for a2a in (nd for nd in graph.nodes if nd.op is OpKind.ALL_TO_ALL and nd.attr("compressed", None)):
        first = next(nd for nd in graph.nodes if nd.name in (f"{a2a.name}.cast", f"{a2a.name}.quant"))
        last = graph.node[f"{a2a.name}.sum"]
        x_name, y_name = first.inputs[0], last.outputs[0]
        flat, dim = a2a.attr("flat", False), a2a.attr("split_dim")
        mean = last.attr("reduce") == "mean"
        for group in _groups(a2a, n, d):
            xs = torch.stack([res.envs[i][x_name].reshape(-1) if flat else res.envs[i][x_name] for i in group])
            exact = xs.mean(0) if mean else xs.sum(0)
            mag = xs.abs().sum(0) / (len(group) if mean else 1)
            floor = 0.0
            if subnormal:
                scales = torch.stack([res.envs[i][f"{x_name}.scale"] for i in group])   # [g, b, S]
                floor = subnormal * scales.sum(0)[..., None]
            bound = unit_roundoff * mag + floor + 1e-6 * mag
            for j, i in enumerate(group):
                err = (res.envs[i][y_name].reshape(-1) if flat else res.envs[i][y_name]) - exact.chunk(len(group), dim)[j]
                ok = err.abs() <= bound.chunk(len(group), dim)[j]
                assert bool(ok.all()), f"{a2a.name} on rank {i}: error above the bound"
            checked.add(a2a.name)
    return len(checked)


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("attn,ffn,dispatch", [("sp", "ep", "a2a"), ("tp", "ep", "ag-rs"), ("sp", "tp", "ag-rs")])
@pytest.mark.slow
def test_dp_bf16_compression_error_is_within_bf16_rounding(n, attn, ffn, dispatch, rng):
    layer, graph, params, x, dy = setup(n, attn, ffn, dispatch, rng, dp=2)
    out, report = run_pipeline(graph, "chunk=2,compress=dp-bf16,sar=paper", cost=COST)
    res = interpret(out, params, x, dy)
    assert check_compressed_collectives(out, res, n, 2, 2.0**-8, 0.0) == len(report["compress"]["compressed"]) > 0
    y, dx, grads = eager_step(layer, x, dy)
    assert rel_err(res.output, y) < TOL and rel_err(res.input_grad, dx) < TOL   # only gradients travel compressed
    name, err = max_grad_err(res.param_grads, grads)
    assert err < 2.0**-7, f"{name}: {err:.2e}"


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("attn,ffn", [("tp", "ep"), ("tp", "tp"), ("sp", "ep")])
@pytest.mark.slow
def test_tp_fp8_compression_error_is_within_fp8_rounding(n, attn, ffn, rng):
    layer, graph, params, x, dy = setup(n, attn, ffn, "ag-rs", rng)
    out, report = run_pipeline(graph, "chunk=2,compress=tp-fp8", cost=COST)
    res = interpret(out, params, x, dy)
    expected = len(report["compress"]["compressed"])
    assert expected == (4 if attn == "tp" else 2)               # per chunk: attention RS (tp) and the combine RS
    # E4M3: 4 significant bits -> u = 2^-4; subnormal spacing 2^-9 -> floor 2^-10 * scale per source
    assert check_compressed_collectives(out, res, n, 1, 2.0**-4, 2.0**-10) == expected
    y, _, _ = eager_step(layer, x, dy)
    assert TOL < rel_err(res.output, y) < 2.0**-4                # it does round, within the format's precision


@pytest.mark.parametrize("n", [2, 4])
def test_ep_fp8_dispatch_error_is_within_fp8_rounding(n, rng):
    """Each compressed exchange (the forward dispatch, and in backward the combine's gradient) against
    the same rows sent exactly by the same maps (``run_collective`` of a plain token all-to-all):
    every rank's dequantized rows within 2^-4 |exact| + 2^-10 * the row's scale, element-wise (E4M3:
    3 mantissa bits, subnormal spacing 2^-9); tight enough that bf16's u (2^-8) fails it somewhere,
    so the rows really travel in FP8; the layer's output stays within 2^-4 of eager."""
    import dataclasses

    from moegraph.interpreter import run_collective
    layer, graph, params, x, dy = setup(n, "sp", "ep", "a2a", rng)
    out, report = run_pipeline(graph, "chunk=2,compress=ep-fp8", cost=COST)
    names = ["combine_a2a.c0.bwd", "combine_a2a.c1.bwd", "dispatch_a2a.c0", "dispatch_a2a.c1"]
    assert report["compress"]["compressed"] == names
    res = interpret(out, params, x, dy)
    worst = {(name, u): 0.0 for name in names for u in ("fp8", "bf16")}
    for name in names:
        a2a = out.node[name]
        sent, got = out.node[f"{name}.quant"].inputs[0], out.node[f"{name}.dequant"].outputs[0]
        plain = dataclasses.replace(a2a, inputs=(sent, *a2a.inputs[2:]), outputs=(got, *a2a.outputs[2:]))
        exact = run_collective(plain.with_attrs(payloads=1), [[env[v] for v in plain.inputs] for env in res.envs])
        for env, rank_exact in zip(res.envs, exact):
            want, have = rank_exact[0], env[got]                                        # [R, h] each
            floor = 2.0**-10 * env[a2a.outputs[1]][:, None]                             # the rows' scales
            err = (have - want).abs()
            worst[name, "fp8"] = max(worst[name, "fp8"], float((err / (2.0**-4 * want.abs() + floor + 1e-12)).max()))
            worst[name, "bf16"] = max(worst[name, "bf16"], float((err / (2.0**-8 * want.abs() + 1e-12)).max()))
    for name in names:
        assert worst[name, "fp8"] <= 1.0 < worst[name, "bf16"], (name, worst)
    y, _, _ = eager_step(layer, x, dy)
    assert TOL < rel_err(res.output, y) < 2.0**-4


def test_the_compression_bound_can_fail(rng):
    """The per-collective bound is tight enough to notice fp8 rounding if bf16's u is claimed."""
    layer, graph, params, x, dy = setup(2, "tp", "ep", "ag-rs", rng)
    out, _ = run_pipeline(graph, "compress=tp-fp8", cost=COST)
    res = interpret(out, params, x, dy)
    with pytest.raises(AssertionError, match="error above the bound"):
        check_compressed_collectives(out, res, 2, 1, 2.0**-12, 0.0)
