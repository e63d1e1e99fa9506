"""Lowering rules: nn.Module types -> block specs the emitters in ``blocks`` understand.

transformers' families need no rule file: their decoder layers' parts are recognised by
structure (``structural.py``, with the small per-family tables of ``families.py``) and whole
causal LMs by their children (``hf_common.py``). A module class of another library plugs in with
a rule file that calls ``register`` for each of its module types (see ``reference.py``). A rule reads the module's sizes and the
qualified names of its parameters; it never builds nodes itself, so every family shares the
same, tested, strategy-dependent lowering. What one rule file can describe is therefore
bounded by the block specs: a module computing anything the specs cannot say (another norm,
a bias, a shared expert, a different router) needs new spec fields and ops, not just a rule.

Never silently wrong: a rule stands for the exact class it was registered for.
  * A subclass inherits its parent's rule only if it overrides neither ``forward`` nor any
    method the rule names in ``methods``; otherwise ``find_rule`` raises naming the class.
  * The rule's ``children`` (submodules whose forward the rule also stands for: the router,
    the experts) must be exactly the registered types.
  * After lowering, the tracer checks that every parameter and buffer of the layer reached
    the graph (``ParamSource`` names), unless a rule declares it ``unused`` with a reason.
  * Before tracing, ``check_patches_and_hooks`` refuses what the rules cannot see: a replaced
    ``forward`` (instance attribute or class-level swap) and module hooks.

Whole causal language models plug in with ``register_model``: a model rule recognises the
model's parts (embedding, decoder-layer list, final norm, LM head) by exact class and exact
children, checks the configuration settings those parts read, and returns a ModelSpec. The
model is never traced as a whole: its decoder layers are lowered with the layer rules above.
"""

from __future__ import annotations

import enum
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Mapping

from torch import nn

from moegraph.edges import AuxLoss, EdgeHead
from moegraph.lowering.blocks import AttentionSpec, MLASpec, MLPSpec, MoESpec, NormSpec
from moegraph.lowering.specs import ExpertsSpec, RouterSpec

BlockSpec = NormSpec | AttentionSpec | MLASpec | MoESpec | MLPSpec | RouterSpec | ExpertsSpec   # the last two: folded (parallel_ffn)
SpecRule = Callable[[nn.Module, str], BlockSpec]


class LoweringError(NotImplementedError):
    """A module or operation with no (exact) lowering rule; one line naming it."""


@dataclass(frozen=True)
class Rule:
    """How one module class lowers. ``fn(module, qualname)`` returns its block spec.

    methods:  methods of ``module_type`` besides ``forward`` whose behaviour the spec stands
              for; a subclass overriding any of them needs its own rule.
    children: submodule attribute -> the exact type the spec assumes it has.
    unused:   parameter or buffer name (relative to the module) -> why the graph need not
              read it; everything else the module holds must reach the graph.
    """

    module_type: type
    fn: SpecRule
    methods: tuple[str, ...] = ()
    children: Mapping[str, type] = field(default_factory=dict)
    unused: Mapping[str, str] = field(default_factory=dict)

    def spec(self, module: nn.Module, qualname: str) -> BlockSpec:
        for attr, expected in self.children.items():
            child = getattr(module, attr, None)
            if type(child) is not expected:
                raise LoweringError(f"{_join(qualname, attr)!r} ({_type_name(child)}): the rule for "
                                    f"{self.module_type.__name__} assumes a {expected.__name__} here; "
                                    f"register a rule for {type(module).__name__} that describes it")
        return self.fn(module, qualname)


_RULES: dict[type, Rule] = {}
_FAMILIES_LOADED = False


def register(module_type: type, *, methods: tuple[str, ...] = (), children: Mapping[str, type] | None = None,
             unused: Mapping[str, str] | None = None) -> Callable[[SpecRule], SpecRule]:
    """Decorator: ``@register(MyAttention)`` on a function (module, qualname) -> block spec."""
    def wrap(fn: SpecRule) -> SpecRule:
        _RULES[module_type] = Rule(module_type, fn, tuple(methods), dict(children or {}), dict(unused or {}))
        return fn
    return wrap


def find_rule(module: nn.Module, qualname: str = "") -> Rule | None:
    """The rule for ``type(module)``; None if neither it nor an ancestor has one.

    A subclass of a rule-backed class that overrides a method the rule stands for raises
    LoweringError naming the class: its parent's rule would describe different math.
    """
    _load_families()
    cls = type(module)
    _require_supported_library(cls)
    if cls in _RULES:
        return _RULES[cls]
    if "transformers" in sys.modules or not _guard_on():
        from moegraph.lowering.structural import structural_rule
        rule = structural_rule(module, qualname)
        if rule is not None:
            return rule
    for base in cls.__mro__[1:]:
        rule = _RULES.get(base)
        if rule is None:
            continue
        overridden = [m for m in ("forward", *rule.methods) if getattr(cls, m, None) is not getattr(base, m, None)]
        if overridden:
            raise LoweringError(f"{repr(qualname) if qualname else 'the layer'} ({cls.__module__}.{cls.__name__}) subclasses {base.__name__} "
                                f"but overrides {', '.join(overridden)}: {base.__name__}'s lowering rule does not "
                                f"describe it; register a rule for {cls.__name__}")
        return rule
    return None


def _require_supported_library(cls: type) -> None:
    """For a transformers class (a model, layer or block), one LoweringError when the installed
    transformers is outside the supported range (``structural.require_supported_transformers``)."""
    if any(c.__module__.startswith("transformers.") for c in cls.__mro__):
        from moegraph.lowering.structural import require_supported_transformers
        require_supported_transformers()


def check_patches_and_hooks(root: nn.Module) -> None:
    """Raise naming the first module of ``root`` (the layer or model being compiled) whose
    behaviour its rules do not see: the compiled graph is built from rules and parameters, so a
    replaced forward (on the instance, or a class-level swap: a function the class's own module
    did not define, as kernel-swapping libraries install) and module hooks (forward, pre-forward,
    backward; per module or global) would be dropped silently."""
    from torch.nn.modules import module as torch_module
    for kind in ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks"):
        if getattr(torch_module, f"_global_{kind}", None):
            raise LoweringError(f"a global module {kind[:-1].replace('_', ' ')} is registered (torch.nn.modules.module."
                                f"register_module_{kind[:-1]}): the compiled model would not run it; remove it "
                                "before compiling")
    for name, p in root.named_parameters():
        hooks = [*(getattr(p, "_backward_hooks", None) or {}).values(),
                 *(getattr(p, "_post_accumulate_grad_hooks", None) or {}).values()]
        if hooks:
            raise LoweringError(f"parameter {name!r} has a gradient hook ({_function_name(hooks[0])}): the compiled "
                                "model computes the gradients of its own shards and would not run it; remove it "
                                "(handle.remove()) before compiling, or register it on the compiled model's parameters")
    for qualname, m in root.named_modules():
        where = f"{qualname!r} ({type(m).__name__})" if qualname else f"the compiled {type(m).__name__}"
        for kind in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks"):
            hooks = [h for h in getattr(m, kind, {}).values() if not _observes_only(h)]
            if hooks:
                raise LoweringError(f"{where} has a {kind[1:-1].replace('_', ' ')} "
                                    f"({_function_name(hooks[0])}): the compiled model would not run it; remove it "
                                    "(handle.remove(), or the library call that added it) before compiling, or apply "
                                    "it to the compiled module's output")
        if "forward" in m.__dict__:
            # accelerate's add_hook_to_module wraps forward on the instance and marks it with _hf_hook
            undo = ("accelerate.hooks.remove_hook_from_module(model, recurse=True)" if hasattr(m, "_hf_hook")
                    else "delete the instance attribute, or subclass and register a rule")
            raise LoweringError(f"{where}.forward is replaced on the instance ({_function_name(m.__dict__['forward'])}): "
                                f"the compiler lowers the class's forward; {undo}")
        owner = next(c for c in type(m).__mro__ if "forward" in c.__dict__)
        fn = owner.__dict__["forward"]
        if owner is not nn.Module and not _is_original_forward(owner, fn):
            raise LoweringError(f"{where}: {owner.__module__}.{owner.__qualname__}.forward is replaced by "
                                f"{_function_name(fn)} (a class-level patch): the lowering rule describes the original "
                                "forward; undo the patch before compiling")


TRAIN_ONLY_ATTRS = ("attention_dropout", "jitter_noise")     # transformers' attention dropout, router jitter


def train_only_settings(root: nn.Module) -> tuple[str, ...]:
    """``qualname.attr=value`` for each nonzero setting of ``root`` that acts only in training mode
    (dropout, router jitter): the rules refuse them in training mode, so a module compiled in
    eval mode with one must refuse ``.train()`` too (the compiled graph never applies them)."""
    found = []
    for qualname, m in root.named_modules():
        prefix = f"{qualname}." if qualname else ""
        if isinstance(m, nn.Dropout) and m.p > 0:
            found.append(f"{qualname or type(m).__name__} (Dropout p={m.p})")
        for attr in TRAIN_ONLY_ATTRS:
            value = getattr(m, attr, 0)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                found.append(f"{prefix}{attr}={value}")
    return tuple(found)


# transformers' hooks that change nothing the compiled model computes, by (module, qualname suffix):
#   output_capturing_hook      installed for good by the first forward asking for output_hidden_states /
#                              output_attentions / router logits: it only appends outputs to a collector
#                              active inside the original's forward and returns None;
#   make_inputs_require_grads  installed on the input embedding by enable_input_require_grads (which
#                              gradient_checkpointing_enable and peft's k-bit preparation call): it marks
#                              the embedding output as requiring grad so that checkpointed layers behind
#                              a frozen embedding still get gradients; the compiled layers get theirs
#                              whatever the embedding's flag
_HARMLESS_HOOKS = (("transformers.utils.output_capturing", ".output_capturing_hook"),
                   ("transformers.modeling_utils", "enable_input_require_grads.<locals>.make_inputs_require_grads"))


def _observes_only(hook: object) -> bool:
    """Whether ``hook`` is one of transformers' hooks in _HARMLESS_HOOKS."""
    module, qualname = getattr(hook, "__module__", None), getattr(hook, "__qualname__", "")
    return any(module == m and qualname.endswith(q) for m, q in _HARMLESS_HOOKS)


def _is_original_forward(owner: type, fn: object) -> bool:
    """Whether ``fn``, found as ``owner.forward``, is the forward ``owner``'s own class body
    defined, possibly under decorators from torch or transformers (``can_return_tuple``, the
    checkpointing wrapper, ``torch.no_grad``). The names alone do not tell: ``functools.wraps``
    copies ``__module__`` and ``__qualname__`` onto a patch, so the test reads each function's code
    object, which it cannot copy, along the ``__wrapped__`` chain."""
    libraries = [sys.modules.get(name) for name in ("torch", "transformers")]
    library_dirs = tuple(os.path.dirname(lib.__file__) + os.sep for lib in libraries if lib is not None)
    source = getattr(sys.modules.get(owner.__module__), "__file__", None)
    while True:
        code, inner = getattr(fn, "__code__", None), getattr(fn, "__wrapped__", None)
        if code is None:
            return False
        # co_qualname (Python >= 3.11) cannot be copied by functools.wraps; on 3.10 the name check
        # falls back to __qualname__ and only the file tells a patch apart
        qualname = getattr(code, "co_qualname", getattr(fn, "__qualname__", None))
        if qualname == f"{owner.__qualname__}.forward" and source in (None, code.co_filename):
            return inner is None
        # a decorator's wrapper: torch's, transformers', or one the class's own file defines
        if inner is None or not (code.co_filename.startswith(library_dirs) or code.co_filename == source):
            return False
        fn = inner


def _function_name(fn: object) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


class ModelOutput(enum.Enum):
    """What a recognised model's forward returns."""

    CAUSAL_LM = "causal-lm"      # .loss (with labels) and .logits, from an LM head
    HIDDEN = "hidden"            # .last_hidden_state: the final norm's output (a base model)


@dataclass(frozen=True)
class ModelSpec:
    """A causal LM's parts, by qualified name in the model (names of parameters, not modules).

    embed:       the token embedding's weight [vocab, h]; ``padding_idx`` its row that gets no
                 gradient (nn.Embedding's padding_idx), or None.
    layers:      the nn.ModuleList of decoder layers, applied in order to the embedding.
    norm:        the final norm's weight [h], applied to the last layer's output; ``norm_bias``
                 its bias [h] (a LayerNorm's), or None.
    head:        the LM head's weight [vocab, h] (no bias), or None for a base model.
    edge_head:   what the final norm and the logits compute (``moegraph.edges.EdgeHead``: the norm's
                 kind, eps and bias, the logits' scale and soft cap).
    unused:      other parameters or buffers of the model -> why nothing needs to read them.
    aux_loss:    the router's auxiliary load-balancing loss the causal LM adds to its loss
                 (transformers' ``output_router_logits=True``: ``moegraph.edges.AuxLoss``), or None.
    tied:        the head's weight is the embedding's (tie_word_embeddings): one parameter.
    """

    embed: str
    padding_idx: int | None
    layers: str
    norm: str
    head: str | None
    output: ModelOutput
    edge_head: EdgeHead
    unused: Mapping[str, str] = field(default_factory=dict)
    aux_loss: AuxLoss | None = None
    tied: bool = False
    norm_bias: str | None = None

    def __post_init__(self):
        if self.edge_head.bias != (self.norm_bias is not None):
            raise ValueError(f"ModelSpec: edge_head.bias={self.edge_head.bias} but norm_bias={self.norm_bias!r}")
        if self.head is None and not self.edge_head.plain:
            raise ValueError(f"ModelSpec: a base model (no LM head) has no logit scale or soft cap ({self.edge_head})")

    @property
    def norm_names(self) -> tuple[str, ...]:
        """The final norm's parameters: its weight, then its bias where it has one."""
        return (self.norm,) + ((self.norm_bias,) if self.norm_bias is not None else ())


ModelSpecRule = Callable[[nn.Module], ModelSpec]


@dataclass(frozen=True)
class ModelRule:
    """How one causal-LM class is recognised: ``fn(model)`` returns its ModelSpec.

    children: the model's direct submodules, name -> exact type; any other child (a dropout,
    an adapter) or a missing one raises naming it, since the rule would not describe it."""

    model_type: type
    fn: ModelSpecRule
    children: Mapping[str, type]

    def spec(self, model: nn.Module) -> ModelSpec:
        found = dict(model.named_children())
        for name, child in found.items():
            expected = self.children.get(name)
            if expected is None:
                raise LoweringError(f"{name!r} ({type(child).__module__}.{type(child).__name__}) in "
                                    f"{type(model).__name__}: the model rule knows only "
                                    f"{', '.join(self.children)}; remove it or register a model rule that describes it")
            if type(child) is not expected:
                raise LoweringError(f"{name!r} ({type(child).__module__}.{type(child).__name__}): the model rule for "
                                    f"{type(model).__name__} assumes a {expected.__name__} here")
        missing = [name for name in self.children if name not in found]
        if missing:
            raise LoweringError(f"{type(model).__name__} has no {', '.join(map(repr, missing))}: the model rule "
                                "assumes it")
        return self.fn(model)


_MODEL_RULES: dict[type, ModelRule] = {}


def register_model(model_type: type, *, children: Mapping[str, type]) -> Callable[[ModelSpecRule], ModelSpecRule]:
    """Decorator: ``@register_model(MyForCausalLM, children={...})`` on a function model -> ModelSpec."""
    def wrap(fn: ModelSpecRule) -> ModelSpecRule:
        _MODEL_RULES[model_type] = ModelRule(model_type, fn, dict(children))
        return fn
    return wrap


def has_model_rule(model: object) -> bool:
    """Whether ``model`` is a causal LM a model rule recognises (its exact class, or a transformers
    causal LM or base model by its children)."""
    _load_families()
    return type(model) in _MODEL_RULES or _structural_model_rule(model) is not None


def find_model_rule(model: nn.Module) -> ModelRule:
    """The rule for exactly ``type(model)`` (a subclass may compute anything: no inheritance), or a
    transformers causal LM recognised by its children."""
    _load_families()
    _require_supported_library(type(model))
    rule = _MODEL_RULES.get(type(model)) or _structural_model_rule(model)
    if rule is None and "transformers" in sys.modules:
        from moegraph.lowering.hf_common import explain_no_rule
        explain_no_rule(model)           # raises naming the construct of a transformers model it cannot read
    if rule is None:
        cls = type(model)
        known = ", ".join(sorted(t.__name__ for t in _MODEL_RULES))
        raise LoweringError(f"the model ({cls.__module__}.{cls.__name__}) has no model rule: recognised are "
                            f"transformers' causal LMs (children model and lm_head; the model's embed_tokens, layers, "
                            f"norm, rotary_emb) and {known} (compile one decoder layer with its [b, s, h] input "
                            "instead)")
    return rule


def _structural_model_rule(model: object) -> ModelRule | None:
    if "transformers" not in sys.modules or not isinstance(model, nn.Module):
        return None
    from moegraph.lowering.hf_common import structural_model_rule
    return structural_model_rule(model)


def _guard_on() -> bool:
    from moegraph.lowering.structural import guard_on
    return guard_on()


def check_embedding(module: nn.Embedding, qualname: str) -> None:
    """Raise naming the first nn.Embedding setting a plain row lookup does not model."""
    for attr, plain in (("max_norm", None), ("scale_grad_by_freq", False), ("sparse", False)):
        if getattr(module, attr) != plain:
            raise LoweringError(f"{qualname}.{attr}={getattr(module, attr)!r}: only a plain embedding lookup is "
                                f"supported ({attr}={plain!r})")


def check_head(model: nn.Module, head: nn.Linear, embed: nn.Embedding, qualname: str) -> bool:
    """An LM head without bias; whether it is tied (its weight IS the embedding's: the compiled
    model then holds one parameter, whose gradient is the head's plus the embedding's, as
    autograd sums them in the original). A config asking for tied weights that are not the same
    tensor (untied by hand after loading) is refused: which one the user means is unknown."""
    if head.bias is not None:
        raise LoweringError(f"{qualname}.bias: an LM head with a bias is not supported")
    tied = head.weight is embed.weight
    if not tied and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        raise LoweringError(f"{qualname}: config.tie_word_embeddings=True but {qualname}.weight is not the "
                            "embedding's weight: call model.tie_weights(), or set tie_word_embeddings=False")
    return tied


def _join(qualname: str, name: str) -> str:
    return f"{qualname}.{name}" if qualname else name


def _type_name(obj: object) -> str:
    return "missing" if obj is None else type(obj).__name__


def _load_families(*, every: bool = False) -> None:
    """Import the built-in rule file of the project's own layer (transformers' families need none:
    ``structural.py`` recognises them)."""
    from moegraph.lowering import reference  # noqa: F401
