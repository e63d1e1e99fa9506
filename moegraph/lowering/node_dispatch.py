"""The hierarchical token dispatch and combine (Strategy.ep_nodes = N > 1): each token crosses the
NICs once per destination node, as DeepEP's normal kernels send it (DeepSeek-V3 §3.2.2).

Notation (MegaScale-MoE Table 1, as moegraph.lowering.blocks):
    b: micro-batch  h: hidden  n: group size  k: top-k  E: experts  El: experts per rank (E/n)
    N: nodes the group spans (ep_nodes)   G: ranks per node (n/N)
    T: this rank's tokens (b*L)           d: expected distinct destination nodes of a token
    Rn: (token, destination node) rows, balanced T*d (rounded up to a multiple of N)
    R: expert rows at the experts, balanced T*k

The group's rank r sits on node r // G with local index r % G. Expert e lives on rank e // El, so
on node e // (G*El). A token's rows go in two hops, as DeepEP's:

    forward   node_map      INDEX_MAP 'by_node': one row per (token, destination node)    [T, k] -> [Rn]
              node_scatter  PERMUTE the tokens, their expert ids and weights by it        [T, h] -> [Rn, h]
              node_a2a      ALL_TO_ALL over the rail (axis 'rail': the N ranks of local
                            index r % G, one per node; on the NICs): to rank (node, r % G)  [Rn, h] -> [Rn', h]
                            (+ node_ids_a2a, node_weights_a2a: the rows' [Rn, k] routing)
              index_map     INDEX_MAP 'in_node': the received tokens' rows for this node's
                            experts, grouped by the local rank holding them                  [Rn', k] -> [R]
              dispatch_scatter, dispatch_a2a (axis 'node': the G ranks of this node, NVLink)  [Rn', h] -> [R, h]
              ... the experts (blocks._emit_moe_chunk) ...
              combine_a2a   back to the relay rank (axis 'node')                            [R, h] -> [R, h]
              combine_gather UNPERMUTE: this node's expert outputs summed per received token,
                            weighted by the travelled routing weights (unless the gate ran
                            before FC2)                                                       [R, h] -> [Rn', h]
              node_combine_a2a back home over the rail                                        [Rn', h] -> [Rn, h]
              node_gather   UNPERMUTE: the nodes' partial sums summed per token                [Rn, h] -> [b, L, h]

Only existing op kinds: the backward is autodiff's (moegraph.autodiff), each all-to-all's way back
riding on its own dispatch's maps. The planning rows (Rn, and Rn' = Rn) are the balanced
expectation, as R is (moegraph.ir): a token's k experts, uniform over the E experts (or over the
topk_groups of a group-limited router whose groups lie on whole nodes), hit d = M(1 - (1 - 1/M)^k)
distinct nodes of the M it can reach. The runtime exchanges the real, data-dependent counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moegraph.builder import GraphBuilder
from moegraph.ir import OpKind, ValueKind
from moegraph.lowering.blocks_ext import WEIGHT_DTYPE
from moegraph.lowering.routing import INDEX_DTYPE
from moegraph.lowering.specs import MoESpec


@dataclass(frozen=True)
class NodeRoute:
    """The values a hierarchical dispatch leaves for the experts and the combine."""

    rows: str          # [R, h] expert rows at their experts
    seg: str           # [G, El] recv map: row segments per (relay rank, local expert)
    index_map: str     # [R] the relay's in-node map (flat: relay token * k + slot)
    relay_weights: str  # [Rn', k] the received tokens' routing weights
    relay_tokens: int  # Rn'
    node_map: str      # [Rn] this rank's (token, node) map
    relay_map: str     # [N, 1] recv map of the rail hop


def reachable_nodes(spec: MoESpec, nodes: int) -> float:
    """Expected nodes a token's router may choose from: all N, or, for a group-limited router
    whose expert groups lie on whole nodes (groups a multiple of N), the nodes its topk_groups
    groups fall on (chosen uniformly: N (1 - C(groups - q, t) / C(groups, t)), q groups per node)."""
    if spec.groups > 1 and spec.topk_groups < spec.groups and spec.groups % nodes == 0:
        q, t = spec.groups // nodes, spec.topk_groups
        return nodes * (1 - math.comb(spec.groups - q, t) / math.comb(spec.groups, t))
    return float(nodes)


def node_rows(spec: MoESpec, tokens: int, nodes: int) -> int:
    """Rn: balanced (token, destination node) rows of ``tokens`` tokens, a multiple of N (the rail
    all-to-all splits its buffer into N equal planning shards)."""
    m = reachable_nodes(spec, nodes)
    rows = math.ceil(tokens * m * (1 - (1 - 1 / m) ** spec.top_k) - 1e-9)   # d <= min(m, k) distinct nodes
    return -(-rows // nodes) * nodes


def dispatch(g: GraphBuilder, spec: MoESpec, tokens_in: str, topk_w: str, topk_idx: str, El: int, c: str,
             kw: dict) -> NodeRoute:
    """Tokens [b, L, h] with their routing [b, L, k] -> expert rows [R, h] at their experts, in two hops."""
    nodes = g.strategy.ep_nodes                 # Strategy checked that N splits n into nodes; lowering, that n divides E
    G = g.strategy.n // nodes
    h, k = g.dims.h, spec.top_k
    T = math.prod(g.shape(tokens_in)[:-1])
    Rn, R = node_rows(spec, T, nodes), T * k
    layout = {"experts_per_rank": El, "top_k": k, "node_ranks": G}
    nmap = g.value(f"node_map{c}", (Rn,), kind=ValueKind.ROUTING, dtype=INDEX_DTYPE, routed=True)
    g.node(f"node_map{c}", OpKind.INDEX_MAP, (topk_idx,), (nmap,), flops=T * k * k,
           attrs={"layout": "by_node"} | layout, **kw)
    send = g.value(f"node_rows_send{c}", (Rn, h), routed=True)
    g.node(f"node_scatter{c}", OpKind.PERMUTE, (tokens_in, nmap), (send,), attrs={"index": "token"}, **kw)  # [T, h] -> [Rn, h]
    ids_send = g.value(f"node_topk_experts_send{c}", (Rn, k), kind=ValueKind.ROUTING, dtype=INDEX_DTYPE, routed=True)
    g.node(f"node_scatter_ids{c}", OpKind.PERMUTE, (topk_idx, nmap), (ids_send,), attrs={"index": "token"}, **kw)
    w_send = g.value(f"node_topk_weights_send{c}", (Rn, k), kind=ValueKind.ROUTING, dtype=WEIGHT_DTYPE, routed=True)
    g.node(f"node_scatter_weights{c}", OpKind.PERMUTE, (topk_w, nmap), (w_send,), attrs={"index": "token"}, **kw)
    rail = {"axis": "rail", "scope": "inter"}
    relay = g.value(f"relay_rows{c}", (Rn, h), routed=True)
    rmap = g.value(f"relay_map{c}", (nodes, 1), kind=ValueKind.ROUTING, dtype=INDEX_DTYPE)
    g.collective(f"node_a2a{c}", OpKind.ALL_TO_ALL, (send, nmap), (relay, rmap), full_bytes=g.nbytes(send),
                 group=nodes, attrs=rail | {"mode": "tokens", "direction": "to_experts", "emit_map": True}, **kw)
    relay_ids = g.value(f"relay_topk_experts{c}", (Rn, k), kind=ValueKind.ROUTING, dtype=INDEX_DTYPE, routed=True)
    relay_w = g.value(f"relay_topk_weights{c}", (Rn, k), kind=ValueKind.ROUTING, dtype=WEIGHT_DTYPE, routed=True)
    for name, sent, got in (("node_ids_a2a", ids_send, relay_ids), ("node_weights_a2a", w_send, relay_w)):
        g.collective(f"{name}{c}", OpKind.ALL_TO_ALL, (sent, nmap), (got,), full_bytes=g.nbytes(sent), group=nodes,
                     attrs=rail | {"mode": "tokens", "direction": "to_experts", "emit_map": False}, **kw)
    imap = g.value(f"index_map{c}", (R,), kind=ValueKind.ROUTING, dtype=INDEX_DTYPE, routed=True)
    g.node(f"index_map{c}", OpKind.INDEX_MAP, (relay_ids,), (imap,), flops=Rn * k,
           attrs={"layout": "in_node"} | layout, **kw)
    rows = g.value(f"ffn_in_send{c}", (R, h), routed=True)
    g.node(f"dispatch_scatter{c}", OpKind.PERMUTE, (relay, imap), (rows,), attrs={"index": "token"}, **kw)  # [Rn', h] -> [R, h]
    ffn_in = g.value(f"ffn_in{c}", (R, h), routed=True)
    seg = g.value(f"recv_map{c}", (G, El), kind=ValueKind.ROUTING, dtype=INDEX_DTYPE)
    g.collective(f"dispatch_a2a{c}", OpKind.ALL_TO_ALL, (rows, imap), (ffn_in, seg), full_bytes=g.nbytes(rows),
                 group=G, attrs={"axis": "node", "scope": "intra", "mode": "tokens", "direction": "to_experts",
                                 "emit_map": True}, **kw)
    return NodeRoute(ffn_in, seg, imap, relay_w, Rn, nmap, rmap)


def row_weights(g: GraphBuilder, route: NodeRoute, c: str, kw: dict) -> str:
    """Each expert row's routing weight at its expert (the gate before FC2, or a weighted input):
    picked from the relay's travelled weights by its in-node map, sent along the rows: [R] fp32."""
    R = g.shape(route.index_map)[0]
    sent = g.value(f"row_weights_send{c}", (R,), kind=ValueKind.ROUTING, dtype=WEIGHT_DTYPE, routed=True)
    g.node(f"gate_weights{c}", OpKind.PERMUTE, (route.relay_weights, route.index_map), (sent,),
           attrs={"index": "slot"}, **kw)                                            # [Rn', k] -> [R]
    got = g.value(f"row_weights{c}", (R,), kind=ValueKind.ROUTING, dtype=WEIGHT_DTYPE, routed=True)
    g.collective(f"gate_weights_a2a{c}", OpKind.ALL_TO_ALL, (sent, route.index_map), (got,), full_bytes=g.nbytes(sent),
                 group=g.strategy.n // g.strategy.ep_nodes,
                 attrs={"axis": "node", "scope": "intra", "mode": "tokens", "direction": "to_experts",
                        "emit_map": False}, **kw)
    return got


def combine(g: GraphBuilder, route: NodeRoute, fc2_out: str, combined: str, weighted: bool, c: str, kw: dict) -> str:
    """Expert outputs [R, h] -> the tokens' outputs ``combined`` (a declared [b, L, h] value): summed
    within the relay's node (weighted there unless the gate ran before FC2), then over the nodes at home."""
    nodes = g.strategy.ep_nodes
    G, h = g.strategy.n // nodes, g.dims.h
    R = g.shape(fc2_out)[0]
    back = g.value(f"fc2_out_a2a{c}", (R, h), routed=True)
    g.collective(f"combine_a2a{c}", OpKind.ALL_TO_ALL, (fc2_out, route.seg), (back,), full_bytes=g.nbytes(fc2_out),
                 group=G, attrs={"axis": "node", "scope": "intra", "mode": "tokens", "direction": "from_experts"},
                 **kw)
    partial = g.value(f"relay_out{c}", (route.relay_tokens, h), routed=True)
    if weighted:
        g.node(f"combine_gather{c}", OpKind.UNPERMUTE, (back, route.relay_weights, route.index_map), (partial,),
               flops=2 * R * h, attrs={"weighted": True}, **kw)                     # [R, h] -> [Rn', h]
    else:
        g.node(f"combine_gather{c}", OpKind.UNPERMUTE, (back, route.index_map), (partial,),
               flops=R * h, attrs={"weighted": False}, **kw)
    home = g.value(f"node_out{c}", (route.relay_tokens, h), routed=True)
    g.collective(f"node_combine_a2a{c}", OpKind.ALL_TO_ALL, (partial, route.relay_map), (home,),
                 full_bytes=g.nbytes(partial), group=nodes,
                 attrs={"axis": "rail", "scope": "inter", "mode": "tokens", "direction": "from_experts"}, **kw)
    g.node(f"node_gather{c}", OpKind.UNPERMUTE, (home, route.node_map), (combined,),
           flops=route.relay_tokens * h, attrs={"weighted": False}, **kw)           # [Rn, h] -> [b, L, h]
    return combined
