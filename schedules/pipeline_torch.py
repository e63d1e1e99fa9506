"""torch.distributed.pipelining's schedules as moegraph orders, and moegraph orders as torch's.

The baselines are torch's own generated schedules, never re-implemented here: ``torch_orders``
instantiates the schedule class on stand-in stages (``_schedule_visualizer.get_schedule_ops``,
which torch provides for exactly this) and reads its per-rank action table
(``pipeline_order``); ``to_torch`` writes an order back as torch ``_Action`` rows, the
"compute_only" table ``_PipelineScheduleRuntime`` lowers (adding its sends and receives) and
runs, and ``write_csv`` saves it in the format its ``_load_csv`` reads: one row per pipeline rank,
one cell per action (``2F0``, ``1I3``, ``0W3``, ``1B2``, ``(0F7;7B3)OVERLAP_F_B``).

Which schedule fits which layout (``TORCH_SCHEDULES``: placement, stages per rank):

    GPipe, 1F1B                               V = 1
    Interleaved1F1B, InterleavedZeroBubble    loop placement, V >= 2
    ZBVZeroBubble, DualPipeV                  V-shape placement, V = 2
"""

from __future__ import annotations

import csv
import hashlib
import io
from pathlib import Path


from moegraph.atomic import write_atomic
from moegraph.passes.stages import StageLayout
from moegraph.schedules.pipeline import Action, Item, Orders, Pair
from moegraph.schedules.problem import ScheduleError

__all__ = ["TORCH_SCHEDULES", "torch_orders", "torch_schedules_for", "torch_baselines", "to_torch", "recv_posts", "csv_text", "orders_hash", "write_csv",
           "read_csv"]

TORCH_SCHEDULES = {"GPipe": ("loop", 1), "1F1B": ("loop", 1), "Interleaved1F1B": ("loop", None),
                   "InterleavedZeroBubble": ("loop", None), "ZBVZeroBubble": ("v", 2), "DualPipeV": ("v", 2)}
"""torch schedule name -> (placement, stages per rank; None: any V >= 2)."""


def torch_schedules_for(layout: StageLayout) -> tuple[str, ...]:
    """The torch schedules whose stage placement is ``layout``'s."""
    V = layout.virtual
    out = []
    for name, (placement, per_rank) in TORCH_SCHEDULES.items():
        if per_rank == 1 and V == 1 or (per_rank is None and V >= 2 and layout.placement == "loop") or (
                per_rank == 2 and V == 2 and layout.placement == "v"):
            out.append(name)
    return tuple(out)


def _from_torch(action) -> Item:
    from torch.distributed.pipelining.schedules import OVERLAP_F_B
    if action.computation_type == OVERLAP_F_B:
        subs = tuple(_from_torch(a) for a in action.sub_actions or ())
        if len(subs) != 2:
            raise ScheduleError(f"torch action {action}: an OVERLAP_F_B of {len(subs)} actions (moegraph pairs one F "
                                "with one B)")
        f = next((a for a in subs if a.kind == "F"), None)
        b = next((a for a in subs if a.kind == "B"), None)
        if f is None or b is None:
            raise ScheduleError(f"torch action {action}: OVERLAP_F_B of {subs[0]} and {subs[1]}; moegraph pairs an F "
                                "with a B")
        return Pair(f, b)
    kind = action.computation_type.value
    if kind not in ("F", "I", "W", "B") or action.microbatch_index is None:
        raise ScheduleError(f"torch action {action} is not a compute action of one micro-batch")
    return Action(kind, action.stage_index, action.microbatch_index)


def torch_orders(name: str, layout: StageLayout, micro_batches: int) -> Orders:
    """torch's ``name`` schedule for ``layout`` and M micro-batches, as per-rank orders."""
    if name not in TORCH_SCHEDULES:
        raise ScheduleError(f"torch schedule {name!r} is not one of {', '.join(TORCH_SCHEDULES)}")
    if name not in torch_schedules_for(layout):
        raise ScheduleError(f"torch's {name} does not fit a layout of {layout.virtual} stage(s) per rank placed "
                            f"{layout.placement!r}; it fits: {', '.join(torch_schedules_for(layout)) or 'none'}")
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    try:
        table = get_schedule_ops(name, layout.pp, micro_batches, layout.virtual)
    except (AssertionError, ValueError, RuntimeError) as err:
        raise ScheduleError(f"torch's {name} refuses pp={layout.pp}, vpp={layout.virtual}, "
                            f"micro_batches={micro_batches}: {err}") from None
    # torch's tables may carry the data-parallel sync point (REDUCE_GRAD) and FSDP's UNSHARD /
    # RESHARD: the step end moegraph prices itself (each stage's sync after its last backward)
    skip = {"REDUCE_GRAD", "UNSHARD", "RESHARD"}
    orders = tuple(tuple(_from_torch(a) for a in row if a is not None and a.computation_type.value not in skip)
                   for row in table)
    if name == "1F1B":
        orders = tuple(_renumber_last_forwards(row, micro_batches) for row in orders)
    for r, row in enumerate(orders):
        stages = {a.stage for item in row for a in ((item.forward, item.backward) if isinstance(item, Pair) else (item,))}
        if stages != set(layout.stages_of(r)):
            raise ScheduleError(f"torch's {name} runs stages {sorted(stages)} on rank {r}; the layout puts "
                                f"{list(layout.stages_of(r))} there")
    return orders


def torch_baselines(layout: StageLayout, micro_batches: int) -> tuple[dict[str, Orders], dict[str, str]]:
    """Every torch schedule whose placement is ``layout``'s, as orders, and those torch refuses
    for its P, V and M (name -> torch's reason: 1F1B and DualPipeV want at least as many
    micro-batches as stages). ScheduleError when torch refuses them all."""
    orders, refused = {}, {}
    for name in torch_schedules_for(layout):
        try:
            orders[name] = torch_orders(name, layout, micro_batches)
        except ScheduleError as err:
            refused[name] = str(err)
    if not orders:
        raise ScheduleError(f"torch.distributed.pipelining generates no schedule for pp={layout.pp}, "
                            f"vpp={layout.virtual} ({layout.placement}), micro_batches={micro_batches}: "
                            + "; ".join(refused.values()))
    return orders, refused


def _renumber_last_forwards(row: tuple[Item, ...], M: int) -> tuple[Item, ...]:
    """torch 2.13's ``Schedule1F1B._get_pipeline_order`` numbers the last rank's forwards 1..M
    (it starts its counter at 0 and increments before the first use when there is no warm-up);
    its runtime (``_step_microbatches``) runs 0..M-1 in that order. Exactly that pattern is
    shifted down by one; any other row is returned as read (and validated by the caller)."""
    forwards = [a.mb for a in row if isinstance(a, Action) and a.kind == "F"]
    if forwards != list(range(1, M + 1)):
        return row
    return tuple(Action("F", a.stage, a.mb - 1) if isinstance(a, Action) and a.kind == "F" else a for a in row)


def to_torch(orders: Orders) -> dict[int, list]:
    """Per rank, torch ``_Action``s of the order (a Pair becomes an OVERLAP_F_B of its F and B)."""
    from torch.distributed.pipelining.schedules import OVERLAP_F_B, _Action, _ComputationType

    def one(a: Action):
        return _Action(a.stage, _ComputationType.from_str(a.kind), a.mb)
    return {r: [_Action(-1, OVERLAP_F_B, None, (one(i.forward), one(i.backward))) if isinstance(i, Pair) else one(i)
                for i in row] for r, row in enumerate(orders)}


def recv_posts(orders: Orders, layout: StageLayout) -> dict[tuple[str, int, int], int]:
    """Where torch's runtime posts each receive of ``orders``: (``"fwd"`` or ``"bwd"``, receiving
    stage, micro-batch) -> how many of the receiving rank's items run before it. The runtime lowers
    the compute-only table with torch's own ``_add_send_recv`` (a receive goes into the receiver's
    list when the builder places the sender's compute, as early as its interleaving allows) and
    posts each receive when it reaches it; gloo and NCCL move a message once both ends are posted.
    Only receives across ranks are listed."""
    from torch.distributed.pipelining.schedules import RECV_B, RECV_F, _add_send_recv
    lowered = _add_send_recv(to_torch(orders), stage_to_rank=layout.rank_of, num_stages=len(layout.stages))
    out = {}
    for rank, actions in lowered.items():
        done = 0
        for a in actions:
            if a.computation_type in (RECV_F, RECV_B):
                out[("fwd" if a.computation_type == RECV_F else "bwd", a.stage_index, a.microbatch_index)] = done
            elif a.is_compute_op:
                done += 1
    return out


def csv_text(orders: Orders) -> str:
    """The order as torch's compute-only action CSV text (``_PipelineScheduleRuntime._load_csv``):
    one row per pipeline rank."""
    rows = to_torch(orders)
    text = io.StringIO(newline="")
    writer = csv.writer(text)
    for r in range(len(orders)):
        writer.writerow([str(a) for a in rows[r]])
    return text.getvalue()


def orders_hash(orders: Orders) -> str:
    """The pipeline schedule's hash: sha256 of its action CSV (``csv_text``), what ``write_csv``
    writes; the same orders give the same hash whichever front door compiled them."""
    return "sha256:" + hashlib.sha256(csv_text(orders).encode()).hexdigest()


def write_csv(orders: Orders, path: str | Path) -> Path:
    """The order as torch's compute-only action CSV (``csv_text``), written atomically."""
    return write_atomic(path, csv_text(orders))        # a kill leaves the old CSV or this one (moegraph.atomic)


def read_csv(path: str | Path) -> Orders:
    """An action CSV (as ``write_csv`` writes it, or torch's ``_dump_csv`` compute-only) as orders."""
    from torch.distributed.pipelining.schedules import _Action
    with Path(path).open(newline="") as f:
        return tuple(tuple(_from_torch(_Action.from_str(cell)) for cell in row if cell.strip()) for row in csv.reader(f))


