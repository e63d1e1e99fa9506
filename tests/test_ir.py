"""verify() rejects malformed graphs and names the bad node."""

import dataclasses
import re

import pytest

from moegraph.ir import GraphError, Node, OpKind, Phase, Strategy, freeze_attrs, verify
from moegraph.registry import load_model
from moegraph.tracer import trace_model


@pytest.fixture(scope="module")
def graph():
    return trace_model(load_model("tiny"), Strategy("sp", "ep", "ag-rs", 2), batch=1, seq=32)


def replace_node(graph, name, **changes):
    nodes = tuple(dataclasses.replace(n, **changes) if n.name == name else n for n in graph.nodes)
    return dataclasses.replace(graph, nodes=nodes)


def test_traced_graph_verifies(graph):
    assert verify(graph) is graph


def test_unknown_input_is_named(graph):
    bad = replace_node(graph, "qkv_proj", inputs=("ln1_out", "no_such_weight"))
    with pytest.raises(GraphError, match=r"node 'qkv_proj' \(gemm, forward\) reads unknown value 'no_such_weight'"):
        verify(bad)


def test_use_before_definition_is_named(graph):
    nodes = list(graph.nodes)
    i = next(i for i, n in enumerate(nodes) if n.name == "qkv_proj")
    nodes[i - 1], nodes[i] = nodes[i], nodes[i - 1]
    with pytest.raises(GraphError, match=r"node 'qkv_proj' .* reads 'ln1_out' before it is produced"):
        verify(dataclasses.replace(graph, nodes=tuple(nodes)))


def test_collective_without_group_is_named(graph):
    with pytest.raises(GraphError, match=r"node 'ln2_ag' \(all_gather, forward\) is a collective without a group"):
        verify(replace_node(graph, "ln2_ag", group=0))


def test_compute_with_comm_bytes_is_named(graph):
    with pytest.raises(GraphError, match=r"node 'fc1' .* is compute but has group=0, comm_bytes=5"):
        verify(replace_node(graph, "fc1", comm_bytes=5))


def test_forward_node_reading_a_gradient_is_named(graph):
    bad = replace_node(graph, "swiglu", inputs=("fc1_out", "d_fc2_in"))
    with pytest.raises(GraphError, match=r"node 'swiglu' .* is a forward node but reads gradient 'd_fc2_in'"):
        verify(bad)


def test_duplicate_node_is_named(graph):
    extra = Node("fc1", OpKind.ADD, Phase.FORWARD, ("hidden", "hidden"), ("ffn_out",))
    with pytest.raises(GraphError, match=r"node 'fc1' is declared twice"):
        verify(dataclasses.replace(graph, nodes=graph.nodes + (extra,)))


@pytest.mark.parametrize("name, key, bad, valid", [
    ("qkv_split", "mode", None, "'split', 'concat'"),
    ("qkv_split.dgrad", "mode", "concatenate", "'split', 'concat'"),
    ("dispatch_scatter", "index", None, "'token', 'slot'"),
    ("dispatch_scatter.dgrad", "index", "row", "'token', 'slot'"),
    ("router", "scoring", None, "'softmax', 'sigmoid'"),
    ("router.wgrad", "scoring", "tanh", "'softmax', 'sigmoid'"),
])
def test_an_attribute_that_picks_the_kernel_is_present_and_valid(graph, name, key, bad, valid):
    """SPLIT's mode, PERMUTE's index and ROUTER's scoring decide what the kernel computes: a node
    without one, or with an unknown value, is refused by name (no kernel default is run)."""
    node = graph.node[name]
    attrs = {k: v for k, v in node.attrs if k != key} | ({} if bad is None else {key: bad})
    with pytest.raises(GraphError, match=rf"node '{re.escape(name)}' \({node.op.value}/{node.role.value}\): "
                                         rf"{key}={bad!r} is not one of {valid}"):
        verify(replace_node(graph, name, attrs=freeze_attrs(attrs)))


@pytest.mark.parametrize("name, change, message", [
    ("input_norm", {"eps": None}, r"eps=None is not a number"),                        # missing
    ("input_norm", {"eps": "1e-5"}, r"eps='1e-5' is not a number"),
    ("rope", {"theta": None}, r"theta=None is not a number"),
    ("qkv_split", {"sizes": (64, "32", 32)}, r"sizes=\(64, '32', 32\) is not a tuple of ints"),
    ("router", {"top_k": 2.0}, r"top_k=2.0 is not an int"),
    ("index_map", {"layout": "global"}, r"layout='global' is not one of 'local', 'all', 'by_dest'"),
    ("combine_gather", {"weighted": 1}, r"weighted=1 is not a bool"),
    ("ln2_ag", {"dim": None}, r"dim=None is not an int"),
    ("qkv_a2a", {"mode": "rows"}, r"mode='rows' is not one of 'heads', 'tokens', 'shards'"),
    ("fc1", {"stream_byte": 8}, r"unknown attribute 'stream_byte'; grouped_gemm nodes take accumulate, "),
    ("router", {"scoring": "sigmoid"}, r"scoring='sigmoid' needs groups, topk_groups and scale"),
])
def test_node_attributes_fit_their_ops_record(graph, name, change, message):
    """Every node's attributes are read through its op's typed record (moegraph.node_attrs): a
    missing required one, a wrong-typed one, an unknown key (a typo would otherwise be ignored and
    the reader's default run) or an inconsistent set is refused by verify, naming the node."""
    node = graph.node[name]
    attrs = {k: v for k, v in node.attrs if change.get(k, 0) is not None} | {k: v for k, v in change.items()
                                                                               if v is not None}
    with pytest.raises(GraphError, match=rf"^node '{name}' \({node.op.value}/{node.role.value}\): {message}"):
        verify(replace_node(graph, name, attrs=freeze_attrs(attrs)))


def test_eager_nodes_need_no_op_attributes(graph):
    """A node run by its own callable (attr eager, the model's edges) reads none of its op's
    attributes: verify does not ask for them, and the typed record holds None."""
    bad = replace_node(graph, "input_norm", attrs=freeze_attrs({"eager": True, "edge": True}))
    assert verify(bad).node["input_norm"].typed.eps is None


def test_an_all_reduce_that_would_average_is_refused(graph):
    """Reduce-scatters may average (reduce="mean"); no backend averages an all-reduce, so one asking
    for it is refused by name rather than summed."""
    node = graph.node["router.weight.grad_allreduce"]
    with pytest.raises(GraphError, match=r"node 'router.weight.grad_allreduce' \(all_reduce, backward\) has "
                                         r"reduce='mean': an all-reduce only sums"):
        verify(replace_node(graph, node.name, attrs=freeze_attrs(dict(node.attrs) | {"reduce": "mean"})))
    assert verify(replace_node(graph, node.name, attrs=freeze_attrs(dict(node.attrs) | {"reduce": "sum"})))


def test_a_gradient_reaching_a_routing_input_is_refused():
    """Only parameters and activation inputs get gradient outputs: a differentiable op reading a
    routing graph input (here GATE's row weights) would have its gradient dropped, so lowering
    refuses it by name."""
    from moegraph.autodiff import add_backward
    from moegraph.builder import GraphBuilder
    from moegraph.ir import Dims, ValueKind
    g = GraphBuilder("gate_only", Dims(b=1, s=4, h=8, n=1, k=1, heads=1, kv_heads=1, head_dim=8, ffn=8, experts=1),
                     Strategy("sp", "ep", "ag-rs", 1))
    rows = g.input("rows", (4, 8))
    weights = g.input("row_weights", (4,), kind=ValueKind.ROUTING)
    out = g.like("gated", rows)
    g.node("gate", OpKind.GATE, (rows, weights), (out,))
    with pytest.raises(NotImplementedError, match=r"graph input 'row_weights' \(routing\) receives a gradient "
                                                  r"from 'd_row_weights': only parameters and activation inputs"):
        add_backward(g, out)


def test_backward_is_explicit_with_separate_weight_gradients(graph):
    by_name = graph.node
    assert by_name["fc1.dgrad"].phase is Phase.BACKWARD and by_name["fc1.wgrad"].role.value == "wgrad"
    assert "fc1_out" in graph.saved and "hidden" in graph.saved
    # every parameter has a gradient output, replicated ones synchronised by an all-reduce
    assert set(graph.grad_of) == {p for p, _ in graph.params}
    assert by_name["router.weight.grad_allreduce"].op is OpKind.ALL_REDUCE


# --- bytes on the wire: one exact rule (ir.collective_bytes), applied by GraphBuilder.collective ---

def test_every_collective_sends_exactly_n_minus_1_shards(graph):
    """Each forward collective's comm_bytes is (n-1)/n of the tensor the rule names, with no rounding:
    all-gather -> its output, reduce-scatter and all-to-all -> their (first) input."""
    comm = [n for n in graph.nodes if n.is_comm and n.phase is Phase.FORWARD]
    assert {n.op for n in comm} >= {OpKind.ALL_TO_ALL} and comm
    for node in comm:
        full = graph.value[node.outputs[0] if node.op is OpKind.ALL_GATHER else node.inputs[0]].nbytes
        if node.name.startswith("qkv_a2a"):       # q, k and v travel together
            full = sum(graph.value[v].nbytes for v in node.inputs)
        if node.name.startswith("routing_ag"):    # ag-rs: the top-k weights and ids travel together
            full = sum(graph.value[v].nbytes for v in node.outputs)
        assert node.comm_bytes * node.group == full * (node.group - 1), node.name


def test_a_tensor_that_does_not_split_evenly_is_a_config_error_not_rounded(tmp_path):
    """hidden=100 (explicit head_dim) and n=3: one token row is 200 bytes, which 3 ranks cannot
    share exactly; the old rule silently sent 133 bytes."""
    from moegraph.builder import ConfigError
    path = tmp_path / "odd.yaml"
    path.write_text("layers: 1\nhidden: 100\nheads: 3\nkv_heads: 3\nhead_dim: 32\nffn_hidden: 64\n"
                    "experts: 3\ntop_k: 1\n")
    with pytest.raises(ConfigError) as e:
        trace_model(load_model(str(path)), Strategy("sp", "ep", "a2a", 3), batch=1, seq=3)
    assert str(e.value) == ("collective 'dispatch_a2a' (all_to_all): 200 bytes do not split into 3 equal shards "
                            "(full_tensor_bytes=200 is not divisible by n=3)")


# --- the one graph digest (tune cache key, execution-plan hash) -----------------------------------

def test_graph_digest_tracks_computation_and_cost_but_not_meta(graph):
    from moegraph.ir import graph_digest
    again = trace_model(load_model("tiny"), Strategy("sp", "ep", "ag-rs", 2), batch=1, seq=32)
    assert graph_digest(again) == graph_digest(graph) and again is not graph
    first = graph.nodes[0]
    changed = [replace_node(graph, first.name, flops=first.flops + 1),                  # cost: tune must re-solve
               replace_node(graph, first.name, attrs=first.with_attrs(extra=1).attrs),
               dataclasses.replace(graph, saved=graph.saved - {sorted(graph.saved)[0]}),
               dataclasses.replace(graph, strategy=dataclasses.replace(graph.strategy, chunks=2))]
    assert len({graph_digest(g) for g in changed} | {graph_digest(graph)}) == len(changed) + 1
    assert graph_digest(graph.with_meta(note="bookkeeping")) == graph_digest(graph)


@pytest.mark.slow
def test_graph_digest_is_the_same_in_another_process(graph):
    """Ranks and cache readers are other processes: no hash-seed-dependent order may leak in."""
    import subprocess
    import sys
    from moegraph.ir import graph_digest
    code = ("from moegraph.ir import Strategy, graph_digest; from moegraph.registry import load_model; "
            "from moegraph.tracer import trace_model; "
            "print(graph_digest(trace_model(load_model('tiny'), Strategy('sp', 'ep', 'ag-rs', 2), batch=1, seq=32)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}).stdout.strip()
    assert out == graph_digest(graph)


# --- the typed strategy ------------------------------------------------------------------------

def test_strategy_names_every_offending_field_at_once():
    from moegraph.ir import ConfigError
    with pytest.raises(ConfigError) as e:
        Strategy("xx", "tp", "a2a", 0, dtype="fp8", chunks=True, gate="middle", dp=-1, remat="budget")
    assert str(e.value) == (
        "attn='xx' is not one of 'tp', 'sp'; dtype='fp8' is not one of 'bf16', 'fp32'; "
        "gate='middle' is not one of 'after-fc2', 'before-fc2'; n=0 must be a positive integer; "
        "chunks=True must be a positive integer; dp=-1 must be a positive integer; dispatch='a2a' needs "
        "ffn='ep' (tensor-parallel experts see every token: use dispatch='ag-rs'); remat='budget' needs "
        "remat_budget, a byte count >= 0 (got None)")
    with pytest.raises(ConfigError, match=r"^remat_budget=5 is only valid with remat='budget' \(remat='paper'\)$"):
        Strategy("sp", "ep", "a2a", 2, remat="paper", remat_budget=5)
    with pytest.raises(ConfigError, match=r"^ffn='dp' is not one of 'tp', 'ep'$"):
        dataclasses.replace(Strategy("sp", "ep", "a2a", 2), ffn="dp")
    with pytest.raises(ConfigError, match=r"^dispatch='foo' is not one of 'a2a', 'ag-rs'$"):   # no second, false reason
        Strategy("sp", "tp", "foo", 2)


def test_strategy_round_trips_through_its_dict():
    s = Strategy("sp", "ep", "a2a", 2, chunks=4, remat="budget", remat_budget=1 << 20, gate="before-fc2",
                 passes=("sar=budget:1MiB",))
    assert Strategy.from_dict(s.as_dict()) == s
    from moegraph.ir import ConfigError
    with pytest.raises(ConfigError, match="^strategy: unknown field 'chunk'; valid: "):
        Strategy.from_dict(s.as_dict() | {"chunk": 2})


def test_an_alias_cycle_is_named(graph):
    # qkv holds q's storage; a qkv that is also a view of q would leave neither holding any:
    # memory accounting would follow the views for ever (or count none)
    values = tuple(dataclasses.replace(v, alias_of="q") if v.name == "qkv" else v for v in graph.values)
    with pytest.raises(GraphError, match=r"value '(q|qkv)' is a view of itself \(an alias cycle\)"):
        verify(dataclasses.replace(graph, values=values))
    assert graph.base_of("q") == "qkv" and graph.base_of("qkv") == "qkv"
