"""The SM budgets a plan compiled for NCCL ranks may give its collectives (runtime/native_budgets.py):
budget 0 (copy engines), which this runtime does not run on NCCL, is left out of such plans and
refused in given ones; gloo plans are unchanged."""

from __future__ import annotations

import pytest

from moegraph.config import CompileConfig, SolverEffort
from moegraph.ir import ConfigError
from moegraph.registry import load_hardware
from moegraph.runtime import PlanError
from moegraph.runtime.native_budgets import check_native_budgets, runnable_config, runnable_hardware
from moegraph.schedules.driver import build


def test_nccl_leaves_out_budget_zero_and_gloo_keeps_the_profile():
    h800 = load_hardware("h800")
    assert 0 in h800.comm_sm_budgets
    assert runnable_hardware(h800, "nccl").comm_sm_budgets == tuple(b for b in h800.comm_sm_budgets if b)
    assert runnable_hardware(h800, "gloo") is h800 and runnable_hardware(h800, None) is h800


def test_a_copy_engine_only_profile_is_refused_on_nccl_by_name():
    with pytest.raises(ConfigError, match="'cpu-gloo' allows only SM budget 0"):
        runnable_hardware(load_hardware("cpu-gloo"), "nccl")


def _comm_budgets(config: CompileConfig) -> list[int]:
    compiled = build(config)
    return [n.sm_budget for n in compiled.schedule.nodes if compiled.graph.node[n.name].is_comm]


def test_a_plan_compiled_for_nccl_ranks_gives_no_collective_budget_zero():
    """The same layer (the default config: Mixtral-8x7B on h800): scheduled for the profile, CP-SAT
    hands some collectives to copy engines (budget 0); scheduled for NCCL ranks, none."""
    config = CompileConfig(model="mixtral-8x7b", hardware="h800", solver=SolverEffort(1.0))
    assert 0 in _comm_budgets(config)
    for_nccl = runnable_config(config, "nccl")
    assert for_nccl.hardware.comm_sm_budgets == (8, 16, 24, 32)
    budgets = _comm_budgets(for_nccl)
    assert budgets and min(budgets) > 0
    assert runnable_config(config, "gloo") is config


def test_a_given_plan_with_budget_zero_is_refused_on_nccl_naming_the_stream():
    keys = [("comm", 16), ("comm2", 0)]
    with pytest.raises(PlanError, match=r"stream\(s\) comm2 SM budget 0"):
        check_native_budgets(keys, "nccl")
    check_native_budgets(keys, "gloo")                      # gloo records budgets, runs them all
    check_native_budgets([("comm", 16)], "nccl")
