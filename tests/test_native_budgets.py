"""The SM budgets a plan compiled for NCCL ranks may give its collectives (runtime/native_budgets.py):
budget 0 (copy engines), which this runtime does not run on NCCL, is left out of such plans
(CompileConfig.copy_engines=False, `compile --no-copy-engines`) and refused in given ones; gloo
plans are unchanged."""

from __future__ import annotations

import json

import pytest

from moegraph.config import CompileConfig, SolverEffort
from moegraph.ir import ConfigError
from moegraph.registry import RegistryError, load_hardware
from moegraph.runtime import PlanError
from moegraph.runtime.native_budgets import check_native_budgets, runnable_config
from moegraph.cli import main
from moegraph.schedules.driver import build

DEFAULT = CompileConfig(model="mixtral-8x7b", hardware="h800", solver=SolverEffort(1.0))


def test_without_copy_engines_leaves_out_budget_zero_only():
    h800 = load_hardware("h800")
    assert 0 in h800.comm_sm_budgets
    assert h800.without_copy_engines().comm_sm_budgets == tuple(b for b in h800.comm_sm_budgets if b)
    cpu = load_hardware("cpu-2core-gloo")
    assert 0 not in cpu.comm_sm_budgets and cpu.without_copy_engines() is cpu


def test_a_copy_engine_only_profile_is_refused_by_name():
    with pytest.raises(RegistryError, match="'cpu-gloo' allows only SM budget 0"):
        load_hardware("cpu-gloo").without_copy_engines()


def test_nccl_ranks_plan_without_copy_engines_and_gloo_ranks_as_given():
    assert runnable_config(DEFAULT, "nccl").copy_engines is False
    assert runnable_config(DEFAULT, "gloo") is DEFAULT and runnable_config(DEFAULT, None) is DEFAULT
    with pytest.raises(ConfigError, match="copy_engines='no' must be True or False"):
        CompileConfig(model="mixtral-8x7b", copy_engines="no")


def _comm_budgets(config: CompileConfig) -> list[int]:
    compiled = build(config)
    return [n.sm_budget for n in compiled.schedule.nodes if compiled.graph.node[n.name].is_comm]


def test_a_plan_compiled_for_nccl_ranks_gives_no_collective_budget_zero():
    """The same layer (the default config: Mixtral-8x7B on h800): scheduled for the profile, CP-SAT
    hands some collectives to copy engines (budget 0); scheduled for NCCL ranks, none."""
    assert 0 in _comm_budgets(DEFAULT)
    budgets = _comm_budgets(runnable_config(DEFAULT, "nccl"))
    assert budgets and min(budgets) > 0


def _file_budgets(path) -> tuple[list[int], list[int]]:
    """(the file's hardware budgets, its collectives' budgets)."""
    sched = json.loads(path.read_text())
    comm = [n["sm_budget"] for n in sched["nodes"] if n["stream"] != "compute"]
    return sched["hardware"]["comm_sm_budgets"], comm


def test_compile_no_copy_engines_writes_a_plan_nccl_runs(tmp_path, capsys):
    """`compile --no-copy-engines` records the SM-only budgets in the file's hardware and gives no
    collective budget 0; the default compile of the same layer gives some (refused on NCCL)."""
    for flags, name in (((), "ce.json"), (("--no-copy-engines",), "sm.json")):
        assert main(["compile", "--time-limit", "1", *flags, "-o", str(tmp_path / name)]) == 0
        said = "(collectives on SMs only: --no-copy-engines)" in capsys.readouterr().out
        assert said == bool(flags)
    hw, comm = _file_budgets(tmp_path / "ce.json")
    assert 0 in hw and 0 in comm
    hw, comm = _file_budgets(tmp_path / "sm.json")
    assert 0 not in hw and comm and min(comm) > 0


def test_a_given_plan_with_budget_zero_is_refused_on_nccl_naming_the_stream():
    keys = [("comm", 16), ("comm2", 0)]
    with pytest.raises(PlanError, match=r"stream\(s\) comm2 SM budget 0.*--no-copy-engines"):
        check_native_budgets(keys, "nccl")
    check_native_budgets(keys, "gloo")                      # gloo records budgets, runs them all
    check_native_budgets([("comm", 16)], "nccl")
