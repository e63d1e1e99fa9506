"""Lowering rules: nn.Module types -> block specs the emitters in ``blocks`` understand.

A model family plugs in with one rule file that calls ``register`` for each of its module
types (see ``reference.py`` and ``hf_mixtral.py``). A rule reads the module's sizes and the
qualified names of its parameters; it never builds nodes itself, so every family shares the
same, tested, strategy-dependent lowering.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from moegraph.lowering.blocks import AttentionSpec, MoESpec, NormSpec

BlockSpec = NormSpec | AttentionSpec | MoESpec
SpecRule = Callable[[nn.Module, str], BlockSpec]

_RULES: dict[type, SpecRule] = {}
_FAMILIES_LOADED = False


def register(module_type: type) -> Callable[[SpecRule], SpecRule]:
    """Decorator: ``@register(MyAttention)`` on a function (module, qualname) -> block spec."""
    def wrap(fn: SpecRule) -> SpecRule:
        _RULES[module_type] = fn
        return fn
    return wrap


def find_rule(module: nn.Module) -> SpecRule | None:
    _load_families()
    for cls in type(module).__mro__:
        if cls in _RULES:
            return _RULES[cls]
    return None


def _load_families() -> None:
    """Import the built-in rule files once; families whose library is missing are skipped."""
    global _FAMILIES_LOADED
    if _FAMILIES_LOADED:
        return
    _FAMILIES_LOADED = True
    from moegraph.lowering import reference  # noqa: F401
    try:
        from moegraph.lowering import hf_mixtral  # noqa: F401
    except ImportError:          # transformers not installed: Mixtral modules simply have no rule
        pass
