"""The one driver (moegraph.schedules.driver) and its typed config (moegraph.config).

Every front door compiles a CompileConfig through ``build``/``lower``: the same configuration
gives one schedule hash whichever door it enters by. The config names every bad field; the text
form of a pipeline and argparse stay at the CLI's edge; a pass's scope is a typed field.
"""

import ast
import dataclasses
import functools
import pathlib

import pytest

import moegraph
from moegraph.cli import main
from moegraph.config import RECORDED, CompileConfig, ModelEdges, SolverEffort
from moegraph.ir import ConfigError, Strategy
from moegraph.pass_steps import DEFAULT_PASSES, Chunk, GateReorder, PassError, Sar, parse_passes, step_label
from moegraph.registry import load_hardware, load_model

ROOT = pathlib.Path(__file__).resolve().parents[1]
STAGES = ("moegraph", "passes", "schedules", "runtime")


@functools.lru_cache(maxsize=1)
def sources() -> tuple[tuple[str, str, ast.AST], ...]:
    """(path relative to the root, text, syntax tree) of every module of the four stages, parsed once."""
    out = []
    for path in sorted(p for stage in STAGES for p in (ROOT / stage).rglob("*.py")):
        text = path.read_text()
        out.append((str(path.relative_to(ROOT)), text, ast.parse(text)))
    return tuple(out)
TINY = Strategy("sp", "ep", "ag-rs", 2, dtype="fp32")


# -- acceptance: one configuration, four front doors, one schedule hash ------------------------------

@pytest.mark.slow
def test_every_front_door_compiles_the_same_config_to_one_schedule(tmp_path):
    """tiny, n=2, s=64, fp32, no passes, greedy on h800: the CLI (`compile -o`), tune's candidate
    path, ``moegraph.compile`` and calibration's model step schedule it identically."""
    from moegraph.runtime.calibrate.steps import LayerConfig, step_plans
    from moegraph.schedules.schedule_file import load_schedule
    from moegraph.schedules.tune import Cache, baseline_config, candidate_config, evaluate
    model, hw = load_model("tiny"), load_hardware("h800")

    out = tmp_path / "cli.json"
    assert main(["compile", "--model", "tiny", "--hardware", "h800", "--n", "2", "--seq", "64", "--dtype", "fp32",
                 "--passes", "none", "--schedule", "greedy", "-o", str(out)]) == 0
    cli = load_schedule(out).hash

    base = baseline_config(model, hw, n=2, batch=1, seq=64, dtype="fp32")
    entry = evaluate(candidate_config(base, TINY).replace(schedule="greedy"), Cache(None))
    from moegraph.schedules.schedule_file import Schedule
    tuned = Schedule.from_json(entry["schedule"]).hash

    api = moegraph.compile(CompileConfig(model="tiny", strategy=TINY, passes=(), schedule="greedy", batch=1, seq=64,
                                         hardware="h800")).schedule.hash

    _, _, probe = step_plans(LayerConfig("tiny", 64, "sp", "ep", "ag-rs"), hw, 2)
    calibrated = probe.source_hash

    assert cli.startswith("sha256:") and cli == tuned == api == calibrated


@pytest.mark.slow
def test_a_pipeline_config_compiles_to_one_schedule_by_the_cli_and_the_api(tmp_path, capsys):
    """pp=2 (small, 4 layers, n=1, s=64, fp32, no passes, M=4, units greedy-priced): `compile
    --pp 2 -o` and ``moegraph.compile(config)`` give one pipeline schedule hash, and the action
    CSV the CLI writes is the schedule that hash names."""
    import json

    from moegraph.schedules.pipeline_torch import orders_hash, read_csv
    out = tmp_path / "orders.csv"
    assert main(["compile", "--model", "small", "--n", "1", "--seq", "64", "--dtype", "fp32", "--passes", "none",
                 "--schedule", "greedy", "--time-limit", "1", "--pp", "2", "--micro-batches", "4", "-o", str(out),
                 "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    api = moegraph.compile(CompileConfig(model="small", strategy=Strategy("sp", "ep", "ag-rs", 1, dtype="fp32"),
                                         passes=(), schedule="greedy", seq=64, layers="all", micro_batches=4, pp=2,
                                         solver=SolverEffort(1.0)))
    assert cli["hash"].startswith("sha256:") and cli["hash"] == api.hash == orders_hash(read_csv(out))
    assert cli["step_us"] == pytest.approx(api.timeline.makespan * api.built.problem.tick_us)


def test_the_runtime_compiles_a_module_through_the_driver(monkeypatch):
    """``moegraph.compile(module, x)`` reaches the scheduler only through the driver's build."""
    import torch

    import moegraph.schedules.driver as driver
    from moegraph.models import MoETransformerLayer
    calls = []
    real = driver.build
    monkeypatch.setattr(driver, "build", lambda config, **kw: calls.append(config) or real(config, **kw))
    torch.manual_seed(0)
    layer = MoETransformerLayer.from_config(load_model("tiny"))
    compiled = moegraph.compile(layer, torch.randn(1, 16, load_model("tiny").hidden), passes="none",
                                schedule="greedy", hardware="cpu-gloo")
    assert len(calls) == 1 and calls[0].model is layer and calls[0].strategy.n == 1 and calls[0].seq == 16
    assert compiled.plan.source_hash is not None


# -- the config ------------------------------------------------------------------------------------

def test_config_names_every_bad_field_and_its_valid_values():
    with pytest.raises(ConfigError) as err:
        CompileConfig(model=3, passes="sar=paper", schedule="fast", layers=0, micro_batches=0, batch=-1, seq=1.5,
                      memory_budget=0, top_k=0, edges="all", solver=SolverEffort(time_limit_s=0), comm_streams=3)
    msg = str(err.value)
    for part in ("model=3 must be a registry name", "passes='sar=paper' must be a tuple of pass steps",
                 "schedule='fast' is not one of cpsat, sequential, greedy, megascale, megatron-1f1b, dualpipe",
                 "layers=0 must be a positive integer or 'all'", "micro_batches=0", "batch=-1", "seq=1.5",
                 "memory_budget=0", "top_k=0", "edges='all' must be 'auto', 'none' or a ModelEdges",
                 "solver.time_limit_s=0", "comm_streams=3 is not one of 1, 2"):
        assert part in msg, part


def test_config_defaults_and_typed_passes():
    c = CompileConfig(model="tiny")
    assert c.passes == DEFAULT_PASSES == parse_passes("gate-reorder,sar=paper")
    assert [step_label(s) for s in c.passes] == ["gate-reorder", "sar=paper"]
    with pytest.raises(ConfigError, match="dualpipe.*needs micro_batches >= 2"):
        CompileConfig(model="tiny", schedule="dualpipe")
    with pytest.raises(ConfigError, match="pass 'sar' is given twice"):
        CompileConfig(model="tiny", passes=(Sar(), Sar("none")))
    with pytest.raises(ConfigError, match="edges.vocab=0"):
        CompileConfig(model="tiny", edges=ModelEdges(0))
    assert dataclasses.replace(c, layers="all").layers == "all"


def test_pass_steps_type_their_arguments():
    assert parse_passes("chunk=4,sar=budget:3GiB:7.5s") == (Chunk(4), Sar("budget", 3 * 2**30, 7.5))
    assert step_label(Sar("budget", 3 * 2**30)) == "sar=budget:3GiB"          # as people write it
    assert step_label(Sar("budget", 40000)) == "sar=budget:40000"
    assert parse_passes("none") == parse_passes("") == ()
    with pytest.raises(ValueError, match="not a positive integer"):
        Chunk(0)
    with pytest.raises(PassError, match=r"pass 'gate-reorder': invalid argument 'never' \(not a gate order\)"):
        parse_passes("gate-reorder=never")
    assert GateReorder().arg is None and GateReorder("after-fc2").arg == "after-fc2"


def test_recorded_passes_rebuild_a_schedule_files_graph():
    """passes=RECORDED (run --schedule FILE): the graph the strategy's typed fields describe,
    equal to the pipeline's that recorded them."""
    from moegraph.ir import graph_digest
    from moegraph.schedules.driver import lower
    piped = lower(CompileConfig(model="small", strategy=Strategy("sp", "ep", "ag-rs", 2), seq=64, layers=2,
                                passes=parse_passes("gate-reorder,chunk=2,sar=paper")))
    again = lower(CompileConfig(model="small", strategy=piped.graph.strategy, seq=64, layers=2, passes=RECORDED))
    assert graph_digest(again.graph) == graph_digest(piped.graph)
    assert again.graph.strategy.passes == ("gate-reorder", "chunk=2", "sar=paper")


# -- the model-level rewrites are passes, their scope a typed field -----------------------------------

def test_model_level_rewrites_run_in_the_pass_manager_by_stage():
    from moegraph.passes import MODEL_PASSES, PASSES, AddEdges, MergeMicroBatches, SplitStages, StackLayers
    from moegraph.passes.manager import spec_of
    from moegraph.passes.manager import staged
    from moegraph.passes.stages import StageLayout
    stages = {t.NAME: s.stage for t, s in MODEL_PASSES.items()}
    assert stages == {"stack": -1, "microbatches": 10, "edges": 11, "stages": 12}
    user = [p.stage for p in PASSES.values()]
    assert stages["stack"] < min(user) and max(user) < stages["microbatches"] < stages["edges"] < stages["stages"]
    split = SplitStages(StageLayout.even(2, 2))
    order = staged([split, AddEdges(1024), Sar("paper"), MergeMicroBatches(2), StackLayers(2), GateReorder()])
    assert [spec_of(s).name for s in order] == ["stack", "gate-reorder", "sar", "microbatches", "edges", "stages"]


def test_a_pass_scope_is_a_field_not_a_function_attribute():
    """Built passes carry their scope (sar's model-wide budget decides on the whole stack); no
    function attribute holds state anywhere in the stages."""
    from moegraph.cost import CostModel
    from moegraph.passes import build_pass
    cost = CostModel(load_hardware("h800"))
    assert build_pass(Sar("paper"), cost).scope == "layer"
    assert build_pass(Sar("budget", 2**20), cost).scope == "step"
    assert build_pass(Chunk(2), cost).scope == "layer"
    for rel, _, tree in sources():
        functions = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in functions
                            and not t.attr.startswith("__")):       # a name or docstring is no state
                        pytest.fail(f"{rel}:{node.lineno} sets {t.value.id}.{t.attr}")


# -- front-door boundaries ----------------------------------------------------------------------------

CLI_MODULES = {"moegraph/cli.py", "moegraph/commands.py", "moegraph/options.py", "schedules/commands.py",
               "runtime/commands.py", "runtime/demo.py", "runtime/netns.py", "runtime/calibrate/command.py"}
"""The command-line modules: each builds or reads a parser (netns.py holds the --link flags beside
the link emulation they configure)."""


def test_argparse_stays_in_the_cli_modules():
    """argparse (and its Namespace, and run's Unset flag marker) appears only in the CLI modules:
    the library takes typed values (CompileConfig, RuntimeOptions)."""
    offenders = []
    for rel, text, tree in sources():
        imports = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
            {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        if rel not in CLI_MODULES and ("argparse" in imports or "Namespace" in text or "Unset" in text):
            offenders.append(rel)
    assert not offenders, offenders


def test_the_tracer_and_scheduler_are_composed_only_by_the_driver():
    """trace -> passes -> schedule is composed in one place: no other module of the stages calls
    the tracer's entry points (nor lowers a whole strategy by hand)."""
    entry = {"trace_model", "trace_module", "trace_causal_lm", "trace_layers", "lower_strategy"}
    allowed = {"moegraph/tracer.py", "schedules/driver.py"}
    callers = []
    for rel, _, tree in sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in entry and rel not in allowed:
                    callers.append(f"{rel}:{node.lineno} {name}")
    assert not callers, callers


def test_public_api():
    import moegraph.schedules.schedule_file as sf
    assert moegraph.CompileConfig is CompileConfig and moegraph.Strategy is Strategy
    assert moegraph.load_schedule is sf.load_schedule and callable(moegraph.trace) and callable(moegraph.compile)
    lowered = moegraph.trace(CompileConfig(model="tiny", strategy=TINY, passes=(Sar("paper"),), seq=64))
    assert lowered.graph.strategy.passes == ("sar=paper",) and lowered.report["pipeline"] == ["sar=paper"]
    with pytest.raises(ValueError, match="compiles the config alone"):
        moegraph.compile(CompileConfig(model="tiny"), object())


def test_compile_a_module_with_a_config_or_keywords_not_both():
    """``compile(module, x, config=...)``: the config's compile options; the module, the world
    and the input give the model, n, s and the dtype. Keywords beside a config are refused."""
    import torch

    from moegraph.models import MoETransformerLayer
    cfg = load_model("tiny")
    layer = MoETransformerLayer.from_config(cfg)
    x = torch.randn(1, 16, cfg.hidden)
    config = CompileConfig(model="tiny", strategy=Strategy("sp", "ep", "a2a", 4, dtype="bf16"), passes=(Sar(),),
                           schedule="greedy", hardware="cpu-gloo")
    compiled = moegraph.compile(layer, x, config=config)
    st = compiled.graph.strategy
    assert (st.n, st.dtype, st.dispatch, st.passes, compiled.graph.dims.s) == (1, "fp32", "a2a", ("sar",), 16)
    with pytest.raises(ValueError, match="takes the compile options from the config; attn, passes given as well"):
        moegraph.compile(layer, x, config=config, attn="tp", passes="none")
