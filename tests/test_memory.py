"""Whole-step memory (moegraph.memory) against closed forms and the eager module's parameters."""

from __future__ import annotations

import pytest
import torch

from moegraph.passes.edges import add_edges
from moegraph.ir import Strategy
from moegraph.passes.stack import stack_layers
from moegraph.memory import (ADAM, ADAM_DISTRIBUTED, edge_activation_bytes, layer_params, one_f_one_b_in_flight,
                             pipeline_memory, rank_memory, stack_activation_bytes, stage_memory)
from moegraph.models import MoETransformer
from moegraph.registry import load_model
from moegraph.tracer import trace_model

SMALL = load_model("small")        # h 512, 8 heads, 4 kv heads, f 1024, 8 experts, top-2, 4 layers


def eager_numel(layers: int, vocab: int) -> int:
    """Elements of the eager causal LM (the independent reference)."""
    with torch.device("meta"):
        model = MoETransformer.from_config(SMALL, layers=layers, vocab=vocab)
    return sum(p.numel() for p in model.parameters())


def test_layer_params_at_n1_equal_the_eager_layer():
    g = trace_model(SMALL, Strategy("sp", "ep", "ag-rs", 1), batch=1, seq=16)
    count = layer_params(g)
    with torch.device("meta"):
        model = MoETransformer.from_config(SMALL, layers=1, vocab=10)
    assert count.trained == sum(p.numel() for p in model.layers[0].parameters())
    assert count.buffers == 0 and count.dtype_bytes == 2


def test_layer_params_at_n2_shard_experts_and_replicate_sp_attention():
    h, H, G, d, f, E = 512, 8, 4, 64, 1024, 8
    attention = h * (H + 2 * G) * d + H * d * h + 2 * h        # qkv, o, two norms: replicated under sp
    g = trace_model(SMALL, Strategy("sp", "ep", "ag-rs", 2), batch=1, seq=16)
    assert layer_params(g).trained == attention + E * h + 3 * E * f * h // 2
    tp = trace_model(SMALL, Strategy("tp", "tp", "ag-rs", 2), batch=1, seq=16)
    assert layer_params(tp).trained == attention // 2 + h + E * h + 3 * E * f * h // 2   # norms stay whole


@pytest.mark.parametrize("dp", [1, 4])
def test_whole_model_states_match_megatron_closed_form(dp):
    """P=1, n=1: params + grads + optimizer = (2 + 4 + 12/dp) bytes per eager parameter
    (Megatron-Core's distributed-optimizer table), the non-distributed optimizer 18."""
    L, V = 3, 100
    g = trace_model(SMALL, Strategy("sp", "ep", "ag-rs", 1), batch=1, seq=16)
    mem, = pipeline_memory([[g] * L], vocab=V, tied=False, dp=dp, in_flight=[1], head_activation_bytes=0)
    numel = eager_numel(L, V)
    assert mem.params == 2 * numel and mem.grads == 4 * numel
    assert mem.optimizer == -(-12 * numel // dp)
    assert mem.comm_buffers == 0
    plain = stage_memory(0, layer_params(g), dp=dp, activation_bytes_per_mb=0, in_flight=1, boundary=0,
                         neighbours=0, optimizer=ADAM)
    assert plain.params + plain.grads + plain.optimizer == 18 * layer_params(g).trained


def test_stages_split_the_model_and_pay_boundary_buffers():
    L, V, P = 4, 100, 2
    g = trace_model(SMALL, Strategy("sp", "ep", "ag-rs", 1), batch=1, seq=16)
    stages = pipeline_memory([[g] * 2, [g] * 2], vocab=V, tied=False, dp=1, in_flight=[2, 1],
                             head_activation_bytes=0)
    assert sum(s.params for s in stages) == 2 * eager_numel(L, V)
    boundary = 1 * 16 * 512 * 2                               # [b, s, h] bf16
    assert [s.comm_buffers for s in stages] == [2 * boundary, 2 * boundary]
    two = stack_layers(g, 2).activation_bytes()
    assert [s.activations for s in stages] == [2 * two, 1 * two]
    rank = rank_memory(stages, peak_activations=123)
    assert rank["total"] == sum(s.states for s in stages) + 123


def test_one_f_one_b_in_flight():
    assert one_f_one_b_in_flight(4, 8) == (4, 3, 2, 1)
    assert one_f_one_b_in_flight(4, 2) == (2, 2, 2, 1)


def test_head_activations_are_normed_logits_and_last_output():
    b, s, h, V = 1, 16, 512, 100
    g = add_edges(stack_layers(trace_model(SMALL, Strategy("sp", "ep", "ag-rs", 1), batch=b, seq=s), 2), vocab=V)
    assert "l1.hidden_next" in g.saved          # the last layer's output: the layers count it already
    assert edge_activation_bytes(g) == 2 * (b * s * h + b * s * V)


def test_a_chain_of_layers_counts_each_boundary_once():
    g = trace_model(SMALL, Strategy("sp", "ep", "ag-rs", 1), batch=1, seq=16)
    assert stack_activation_bytes([g] * 3) == stack_layers(g, 3).activation_bytes()


def test_bad_inputs_raise_naming_the_value():
    g = trace_model(SMALL, Strategy("sp", "ep", "ag-rs", 1), batch=1, seq=16)
    with pytest.raises(ValueError, match="dp=0"):
        stage_memory(0, layer_params(g), dp=0, activation_bytes_per_mb=0, in_flight=1, boundary=0, neighbours=0)
    with pytest.raises(ValueError, match="neighbours=3"):
        stage_memory(0, layer_params(g), dp=1, activation_bytes_per_mb=0, in_flight=1, boundary=0, neighbours=3)
    with pytest.raises(ValueError, match="2 stages but 1 in-flight"):
        pipeline_memory([[g], [g]], vocab=None, tied=False, dp=1, in_flight=[1], head_activation_bytes=0)
    assert ADAM_DISTRIBUTED.distributed and not ADAM.distributed


def test_trace_json_reports_the_step_memory_without_solving(capsys):
    import json

    from moegraph.cli import main
    from moegraph.models import VOCAB
    assert main(["trace", "--model", "small", "--n", "1", "--seq", "16", "--layers", "2", "--passes", "none",
                 "--dp", "2", "--json"]) == 0
    mem = json.loads(capsys.readouterr().out)["step_memory"]
    numel = eager_numel(2, VOCAB)
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (2 * numel, 4 * numel, 12 * numel // 2)
    assert mem["total"] == sum(mem[k] for k in ("params", "grads", "optimizer", "activations", "comm_buffers"))
