"""The pipeline through the one configuration: CompileConfig's pp/vpp fields, the driver's
pipeline step, `compile/trace/tune --pp`, the whole per-rank memory under --memory-budget.

Tiny shapes: the registry's `small` (4 layers, h=512) at s=64, n=2 or 1, fp32, no passes, units
priced by the greedy list schedule, P=2, M=4, short deterministic CP-SAT limits.
"""

from __future__ import annotations

import json

import pytest

import moegraph
from moegraph.cli import main
from moegraph.config import CompileConfig, PipelineSearch, SolverEffort, config_layers
from moegraph.ir import ConfigError, Strategy
from moegraph.registry import load_model

SMALL = ["--model", "small", "--seq", "64", "--dtype", "fp32", "--passes", "none", "--micro-batches", "4"]
"""The CLI flags of the tiny pipeline (n and --pp added per test)."""


def small_config(n: int = 2, **changes) -> CompileConfig:
    """The config the CLI flags SMALL + --n n --pp 2 --schedule greedy --time-limit 1 build."""
    fields = dict(model=load_model("small"), strategy=Strategy("sp", "ep", "ag-rs", n, dtype="fp32"), passes=(),
                  schedule="greedy", seq=64, layers="all", micro_batches=4, pp=2, solver=SolverEffort(1.0))
    return CompileConfig(**(fields | changes))


def one_line_error(capsys, argv: list[str]) -> str:
    """Run the CLI; it must fail with exit 2 and one line on stderr, nothing on stdout (argparse's
    refusals exit through SystemExit, the commands' return 2)."""
    try:
        rc = main(argv)
    except SystemExit as stop:
        rc = stop.code
    assert rc == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    return err.strip()


# -- CompileConfig --------------------------------------------------------------------------------

@pytest.mark.parametrize("changes, message", [
    (dict(pp=0), "pp=0 must be a positive integer"),
    (dict(vpp=2, pp=1), "vpp=2 needs pp >= 2"),
    (dict(pp=1, placement="v"), "placement='v' needs pp >= 2 and vpp=2"),
    (dict(pipeline=PipelineSearch(windows=8, overlap_param_gather=True)),       # was accepted and ignored
     "pipeline=PipelineSearch(unit_time_limit_s=1.0, windows=8,"),
    (dict(pipeline=PipelineSearch(runnable=True)), "searches a pipeline's order: it needs pp >= 2"),
    (dict(pp=4, layers=2), "pp=4 x vpp=1 = 4 stages exceed layers=2"),
    (dict(pp=2, vpp=3, placement="v", layers=8), "placement='v' puts two stages on each rank: it needs vpp=2"),
    (dict(pp=2, placement="spiral", layers=4), "placement='spiral' is not one of loop, v"),
    (dict(pp=2000, layers=4), "stages=2,000 is over the limit"),
    (dict(pp=2, layers=4, schedule="dualpipe", micro_batches=4), "schedule='dualpipe' is a merged step's baseline"),
    (dict(pp=2, layers=4, edges="none"), "edges='none': with pp=2 the embedding and head are priced"),
    (dict(pp=2, layers=4, comm_streams=2), "comm_streams=2: with pp=2 each unit is priced on one comm stream"),
    (dict(pp=2, layers=4, pipeline=PipelineSearch(windows=-1)), "pipeline.windows=-1 must be an integer >= 0"),
    (dict(pp=2, layers=4, launch_order="program"), "launch_order='program': with pp=2 each unit is priced"),
])
def test_pipeline_fields_are_validated_naming_the_field(changes, message):
    with pytest.raises(ConfigError) as err:
        CompileConfig(model="small", **changes)
    assert message in str(err.value)


def test_layers_of_a_pipeline_are_the_models_own_dense_first_layers_included():
    ds = load_model("deepseek-v3")
    assert config_layers(CompileConfig(model="deepseek-v3", pp=16, layers="all"), ds) == 61      # 3 dense + 58 MoE
    assert config_layers(CompileConfig(model="deepseek-v3", layers="all"), ds) == 58             # a stack: MoE only
    with pytest.raises(ConfigError, match=r"pp=8 x vpp=1 = 8 stages exceed the 4 layers of small's pipeline"):
        config_layers(CompileConfig(model="small", pp=8, layers="all"), load_model("small"))
    with pytest.raises(ConfigError, match=r"layers=62 must be at most deepseek-v3's 61 layers"):
        config_layers(CompileConfig(model="deepseek-v3", pp=2, layers=62), ds)


# -- the CLI: bad values are one line, exit 2, before any work --------------------------------------

@pytest.mark.parametrize("extra, message", [
    (["--pp", "0"], "argument --pp: '0' is not a positive integer"),
    (["--pp", "5"], "pp=5 x vpp=1 = 5 stages exceed the 4 layers of small's pipeline"),
    (["--pp", "2", "--layers", "9"], "layers=9 must be at most small's 4 layers"),
    (["--vpp", "2"], "vpp=2 needs pp >= 2"),
    (["--vocab", "1000"], "--vocab applies to a pipeline: give --pp P"),
    (["--windows", "2"], "--windows applies to a pipeline: give --pp P"),
    (["--pp", "2", "--placement", "v"], "placement='v' puts two stages on each rank: it needs vpp=2"),
    (["--pp", "2", "--schedule", "dualpipe"], "schedule='dualpipe' is a merged step's baseline"),
    (["--pp", "2", "-o", "orders.json"], "-o 'orders.json' must end in one of .csv"),
    (["--pp", "2", "--comm-streams", "2"], "comm_streams=2: with pp=2 each unit is priced on one comm stream"),
])
def test_compile_refuses_bad_pipeline_flags_in_one_line(capsys, tmp_path, monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    err = one_line_error(capsys, ["compile", *SMALL, "--n", "2", *extra])
    assert err.startswith("moegraph compile: error: ") and message in err
    assert list(tmp_path.iterdir()) == []


def test_trace_and_tune_take_the_pipeline_flags_too(capsys):
    assert "vpp=2 needs pp >= 2" in one_line_error(capsys, ["trace", *SMALL, "--vpp", "2"])
    err = one_line_error(capsys, ["tune", "--model", "small", "--pp", "9"])
    assert "pp=9 x vpp=1 = 9 stages exceed the 4 layers of small's pipeline" in err
    assert "--fuse is not supported with --pp" in one_line_error(capsys, ["tune", "--model", "small", "--pp", "2",
                                                                          "--fuse"])


# -- the driver's pipeline step ------------------------------------------------------------------------

def test_the_split_boundary_step_prices_the_edges_and_the_transfers():
    """The stage-split pass, run by the pass manager on the two-layer step, makes one P2P node
    each way carrying a layer's input [b, s/n, h]; the edges it assigns price as they do unsplit."""
    from moegraph.ir import OpKind, Phase
    from moegraph.passes import add_edges, stack_layers
    from moegraph.passes.stages import STAGE_ATTR
    from moegraph.schedules.driver import lower
    from moegraph.schedules.pipeline_model import boundary_step
    from moegraph.schedules.pipeline_price import price_edges
    low = lower(small_config().replace(pp=1, layers=1, micro_batches=1, edges="none"))
    step = boundary_step(low.graph, 1000, low.cost)
    p2p = [n for n in step.nodes if n.op is OpKind.P2P]
    assert sorted(n.phase.value for n in p2p) == sorted([Phase.FORWARD.value, Phase.BACKWARD.value])
    assert all(n.comm_bytes == 1 * (64 // 2) * 512 * 4 for n in p2p)      # [b, s/n, h] fp32
    assert {n.attr(STAGE_ATTR) for n in step.nodes} == {0, 1}
    unsplit = add_edges(stack_layers(low.graph, 2), vocab=1000)
    assert price_edges(step, low.cost) == price_edges(unsplit, low.cost)


# -- one configuration, two front doors, one pipeline schedule -----------------------------------------

@pytest.fixture(scope="module")
def compiled():
    """``moegraph.compile`` of the tiny pipeline config (n=1: each rank holds whole layers)."""
    return moegraph.compile(small_config(n=1))


@pytest.mark.slow
def test_the_returned_step_is_no_longer_than_any_torch_schedule(compiled):
    steps = {name: t.makespan for name, t in compiled.result.warm_starts.items()}
    assert set(steps) == {"GPipe", "1F1B"}
    assert compiled.timeline.makespan <= min(steps.values())


@pytest.mark.slow
def test_per_rank_memory_holds_the_eager_models_parameters(compiled):
    """n=1, fp32, dp=1: the ranks' parameter bytes sum to the eager model's (embedding, 4 layers,
    norm, untied head: ``MoETransformer``); fp32 main gradients are as large, Adam's two moments
    twice (an fp32 parameter is its own master copy); activations follow the in-flight micro-batches."""
    import torch

    from moegraph.models import VOCAB, MoETransformer
    with torch.device("meta"):
        eager = MoETransformer.from_config(load_model("small"), layers=4, vocab=VOCAB)
    numel = sum(p.numel() for p in eager.parameters())
    rows = compiled.memory()
    assert sum(r["params"] for r in rows) == 4 * numel
    for r in rows:
        assert r["grads"] == r["params"] and r["optimizer"] == 2 * r["params"]
        assert r["total"] == sum(r[c] for c in ("params", "grads", "optimizer", "activations", "comm_buffers"))
        # one boundary tensor [b, s/n, h] = [1, 64, 512] fp32 each way with its one neighbour
        assert r["comm_buffers"] == 2 * 64 * 512 * 4
    assert [r["total"] for r in rows] == list(compiled.timeline.peak_bytes)


# -- --memory-budget caps the whole per-rank memory with --pp ------------------------------------------

@pytest.mark.slow
def test_an_impossible_budget_names_the_smallest_feasible_one(compiled, capsys):
    """The named budget is the smallest: one byte less is refused, exactly it compiles and fits."""
    from moegraph.schedules.pipeline import least_peak_bytes
    least = max(least_peak_bytes(compiled.built.problem))
    err = one_line_error(capsys, ["compile", *SMALL, "--n", "1", "--pp", "2", "--schedule", "greedy",
                                  "--memory-budget", str(least - 1)])
    assert "no pipeline schedule fits; the smallest feasible budget is" in err
    assert f"{least / 2**20:.2f}MiB" in err
    tight = moegraph.compile(small_config(n=1, memory_budget=least))
    assert max(tight.timeline.peak_bytes) <= least and tight.timeline.fits
    torch_fits = any(t.fits for name, t in tight.result.warm_starts.items() if name != "least-memory")
    assert ("least-memory" in tight.result.warm_starts) == (not torch_fits)


# -- trace --pp: the estimate without solving -----------------------------------------------------------

@pytest.mark.slow
def test_trace_shows_the_estimate_without_solving(capsys, monkeypatch):
    from ortools.sat.python import cp_model

    def no_solve(*_a, **_k):
        raise AssertionError("trace --pp solved a CP-SAT model")
    monkeypatch.setattr(cp_model.CpSolver, "Solve", no_solve)
    assert main(["trace", *SMALL, "--n", "1", "--pp", "2", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["priced_by"] == "greedy" and est["memory_under"] == "1F1B"
    assert est["pipeline"]["stages"] == [[0, 1], [2, 3]] and est["pipeline"]["world"] == 2
    rows = est["memory"]
    assert {r["rank"]: r["stages"] for r in rows} == {0: [0], 1: [1]}
    assert max(r["total"] for r in rows) == est["baselines"]["1F1B"]["peak_memory_bytes"]
    # one micro-batch per step: torch generates no 1F1B (M < P), GPipe holds the one micro-batch
    assert main(["trace", *SMALL[:-1], "1", "--n", "1", "--pp", "2", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["memory_under"] == "GPipe" and "1F1B" in one["refused"]
    # 1F1B holds min(P - p, M) micro-batches on stage p: 2 on rank 0, 1 on rank 1
    assert [r["activations"] for r in rows] == [2 * one["memory"][0]["activations"], one["memory"][1]["activations"]]
    assert [r["params"] for r in rows] == [r["params"] for r in one["memory"]]
    assert set(est["baselines"]) == {"GPipe", "1F1B"}
    assert est["baselines"]["GPipe"]["peak_memory_bytes"] >= est["baselines"]["1F1B"]["peak_memory_bytes"]


# -- tune --pp --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_tune_ranks_strategies_by_the_predicted_pipeline_step(capsys, tmp_path):
    from moegraph.schedules.pipeline_torch import read_csv
    out = tmp_path / "best.csv"
    # s=66: only chunks=1 divides s/n, so 12 candidates (not 36)
    assert main(["tune", "--model", "small", "--n", "2", "--seq", "66", "--dtype", "fp32", "--pp", "2",
                 "--micro-batches", "4", "--time-limit", "0.5", "--refine", "1", "-o", str(out), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    rows = res["candidates"]
    assert len(rows) == 12          # attn tp|sp x (ffn tp, ep a2a, ep ag-rs) x remat none|paper
    steps = [r["step_us"] for r in rows if r["feasible"]]
    assert steps == sorted(steps) and res["best"] == rows[0]
    assert res["best"]["speedup"] == pytest.approx(res["baseline"]["step_us"] / res["best"]["step_us"], rel=1e-3)
    assert len(read_csv(out)) == 2 and (tmp_path / "best.png").stat().st_size > 0


@pytest.mark.slow
def test_tune_pp_ranks_a_gqa_layer_against_its_folded_baseline(capsys, tmp_path):
    """small has 4 kv heads: over n = 8 its attention folds onto 4 ranks (attn_nodes = 2) in the
    baseline and in every candidate, and the pipeline step is ranked against that baseline."""
    assert main(["tune", "--model", "small", "--n", "8", "--batch", "2", "--seq", "64", "--dtype", "fp32", "--pp", "2",
                 "--micro-batches", "4", "--time-limit", "0.5", "--refine", "1", "-o", str(tmp_path / "b.csv"),
                 "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["baseline"]["strategy"] == "tp+ep sequential (attention folded: attn_nodes=2)"
    assert res["candidates"] and {r["strategy"]["attn_nodes"] for r in res["candidates"]} == {2}
    assert res["best"]["speedup"] == pytest.approx(res["baseline"]["step_us"] / res["best"]["step_us"], rel=1e-3)


def test_a_hugging_face_models_step_prices_its_own_vocabulary():
    """A Hugging Face config's LM head is priced at its own vocab_size (Qwen3-30B-A3B's published
    151,936), not the registry's default 32,000; --vocab (ModelEdges) still overrides it; a
    registry entry without a config keeps the default."""
    from moegraph.config import ModelEdges
    from moegraph.ir import OpKind
    from moegraph.schedules.driver import lower
    assert load_model("qwen3-30b-a3b").hf_vocab == 151_936 and load_model("mixtral-8x7b").hf_vocab is None

    def head_vocab(**changes) -> int:
        config = CompileConfig(model="qwen3-30b-a3b", strategy=Strategy("sp", "ep", "a2a", 4), hardware="h800",
                               seq=512, layers=2, pp=2, micro_batches=2, passes=()).replace(**changes)
        step = lower(config).graph
        (head,) = [n for n in step.nodes if n.op is OpKind.GEMM and n.name.endswith("lm_head")]
        return step.value[head.outputs[0]].shape[-1]

    assert head_vocab() == 151_936
    assert head_vocab(edges=ModelEdges(1000)) == 1000


@pytest.mark.slow
def test_compile_pp_json_gives_the_returned_order_and_each_baseline_one_shape(compiled):
    """The returned order's exposed p2p and gather are the worst rank's, as each baseline's are,
    with each rank's beside them (they were a list at the top level and a number under baselines)."""
    from moegraph.schedules.pipeline_report import compile_summary
    c = compile_summary(compiled)
    per_rank = compiled.timeline.summary()["exposed_p2p_us"]
    assert c["exposed_p2p_us"] == max(per_rank) and c["exposed_p2p_us_per_rank"] == per_rank
    rows = [c, *c["baselines"].values()]
    for key in ("exposed_p2p_us", "exposed_gather_us"):
        assert all(isinstance(r[key], float) for r in rows)
        assert all(r[key] == max(r[f"{key}_per_rank"]) for r in rows)
    for name, t in compiled.result.warm_starts.items():
        assert c["baselines"][name]["exposed_p2p_us_per_rank"] == t.summary()["exposed_p2p_us"]
