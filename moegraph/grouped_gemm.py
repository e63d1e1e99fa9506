"""The grouped GEMM: each expert's rows times that expert's weight, without reading the host.

Notation: R expert rows (sorted by expert), K and N the GEMM's inner and outer widths, E groups
(experts), one weight [N, K] per group.

Rows arrive grouped by an ``IndexMap`` (device-side group ends ``offsets`` [E] int32: the host
never learns the counts) or a ``RecvMap`` (host segments: the all-to-all that delivered the rows
needed them there). Three ways to compute it, chosen from the device and dtype, never the data:

native   ``torch._grouped_mm`` with the device-side ends, where that reads no host value: on
         CUDA its CUTLASS kernel takes bf16 on sm90/sm100 only; for any other dtype or GPU
         torch runs ``_grouped_mm_fallback`` (aten/src/ATen/native/GroupedMMUtils.h, called by
         ``_grouped_mm_cuda`` in native/cuda/GroupedBlas.cpp), which copies ``offs`` to the host
         (``offs.cpu()``, a synchronisation per call) and loops over the groups. On CPU that
         fallback is the op itself, and the ends are host memory already. Probed once per
         (device, dtype), not assumed from a version table (``native_grouped_mm``).
masked   off the CPU, where the native op would read the host: one batched GEMM applies every
         expert's weight to every row and each row keeps its own expert's result (its group from
         ``searchsorted`` on the device ends). No host read, each row's products as the native
         op computes them, but E times the FLOPs and an [E, R, N] intermediate (built in blocks of
         at most ``MASKED_BLOCK_BYTES``). What fp32 (the CPU suite's and the GPU tests' dtype)
         and pre-sm90 GPUs run.
host     a loop over host row segments: a ``RecvMap``, or on CPU a dtype or stride that
         ``torch._grouped_mm`` does not take (fp64, unaligned rows).

Padded maps: rows past the last end are padding (``moegraph.index_map``); the native op leaves
their output uncomputed and the masked one computes garbage there, so ``grouped_rows`` zeroes them;
weight gradients never read them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moegraph.index_map import mask_padding

_GROUPED_MM = getattr(torch, "_grouped_mm", None)
_NATIVE: dict[tuple[str, torch.dtype], bool] = {}        # (device, dtype) -> probed once

# The masked path's [e, R, N] (or [e, N, R]) intermediate is built this many bytes at a time: a
# memory bound chosen for the fallback (a few expert blocks of an fp32 layer), not a tuned figure.
MASKED_BLOCK_BYTES = 256 << 20


def native_grouped_mm(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` computes on ``device`` in ``dtype`` from device-side group
    ends without reading the host (module docstring). Probed once on tiny aligned operands in both
    call shapes (2-D x 3-D, and 2-D x 2-D for weight gradients); on CUDA under
    ``torch.cuda.set_sync_debug_mode("error")``, so torch's host fallback counts as not native.
    Other device types: False (their fallback reads the host). Decided up front, so an error from
    a real call (a shape bug) propagates instead of switching the op off."""
    if _GROUPED_MM is None:
        return False
    device = torch.device(device)
    key = (str(device), dtype)
    if key not in _NATIVE:
        _NATIVE[key] = _probe(device, dtype)
    return _NATIVE[key]


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type not in ("cpu", "cuda"):
        return False
    x = torch.zeros(32, 16, dtype=dtype, device=device)                    # [R, K], two groups of 16 rows
    w = torch.zeros(2, 16, 16, dtype=dtype, device=device)                 # [E, N, K]
    ends = torch.arange(16, 33, 16, dtype=torch.int32, device=device)      # [16, 32], no host copy
    old = torch.cuda.get_sync_debug_mode() if device.type == "cuda" else None
    if old is not None:
        torch.cuda.set_sync_debug_mode("error")
    try:
        _GROUPED_MM(x, w.transpose(-2, -1), offs=ends)
        _GROUPED_MM(x.T, x, offs=ends)
        return True
    except (RuntimeError, NotImplementedError):
        return False
    finally:
        if old is not None:
            torch.cuda.set_sync_debug_mode(old)


def _aligned(*tensors: torch.Tensor) -> bool:
    """torch._grouped_mm's operand rule: every non-unit stride and the storage offset 16-byte aligned."""
    for t in tensors:
        size = t.element_size()
        if (t.storage_offset() * size) % 16 or any(st != 1 and (st * size) % 16 for st in t.stride()):
            return False
    return True


def grouped_rows(x: torch.Tensor, w: torch.Tensor, seg, transpose_w: bool = False) -> torch.Tensor:
    """Per-segment x @ w[e].T, or x @ w[e] for data gradients (``transpose_w``): x [R, K] ->
    [R, N]. ``seg``: an IndexMap (device-side ends, one group per expert weight) or a RecvMap (host
    segments). A padded map's rows past its last end come out zero."""
    if seg.offsets is not None:
        if seg.offsets.shape[0] != w.shape[0]:
            raise ValueError(f"index map has {seg.offsets.shape[0]} groups for {w.shape[0]} expert weights")
        b = w if transpose_w else w.transpose(-2, -1)                      # [E, K, N]
        if native_grouped_mm(x.device, x.dtype) and _aligned(x, b):
            return mask_padding(_GROUPED_MM(x, b, offs=seg.offsets), seg.rows)
        if x.device.type != "cpu":
            return mask_padding(masked_rows(x, b, seg.offsets), seg.rows)
    outs, start = [], 0
    for e, count in seg.segments:
        xe = x[start:start + count]
        outs.append(xe @ w[e] if transpose_w else F.linear(xe, w[e]))
        start += count
    width = w.shape[2] if transpose_w else w.shape[1]
    if seg.rows is not None and start < x.shape[0]:          # a padded map: zero rows R..C-1
        outs.append(x.new_zeros((x.shape[0] - start, width)))
    if not outs:
        return x.new_zeros((0, width))
    return torch.cat(outs)


def grouped_weight_grad(x: torch.Tensor, dy: torch.Tensor, seg, w_shape) -> torch.Tensor:
    """dw[e] = dy_e^T x_e over each expert's rows: x [R, K], dy [R, N] -> [E, N, K]; an expert
    with no rows gets zeros. Rows past the last end (a padded map's padding) are read by no path:
    the groups end there, the host loop's segments cover the real rows only."""
    if seg.offsets is not None and seg.offsets.shape[0] == w_shape[0]:
        if native_grouped_mm(x.device, x.dtype) and _aligned(dy.T, x):
            return _GROUPED_MM(dy.T, x, offs=seg.offsets)          # [E, N, K]; empty groups are zero
        if x.device.type != "cpu":
            return masked_group_sums(dy.T, x, seg.offsets)
    dw = x.new_zeros(w_shape)
    start = 0
    for e, count in seg.segments:                 # an expert may own several segments (a2a): accumulate
        dw[e].addmm_(dy[start:start + count].T, x[start:start + count])
        start += count
    return dw


def row_groups(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows] the group of each row from the device-side ends (rows past the last end: E), on the device."""
    return torch.searchsorted(offsets, torch.arange(rows, device=offsets.device, dtype=offsets.dtype), right=True)


def _blocks(groups: int, bytes_per_group: int) -> list[tuple[int, int]]:
    step = max(1, min(groups, MASKED_BLOCK_BYTES // max(1, bytes_per_group)))
    return [(e, min(groups, e + step)) for e in range(0, groups, step)]


def masked_rows(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """a [R, K], b [E, K, N] -> [R, N], row r = a[r] @ b[g(r)] with g from ``offsets``: every
    group's product of every row, each row keeping its own (module docstring: the masked path).
    Rows past the last end hold some group's product: callers mask them."""
    R, K, N = a.shape[0], a.shape[1], b.shape[2]
    group = row_groups(offsets, R)
    out = None
    for e0, e1 in _blocks(b.shape[0], R * N * a.element_size()):
        y = torch.bmm(a.expand(e1 - e0, R, K), b[e0:e1])                                 # [e, R, N]
        own = y.gather(0, (group - e0).clamp(0, e1 - e0 - 1).view(1, R, 1).expand(1, R, N))[0]
        out = own if out is None else torch.where(((group >= e0) & (group < e1)).view(R, 1), own, out)
    return out


def masked_group_sums(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """a [N, R], b [R, K] -> [E, N, K], out[g] = a[:, rows of g] @ b[rows of g] (the weight
    gradient's shape of torch._grouped_mm). Every group sums over every row with the others'
    columns of ``a`` set to zero (``where``, not a product: rows past the last end may hold NaN,
    and b's are zeroed for the same reason)."""
    N, R, K, E = a.shape[0], a.shape[1], b.shape[1], offsets.shape[0]
    group = row_groups(offsets, R)
    b = torch.where((group < E).view(R, 1), b, 0)
    outs = []
    for e0, e1 in _blocks(E, N * R * a.element_size()):
        mine = group.view(1, 1, R) == torch.arange(e0, e1, device=group.device, dtype=group.dtype).view(-1, 1, 1)
        outs.append(torch.bmm(torch.where(mine, a.view(1, N, R), 0), b.expand(e1 - e0, R, K)))   # [e, N, K]
    return outs[0] if len(outs) == 1 else torch.cat(outs)
