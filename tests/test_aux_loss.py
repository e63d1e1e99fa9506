"""The router's auxiliary load-balancing loss (transformers' output_router_logits=True,
moegraph.edges.AuxLoss): the compiled model's loss and every parameter gradient against the eager
HF module on the global batch, on 2 (n=2) and 4 (n=2 x dp=2) gloo ranks; the graph's extra nodes
and their prices; the refusals. A LARGE coefficient (1.0) makes the term dominate the router
gradients, and two deliberately broken runs (the aux seed zeroed; the stats' all-reduces made
local) must fail the same comparison."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import aux_workers as workers
from helpers import RANK_BATCH
import moegraph
from moegraph.passes.stack import stack_layers
from moegraph.cost import CostModel
from moegraph.edges import AuxLoss, edge_values
from moegraph.passes.edges import add_edges
from moegraph.ir import GraphError, OpKind, Phase, Strategy
from moegraph.registry import load_hardware, load_model
from moegraph.runtime.check import rel_err
from moegraph.tracer import trace_causal_lm, trace_model

HAS_HF = importlib.util.find_spec("transformers") is not None
TOL = 1e-5                                  # as tests/test_model.py and tests/test_dp.py (fp32)
BROKEN = 1e-2                               # a broken run's error is far above this

pytestmark = pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")

CHUNKED = "chunk=2,gate-reorder,sar=paper"
N2 = {
    "sp-ep-agrs": dict(seed=3, coef=1.0, attn="sp", ffn="ep", dispatch="ag-rs", passes="gate-reorder,sar=paper"),
    "sp-ep-a2a-skewed-chunked": dict(seed=4, coef=1.0, attn="sp", ffn="ep", dispatch="a2a", skew=True,
                                     passes=CHUNKED),
    "tp-tp-mixtral-coef": dict(seed=5, coef=0.02, attn="tp", ffn="tp"),
    "mb2-sp-ep-a2a": dict(seed=13, coef=1.0, attn="sp", ffn="ep", dispatch="a2a", micro_batches=2),
    "mb2-tp-tp-skewed-chunked": dict(seed=14, coef=1.0, attn="tp", ffn="tp", micro_batches=2, skew=True,
                                     passes=CHUNKED),
    # GPT-OSS: a trained logit bias, top-k of the logits before the softmax; a small coefficient as its config's
    "gpt-oss-sp-ep-a2a": dict(seed=6, coef=0.05, family="gpt_oss", attn="sp", ffn="ep", dispatch="a2a"),
    "broken-no-allreduce": dict(seed=4, coef=1.0, attn="sp", ffn="ep", dispatch="a2a", **{"break": "no_allreduce"}),
    "broken-zero-seed": dict(seed=3, coef=1.0, attn="sp", ffn="ep", dispatch="ag-rs", **{"break": "zero_seed"}),
}
DP2 = {
    "dp2-sp-ep-a2a": dict(seed=8, coef=1.0, attn="sp", ffn="ep", dispatch="a2a", dp=2),
    "dp2-sp-ep-agrs-skewed": dict(seed=9, coef=1.0, attn="sp", ffn="ep", dispatch="ag-rs", dp=2, skew=True),
}


# Both run in the suite's shared 2- and 4-rank spawns (helpers.RankBatch): starting ranks costs seconds.
if HAS_HF:
    N2_CASES = RANK_BATCH.add(2, "aux.n2", workers.cases, list(N2.values()), timeout_s=600)
    DP2_CASES = RANK_BATCH.add(4, "aux.n2dp2", workers.cases, list(DP2.values()), timeout_s=600)


def _by_case(cases: dict, res: list) -> dict:
    for rank in res[1:]:                    # every rank reports the same full gradients
        assert [r["grads"] for r in rank] == pytest.approx([r["grads"] for r in res[0]], rel=1e-3, abs=1e-9)
    return dict(zip(cases, res[0]))


@pytest.fixture(scope="module")
def n2(rank_results):
    return _by_case(N2, rank_results(2, N2_CASES))


@pytest.fixture(scope="module")
def n2dp2(rank_results):
    return _by_case(DP2, rank_results(4, DP2_CASES))


def _assert_matches(r: dict) -> None:
    # merged steps (aux None): the aux loss is checked inside each micro-batch's loss (coef 1.0)
    assert r["loss"] < TOL and (r["aux"] is None or r["aux"] < TOL), r
    assert r["grads"] < TOL, r


@pytest.mark.parametrize("case", [k for k in N2 if not k.startswith("broken")])
def test_loss_and_every_gradient_match_eager_n2(n2, case):
    _assert_matches(n2[case])
    # every dispatch (ag-rs too: it gathers the routing, not the router's input) routes each
    # rank's own shard: the stats are summed over the replica
    assert n2[case]["edge_nodes"] == ["edges.aux.allreduce", "edges.aux.sum"]
    # 2 layers x chunks x micro-batches routers, all summed
    chunks = 2 if N2[case].get("passes") == CHUNKED else 1
    assert n2[case]["routers"] == 2 * chunks * N2[case].get("micro_batches", 1)


def test_skewed_routing_is_far_from_balanced(n2):
    """The skewed case's aux loss is far above a balanced router's top_k (= 2): the term is not
    a constant near its minimum there."""
    assert n2["sp-ep-a2a-skewed-chunked"]["aux_value"] > 2.3
    assert n2["sp-ep-agrs"]["aux_value"] == pytest.approx(2.0, abs=0.1)


def test_broken_aux_terms_fail_the_comparison(n2):
    """Without the stats' all-reduce (a2a) the loss and the router gradients go wrong (each rank's
    aux loss is then its own rows', N their count: a local estimate, 4e-3 off here, the router
    gradients 1.2); with the aux seed zeroed (its gradient dropped) the router gradients do: the
    comparison can fail."""
    r = n2["broken-no-allreduce"]
    assert r["aux"] > 100 * TOL and r["router_grads"] > BROKEN, r
    r = n2["broken-zero-seed"]
    assert r["loss"] < TOL and r["router_grads"] > BROKEN, r


@pytest.mark.parametrize("case", list(DP2))
def test_loss_and_every_gradient_match_eager_on_the_global_batch_dp2(n2dp2, case):
    _assert_matches(n2dp2[case])
    assert "edges.aux.allreduce_dp" in n2dp2[case]["edge_nodes"]


# -- one rank: families, graph, refusals ----------------------------------------------------------

@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe", "ernie4_5_moe"])
def test_one_rank_zoo_families_match_eager(family):
    """GPT-OSS's router adds a trained bias to its logits: transformers' aux loss softmaxes the biased
    logits, so the aux stats and their gradient (to x, w and the bias) must too (they once dropped the
    bias: aux 2.1637 vs eager 2.1820, and the bias's gradient kernel crashed on the aux inputs).
    Ernie 4.5 picks its experts by the softmax plus a choice bias (moe_statics); transformers' aux loss
    counts the top-k of the softmax alone (the stats once counted the biased choice: 6e-2 off)."""
    _one_rank_step_matches_eager(family)


def _one_rank_step_matches_eager(family: str):
    """One step with the aux loss (coefficient 0.5) at n=1: loss, aux loss and every trainable
    gradient within TOL of the eager module; (compiled, model, ids, labels) for more checks."""
    model = workers.aux_model(family, 11, 2, 0.5)
    ids, labels = workers.data(12, 2)
    compiled = moegraph.compile(model, ids, hardware="cpu-gloo", passes="", schedule="greedy")
    ref = model(ids, labels=labels)
    ref.loss.backward()
    got = compiled(ids, labels=labels)
    got.loss.backward()
    assert rel_err(got.aux_loss.detach(), ref.aux_loss.detach()) < TOL
    assert rel_err(got.loss.detach(), ref.loss.detach()) < TOL
    full = compiled.full_grads()
    errs = {k: rel_err(full[k], p.grad) for k, p in model.named_parameters() if p.requires_grad}
    assert max(errs.values()) < TOL, max(errs, key=errs.get)
    return compiled, model, ids, labels


@pytest.mark.parametrize("family", ["mixtral", "olmoe", "qwen2_moe"])
@pytest.mark.slow
def test_one_rank_families_match_eager(family):
    compiled, model, ids, labels = _one_rank_step_matches_eager(family)
    with torch.no_grad():                   # the no-grad path adds it too
        assert rel_err(compiled(ids, labels=labels).loss, model(ids, labels=labels).loss) < TOL
        # the call-time switch as compiled is accepted (HF's Trainer passes such switches); the other refused
        same = compiled(ids, labels=labels, output_router_logits=True, return_dict=True)
        assert rel_err(same.loss, model(ids, labels=labels, output_router_logits=True).loss) < TOL
        with pytest.raises(AttributeError, match=r"^the compiled model does not return router_logits"):
            same.router_logits
        with pytest.raises(ValueError, match=r"^output_router_logits=False: the model was compiled to run as "
                                             r"output_router_logits=True"):
            compiled(ids, labels=labels, output_router_logits=False)


@pytest.mark.slow
def test_a_zero_coefficient_returns_the_term_for_the_caller_to_weight():
    """transformers computes .aux_loss whenever output_router_logits=True, coefficient 0 too,
    and a caller may add it with a weight of its own: value and gradient as eager."""
    model = workers.aux_model("mixtral", 11, 2, 0.0)
    ids, labels = workers.data(12, 2)
    compiled = moegraph.compile(model, ids, hardware="cpu-gloo", passes="", schedule="greedy")
    ref = model(ids, labels=labels)
    (ref.loss + 0.5 * ref.aux_loss).backward()
    got = compiled(ids, labels=labels)
    (got.loss + 0.5 * got.aux_loss).backward()
    assert rel_err(got.loss.detach(), ref.loss.detach()) < TOL          # the loss holds no aux term
    assert rel_err(got.aux_loss.detach(), ref.aux_loss.detach()) < TOL
    full = compiled.full_grads()
    name = next(k for k in full if k.endswith("mlp.gate.weight"))
    assert rel_err(full[name], dict(model.named_parameters())[name].grad) < TOL


@pytest.mark.parametrize("hardware", ["cpu-gloo", "cpu-2core-gloo"])
@pytest.mark.slow
def test_periodic_unit_is_the_stacks_layer_on_calibrated_profiles(hardware):
    # the default schedule tiles a one-layer unit over the layers; on the calibrated CPU profiles
    # (per-shape curves) a unit priced without the aux loss's router work is not the stack's
    # layer and the tiling raised "the layers are not costed alike"
    model = workers.aux_model("mixtral", 11, 2, 0.5)
    ids, labels = workers.data(12, 2)
    compiled = moegraph.compile(model, ids, hardware=hardware, passes="", time_limit_s=0.5)
    ref = model(ids, labels=labels)
    got = compiled(ids, labels=labels)
    assert rel_err(got.loss.detach(), ref.loss.detach()) < TOL
    assert rel_err(got.aux_loss.detach(), ref.aux_loss.detach()) < TOL


def _spec(model):
    return trace_causal_lm(model, Strategy("sp", "ep", "a2a", 1), batch=1, seq=16)[1]


@pytest.mark.slow
def test_lowering_reads_the_coefficient_and_ignores_what_does_not_add_it():
    assert _spec(workers.aux_model("mixtral", 0, 2, 0.02)).aux_loss == AuxLoss(0.02, 4, 2)
    assert _spec(workers.aux_model("mixtral", 0, 2, 0.0)).aux_loss == AuxLoss(0.0, 4, 2)   # returned, adds 0
    assert _spec(workers.mixtral_model(0, 2)).aux_loss is None                 # output_router_logits=False
    # the base model's output (last_hidden_state) does not change with the flag
    base = workers.aux_model("mixtral", 0, 2, 1.0).model
    ids = torch.randint(0, workers.VOCAB, (2, 16))
    compiled = moegraph.compile(base, ids, hardware="cpu-gloo", passes="", schedule="greedy")
    assert edge_values(compiled.layers.graph).aux_stats == ()
    with torch.no_grad():
        assert rel_err(compiled(ids).last_hidden_state, base(input_ids=ids).last_hidden_state) < TOL


def _graph(dispatch: str, dp: int = 1, aux: AuxLoss | None = AuxLoss(0.02, 8, 2)):
    cfg = load_model("mixtral-8x7b")
    g = stack_layers(trace_model(cfg, Strategy("sp", "ep", dispatch, 8, dtype="bf16", dp=dp), batch=1, seq=2048), 2)
    return add_edges(g, vocab=32000, aux=aux)


def test_graph_nodes_and_prices():
    """Each router writes its [3, E] stats (counts, prob sums, rows counted; T*(E+k) more FLOPs),
    one ADD sums the 2 layers', a [3, E] fp32 all-reduce (a2a: group n) and an inter one (dp) make
    them global; every router backward reads them and the seed (4*T*E more FLOPs); the routers
    know where their rows sit (a padded batch's mask: this rank's shard under a2a)."""
    plain, g = _graph("a2a", dp=2, aux=None), _graph("a2a", dp=2)
    before, node = {n.name: n for n in plain.nodes}, {n.name: n for n in g.nodes}
    T, E, k = 2048 // 8, 8, 2
    routers = [n for n in g.nodes if n.op is OpKind.ROUTER]
    assert len(routers) == 6                                # 2 layers x (forward, dgrad, wgrad)
    for r in routers:
        extra = T * (E + k) if r.phase is Phase.FORWARD else 4 * T * E
        assert r.flops == before[r.name].flops + extra, r.name
    ev = edge_values(g)
    assert ev.aux_coef == 0.02
    assert node["edges.aux.sum"].flops == 3 * E and len(node["edges.aux.sum"].inputs) == 2
    ar, ar_dp = node["edges.aux.allreduce"], node["edges.aux.allreduce_dp"]
    assert (ar.group, ar_dp.group, ar_dp.attr("scope")) == (8, 2, "inter")
    assert ar.comm_bytes == 2 * 7 * (3 * E * 4) // 8                      # ring all-reduce of [3, E] fp32
    assert {(r.attr("aux_positions"), r.attr("aux_chunks")) for r in routers} == {("shard", 1)}
    assert all(node[x].attr("edge") is True for x in ("edges.aux.sum", "edges.aux.allreduce"))
    # ag-rs: the routers see each rank's own rows too (the routing is gathered after them): the
    # stats are summed over the replica, the routers' rows are this rank's shard
    agrs = {n.name: n for n in _graph("ag-rs").nodes}
    assert agrs["edges.aux.allreduce"].group == 8 and "edges.aux.allreduce_dp" not in agrs
    assert agrs["l0.router"].flops == 2 * T * 4096 * E + 5 * T * E + T * (E + k)    # T = s/n rows, + the stats
    assert agrs["l0.router.dgrad"].attr("aux_positions") == "shard"
    est = CostModel(load_hardware("h800"))
    assert est.node_time_us(ar) > 0


def test_aux_on_a_base_graph_or_other_routers_raises():
    mixtral = trace_model(load_model("mixtral-8x7b"), Strategy("sp", "ep", "a2a", 8), batch=1, seq=2048)
    with pytest.raises(GraphError, match="base model"):
        add_edges(mixtral, vocab=None, aux=AuxLoss(0.02, 8, 2))
    with pytest.raises(GraphError, match="softmax top-2 routers of 4 experts only"):
        add_edges(mixtral, vocab=32000, aux=AuxLoss(0.02, 4, 2))
    v3 = trace_model(load_model("deepseek-v3"), Strategy("sp", "ep", "a2a", 8), batch=1, seq=2048)
    router = next(n for n in v3.nodes if n.op is OpKind.ROUTER)
    with pytest.raises(GraphError, match=r"\(sigmoid, experts 256"):
        add_edges(v3, vocab=1024, aux=AuxLoss(0.02, router.attr("experts"), router.attr("top_k")))
    for coef in (-0.01, float("nan"), True):
        with pytest.raises(ValueError, match=r"must be a number >= 0"):
            AuxLoss(coef, 8, 2)


# -- registry models: router_aux_loss_coef ------------------------------------------------------

def test_registry_coefficient_reaches_the_model_step_through_strategy_passes(tmp_path):
    """A registry model with router_aux_loss_coef > 0: its traced stack carries the AuxLoss and the
    model step (the driver's edges='auto', what compile/tune --layers schedule) adds the nodes,
    also after a re-lowering pass (chunk=2); the default 0 adds none."""
    import dataclasses

    from moegraph.config import CompileConfig
    from moegraph.pass_steps import Chunk
    from moegraph.registry import RegistryError
    from moegraph.schedules.api import compile_graph
    from moegraph.schedules.driver import lower
    cost = CostModel(load_hardware("h800"))
    cfg = load_model("mixtral-8x7b")
    assert cfg.router_aux_loss_coef == 0.0
    aux_cfg = dataclasses.replace(cfg, router_aux_loss_coef=0.02)
    st = Strategy("sp", "ep", "a2a", 8, dtype="bf16")
    plain = lower(CompileConfig(model=cfg, strategy=st, passes=(), seq=2048, layers=2)).graph
    g = lower(CompileConfig(model=aux_cfg, strategy=st, passes=(Chunk(2),), seq=2048, layers=2)).graph
    assert edge_values(plain).aux_stats == ()
    ev = edge_values(g)
    assert (ev.aux_coef, ev.aux_experts) == (0.02, 8)
    assert sum(1 for n in g.nodes if n.op is OpKind.ROUTER and n.phase is Phase.FORWARD) == 4   # 2 layers x 2 chunks
    s = compile_graph(g, cost, method="greedy").schedule
    assert {"edges.aux.sum", "edges.aux.allreduce"} <= {n.name for n in s.nodes}
    with pytest.raises(RegistryError, match="router_aux_loss_coef"):
        dataclasses.replace(cfg, router_aux_loss_coef=-0.1)
    with pytest.raises(RegistryError, match="softmax routers only"):
        dataclasses.replace(load_model("deepseek-v3"), router_aux_loss_coef=0.01)
