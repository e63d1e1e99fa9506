"""Batches as training feeds them: right-padded rows and packed documents.

Notation: b rows (one replica's), s the full sequence, S the rows a kernel sees (s for attention,
which always sees the whole sequence: Ulysses' all-to-all or TP's all-gather gather it), p a
token's index in its row.

A plain batch is b causal sequences, positions 0..s-1. Two other forms are what SFT and packed
pre-training feed a transformers causal LM, and this module turns them into ``Tokens``, the
per-token layout the RoPE and attention kernels read (``moegraph.kernels.RankContext.tokens``;
full [b, s] tensors on every rank: each kernel indexes the positions its rows hold):

  right padding  ``attention_mask`` [b, s] of ones then zeros (every row starts with a one):
                 a key at a zero is never attended to (transformers' padding mask, and-ed with
                 the causal one); positions stay 0..s-1. The loss ignores what the labels say
                 (-100), as transformers' does; the router's aux loss counts the tokens the mask
                 keeps (transformers' ``load_balancing_loss_func`` weights its rows by the mask:
                 ``moegraph.kernels``' router stats).
  packing        ``position_ids`` [b, s] (or [1, s]) that restart: a new document starts where a
                 position is not its predecessor + 1 (transformers' ``find_packed_sequence_indices``);
                 RoPE rotates by the given positions and attention stays within a document, causal
                 (and windowed, or chunked) by the positions (``masking_utils``'
                 ``remap_positions_for_packed_sequence``). position_ids without a restart are only
                 RoPE positions; the mask stays causal by index, as transformers'.

Refused by name (``TokensError``): a mask that is not 0/1, a row of zeros (an empty sequence), left padding (a row starting with a
zero: its first queries would attend to nothing), a 4-D mask, the mask together with
position_ids, position_ids that are not integers of shape [b, s] or [1, s].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["Tokens", "TokensError", "BatchForms", "batch_forms", "micro_batch_forms", "tokens_of", "attention_allowed", "rope_positions"]


class TokensError(ValueError):
    """An attention_mask or position_ids form the compiled model does not run; one line naming it."""


@dataclass(frozen=True, eq=False)
class Tokens:
    """The token layout of one batch (module docstring); all tensors [b, s], on the model's device.

    positions: each token's RoPE position (None: 0..s-1).
    documents: each token's document (packing), or None: one per row.
    keys:      bool, whether a token may be attended to (padding), or None: every token.
    """

    positions: torch.Tensor | None = None
    documents: torch.Tensor | None = None
    keys: torch.Tensor | None = None

    def rows(self, index: slice) -> "Tokens":
        """The layout of rows ``index`` (a data-parallel replica's)."""
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return Tokens(pick(self.positions), pick(self.documents), pick(self.keys))


@dataclass(frozen=True)
class BatchForms:
    """What the original model does with the two arguments, so that a compiled batch layout is
    refused by name where the compiled step would differ from eager (``batch_forms``).

    takes:             the original forward's argument names (it may take neither form).
    masks_documents:   whether it keeps packed documents apart by their position_ids (transformers
                       builds the mask from them: ``hf_common.masks_by_position``); False: they
                       attend across and only RoPE restarts; None: unknown (no mask builder seen).
    caches_by_default: its config's use_cache: transformers then builds a cache unless
                       use_cache=False and attends across packed documents.
    """

    takes: frozenset[str] = frozenset()
    masks_documents: bool | None = None
    caches_by_default: bool = False

    def layout(self, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, rows: int, seq: int,
               device: torch.device, use_cache: bool | None = False) -> Tokens | None:
        """The ``Tokens`` of a batch of ``rows`` x ``seq`` (``tokens_of``) as the original runs it
        (``use_cache``: the call's; training passes False), or None for a plain batch."""
        tokens = tokens_of(attention_mask, position_ids, rows, seq, device)
        if tokens is None:
            return None
        given = "attention_mask" if tokens.keys is not None else "position_ids"
        if given not in self.takes:               # the original model would not take it either
            raise ValueError(f"{given}: the original forward takes no {given}, so only a plain batch (no "
                             f"{given}, or one that changes nothing) is compiled for it")
        if tokens.documents is not None and not self.masks_documents:
            if self.masks_documents is None:
                raise ValueError("position_ids restart (packed documents), but how the original builds its attention "
                                 "mask is unknown (its base model's forward shows no mask builder): not compiled")
            tokens = Tokens(positions=tokens.positions)    # as its masks: documents attend across, RoPE restarts
        if tokens.documents is not None and use_cache is not False and self.caches_by_default:
            raise ValueError("position_ids restart (packed documents) but use_cache is not False: transformers then "
                             "builds a cache and attends across the documents, the compiled model keeps them apart; "
                             "pass use_cache=False (as training does)")
        return tokens


def micro_batch_forms(attention_mask, position_ids, micro_batches: int) -> list[tuple[object, object]]:
    """A step's per-micro-batch (attention_mask, position_ids): each argument None, or a sequence of
    ``micro_batches`` entries, each None or a tensor (one per micro-batch; a step's whole batch in
    one tensor is refused: each micro-batch takes either form, or none)."""
    M = micro_batches
    for what, seq in (("attention_mask", attention_mask), ("position_ids", position_ids)):
        if seq is not None and (isinstance(seq, torch.Tensor) or not isinstance(seq, Sequence) or len(seq) != M):
            got = (f"one tensor {list(seq.shape)}" if isinstance(seq, torch.Tensor) else
                   f"{len(seq)}" if isinstance(seq, Sequence) else type(seq).__name__)
            raise ValueError(f"a step of {M} micro-batches takes {what} as None or a sequence of {M} entries (one per "
                             f"micro-batch, each None or a tensor), got {got}")
    return [(None if attention_mask is None else attention_mask[j], None if position_ids is None else position_ids[j])
            for j in range(M)]


def batch_forms(model) -> BatchForms:
    """The ``BatchForms`` of an original module (an nn.Module; a transformers causal LM or not)."""
    import inspect

    from moegraph.lowering.hf_common import masks_by_position
    takes = frozenset(q.name for q in inspect.signature(model.forward).parameters.values()
                      if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD, q.KEYWORD_ONLY))
    return BatchForms(takes, masks_by_position(model) if "position_ids" in takes else None,
                      bool(getattr(getattr(model, "config", None), "use_cache", False)))


def tokens_of(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, rows: int, seq: int,
              device: torch.device) -> Tokens | None:
    """The ``Tokens`` of a batch of ``rows`` x ``seq`` tokens given transformers' two arguments,
    None for a plain batch (no mask or all ones, no position_ids or 0..s-1 on every row)."""
    if attention_mask is not None and position_ids is not None:
        raise TokensError("attention_mask and position_ids together are not supported: pass the mask (right "
                          "padding) or the position_ids (packed documents), not both")
    if attention_mask is not None:
        return _padding(attention_mask, rows, seq, device)
    if position_ids is not None:
        return _packing(position_ids, rows, seq, device)
    return None


def _padding(mask: torch.Tensor, rows: int, seq: int, device) -> Tokens | None:
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        what = f"a {mask.dim()}-D mask {list(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TokensError(f"attention_mask: {what} is not supported; pass a 2-D [b, s] mask of 0/1 (right "
                          "padding) or position_ids for packed documents")
    if tuple(mask.shape) != (rows, seq):
        raise TokensError(f"attention_mask has shape {list(mask.shape)}; the model was compiled for [b, s] = "
                          f"{[rows, seq]}")
    if bool(((mask != 0) & (mask != 1)).any()):
        raise TokensError("attention_mask holds values other than 0 and 1")
    keys = mask.to(device=device) != 0
    if bool(keys.all()):
        return None
    if not bool(keys.any(1).all()):
        row = int((~keys.any(1)).nonzero()[0])
        raise TokensError(f"attention_mask row {row} is all zeros: it masks every token (an empty sequence); every "
                          "row needs at least its first token (right padding: ones then zeros)")
    if not bool(keys[:, 0].all()):
        row = int((~keys[:, 0]).nonzero()[0])
        raise TokensError(f"attention_mask row {row} starts with a 0 (left padding): only right padding (ones "
                          "then zeros) is supported")
    if bool((keys[:, 1:] & ~keys[:, :-1]).any()):
        row = int((keys[:, 1:] & ~keys[:, :-1]).any(1).nonzero()[0])
        raise TokensError(f"attention_mask row {row} has a 1 after a 0: only right padding (ones then zeros) is "
                          "supported (for packed documents pass position_ids)")
    return Tokens(keys=keys)


def _packing(position_ids: torch.Tensor, rows: int, seq: int, device) -> Tokens | None:
    if not isinstance(position_ids, torch.Tensor) or position_ids.dtype not in (torch.int32, torch.int64) \
            or position_ids.dim() != 2 or position_ids.shape[1] != seq or position_ids.shape[0] not in (1, rows):
        what = (f"{position_ids.dtype} {list(position_ids.shape)}" if isinstance(position_ids, torch.Tensor)
                else type(position_ids).__name__)
        raise TokensError(f"position_ids is {what}; the compiled model takes integer [b, s] = {[rows, seq]} "
                          "(or [1, s])")
    pos = position_ids.to(device).expand(rows, seq)
    if bool((pos == torch.arange(seq, device=device)).all()):
        return None
    # transformers' find_packed_sequence_indices: a document starts where a position is not its predecessor + 1
    step = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1)
    documents = (step != 1).cumsum(-1)
    return Tokens(positions=pos, documents=documents if bool((documents[:, -1] != 0).any()) else None)


def rope_positions(tokens: Tokens | None, index: torch.Tensor) -> torch.Tensor:
    """The RoPE positions of the rows at sequence indices ``index`` [S]: [S] (a plain batch, or
    padding) or [b, S] (given position_ids)."""
    if tokens is None or tokens.positions is None:
        return index
    return tokens.positions[:, index]


def attention_allowed(tokens: Tokens | None, seq: int, window: int | None, chunk: int | None,
                      device) -> torch.Tensor:
    """Which (query, key) pairs attention keeps: [S, S], or [b, 1, S, S] for a batch with a layout
    (module docstring): causal, within a sliding ``window`` (keys in (q - window, q]) or q's
    ``chunk``, by index (by position within a packed document), keys allowed by the padding."""
    i = torch.arange(seq, device=device)
    packed = tokens is not None and tokens.documents is not None
    p = tokens.positions if packed else i                                   # [b, S] or [S]
    q, k = p[..., :, None], p[..., None, :]
    allowed = k <= q
    if window is not None:
        allowed = allowed & (k > q - window)
    if chunk is not None:
        allowed = allowed & ((k // chunk) == (q // chunk))
    if packed:
        allowed = allowed & (tokens.documents[:, :, None] == tokens.documents[:, None, :])
    if tokens is not None and tokens.keys is not None:
        allowed = allowed & tokens.keys[:, None, :]
    return allowed[:, None] if allowed.dim() == 3 else allowed
