"""The node and rail group axes (strategy.ep_nodes): the interpreter's groups, the runtime's
``Layout``, and token all-to-alls on real gloo ranks against the interpreter's ``run_collective``.

n ranks of a replica span N = n/G nodes of G consecutive ranks: "node" is the G ranks of one node,
"rail" the N ranks with the same local index, one per node.
"""

from __future__ import annotations

import pytest
import torch

from helpers import RANK_BATCH
from moegraph.index_map import IndexMap, RecvMap
from moegraph.interpreter import axis_groups, axis_of, run_collective
from moegraph.ir import Node, OpKind, Phase, freeze_attrs
from moegraph.runtime import RuntimeFailure
from moegraph.runtime.layout import Layout
from seeding import fresh_seed

N, G = 4, 2                 # 4 ranks: 2 nodes of 2 ranks; node groups {0,1},{2,3}, rail groups {0,2},{1,3}
H, PER = 3, 2               # row width; experts per destination rank


def test_node_and_rail_groups_are_replica_major():
    assert axis_groups("node", 8, 2, node_ranks=4) == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15))
    assert axis_groups("rail", 8, 1, node_ranks=4) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert axis_groups("rail", 4, 2, node_ranks=2) == ((0, 2), (1, 3), (4, 6), (5, 7))


@pytest.mark.parametrize("axis", ["node", "rail"])
@pytest.mark.parametrize("node_ranks", [0, 3, 8])
def test_groups_without_a_valid_node_size_name_the_axis_and_value(axis, node_ranks):
    with pytest.raises(ValueError, match=rf"axis '{axis}'.*node_ranks={node_ranks}\b"):
        axis_groups(axis, 8, 1, node_ranks=node_ranks)


def test_axis_of_reads_the_node_axes_and_names_the_valid_ones():
    def node(axis):
        return Node(name="a2a", op=OpKind.ALL_TO_ALL, phase=Phase.FORWARD, inputs=("x", "m"), outputs=("y",),
                    group=2, attrs=freeze_attrs({"mode": "tokens", "axis": axis}))
    assert [axis_of(node(a)) for a in ("node", "rail", "mp")] == ["node", "rail", "mp"]
    with pytest.raises(ValueError, match="axis='pp'.*node.*rail"):
        axis_of(node("pp"))


def test_layout_sizes_and_partitions_the_node_axes():
    layout = Layout(8, 1, rank=5, node_ranks=4)
    assert (layout.size("node"), layout.size("rail"), layout.size("mp")) == (4, 2, 8)
    assert layout.partition("rail") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert layout.partition("node") == ((0, 1, 2, 3), (4, 5, 6, 7))
    # pipeline blocks: each block's groups, offset by the block's n x dp ranks
    assert Layout(4, 1, rank=0, pp=2, node_ranks=2).partition("rail") == ((0, 2), (1, 3), (4, 6), (5, 7))


@pytest.mark.parametrize("node_ranks", [1, 3, 8])
def test_layout_refuses_a_node_size_that_does_not_split_n(node_ranks):
    with pytest.raises(RuntimeFailure, match=rf"node_ranks={node_ranks}\b.*valid: 0, 2, 4"):
        Layout(8, 1, rank=0, node_ranks=node_ranks)


def test_layout_without_nodes_has_no_node_axes():
    with pytest.raises(RuntimeFailure, match="axis 'rail' needs nodes"):
        Layout(8, 1, rank=0).size("rail")


# -- token all-to-alls on 4 gloo ranks ----------------------------------------------------------

def _token_node(name: str, axis: str, direction: str, inputs, outputs, **attrs) -> Node:
    return Node(name=name, op=OpKind.ALL_TO_ALL, phase=Phase.FORWARD, inputs=tuple(inputs), outputs=tuple(outputs),
                group=G, attrs=freeze_attrs({"mode": "tokens", "axis": axis, "direction": direction, **attrs}))


def _dispatch(axis: str) -> Node:
    # two payloads (rows and per-row scales, as an FP8 dispatch) and the recv map
    return _token_node(f"dispatch.{axis}", axis, "to_experts", ("x", "s", "map"), ("y", "ys", "rmap"),
                       emit_map=True, payloads=2)


def _combine(axis: str) -> Node:
    return _token_node(f"combine.{axis}", axis, "from_experts", ("z", "rmap"), ("back",))


def _inputs(seed: int, rank: int, axis: str) -> tuple[torch.Tensor, torch.Tensor, IndexMap]:
    """Rank ``rank``'s rows for a dispatch on ``axis``: uneven counts per (destination, expert),
    zeros included; every value names its source rank, so a wrong group cannot match."""
    gen = torch.Generator().manual_seed(seed + 97 * rank + (0 if axis == "node" else 50_000))
    counts = torch.randint(0, 4, (G * PER,), generator=gen)             # [g * El] rows per expert
    rows = int(counts.sum())
    x = torch.randn(rows, H, generator=gen) + 100 * rank                 # [R, h]
    s = torch.rand(rows, 1, generator=gen) + rank                       # [R, 1] per-row scales
    return x, s, IndexMap(torch.arange(rows), 1, counts, None, per_dest=PER)


def node_axes_exchange(rank: int, n: int, seed: int) -> dict:
    """On each of rail and node: a dispatch (2 payloads, emit_map), its combine back (the recv
    map's ``sent``), and a combine that exchanges its counts (a recv map without ``sent``)."""
    from moegraph.runtime.collectives import Comm
    comm = Comm([("comm", 0)], rank=rank, n=n, node_ranks=G, axes=("mp", "node", "rail"), timeout_s=60.0)
    out = {"metas": sorted(comm.metas)}
    for axis in ("rail", "node"):
        x, s, imap = _inputs(seed, rank, axis)
        y, ys, rmap = comm.issue(_dispatch(axis), [x, s, imap], "comm", 0).wait(60.0, rank)
        z = 2 * y                                                        # the experts' rows, [R_recv, h]
        back, = comm.issue(_combine(axis), [z, rmap], "comm", 0).wait(60.0, rank)
        unsent = RecvMap(rmap.segments, rmap.splits)                     # counts exchanged again
        back2, = comm.issue(_combine(axis), [z, unsent], "comm", 0).wait(60.0, rank)
        out[axis] = {"y": y, "ys": ys, "rmap": (rmap.segments, rmap.splits, rmap.sent), "back": back,
                     "back2": back2}
    return out


SEED = fresh_seed()
EXCHANGE = RANK_BATCH.add(N, "node_axes.exchange", node_axes_exchange, SEED, timeout_s=120)


@pytest.fixture(scope="module")
def exchanged(rank_results):
    return rank_results(N, EXCHANGE)


@pytest.mark.parametrize("axis", ["rail", "node"])
def test_token_all_to_alls_on_node_axes_match_the_interpreter(exchanged, axis):
    seed = SEED
    expected: dict[int, dict] = {}
    for group in axis_groups(axis, N, 1, node_ranks=G):
        ins = [list(_inputs(seed, r, axis)) for r in group]
        sends = [imap.splits for _, _, imap in ins]
        for r, (y, ys, rmap) in zip(group, run_collective(_dispatch(axis), ins)):
            expected[r] = {"y": y, "ys": ys, "rmap": rmap}
        backs = run_collective(_combine(axis), [[2 * expected[r]["y"], expected[r]["rmap"]] for r in group])
        for r, (back,), sent in zip(group, backs, sends):
            expected[r] |= {"back": back, "sent": sent}
    for r, res in enumerate(exchanged):
        got, want = res[axis], expected[r]
        assert res["metas"] == ["mp", "node", "rail"]
        assert torch.equal(got["y"], want["y"]) and torch.equal(got["ys"], want["ys"]), (axis, r)
        assert got["rmap"][:2] == (want["rmap"].segments, want["rmap"].splits), (axis, r)
        assert got["rmap"][2] == want["sent"], (axis, r)
        # the rows' way back: the exact rows this rank sent, doubled (the combine's reference too)
        x, _, _ = _inputs(seed, r, axis)
        assert torch.equal(want["back"], 2 * x)
        assert torch.equal(got["back"], want["back"]) and torch.equal(got["back2"], want["back"]), (axis, r)


def test_attention_axes_split_the_replica_like_the_node_axes():
    """A folded attention's groups (Strategy.attn_nodes): attn, its G consecutive ranks; attn_dp, the
    n/G ranks with its local index. G = 1 is valid: each rank's attention alone, summed over all."""
    assert axis_groups("attn", 8, 1, attn_ranks=2) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert axis_groups("attn_dp", 4, 2, attn_ranks=2) == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert axis_groups("attn_dp", 4, 1, attn_ranks=1) == ((0, 1, 2, 3),)
    layout = Layout(8, 1, rank=5, node_ranks=4, attn_ranks=2)
    assert (layout.size("attn"), layout.size("attn_dp"), layout.size("node")) == (2, 4, 4)
    assert layout.partition("attn_dp") == ((0, 2, 4, 6), (1, 3, 5, 7))
    with pytest.raises(ValueError, match=r"axis 'attn'.*attn_ranks=3\b"):
        axis_groups("attn", 8, 1, attn_ranks=3)
    with pytest.raises(RuntimeFailure, match=r"attn_ranks=3 does not split n=8.*valid: 0, 1, 2, 4"):
        Layout(8, 1, rank=0, attn_ranks=3)
    with pytest.raises(RuntimeFailure, match="axis 'attn_dp' needs a folded attention"):
        Layout(8, 1, rank=0).size("attn_dp")
