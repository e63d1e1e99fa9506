"""What the structural lowering cannot read from a module: small declarative tables, one row per
transformers family that needs one (keyed by the family's folder, ``transformers.models.<family>``).

Everything else is read from the modules themselves (``moegraph.lowering.structural``): which
submodules exist, their parameters' shapes, the attributes the class's forward reads, and the
configuration fields with the usual names. A row here only says what differs from those defaults;
a wrong row (or a missing one) cannot make a compile silently wrong, since every compile checks
each lowered layer against its eager module numerically (``moegraph.lowering.check``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Scoring = Literal["softmax", "sigmoid"]
GroupScore = Literal["top2-sum", "max"]


@dataclass(frozen=True)
class RouterRow:
    """How a family's router turns logits into top-k weights (``MoESpec``'s router fields); a field
    left None is read from the router itself (``structural.router_behaviour``: its forward's source
    and attributes).

    scoring:      softmax over the experts, or a sigmoid per expert.
    normalize:    renormalise the chosen weights to sum to 1: a bool, or the name of the
                  attribute (on the router, the block or the config) that says it.
    choice_bias:  attribute path (from the MoE block) of the score-correction bias added to the
                  scores for the choice only.
    choice_on:    what that bias is added to: the scores (DeepSeek-V3: sigmoid(logits) + bias) or
                  the logits before the scoring (Kolibri: top-k of logits + bias; the chosen
                  experts' sigmoid scores weigh them).
    group_score:  how an expert group ranks for grouped routing (n_group / topk_group):
                  the sum of its two best scores (DeepSeek-V3) or its best one (DeepSeek-V2).
    grouped:      the attribute that switches grouped routing on (e.g. topk_method), with the
                  value meaning "grouped"; None: grouped whenever n_group > 1.
    order:        'softmax-topk': the softmax over every expert, its top-k, renormalised (Mixtral,
                  Qwen); 'topk-softmax': the top-k of the logits, then the softmax over those k
                  (GPT-OSS). Equal in value, but only the second leaves the experts no token picks
                  exactly zero gradient (the first leaves rounding there, which AdamW amplifies);
                  the compiled router computes what the eager one does.
    """

    scoring: Scoring | None = None
    normalize: bool | str | None = None
    choice_bias: str | None = None
    choice_on: Literal["scores", "logits"] = "scores"
    group_score: GroupScore = "top2-sum"
    grouped: tuple[str, str] | None = None
    order: Literal["softmax-topk", "topk-softmax"] = "softmax-topk"


@dataclass(frozen=True)
class ExpertRow:
    """How a family stores its fused expert weights (3-D tensors [E, ., .]).

    gate_up:  'concat': gate rows then up rows (chunk(2)); 'interleaved': gate at even, up at odd
              positions (GPT-OSS).
    order:    'gate-up' (SwiGLU's silu(gate) * up) or 'up-gate' (the first half is the up projection).
    """

    gate_up: Literal["concat", "interleaved"] = "concat"
    order: Literal["gate-up", "up-gate"] = "gate-up"
    # three tensors of their own instead (paths below the experts module: gate, up, down), each flat
    # [E*f, h] (DBRX's mlp.w1, mlp.v1, mlp.w2; down used as rows @ w2, i.e. stored [f, h] per expert)
    separate: tuple[str, str, str] | None = None


@dataclass(frozen=True)
class ModelNames:
    """The children a causal LM and its base model hold (``moegraph.lowering.hf_common``): the base
    model's attribute, and in it the embedding, the decoder layers and the final norm (the rotary
    module is ``rotary_emb`` in every family)."""

    base: str = "model"
    embed: str = "embed_tokens"
    layers: str = "layers"
    norm: str = "norm"


@dataclass(frozen=True)
class Family:
    """One transformers family's row. Empty fields take the structural defaults."""

    router: RouterRow = field(default_factory=RouterRow)
    experts: ExpertRow = field(default_factory=ExpertRow)
    # the routing weight scales each expert's input rows, not its output (Llama 4)
    weighted_input: bool = False
    names: ModelNames = field(default_factory=ModelNames)


DEFAULT = Family()

FAMILIES: dict[str, Family] = {
    "mixtral": Family(router=RouterRow(normalize=True)),
    "deepseek_v2": Family(router=RouterRow(normalize=False, group_score="max",
                                           grouped=("topk_method", "group_limited_greedy"))),
    "minimax_m2": Family(router=RouterRow(choice_bias="e_score_correction_bias", normalize=True)),
    "ernie4_5_moe": Family(router=RouterRow(normalize=True, choice_bias="gate.moe_statics.e_score_correction_bias")),
    "kolibri1": Family(router=RouterRow(choice_on="logits")),
    # the block's never-trained expert_bias, passed to its router as a forward argument
    "afmoe": Family(router=RouterRow(choice_bias="expert_bias")),
    # top-k of its (biased) logits, then the softmax over the k
    "gpt_oss": Family(router=RouterRow(order="topk-softmax"), experts=ExpertRow(gate_up="interleaved")),
    "llama4": Family(weighted_input=True),
    # the top-k weights divided by their p-norm, p = ffn_config.moe_normalize_expert_weights (1: their sum);
    # separate flat expert tensors; a base model 'transformer' of wte, blocks, norm_f
    "dbrx": Family(router=RouterRow(normalize="moe_normalize_expert_weights"),
                   experts=ExpertRow(separate=("mlp.w1", "mlp.v1", "mlp.w2")),
                   names=ModelNames(base="transformer", embed="wte", layers="blocks", norm="norm_f")),
}


def family_row(family: str | None) -> Family:
    return FAMILIES.get(family or "", DEFAULT)
