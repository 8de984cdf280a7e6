"""Exercise ex09's answer: a two-level all-gather of a ZeRO-3 layer, across nodes on 1/G of the layer
first, then inside the node.

`HierarchicalZero3` (`zero_core.variants.hierarchical`) names `hierarchical_all_gather` through
`zero_core.registry` and imports it only when it runs it. Where a student's ex09 is graded, the grading
sandbox leaves this module out (`autograder.walls`): the grader trains the stage with the student's
function in a process where this module is never loaded, and cannot be.

N ranks sit in M = N/G nodes of G; rank r = node·G + l owns chunk r (c elements) of the layer's padded flat
parameters. A flat ring all-gather sends (N-1)/N of the layer per rank, and the last rank of each node
sends all of it across nodes. Here (`zero_core.topology`, "hierarchical"):

1. across nodes, among the M ranks with local index l (`cross_group`): every rank ends with chunks
   l, G+l, 2G+l, ..., one per node, (M-1)·c elements sent across per rank, (M-1)/M·Ψ/G;
2. inside the node (`node_group`): those M chunks are spread over the layout in steps of G, so a single
   all-gather of them would land in node-major order, not rank-major. Chunks m·G ... m·G+G-1 are
   contiguous, though: one all-gather per node block m, of chunk m·G+l from each local index, straight
   into its place in `output`, (G-1)·M·c elements per rank, all intra-node.

The only buffer besides `output` is the staging of step 1, M·c = Ψ_layer/G elements, freed on return.
DeepSpeed's MiCS gathers the same way (`mics_hierarchical_params_gather`: inter-node first into a 1/G
block, then per-block intra-node gathers; deepspeed/runtime/zero/mics.py, `_hierarchical_all_gather_params`).
"""

from __future__ import annotations

import torch

from zero_core import dist


def hierarchical_all_gather(
    output: torch.Tensor, shard: torch.Tensor, node_group: dist.ProcessGroup, cross_group: dist.ProcessGroup
) -> None:
    """`output` (N·c elements) becomes every rank's `shard` (c elements) in rank order, in two levels."""
    gpus_per_node, nodes = dist.get_world_size(node_group), dist.get_world_size(cross_group)
    chunk = shard.numel()
    staging = shard.new_empty(nodes * chunk)
    dist.all_gather_single(staging, shard, group=cross_group)
    blocks = output.view(nodes, gpus_per_node * chunk)
    for node in range(nodes):
        dist.all_gather_single(blocks[node], staging[node * chunk : (node + 1) * chunk], group=node_group)
