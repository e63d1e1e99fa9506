"""Coverage: every parameter and buffer a decoder layer holds must be read by its lowered graph
(``check_coverage``, run by ``moegraph.tracer.lower`` with the structural guard on), wholly: narrowed
views of one tensor must tile it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moegraph.ir import Graph
from moegraph.lowering import LoweringError

if TYPE_CHECKING:
    from moegraph.tracer import LayerProgram


def check_coverage(graph: Graph, program: LayerProgram) -> None:
    """Every parameter and buffer the layer holds must be read by the graph, wholly (narrowed
    sources must tile it), unless a rule declared it unused: otherwise the graph would compute
    something else than the module, silently."""
    narrows: dict[str, list] = {}
    for _, spec in graph.params:
        for src in spec.sources:
            narrows.setdefault(src.qualname, []).append(src)
    missing = [name if name not in narrows else f"{name} (only partly)"
               for name, shape in program.reads if not _covered(narrows.get(name), shape)]
    if missing:
        raise LoweringError(f"{graph.name}: the lowered graph does not read {', '.join(missing)}: the lowering rules "
                            "of their modules do not model them; give the module a rule that does (or declares them "
                            "unused, with a reason)")


def _covered(sources: list | None, shape: tuple[int, ...]) -> bool:
    """Whether the sources' views (ParamSource.view) read every element of a tensor of ``shape``:
    one whole view, or narrowed views of one dim whose (strided) ranges cover it."""
    if not sources:
        return False
    if any(src.narrow is None for src in sources):
        return True
    if any(src.unflatten is not None for src in sources):
        return False          # a narrowed view of an unflattened tensor: not one dim of the tensor itself
    dims = {_source_dim(src, len(shape)) for src in sources}
    if len(dims) != 1:
        return False
    seen = bytearray(shape[dims.pop()])
    for src in sources:
        _, start, length = src.narrow
        rows = range(start, min(len(seen), start + src.step * length), src.step)
        seen[rows.start:rows.stop:rows.step] = b"\x01" * len(rows)
    return all(seen)


def _source_dim(src, ndim: int) -> int:
    """The dim of the module tensor that ``src``'s narrow cuts (its transpose swaps the last two)."""
    dim = src.narrow[0] % ndim
    if src.transpose and dim >= ndim - 2:
        dim = 2 * ndim - 3 - dim
    return dim
