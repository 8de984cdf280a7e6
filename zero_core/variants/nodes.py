"""Nodes of G ranks as process groups: what every stage that knows the nodes builds its collectives on.

N ranks sit in M = N/G nodes of G consecutive ranks (`zero_core.topology`). Two kinds of group follow:
a node's G ranks (HSDP's shard group, hpZ's secondary partition, qgZ's first all-to-all, the hierarchical
gather's second level), and, for each local index l, the M ranks that have it, one per node (HSDP's replica
group, qgZ's second all-to-all, the hierarchical gather's first level).
"""

from __future__ import annotations

from zero_core import dist
from zero_core.context import current


def node_groups(world_size: int, gpus_per_node: int) -> tuple[list[dist.ProcessGroup], list[dist.ProcessGroup]]:
    """(shard groups, replica groups): every node's G ranks, and for each local index the M ranks that have it.

    Every rank makes every group, as `torch.distributed.new_group` requires, members or not.
    """
    if gpus_per_node < 1 or world_size % gpus_per_node:
        raise ValueError(f"gpus_per_node {gpus_per_node} must divide the {world_size} ranks into whole nodes")
    nodes = world_size // gpus_per_node
    shards = [dist.new_group(range(n * gpus_per_node, (n + 1) * gpus_per_node)) for n in range(nodes)]
    replicas = [dist.new_group(range(local, world_size, gpus_per_node)) for local in range(gpus_per_node)]
    return shards, replicas


def this_ranks_groups(gpus_per_node: int | None) -> tuple[int, dist.ProcessGroup, dist.ProcessGroup]:
    """(G, this rank's node group, this rank's replica group); G defaults to every rank on one node."""
    ctx = current()
    gpus_per_node = gpus_per_node or ctx.world_size
    shards, replicas = node_groups(ctx.world_size, gpus_per_node)
    return gpus_per_node, shards[ctx.rank // gpus_per_node], replicas[ctx.rank % gpus_per_node]
