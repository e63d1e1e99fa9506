"""The stage-level pipeline schedule: timeline rules against closed forms, torch's tables, CP-SAT."""

from __future__ import annotations

import pytest

from moegraph.passes.stages import StageLayout
from moegraph.schedules.pipeline import Action, Pair, PipelineProblem, StageWork, simulate
from moegraph.schedules.pipeline_cpsat import solve_pipeline
from moegraph.schedules.pipeline_torch import (TORCH_SCHEDULES, read_csv, torch_orders, torch_schedules_for,
                                               write_csv)
from moegraph.schedules.problem import ScheduleError


def problem(P=4, M=8, V=1, placement="loop", *, f=10, i=6, w=4, b=None, saving=0, sync=0, send=0, opt=0,
            held=100, held_w=0, static=0, cap=None) -> PipelineProblem:
    layout = StageLayout.even(P * V * 2, P, V, placement)
    S = P * V
    work = tuple(StageWork(f, i, w, i + w if b is None else b, saving, sync, held, held_w) for _ in range(S))
    return PipelineProblem(layout, M, work, (send,) * (S - 1), (send,) * (S - 1), (opt,) * P, (static,) * P, cap)


@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
def test_one_stage_per_rank_step_is_the_closed_form(name):
    """No transfers, no step end: (M + P - 1)(F + B); bubble (P - 1)/(M + P - 1)."""
    P, M, F, B = 4, 8, 10, 10
    pr = problem(P, M, f=F, i=6, w=4)
    t = simulate(pr, torch_orders(name, pr.layout, M))
    assert t.makespan == (M + P - 1) * (F + B)
    assert t.bubble_fraction == pytest.approx((P - 1) / (M + P - 1))


def test_transfers_and_step_end_on_two_stages():
    F, B, t_, sync, opt = 7, 11, 3, 5, 2
    pr = problem(2, 1, f=F, i=B - 4, w=4, send=t_, sync=sync, opt=opt)
    tl = simulate(pr, ((Action("F", 0, 0), Action("B", 0, 0)), (Action("F", 1, 0), Action("B", 1, 0))))
    # rank 0: F, (send), rank 1: F, B, (send back), rank 0: B, then its sync and optimizer step
    assert tl.makespan == 2 * F + 2 * t_ + 2 * B + sync + opt
    assert tl.wait_ticks == (t_, t_)
    assert [(x.direction, x.start, x.end) for x in tl.transfers] == [("fwd", F, F + t_),
                                                                    ("bwd", 2 * F + t_ + B, 2 * F + 2 * t_ + B)]
    assert tl.exposed_sync_ticks == sync


def test_peak_memory_is_the_in_flight_micro_batches():
    P, M, held, static = 4, 8, 100, 1000
    pr = problem(P, M, held=held, static=static)
    one = simulate(pr, torch_orders("1F1B", pr.layout, M))
    assert one.peak_bytes == tuple(static + min(P - r, M) * held for r in range(P))
    gpipe = simulate(pr, torch_orders("GPipe", pr.layout, M))
    assert gpipe.peak_bytes == (static + M * held,) * P


def test_weight_gradients_hold_their_share_until_w():
    pr = problem(2, 2, held=100, held_w=30)
    orders = ((Action("F", 0, 0), Action("F", 0, 1), Action("I", 0, 0), Action("I", 0, 1), Action("W", 0, 0),
               Action("W", 0, 1)),
              (Action("F", 1, 0), Action("I", 1, 0), Action("F", 1, 1), Action("I", 1, 1), Action("W", 1, 0),
               Action("W", 1, 1)))
    tl = simulate(pr, orders)
    assert tl.peak_bytes == (200, 100 + 30)       # rank 1: I frees 70 of micro-batch 0 before F of 1


def test_orders_are_checked_and_deadlocks_named():
    pr = problem(2, 1)
    with pytest.raises(ScheduleError, match="stage 1 is on rank 1"):
        simulate(pr, ((Action("F", 0, 0), Action("F", 1, 0), Action("B", 1, 0), Action("B", 0, 0)), ()))
    with pytest.raises(ScheduleError, match="needs B, or I and W, once"):
        simulate(pr, ((Action("F", 0, 0), Action("I", 0, 0)), (Action("F", 1, 0), Action("B", 1, 0))))
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(pr, ((Action("B", 0, 0), Action("F", 0, 0)), (Action("F", 1, 0), Action("B", 1, 0))))


@pytest.mark.parametrize("name", list(TORCH_SCHEDULES))
def test_every_torch_schedule_reads_into_a_valid_order(name):
    placement, per_rank = TORCH_SCHEDULES[name]
    pr = problem(4, 8, per_rank or 2, placement)
    assert name in torch_schedules_for(pr.layout)
    tl = simulate(pr, torch_orders(name, pr.layout, 8))
    assert tl.makespan > 0
    if name == "DualPipeV":
        assert any(isinstance(i, Pair) for row in tl.orders for i in row)


def test_a_torch_schedule_of_another_placement_is_refused():
    with pytest.raises(ScheduleError, match="does not fit a layout of 2 stage"):
        torch_orders("DualPipeV", problem(2, 4, 2, "loop").layout, 4)


def test_csv_round_trip_and_torch_runtime_loads_it(tmp_path):
    from unittest import mock

    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    from torch.distributed.pipelining.stage import PipelineStage
    pr = problem(2, 4, 2, "v")
    orders = torch_orders("DualPipeV", pr.layout, 4)
    path = write_csv(orders, tmp_path / "dualpipev.csv")
    assert read_csv(path) == orders
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, 2, None, 4
    runtime = _PipelineScheduleRuntime([stage, stage], 4)
    runtime._load_csv(str(path))                # validates the table and adds its sends and receives
    assert any("SEND_F" in str(a) for a in runtime.pipeline_order_with_comms[0])


def test_cpsat_is_never_longer_than_torch_and_splits_heavy_weight_gradients():
    """1F1B runs B whole; with W half of the backward, deferring W into the drain's bubbles is
    shorter (zero bubble's split), which CP-SAT finds from 1F1B's warm start."""
    pr = problem(3, 4, f=10, i=10, w=10, b=20, send=1)
    warm = {n: torch_orders(n, pr.layout, 4) for n in torch_schedules_for(pr.layout)}
    res = solve_pipeline(pr, warm, time_limit_s=2)
    assert res.timeline.makespan <= min(t.makespan for t in res.warm_starts.values())
    assert res.source == "cpsat" and res.timeline.makespan < res.warm_starts["1F1B"].makespan
    assert any(isinstance(i, Action) and i.kind == "W" for row in res.timeline.orders for i in row)
    again = solve_pipeline(pr, warm, time_limit_s=2)
    assert again.timeline.orders == res.timeline.orders          # deterministic


def test_cpsat_keeps_the_memory_cap():
    pr = problem(2, 6, held=100, cap=350)
    warm = {n: torch_orders(n, pr.layout, 6) for n in torch_schedules_for(pr.layout)}
    res = solve_pipeline(pr, warm, time_limit_s=1)
    assert not res.warm_starts["GPipe"].fits and res.warm_starts["1F1B"].fits
    assert res.timeline.fits and max(res.timeline.peak_bytes) <= 350
    with pytest.raises(ScheduleError, match="no warm start fits the memory cap"):
        solve_pipeline(problem(2, 6, held=100, cap=150), warm, time_limit_s=1)


def test_overlapped_pairs_are_chosen_when_they_save():
    pr = problem(2, 4, 2, "v", f=10, i=8, w=4, saving=8, send=1)
    warm = {"ZBVZeroBubble": torch_orders("ZBVZeroBubble", pr.layout, 4)}
    res = solve_pipeline(pr, warm, time_limit_s=2)
    assert res.timeline.makespan < res.warm_starts["ZBVZeroBubble"].makespan
    assert any(isinstance(i, Pair) for row in res.timeline.orders for i in row)


def test_runnable_orders_pair_a_stage_only_with_itself():
    """split=False (what compiled stages run, PipelineSearch.runnable), cross_pairs=False: the
    V-shape's turn pairs no two stages, DualPipeV's table, which does, is no warm start, and
    ZBV's runs each whole B where its I was."""
    pr = problem(2, 4, 2, "v", f=10, i=8, w=4, saving=8, send=1)
    warm = {n: torch_orders(n, pr.layout, 4) for n in ("ZBVZeroBubble", "DualPipeV")}
    assert any(isinstance(i, Pair) and i.forward.stage != i.backward.stage for row in warm["DualPipeV"] for i in row)
    res = solve_pipeline(pr, warm, time_limit_s=2, split=False, cross_pairs=False)
    assert set(res.warm_starts) == {"ZBVZeroBubble (B at I)"}
    items = [i for row in res.timeline.orders for i in row]
    assert all(i.forward.stage == i.backward.stage for i in items if isinstance(i, Pair))
    assert not any(isinstance(i, Action) and i.kind in ("I", "W") for i in items)


@pytest.mark.slow
def test_pipeline_gantt_is_readable_at_sixteen_stages(tmp_path):
    from moegraph.schedules.pipeline_gantt import BUBBLE, pipeline_figure, render_pipeline
    pr = problem(16, 16, 1, f=10, i=8, w=4, send=2, sync=30, opt=5)
    tl = simulate(pr, torch_orders("1F1B", pr.layout, 16))
    import matplotlib.pyplot as plt
    fig = pipeline_figure(tl, "1F1B")
    fig.canvas.draw()
    ax = fig.axes[0]
    assert len(ax.get_yticks()) == 3 * 16
    assert any(p.get_facecolor()[:3] == tuple(int(BUBBLE[k:k + 2], 16) / 255 for k in (1, 3, 5))
               for p in ax.patches)                      # bubbles shaded
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in ax.texts]
    assert all(not a.overlaps(b) for k, a in enumerate(boxes) for b in boxes[k + 1:])
    plt.close(fig)
    for title in ("1F1B", "qwen3-30b-a3b: best pipeline step"):       # the legend sat on the title
        fig = pipeline_figure(tl, title)
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        legend, heading = fig.axes[0].get_legend().get_window_extent(r), fig.axes[0]._left_title.get_window_extent(r)
        assert heading.y0 > legend.y1 and not heading.overlaps(legend), title
        colours = [tuple(p.get_facecolor()) for p in fig.axes[0].get_legend().get_patches()]
        assert len(set(colours)) == len(colours)              # F and its sends were two entries of one blue
        plt.close(fig)
    assert render_pipeline(tl, tmp_path / "p.png").stat().st_size > 0


def test_model_problem_prices_stages_and_reports_memory_by_component():
    """A 4-layer model over 2 ranks: every layer in a stage, the head's stage dearer, each rank's
    states the memory model's, its peak = states + what its 1F1B timeline holds."""
    from moegraph.cost import CostModel
    from moegraph.ir import Strategy
    from moegraph.memory import COMPONENTS
    from moegraph.registry import load_hardware, load_model
    from moegraph.schedules.pipeline_model import model_layers, pipeline_problem, rank_memory_report
    cost = CostModel(load_hardware("h800"))
    layers = model_layers(load_model("small"), Strategy("sp", "ep", "ag-rs", 2), batch=1, seq=64, passes="",
                          cost=cost)
    assert len(layers) == 4 and len({id(g) for g in layers}) == 1
    built = pipeline_problem(layers, cost, pp=2, micro_batches=4, vocab=1000)
    assert [i for s in built.problem.layout.stages for i in s] == [0, 1, 2, 3]
    last, first = built.problem.work[-1], built.problem.work[0]
    assert last.f > 0 and last.sync >= first.sync            # the head's gradient all-reduce syncs on the last stage
    tl = simulate(built.problem, torch_orders("1F1B", built.problem.layout, 4))
    report = rank_memory_report(built, tl)
    for r, row in enumerate(report):
        assert row["total"] == tl.peak_bytes[r] == sum(row[c] for c in COMPONENTS)
        assert row["activations"] == min(2 - r, 4) * built.stage_memory[r].activation_bytes_per_mb


@pytest.mark.slow
def test_parameter_gather_delays_each_stage_first_forward_only():
    """With the all-gather half overlapped with the next step (Megatron's --overlap-param-gather),
    each stage's gather opens the step on its rank's DP stream: stage 0's first forward waits for
    it (the whole step moves by g), stage 1's starts after its input arrives anyway."""
    g = 5
    layout = StageLayout(((0,), (1,)), 2)

    def pr(gather):
        work = tuple(StageWork(10, 6, 4, 10, 0, 3, 100, 0, gather) for _ in range(2))
        return PipelineProblem(layout, 2, work, (0,), (0,), (0, 0), (0, 0))
    orders = torch_orders("GPipe", layout, 2)
    base, gathered = simulate(pr(0), orders), simulate(pr(g), orders)
    assert gathered.gather == {0: (0, g), 1: (0, g)}
    assert gathered.gather_wait_ticks == (g, 0)
    assert gathered.makespan == base.makespan + g
    assert gathered.summary()["exposed_gather_us"] == [g, 0]
    res = solve_pipeline(pr(g), {"GPipe": orders}, time_limit_s=1)
    assert res.timeline.makespan <= gathered.makespan
    assert res.timeline.gather == gathered.gather and res.timeline.start[Action("F", 0, 0)] >= g
    # layer by layer (two layers a stage): the forward starts after the first half and ends after all + f_tail
    work = tuple(StageWork(10, 6, 4, 10, 0, 3, 100, 0, 8, 4, 5) for _ in range(2))
    layered = simulate(PipelineProblem(layout, 2, work, (0,), (0,), (0, 0), (0, 0)), orders)
    assert layered.start[Action("F", 0, 0)] == max(4, 8 + 5 - 10) and layered.gather_wait_ticks == (4, 0)


@pytest.mark.slow
def test_window_search_shortens_a_step_deterministically_under_the_cap():
    """Windows of micro-batches over a fixed rest find zero bubble's split from 1F1B (W heavy),
    the result re-simulates to itself, fits the cap, and is the same on a second run."""
    from moegraph.schedules.pipeline_lns import improve_by_windows
    P, M = 4, 8
    pr = problem(P, M, f=10, i=10, w=10, b=20, sync=5, send=3, opt=2, held=100, held_w=50, cap=500)
    start = simulate(pr, torch_orders("1F1B", pr.layout, M))
    assert start.fits
    runs = [improve_by_windows(pr, start, window=4, passes=1, max_windows=2, window_limit_s=0.3) for _ in range(2)]
    (best, search), (again, _) = runs
    assert search.windows == 2 and search.kept >= 1
    assert best.makespan == search.after_ticks < start.makespan
    assert simulate(pr, best.orders).makespan == best.makespan and best.fits
    assert again.orders == best.orders


@pytest.mark.slow
def test_solve_pipeline_runs_windows_after_the_whole_step_search():
    pr = problem(4, 8, f=10, i=10, w=10, b=20, sync=5, send=3, opt=2)
    warm = {"1F1B": torch_orders("1F1B", pr.layout, 8)}
    res = solve_pipeline(pr, warm, time_limit_s=0.2, windows=2, window_limit_s=0.3)
    assert res.windows is not None and res.windows.windows in (2, 4)       # one sweep, or two if the first kept one
    assert res.timeline.makespan == res.windows.after_ticks <= res.windows.before_ticks
    assert res.timeline.makespan < res.warm_starts["1F1B"].makespan and res.source == "cpsat"


def test_gather_half_of_the_sync_is_priced_apart_with_data_parallelism():
    from moegraph.cost import CostModel
    from moegraph.ir import Strategy
    from moegraph.registry import load_hardware, load_model
    from moegraph.schedules.pipeline_model import model_layers
    from moegraph.schedules.pipeline_price import price_layer
    cost = CostModel(load_hardware("h800"))
    for dp in (1, 2):
        layer = model_layers(load_model("small"), Strategy("sp", "ep", "ag-rs", 2, dp=dp), batch=1, seq=64,
                             passes="", cost=cost)[0]
        price = price_layer(layer, cost)
        if dp == 1:
            assert price.gather_us == 0
        else:
            assert 0 < price.gather_us < price.sync_us


@pytest.mark.parametrize("V, placement", [(1, "loop"), (2, "loop"), (2, "v")])
def test_the_least_memory_order_reaches_the_least_peak_and_no_torch_schedule_goes_below(V, placement):
    """One micro-batch at a time holds one micro-batch of each of a rank's stages: the least peak
    (``least_peak_bytes``); every torch schedule's peak is at least that, rank by rank."""
    from moegraph.schedules.pipeline import least_memory_orders, least_peak_bytes
    pr = problem(2, 4, V, placement, held=100, held_w=30, static=1000)
    least = least_peak_bytes(pr)
    assert least == (1000 + V * 100,) * 2
    assert simulate(pr, least_memory_orders(pr.layout, 4)).peak_bytes == least
    for name in torch_schedules_for(pr.layout):
        try:
            peaks = simulate(pr, torch_orders(name, pr.layout, 4)).peak_bytes
        except ScheduleError:       # torch does not generate it for this P, V, M (DualPipeV: M < 2P)
            continue
        assert all(p >= q for p, q in zip(peaks, least)), name


def test_a_cap_only_the_least_memory_order_fits_gets_it_as_warm_start():
    from moegraph.schedules.driver import check_pipeline_budget, pipeline_warm_starts
    from moegraph.schedules.problem import MemoryBudgetError
    pr = problem(2, 4, held=100, static=1000, cap=1100)          # 1F1B holds 2 on rank 0, GPipe 4
    warm, _ = pipeline_warm_starts(pr)
    assert set(warm) == {"GPipe", "1F1B", "least-memory"}
    res = solve_pipeline(pr, warm, time_limit_s=1.0)
    assert res.timeline.fits and max(res.timeline.peak_bytes) <= 1100
    check_pipeline_budget(pr)
    with pytest.raises(MemoryBudgetError, match="the smallest feasible budget is 1.07KiB"):
        check_pipeline_budget(problem(2, 4, held=100, static=1000, cap=1099))
    assert set(pipeline_warm_starts(problem(2, 4, held=100, static=1000, cap=1200))[0]) == {"GPipe", "1F1B"}


def _overlapping(transfers) -> list:
    """Pairs of transfers on the same link whose intervals intersect."""
    xs = sorted(transfers, key=lambda x: (x.start, x.end))
    return [(a, b) for i, a in enumerate(xs) for b in xs[i + 1:] if a.link == b.link and b.start < a.end]


def test_a_shared_link_carries_one_direction_at_a_time():
    """The emulated link (one token bucket for both directions): a forward send and a gradient
    sent back take turns, in the simulated timeline and in CP-SAT's, where a full-duplex link runs
    them at once."""
    import dataclasses
    duplex = problem(2, 6, f=10, i=6, w=4, send=24)          # sends longer than a forward
    shared = dataclasses.replace(duplex, shared_link=True)
    order = torch_orders("1F1B", duplex.layout, 6)
    both = simulate(duplex, order)
    assert {x.link for x in both.transfers} == {(0, 1), (1, 0)}
    assert any(a.direction != b.direction for a, b in _overlapping(
        [dataclasses.replace(x, link=(0, 1)) for x in both.transfers]))   # the two directions do overlap
    one = simulate(shared, order)
    assert {x.link for x in one.transfers} == {(0, 1)} and not _overlapping(one.transfers)
    assert one.makespan > both.makespan
    res = solve_pipeline(shared, {"1F1B": order}, time_limit_s=2)
    assert not _overlapping(res.timeline.transfers)
    assert res.timeline.makespan <= one.makespan


def test_a_transfer_waits_for_its_receive_to_be_posted():
    """torch's runtime posts a receive where its ``_add_send_recv`` placed it (1F1B at P=2: rank 1's
    receive of micro-batch 1 after its F0, rank 0's gradient of micro-batch 1 after its F2), and
    gloo/NCCL move the message once both ends are posted. F=10, B=10, a send 8 ticks."""
    import dataclasses
    eager = problem(2, 4, f=10, i=6, w=4, send=8)
    order = torch_orders("1F1B", eager.layout, 4)
    before = {(x.direction, x.mb): x.start for x in simulate(eager, order).transfers}
    tl = simulate(dataclasses.replace(eager, rendezvous=True), order)
    after = {(x.direction, x.mb): x.start for x in tl.transfers}
    # rank 0: F0 0-10, F1 10-20; rank 1: F0 18-28 (fwd0 10-18), B0 28-38; bwd0 38-46, rank 0 B0 46-56, F2 56-66
    assert (before[("fwd", 1)], after[("fwd", 1)]) == (20, 28)     # sent at 20, posted after rank 1's F0 (28)
    # rank 1: F1 38-48, B1 48-58 sends at 58; rank 0 posts that receive after its F2 (66)
    assert (before[("bwd", 1)], after[("bwd", 1)]) == (58, 66)
    assert all(after[k] >= before[k] for k in before)
    assert tl.makespan == 140 and simulate(eager, order).makespan == 132
