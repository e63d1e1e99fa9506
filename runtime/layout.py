"""Where one rank sits among the ranks running a plan, and the groups of each collective axis.

Data parallelism: 2-D process groups. n x D ranks run D replicas of an n-rank group, laid out
replica-major (``Layout``): global rank g = p * n + r is rank r of replica p. A collective runs
on the group its attr ``axis`` names (``axis_of``): "mp" (the default) the n ranks of its own
replica, g in [p*n, (p+1)*n); "dp" the D ranks holding the same rank r, {r, r+n, .., r+(D-1)n}.
This is the simulated layout of ``moegraph.interpreter`` (``axis_groups``, envs replica-major).
Group-rank order is replica order along dp and rank order along mp, as the reference stacks them.
Nodes (``Layout.node_ranks`` = G > 0, strategy.ep_nodes = n/G): the hierarchical token dispatch runs
on "node", the G ranks of one node {q*G, .., q*G+G-1}, and "rail", the n/G ranks with the same local
index {r, r+G, ..}, both within a replica; their token all-to-alls exchange counts on their own group.
A folded attention (``Layout.attn_ranks`` = G > 0, strategy.attn_nodes = n/G) runs on "attn", its G
consecutive ranks, and sums its shards' gradients on "attn_dp", the n/G ranks with its local index.
Pipeline stages (``Layout.pp`` > 1, moegraph.passes.stages' world order): the world holds pp such
blocks of n x D ranks, block p on global ranks [p*n*D, (p+1)*n*D); a plan's groups are its own
block's, and every rank creates every block's groups (``new_group`` is collective).
"""

from __future__ import annotations

from dataclasses import dataclass

from moegraph.interpreter import Axis, axis_groups
from moegraph.runtime import RuntimeFailure


@dataclass(frozen=True)
class Layout:
    """Where one rank sits among n x dp ranks (module docstring: replica-major)."""

    n: int                 # model-parallel group size (the graph's strategy.n)
    dp: int                # replicas (strategy.dp)
    rank: int              # global rank in the default process group
    pp: int = 1            # pipeline blocks of n x dp ranks in the default group (module docstring)
    node_ranks: int = 0    # G, ranks per node (n / strategy.ep_nodes); 0: the plan has no node axes
    attn_ranks: int = 0    # G, ranks per attention (n / strategy.attn_nodes); 0: the plan has no attention axes

    def __post_init__(self):
        if self.n < 1 or self.dp < 1 or self.pp < 1 or not 0 <= self.rank < self.n * self.dp * self.pp:
            raise RuntimeFailure(f"rank {self.rank} does not fit a layout of n={self.n} x dp={self.dp}"
                                 + (f" x pp={self.pp}" if self.pp > 1 else "") + " ranks")
        for name, g, least, what in (("node_ranks", self.node_ranks, 2, "nodes"),
                                     ("attn_ranks", self.attn_ranks, 1, "attentions")):
            if g != 0 and (g < least or self.n % g or self.n // g < 2):
                valid = [0] + [v for v in range(least, self.n // 2 + 1) if self.n % v == 0]
                raise RuntimeFailure(f"{name}={g} does not split n={self.n} into {what}; valid: {', '.join(map(str, valid))}")

    @property
    def world(self) -> int:
        """The ranks running one plan (one pipeline block)."""
        return self.n * self.dp

    @property
    def block(self) -> int:
        """This rank's pipeline block (0 when pp = 1)."""
        return self.rank // self.world

    @property
    def replica(self) -> int:
        return self.rank // self.n % self.dp

    @property
    def mp_rank(self) -> int:
        return self.rank % self.n

    def size(self, axis: Axis) -> int:
        if axis == "mp":
            return self.n
        if axis == "dp":
            return self.dp
        if axis in ("node", "rail", "attn", "attn_dp"):
            nodes = axis in ("node", "rail")
            g = self.node_ranks if nodes else self.attn_ranks
            if not g:
                raise RuntimeFailure(f"axis {axis!r} needs " + ("nodes; this layout has none (strategy.ep_nodes=1)" if nodes
                                     else "a folded attention; this layout has none (strategy.attn_nodes=1)"))
            return g if axis in ("node", "attn") else self.n // g
        raise ValueError(f"axis {axis!r} is not one of mp, dp, node, rail, attn, attn_dp")

    def partition(self, axis: Axis) -> tuple[tuple[int, ...], ...]:
        """Every group of ``axis`` in every pipeline block, as global ranks in group-rank order
        (the same on every rank)."""
        return tuple(tuple(p * self.world + r for r in g) for p in range(self.pp)
                     for g in axis_groups(axis, self.n, self.dp, self.node_ranks, self.attn_ranks))

    def blocks(self) -> tuple[tuple[int, ...], ...]:
        """Every pipeline block's ranks (one block of all ranks when pp = 1)."""
        return tuple(tuple(range(p * self.world, (p + 1) * self.world)) for p in range(self.pp))
