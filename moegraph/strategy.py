"""The layer strategy: how one layer is parallelised, lowered and rematerialized (``Strategy``),
its typed choices, and ``ConfigError``, the one error an invalid model/strategy combination raises.

Notation (MegaScale-MoE Table 1): n, the group size a layer spans (TP/SP/EP degree); N, nodes.
Every name here stays importable from ``moegraph.ir``.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal, Mapping


Attn = Literal["tp", "sp"]
"""Attention parallelism: tensor-parallel heads, or Ulysses sequence parallelism."""
Ffn = Literal["tp", "ep"]
"""Expert parallelism: each expert's h_ffn split n ways, or E/n whole experts per rank."""
Dispatch = Literal["a2a", "ag-rs"]
"""Token dispatch: all-to-all, or all-gather + reduce-scatter (the only one under ffn='tp')."""
ActDtype = Literal["bf16", "fp32"]
"""Activation dtype."""


def valid_dispatches(ffn: Ffn) -> tuple[Dispatch, ...]:
    """The dispatches an FFN parallelism admits: tensor-parallel experts see every token, so
    only ag-rs; expert parallelism either."""
    if ffn == "ep":
        return ("a2a", "ag-rs")
    if ffn == "tp":
        return ("ag-rs",)
    raise ValueError(f"ffn={ffn!r} is not one of 'tp', 'ep'")


Gate = Literal["after-fc2", "before-fc2"]
"""Where routing weights multiply: at the combine (after FC2) or into SwiGLU's output (before)."""
Remat = Literal["none", "paper", "budget"]
"""Rematerialization policy (moegraph.passes.sar): none, Fig 9's, or the cheapest under a byte budget."""
Compress = Literal["none", "dp-bf16", "tp-fp8", "ep-fp8"]
"""Wire compression (moegraph.passes.compress): none, BF16 data-parallel gradient reductions, FP8
tensor-parallel activation reductions, or the FP8 token dispatch (DeepSeek-V3, DeepEP)."""
Fuse = Literal["auto", "all", "none"]
"""Fused comm+compute groups marked (moegraph.passes.fuse): the faster ones, every eligible one, or none."""
class ConfigError(ValueError):
    """An invalid model/strategy combination; the message names every factor involved."""


@dataclass(frozen=True)
class Strategy:
    """How one layer is parallelised, lowered and rematerialized: one typed, validated value.

    Lowering reads attn, ffn, dispatch, n, dtype, dp, chunks, gate, ep_nodes and attn_nodes; remat (and remat_budget),
    compress and fuse record the rewrites applied (``moegraph.passes``: sar, compress, fuse), so
    the typed fields alone rebuild the graph (``CompileConfig(passes=RECORDED)``); passes holds
    the labels of the passes that produced it. Invalid values raise ConfigError naming every offending
    field at once. Divisibility by the model's sizes is checked where the sizes are known
    (``moegraph.builder.check_strategy``).
    """

    attn: Attn
    """'tp' | 'sp'."""
    ffn: Ffn
    """'tp' | 'ep'."""
    dispatch: Dispatch
    """'a2a' | 'ag-rs'; 'a2a' needs ffn='ep'."""
    n: int
    """Group size n (TP/SP/EP degree), >= 1."""
    dtype: ActDtype = "bf16"
    """Activation dtype."""
    chunks: int = 1
    """Token chunks N >= 1 of each block (comm/compute overlap; lowering/blocks.py)."""
    remat: Remat = "none"
    """The rematerialization policy applied: 'none' (not rematerialized), 'paper', 'budget'."""
    gate: Gate = "after-fc2"
    """Routing-weight placement (the gate-reorder pass chooses 'before-fc2')."""
    dp: int = 1
    """Data-parallel degree D >= 1."""
    passes: tuple[str, ...] = ()
    """Labels of the passes that produced the graph, in run order (a record, never parsed back)."""
    remat_budget: int | None = None
    """Activation-byte budget of remat='budget' (None otherwise)."""
    compress: Compress = "none"
    """The wire compression applied (the compress pass records its mode)."""
    fuse: Fuse = "none"
    """The fuse choice that marked fused groups ('none': no group is marked, also when fuse chose none)."""
    ep_nodes: int = 1
    """Nodes N (of n/N ranks) the token dispatch spans: N > 1 (ffn='ep', dispatch='a2a') sends each token
    once per destination node, then over NVLink, as DeepEP (moegraph.lowering.node_dispatch)."""
    attn_nodes: int = 1
    """Groups N the attention is data-parallel over (per-module parallelism, Megatron-Core's "MoE parallel
    folding"): N > 1 runs the attention TP or SP over n/N consecutive ranks (axis 'attn'; a node's, or
    a part of one) on b/N of the batch, while the experts stay EP over all n ranks (ffn='ep',
    dispatch='a2a'); each rank holds tokens [b/N, s/(n/N), h] between blocks (moegraph.token_layout)."""

    def __post_init__(self):
        problems = []
        for f in dataclasses.fields(self):
            choices = typing.get_args(_LITERALS.get(f.name))
            if choices and getattr(self, f.name) not in choices:
                problems.append(f"{f.name}={getattr(self, f.name)!r} is not one of {', '.join(map(repr, choices))}")
        for name in ("n", "chunks", "dp", "ep_nodes", "attn_nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r} must be a positive integer")
        if (self.ffn in typing.get_args(Ffn) and self.dispatch in typing.get_args(Dispatch)
                and self.dispatch not in valid_dispatches(self.ffn)):
            problems.append("dispatch='a2a' needs ffn='ep' (tensor-parallel experts see every token: use "
                            "dispatch='ag-rs')")
        nodes = self.ep_nodes
        if isinstance(nodes, int) and not isinstance(nodes, bool) and nodes > 1 and isinstance(self.n, int):
            if self.ffn != "ep" or self.dispatch != "a2a":
                problems.append(f"ep_nodes={nodes} needs ffn='ep' and dispatch='a2a' (got ffn={self.ffn!r}, "
                                f"dispatch={self.dispatch!r}): only an expert all-to-all crosses nodes per token")
            elif self.n % nodes or self.n // nodes < 2:
                problems.append(f"ep_nodes={nodes} must divide n={self.n} into nodes of at least 2 ranks")
        attn = self.attn_nodes
        if isinstance(attn, int) and not isinstance(attn, bool) and attn > 1 and isinstance(self.n, int):
            if self.ffn != "ep" or self.dispatch != "a2a":
                problems.append(f"attn_nodes={attn} needs ffn='ep' and dispatch='a2a' (got ffn={self.ffn!r}, "
                                f"dispatch={self.dispatch!r}): only expert parallelism takes tokens from every "
                                "rank's own batch rows")
            elif self.n % attn:
                problems.append(f"attn_nodes={attn} must divide n={self.n} (the attention runs on n/attn_nodes ranks)")
            elif nodes > 1 and attn % nodes:
                problems.append(f"attn_nodes={attn} must be a multiple of ep_nodes={nodes}: each attention's "
                                f"n/attn_nodes ranks lie in one of the dispatch's nodes")
        budget = self.remat_budget
        if self.remat == "budget" and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            problems.append(f"remat='budget' needs remat_budget, a byte count >= 0 (got {budget!r})")
        if self.remat != "budget" and budget is not None:
            problems.append(f"remat_budget={budget!r} is only valid with remat='budget' (remat={self.remat!r})")
        if not isinstance(self.passes, tuple) or not all(isinstance(p, str) for p in self.passes):
            problems.append(f"passes={self.passes!r} must be a tuple of pass labels")
        if problems:
            raise ConfigError("; ".join(problems))

    @property
    def attn_ranks(self) -> int:
        """G, the ranks one attention spans: n / attn_nodes."""
        return self.n // self.attn_nodes

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"passes": list(self.passes)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Strategy":
        """Inverse of ``as_dict`` (a schedule file's graph.strategy); unknown keys are a ConfigError."""
        names = {f.name for f in dataclasses.fields(cls)}
        extra = sorted(set(data) - names)
        if extra:
            raise ConfigError(f"strategy: unknown field {extra[0]!r}; valid: {', '.join(sorted(names))}")
        return cls(**{**data, "passes": tuple(data.get("passes", ()))})

    def label(self) -> str:
        """One line for tables: 'sp+ep a2a   chunks=2 remat=paper'."""
        remat = f"budget:{self.remat_budget}" if self.remat == "budget" else self.remat
        return f"{self.attn}+{self.ffn} {self.dispatch:<5} chunks={self.chunks} remat={remat}{node_fields(self)}"


LATER_FIELDS = ("ep_nodes", "attn_nodes")
"""Strategy fields added after schedule files and tune caches were first written (default 1 each)."""


def node_fields(strategy: Strategy | Mapping[str, Any]) -> str:
    """' ep_nodes=N attn_nodes=N' for the node fields a strategy (or its as_dict) sets, for reports."""
    get = strategy.get if isinstance(strategy, Mapping) else lambda f, default: getattr(strategy, f)
    return "".join(f" {f}={v}" for f in LATER_FIELDS if (v := get(f, 1)) > 1)


_LITERALS = {"attn": Attn, "ffn": Ffn, "dispatch": Dispatch, "dtype": ActDtype, "remat": Remat, "gate": Gate,
             "compress": Compress, "fuse": Fuse}
