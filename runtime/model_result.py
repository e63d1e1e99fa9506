"""What a compiled model's forward returns (``CompiledModel.forward``): transformers' ModelOutput
access for the fields it has.

transformers' outputs (``MoeCausalLMOutputWithPast``, ``CausalLMOutputWithPast``, the base models'
``...ModelOutputWithPast``) are ordered dicts of their non-None fields in the dataclass's order:
``out.loss``, ``out["loss"]``, ``out[0]`` (the first non-None field), ``out.to_tuple()``,
``out.keys()``. HF's Trainer reads ``outputs["loss"]`` or ``outputs[0]``. ``ModelResult`` keeps the
same order over the fields a compiled model fills (loss, aux_loss, logits; last_hidden_state for a
base model), so these calls mean what they meant on the eager output of a call with
``use_cache=False`` (the compiled model returns no cache, hidden states, attentions or router logits).
"""

from __future__ import annotations

FIELDS = ("loss", "aux_loss", "logits", "last_hidden_state")      # transformers' dataclass order
ROUTER_LOGITS = ("the compiled model does not return router_logits (its routers keep only the load-balancing "
                 "statistics): read .aux_loss, or run the original for the logits")


class ModelResult:
    """What CompiledModel returns: the attributes the original's output has (None if not asked),
    readable as transformers' ModelOutput (module docstring)."""

    def __init__(self, loss=None, logits=None, last_hidden_state=None, aux_loss=None):
        self.loss, self.logits, self.last_hidden_state = loss, logits, last_hidden_state
        self.aux_loss = aux_loss        # the router's load-balancing loss (unscaled), as transformers

    @property
    def router_logits(self):
        # transformers returns them with output_router_logits=True; the compiled routers keep
        # only their [3, E] statistics (the aux loss reads those), never the [tokens, E] logits
        raise AttributeError(ROUTER_LOGITS)

    def keys(self) -> list[str]:
        """The non-None fields, in transformers' order."""
        return [k for k in FIELDS if getattr(self, k) is not None]

    def values(self) -> list:
        return [getattr(self, k) for k in self.keys()]

    def items(self) -> list[tuple]:
        return [(k, getattr(self, k)) for k in self.keys()]

    def to_tuple(self) -> tuple:
        """The non-None fields' values in order, as ModelOutput.to_tuple."""
        return tuple(self.values())

    def get(self, key: str, default=None):
        return getattr(self, key) if key in self.keys() else default

    def __getitem__(self, key):
        """``out["loss"]`` (a non-None field, else KeyError as ModelOutput's), ``out[0]``, ``out[:2]``."""
        if isinstance(key, str):
            if key == "router_logits":
                raise KeyError(ROUTER_LOGITS)
            if key not in self.keys():
                raise KeyError(key)
            return getattr(self, key)
        return self.to_tuple()[key]

    def __contains__(self, key) -> bool:
        return key in self.keys()

    def __iter__(self):
        return iter(self.keys())        # an ordered dict's: its keys

    def __len__(self) -> int:
        return len(self.keys())

    def __repr__(self) -> str:
        return f"ModelResult({', '.join(k for k in self.keys())})"


__all__ = ["ModelResult"]
