"""`moegraph run --schedule FILE`'s checks, before any rank starts: the file verifies
(``moegraph verify``'s checks, its hash included) and fits ``--memory-budget``
(``check_schedule_file``), and the graph lowered from its settings is the one it schedules
(``check_same_graph``): a file is run as written, never one it does not describe."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def check_schedule_file(schedule: Any, path: Path | str, memory_budget: int | None) -> None:
    """``run --schedule FILE.json`` before any work: the file passes the checks ``moegraph verify``
    makes (``moegraph.schedules.verify``: its hash, SM budgets the hardware allows, durations its
    cost model gives, its memory budget, ...), and its predicted peak fits ``--memory-budget``
    (a file is run as written, not rescheduled: a budget it breaks is refused, not ignored).
    UsageError naming the first violation, or both sizes."""
    from moegraph.options import UsageError, format_bytes
    from moegraph.schedules.gantt import peak_bytes
    from moegraph.schedules.verify import verdict
    found = verdict(schedule).violations
    if found and found[0].check == "hash":
        raise UsageError(f"--schedule {path}: its content does not hash to the hash it records (edited by hand?): "
                         f"re-run compile, or see `moegraph verify {path}`")
    if found:
        raise UsageError(f"--schedule {path} fails `moegraph verify`: {found[0]}")
    peak = peak_bytes(schedule)
    if memory_budget is not None and peak > memory_budget:
        made = (f"made under a budget of {format_bytes(schedule.memory_budget_bytes)}"
                if schedule.memory_budget_bytes is not None else "made under no budget")
        raise UsageError(f"--memory-budget {format_bytes(memory_budget)} is below the predicted peak "
                         f"{format_bytes(peak)} of --schedule {path} ({made}); run schedules a file as written: "
                         "compile one under that budget, or leave --memory-budget out")


def check_same_graph(graph: Any, schedule: Any, path: Path | str) -> None:
    """The graph lowered from the file's settings is the one the file schedules: the fields the
    file holds (strategy, dims, every node's op, costs and attributes) agree and so does its
    digest (``moegraph.ir.graph_digest``, which also covers the values), else PlanError naming
    the first difference. A file without a digest cannot be checked: refused (recompile it)."""
    from moegraph.runtime import PlanError
    if schedule.graph.get("digest") is None:
        raise PlanError(f"--schedule {path} records no graph digest (written before moegraph recorded one), so run "
                        "cannot check that it schedules this graph; recompile it (moegraph compile or tune)")
    if why := _model_difference(graph, schedule):
        raise PlanError(f"--schedule {path}: {why}; recompile it, or pass --model PATH to the model it was "
                        "compiled for")
    if why := _graph_difference(graph, schedule):
        raise PlanError(f"--schedule {path}: lowering its model with its settings gives a different graph than the "
                        f"file schedules: {why} (edited, or written by another moegraph version? recompile it)")


# the layer sizes a model fixes (moegraph.tracer.dims_of); b, s, n and k are run's own settings
MODEL_DIMS = ("h", "heads", "kv_heads", "head_dim", "ffn", "experts")


def _model_difference(graph: Any, schedule: Any) -> str | None:
    """In words, how the model the file was compiled for differs from the model its name loads
    (``graph``'s: lowered from that name), or None: a file whose model name was changed, or a
    registry model whose sizes changed since, is not a strategy or version difference."""
    mine, theirs = graph.dims, schedule.graph.get("dims")
    if not isinstance(theirs, dict):
        return None                   # no sizes to compare: _graph_difference names what differs
    differ = [k for k in MODEL_DIMS if getattr(mine, k) != theirs.get(k)]
    if not differ:
        return None
    name = schedule.graph.get("name")
    return (f"it names model {name} but was compiled for another model: its layer has "
            f"{', '.join(f'{k}={theirs.get(k)}' for k in differ)}, model {name} has "
            f"{', '.join(f'{k}={getattr(mine, k)}' for k in differ)}")


def _graph_difference(graph: Any, schedule: Any) -> str | None:
    """The first difference between ``graph`` and the graph ``schedule`` was written for, in
    words, or None."""
    from moegraph.ir import LATER_FIELDS
    from moegraph.schedules.schedule_file import graph_header, plain
    header = graph_header(graph)
    for key in ("strategy", "dims", "inputs", "outputs"):
        theirs = schedule.graph.get(key)
        if key == "strategy" and isinstance(theirs, dict):
            theirs = dict.fromkeys(LATER_FIELDS, 1) | theirs   # files from before these fields: their default
        if header[key] != theirs:
            return f"{key} {header[key]}, the file's {theirs}"
    names, scheduled = [n.name for n in graph.nodes], {n.name for n in schedule.nodes}
    if set(names) != scheduled:
        return f"nodes differ ({sorted(set(names) ^ scheduled)[:5]})"
    filed = schedule.node
    for n in graph.nodes:
        mine = {"op": n.op.value, "role": n.role.value, "phase": n.phase.value, "inputs": tuple(n.inputs),
                "outputs": tuple(n.outputs), "flops": n.flops, "mem_bytes": n.mem_bytes, "comm_bytes": n.comm_bytes,
                "group": n.group, "attrs": plain(dict(n.attrs)), "module": n.module, "block": n.block,
                "forward_of": n.forward_of}
        theirs = {k: getattr(filed[n.name], k) for k in mine}
        for k in mine:
            if mine[k] != theirs[k]:
                return f"node {n.name!r} has {k} {mine[k]!r}, the file's {theirs[k]!r}"
    if header["digest"] == schedule.graph["digest"]:
        return None
    # every node field the file holds agrees: the rest of the digest (values, parameters, gradients)
    return (f"values, parameters or gradients (graph digest {header['digest'][:12]}, the file's "
            f"{schedule.graph['digest'][:12]})")
