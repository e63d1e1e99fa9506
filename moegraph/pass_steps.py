"""The pass pipeline as typed values: one frozen step per pass, with typed arguments.

    CompileConfig(model="mixtral-8x7b", passes=(GateReorder(), Sar("paper")))

A step names a pass of ``moegraph.passes`` (which builds and runs it: the pass manager) and its
argument as a typed field; ``None`` means the pass's own default, and keeps the step's label
bare (``gate-reorder``, not ``gate-reorder=before-fc2``), as the label is what a graph records
in ``Strategy.passes``. Each step validates its argument on construction (ValueError, the
reason only: ``parse_passes`` names the pass and the valid arguments around it).

The pipeline's text form ("gate-reorder,sar=paper") exists only at the edges where people
type it: the CLI's ``--passes`` and ``moegraph.compile(passes="...")`` call ``parse_passes``
once, and everything after holds these values. The order a pipeline runs in is the pass
manager's (each pass's stage), not the order written.

This module sits in the first stage because ``CompileConfig`` (moegraph.config) holds the
pipeline and ``DEFAULT_PASSES``; the pass manager (a later stage) imports them.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from typing import ClassVar, Literal, Union

from moegraph.ir import Fuse as FuseMode, Gate, Strategy
from moegraph.sizes import exact_byte_size, parse_byte_size


class PassError(ValueError):
    """A bad pipeline, or a pass that failed; the message names the pass (and its predecessors)."""


def label(name: str, arg: str | None) -> str:
    """A pass's label as graphs record it: ``name`` or ``name=arg``."""
    return name if arg is None else f"{name}={arg}"


@dataclass(frozen=True)
class GateReorder:
    """gate-reorder: routing weights multiplied in before FC2 ('before-fc2', the default;
    MegaScale-MoE §4.1) or after it ('after-fc2'). A re-lowering pass."""

    order: Gate | None = None
    """None: the pass's default, 'before-fc2' (label ``gate-reorder``)."""

    NAME: ClassVar[str] = "gate-reorder"
    VALID: ClassVar[str] = "before-fc2 (the default), after-fc2"

    def __post_init__(self):
        if self.order is not None and self.order not in typing.get_args(Gate):
            raise ValueError("not a gate order")

    @property
    def arg(self) -> str | None:
        return self.order

    @classmethod
    def from_text(cls, arg: str | None) -> "GateReorder":
        return cls(arg)


DispatchChoice = Literal["auto", "a2a", "ag-rs"]


@dataclass(frozen=True)
class Dispatch:
    """dispatch: the MoE token dispatch, all-to-all or all-gather + reduce-scatter; 'auto'
    (the default) keeps the one with the smaller predicted time. A re-lowering pass."""

    mode: DispatchChoice | None = None
    """None: the pass's default, 'auto' (label ``dispatch``)."""

    NAME: ClassVar[str] = "dispatch"
    VALID: ClassVar[str] = "auto (the default), a2a, ag-rs"

    def __post_init__(self):
        if self.mode is not None and self.mode not in typing.get_args(DispatchChoice):
            raise ValueError("not a dispatch mode")

    @property
    def arg(self) -> str | None:
        return self.mode

    @classmethod
    def from_text(cls, arg: str | None) -> "Dispatch":
        return cls(arg)


@dataclass(frozen=True)
class Chunk:
    """chunk: N token chunks per block for comm/compute overlap; 'auto' (the default) searches
    N on a predicted two-stream schedule. A re-lowering pass."""

    count: int | Literal["auto"] | None = None
    """A chunk count N >= 1 (dividing s/n, checked on the graph), 'auto', or None (the pass's
    default, 'auto'; label ``chunk``)."""

    NAME: ClassVar[str] = "chunk"
    VALID: ClassVar[str] = "auto (the default), or a chunk count N >= 1 dividing s/n"

    def __post_init__(self):
        c = self.count
        if c is not None and c != "auto" and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError("not a positive integer")

    @property
    def arg(self) -> str | None:
        return None if self.count is None else str(self.count)

    @classmethod
    def from_text(cls, arg: str | None) -> "Chunk":
        if arg is None or arg == "auto":
            return cls(arg)
        if not arg.isdigit():
            raise ValueError("not a positive integer")
        return cls(int(arg))


CompressChoice = Literal["dp-bf16", "tp-fp8", "ep-fp8"]


@dataclass(frozen=True)
class Compress:
    """compress: collectives on the wire in a narrower format: 'dp-bf16' the data-parallel gradient
    sync, 'tp-fp8' the tensor-parallel activation reduce-scatters (MegaScale-MoE §5), 'ep-fp8' the
    token dispatch all-to-all (DeepSeek-V3 §3.3)."""

    mode: CompressChoice
    """Required: the pass has no default mode."""

    NAME: ClassVar[str] = "compress"
    VALID: ClassVar[str] = ", ".join(typing.get_args(CompressChoice))

    def __post_init__(self):
        if self.mode not in typing.get_args(CompressChoice):
            raise ValueError("a mode is required" if self.mode is None else "not a compression mode")

    @property
    def arg(self) -> str | None:
        return self.mode

    @classmethod
    def from_text(cls, arg: str | None) -> "Compress":
        return cls(arg)


SarPolicy = Literal["paper", "none", "budget"]


@dataclass(frozen=True)
class Sar:
    """sar: selective activation rematerialization: the paper's keep-set ('paper', the
    default), none, or the cheapest keep-set within an activation budget ('budget')."""

    policy: SarPolicy | None = None
    """None: the pass's default, 'paper' (label ``sar``)."""
    budget_bytes: int | None = None
    """With policy 'budget' only: the activation budget in bytes (a whole stack's, shared by
    its layers)."""
    keep_search_s: float | None = None
    """With policy 'budget' only: the keep-set search's effort in deterministic seconds (None:
    the pass's default, ``moegraph.passes.sar.KEEP_SEARCH_S``)."""

    NAME: ClassVar[str] = "sar"
    VALID: ClassVar[str] = "paper (the default), none, budget:<bytes>[:<seconds>s] (e.g. budget:2GiB, budget:2GiB:120s)"

    def __post_init__(self):
        if self.policy is not None and self.policy not in typing.get_args(SarPolicy):
            raise ValueError("not a policy")
        budget, limit = self.budget_bytes, self.keep_search_s
        if self.policy == "budget":
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
                raise ValueError(f"budget_bytes={budget!r} must be a byte count >= 0")
            if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))
                                      or not math.isfinite(limit) or limit <= 0):
                raise ValueError(f"keep_search_s={limit!r} must be a positive number of seconds")
        elif budget is not None or limit is not None:
            raise ValueError(f"budget_bytes and keep_search_s go with policy 'budget' (policy={self.policy!r})")

    @property
    def arg(self) -> str | None:
        if self.policy != "budget":
            return self.policy
        # the budget in its largest exact binary unit: the label reads as people write it (budget:3GiB)
        return (f"budget:{exact_byte_size(self.budget_bytes)}"
                + ("" if self.keep_search_s is None else f":{self.keep_search_s:g}s"))

    @classmethod
    def from_text(cls, arg: str | None) -> "Sar":
        if arg is None or not arg.startswith("budget:"):
            return cls(arg)
        size, _, limit = arg[len("budget:"):].partition(":")
        seconds = None
        if limit:                               # budget:<bytes>:<seconds>s
            try:
                if not limit.endswith("s"):
                    raise ValueError
                seconds = float(limit[:-1])
            except ValueError:
                raise ValueError(f"keep-set search limit {limit!r} must be seconds, e.g. 120s") from None
        return cls("budget", parse_byte_size(size), seconds)


@dataclass(frozen=True)
class Fuse:
    """fuse: mark tile-level fused comm+compute groups: 'auto' (the default) where the fused
    price wins, 'all', or 'none'."""

    mode: FuseMode | None = None
    """None: the pass's default, 'auto' (label ``fuse``)."""

    NAME: ClassVar[str] = "fuse"
    VALID: ClassVar[str] = "auto (the default), all, none"

    def __post_init__(self):
        if self.mode is not None and self.mode not in typing.get_args(FuseMode):
            raise ValueError(f"not one of {', '.join(typing.get_args(FuseMode))}")

    @property
    def arg(self) -> str | None:
        return self.mode

    @classmethod
    def from_text(cls, arg: str | None) -> "Fuse":
        return cls(arg)


PassStep = Union[GateReorder, Dispatch, Chunk, Compress, Sar, Fuse]
"""One step of a user's pass pipeline."""

STEPS: dict[str, type] = {cls.NAME: cls for cls in (GateReorder, Dispatch, Chunk, Compress, Sar, Fuse)}
"""Pass name -> its step type: the passes a pipeline may name."""

DEFAULT_PASSES: tuple[PassStep, ...] = (GateReorder(), Sar("paper"))
"""The paper's configuration (§4.1): gating applied before FC2, Fig 9's rematerialization. The one
default pipeline of every command, of ``moegraph.compile`` and of ``CompileConfig``."""


def step_label(step: PassStep) -> str:
    """The label a graph records for ``step`` (``Strategy.passes``)."""
    return label(step.NAME, step.arg)


def parse_passes(text: str) -> tuple[PassStep, ...]:
    """A pipeline's text form -> its steps: ``"gate-reorder,sar=paper"``; '' or 'none' for no
    passes. Unknown names, a name given twice and bad arguments raise PassError naming them."""
    if not isinstance(text, str):
        raise PassError(f"pipeline {text!r} is not text (give the typed steps as a tuple)")
    if not text.strip() or text.strip().lower() == "none":
        return ()
    out: list[PassStep] = []
    for item in (item.strip() for item in text.split(",")):
        if not item:
            raise PassError(f"empty pass name in pipeline {text!r}; valid: {', '.join(sorted(STEPS))}")
        name, eq, arg = item.partition("=")
        name, arg = name.strip(), (arg.strip() if eq else None)
        if name not in STEPS:
            raise PassError(f"unknown pass {name!r}; valid: {', '.join(sorted(STEPS))}")
        if any(name == seen.NAME for seen in out):
            raise PassError(f"pass {name!r} is given twice in pipeline {text!r}")
        try:
            out.append(STEPS[name].from_text(arg))
        except ValueError as err:
            raise PassError(f"pass {name!r}: invalid argument {arg!r} ({err}); valid: {STEPS[name].VALID}") from err
    return tuple(out)


def check_steps(steps: tuple) -> tuple[PassStep, ...]:
    """``steps`` if it is a tuple of pass steps, each named once; else PassError naming the bad one."""
    if not isinstance(steps, tuple):
        raise PassError(f"passes={steps!r} must be a tuple of pass steps (moegraph.pass_steps), e.g. "
                        "(GateReorder(), Sar('paper'))")
    seen: set[str] = set()
    for step in steps:
        if type(step) not in STEPS.values():
            raise PassError(f"passes: {step!r} is not a pass step; valid: "
                            f"{', '.join(cls.__name__ for cls in STEPS.values())}")
        if step.NAME in seen:
            raise PassError(f"pass {step.NAME!r} is given twice in pipeline {steps!r}")
        seen.add(step.NAME)
    return steps


def steps_for(strategy: Strategy) -> tuple[PassStep, ...]:
    """The pipeline that turns the plain lowering of ``strategy`` into the graph its typed fields
    describe: gate-reorder when gate='before-fc2', chunk=N when N > 1, then compress, sar and fuse
    as recorded. What ``moegraph tune`` compiles each candidate with (no text in between)."""
    out: list[PassStep] = []
    if strategy.gate == "before-fc2":
        out.append(GateReorder())
    if strategy.chunks > 1:
        out.append(Chunk(strategy.chunks))
    if strategy.compress != "none":
        out.append(Compress(typing.cast(CompressChoice, strategy.compress)))
    if strategy.remat == "budget":
        out.append(Sar("budget", strategy.remat_budget))
    elif strategy.remat != "none":
        out.append(Sar(strategy.remat))
    if strategy.fuse != "none":
        out.append(Fuse(strategy.fuse))
    return tuple(out)


__all__ = ["Chunk", "Compress", "DEFAULT_PASSES", "Dispatch", "Fuse", "GateReorder", "PassError", "PassStep", "STEPS",
           "Sar", "check_steps", "label", "parse_passes", "step_label", "steps_for"]
