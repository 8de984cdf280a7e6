"""Where a collective's bytes travel: ranks grouped into nodes, each rank's bytes split into intra- and inter-node.

ZeRO §7 counts the bytes each GPU sends; a cluster pays for them on two kinds of link, fast ones inside
a node (NVLink) and a slower network between nodes. Here N ranks sit in M = N/G nodes of G consecutive
ranks (rank r on node r // G, local index r % G), and each rank's bytes of each collective are split by
link class, for two algorithms. S is the buffer's bytes; closed forms assume S splits evenly into N chunks.

"ring", the flat ring of `zero_core.ring` over ranks 0..N-1: NCCL builds its rings this way, a ring in
each node and the node rings joined into one flat ring, no 2-D ring (NVIDIA/nccl#471). Rank r sends to
(r+1) % N, so only the last rank of each node sends across, all its ring bytes: 2(N-1)/N·S for an
all-reduce, on one rank per node, none on the others.

"hierarchical", two levels, every byte that can stay inside a node kept there:
- reduce-scatter: a reduce-scatter inside the node (local index l ends with the node's sum of the 1/G of
  the buffer that ranks with local index l own, chunks l, G+l, 2G+l, ...), then a reduce-scatter of that
  1/G among the M ranks with local index l, one per node: (G-1)/G·S intra, (M-1)/M·S/G inter per rank;
- all-gather: the mirror image, inter-node first on 1/G, then inside the node: the same bytes;
- all-reduce: both, that is an intra-node reduce-scatter, an inter-node all-reduce among the ranks of one
  local index on S/G, an intra-node all-gather: 2(G-1)/G·S intra, 2(M-1)/M·S/G inter per rank. This is
  Horovod's hierarchical all-reduce (horovod/common/ops/nccl_operations.cc, `NCCLHierarchicalAllreduce`:
  `ncclReduceScatter` in the node, `MPI_Allreduce` across nodes per local rank, `ncclAllGather`) and
  Huawei HCCL's ("Hierarchical Communication Principles"), which for a lone reduce-scatter or all-gather
  puts the inter-node step where chunks stay contiguous instead, sending more across;
- broadcast: a pipelined ring across nodes among the ranks with the source's local index, then a ring
  inside each node starting there.
Each step is a ring, so the bytes are `zero_core.ring`'s model applied twice.

An all-to-all is no ring under either name: rank r sends its chunk j straight to rank j, so the chunks for
ranks on other nodes cross, those for its node's ranks stay: (G-1)/N·S intra and (N-G)/N·S inter per rank
(ZeRO++ §3.3 runs qgZ's all-to-alls inside a node, then among one rank per node, so each is all one class).

A collective in a process group (`dist.new_group`) runs among the group's ranks only. "ring" is then the
group's own ring, rank i of the group sending to rank i+1: a group inside one node sends nothing across,
a group of one rank per node sends everything across. "hierarchical" runs the two levels inside the group,
whose ranks must then sit G' to a node on every node it touches (`group_topology`).

What hierarchical changes is where bytes go, not how many: a rank sends (G-1)/G·S + (M-1)/M·S/G =
(N-1)/N·S per pass either way. The busiest inter-node sender sends (N-1)/(M-1) times less (the flat
ring's boundary rank 2(N-1)/N·S, every hierarchical rank 2(M-1)/M·S/G); the mean over ranks falls only by
M(N-1)/(N(M-1)), and a node's total across is 2(N-1)/N·S flat against 2(M-1)/M·S. The win is spreading
a node's inter-node bytes over its G GPUs (and their NICs) instead of one. NCCL runs several rings
(channels) at once, each leaving a node from a different GPU, which spreads the flat ring's too; we count
one ring, as `zero_core.comm` does. Ring factors: nccl-tests PERFORMANCE.md; NCCL's own per-GPU count
for a ring all-reduce, 2(N-1)·S/N, in NVIDIA/nccl#457.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

from zero_core import ring  # not `ring_bytes` by name: graded cells may import topology, and ex01 asks for it
from zero_core.ring import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BARRIER, BROADCAST, OPS, PCIE_OPS, REDUCE_SCATTER

RING = "ring"
HIERARCHICAL = "hierarchical"
ALGORITHMS = (RING, HIERARCHICAL)


@dataclass(frozen=True)
class Topology:
    """N ranks in nodes of G consecutive ranks: rank r on node r // G. G must divide N."""

    world_size: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"a topology needs at least one rank, got world_size={self.world_size}")
        if self.gpus_per_node < 1 or self.world_size % self.gpus_per_node:
            divisors = [g for g in range(1, self.world_size + 1) if self.world_size % g == 0]
            raise ValueError(
                f"{self.gpus_per_node} GPUs per node do not divide {self.world_size} ranks into whole nodes; "
                f"choose one of {', '.join(map(str, divisors))}"
            )

    @classmethod
    def single_node(cls, world_size: int) -> Topology:
        """Every rank on one node: nothing crosses a node boundary (the default everywhere)."""
        return cls(world_size, world_size)

    @property
    def nodes(self) -> int:
        return self.world_size // self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def local_index(self, rank: int) -> int:
        return rank % self.gpus_per_node

    def rank_at(self, node: int, local_index: int) -> int:
        """The rank with `local_index` on `node`, both taken cyclically."""
        return (node % self.nodes) * self.gpus_per_node + local_index % self.gpus_per_node


@dataclass(frozen=True)
class LinkTraffic:
    """One rank's traffic by link class: bytes (or elements, once `scaled`) sent and received."""

    intra_node_sent: float = 0
    inter_node_sent: float = 0
    intra_node_received: float = 0
    inter_node_received: float = 0

    @property
    def sent(self) -> float:
        return self.intra_node_sent + self.inter_node_sent

    @property
    def received(self) -> float:
        return self.intra_node_received + self.inter_node_received

    def __add__(self, other: LinkTraffic) -> LinkTraffic:
        return LinkTraffic(
            self.intra_node_sent + other.intra_node_sent,
            self.inter_node_sent + other.inter_node_sent,
            self.intra_node_received + other.intra_node_received,
            self.inter_node_received + other.inter_node_received,
        )

    def scaled(self, factor: float) -> LinkTraffic:
        return LinkTraffic(*(value * factor for value in asdict(self).values()))

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def group_topology(topology: Topology, group: tuple[int, ...]) -> Topology:
    """The nodes of a process group's ranks, renumbered 0..k-1 in group order: G' of them on each node it
    touches. A group with unequal numbers of ranks on its nodes has no two-level layout: `ValueError`."""
    nodes = [topology.node_of(r) for r in group]
    per_node = nodes.count(nodes[0])
    if len(group) % per_node or any(nodes[i] != nodes[i - i % per_node] for i in range(len(group))):
        raise ValueError(
            f"group {list(group)} does not have the same number of ranks on each of its nodes ({topology}); "
            "count it with the flat ring"
        )
    if len(set(nodes)) != len(group) // per_node:
        raise ValueError(f"group {list(group)} visits a node twice in group order ({topology})")
    return Topology(len(group), per_node)


def link_bytes(
    op: str,
    full_bytes: int,
    element_size: int,
    topology: Topology,
    rank: int,
    algorithm: str = RING,
    src: int = 0,
    *,
    group: tuple[int, ...] = (),
) -> LinkTraffic:
    """Bytes `rank` sends and receives inside its node and across nodes for one collective on `full_bytes`.

    Chunks are cut as `zero_core.ring` cuts them (`torch.tensor_split`: the first chunks one element larger),
    so with `algorithm="ring"` intra + inter is exactly `ring.ring_bytes`. `group` is the global ranks of the
    collective's process group (empty: every rank); `rank` and `src` are global ranks.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown collective algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    if op in PCIE_OPS:
        return LinkTraffic()  # a host copy takes the GPU's PCIe link, neither class of network link
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; expected one of {OPS}")
    n = topology.world_size
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} is outside 0..{n - 1} for the {op} on {topology}")
    members = group or range(n)
    if rank not in members:
        raise ValueError(f"rank {rank} is not in group {list(group)} of the {op}")
    k, index = len(members), members.index(rank)
    src_index = members.index(src) if op == BROADCAST else 0
    if k == 1 or op == BARRIER or full_bytes == 0:
        return LinkTraffic()
    if op == ALL_TO_ALL:
        return _all_to_all(full_bytes, element_size, topology, members, index)
    if algorithm == RING:
        sent, received = ring.ring_bytes(op, full_bytes, element_size, k, index, src_index)
        sends_across = topology.node_of(members[(index + 1) % k]) != topology.node_of(rank)
        receives_across = topology.node_of(members[(index - 1) % k]) != topology.node_of(rank)
        return LinkTraffic(
            0 if sends_across else sent,
            sent if sends_across else 0,
            0 if receives_across else received,
            received if receives_across else 0,
        )
    if group:
        return _hierarchical(op, full_bytes, element_size, group_topology(topology, group), index, src_index)
    return _hierarchical(op, full_bytes, element_size, topology, rank, src)


def _all_to_all(
    full_bytes: int, element_size: int, topology: Topology, members: tuple[int, ...] | range, index: int
) -> LinkTraffic:
    """Rank `members[index]` sends chunk j to `members[j]` and receives its own chunk from each: a chunk to
    or from a rank on another node is inter-node. Chunks cut as `torch.tensor_split` cuts them."""
    k = len(members)
    base, extra = divmod(full_bytes // element_size, k)

    def chunk(j: int) -> int:
        return (base + (1 if j < extra else 0)) * element_size

    node = topology.node_of(members[index])
    peers = [j for j in range(k) if j != index]
    across = [j for j in peers if topology.node_of(members[j]) != node]
    inter_sent = sum(chunk(j) for j in across)
    intra_sent = sum(chunk(j) for j in peers) - inter_sent
    return LinkTraffic(intra_sent, inter_sent, (len(peers) - len(across)) * chunk(index), len(across) * chunk(index))


def _hierarchical(op: str, full_bytes: int, element_size: int, t: Topology, rank: int, src: int) -> LinkTraffic:
    g, m = t.gpus_per_node, t.nodes
    base, extra = divmod(full_bytes // element_size, t.world_size)
    node, local = t.node_of(rank), t.local_index(rank)

    def chunk(r: int) -> int:
        return (base + (1 if r < extra else 0)) * element_size

    def piece(local_index: int) -> int:
        """Bytes of the 1/G of the buffer owned by ranks with `local_index`: chunks local_index + k·G."""
        local_index %= g
        larger = 0 if extra <= local_index else min(m, -(-(extra - local_index) // g))
        return (m * base + larger) * element_size

    if op == REDUCE_SCATTER:
        return LinkTraffic(
            full_bytes - piece(local),
            piece(local) - chunk(rank),
            full_bytes - piece(local - 1),
            piece(local) - chunk(t.rank_at(node - 1, local)),
        )
    if op == ALL_GATHER:
        return LinkTraffic(
            full_bytes - piece(local + 1),
            piece(local) - chunk(t.rank_at(node + 1, local)),
            full_bytes - piece(local),
            piece(local) - chunk(rank),
        )
    if op == ALL_REDUCE:
        return _hierarchical(REDUCE_SCATTER, full_bytes, element_size, t, rank, src) + _hierarchical(
            ALL_GATHER, full_bytes, element_size, t, rank, src
        )
    if op == BROADCAST:
        src_node, src_local = t.node_of(src), t.local_index(src)
        in_chain = local == src_local
        return LinkTraffic(
            0 if local == (src_local - 1) % g else full_bytes,
            full_bytes if in_chain and m > 1 and node != (src_node - 1) % m else 0,
            0 if local == src_local else full_bytes,
            full_bytes if in_chain and node != src_node else 0,
        )
    raise ValueError(f"unknown collective {op!r}; expected one of {OPS}")


class PassSplit(NamedTuple):
    """One ring pass split by link class, per rank: the means over ranks, and the busiest rank's inter-node."""

    intra_node_mean: float
    inter_node_mean: float
    inter_node_max: float


def pass_split(amount: float, topology: Topology, algorithm: str = RING) -> PassSplit:
    """Closed forms for one reduce-scatter or all-gather of `amount` (bytes or elements; an all-reduce is two).

    Flat ring: every rank sends (N-1)/N of it, the M boundary ranks all of that across: mean inter-node
    (N-1)/N·amount/G, the busiest (N-1)/N·amount. Hierarchical: every rank (G-1)/G·amount inside its node
    and (M-1)/M·amount/G across. `link_bytes` gives the same, rank by rank, when the amount splits evenly.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown collective algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    n, g, m = topology.world_size, topology.gpus_per_node, topology.nodes
    if algorithm == RING:
        per_rank = (n - 1) / n * amount
        across = per_rank if m > 1 else 0.0
        return PassSplit(per_rank - across / g, across / g, across)
    inter = (m - 1) / m * amount / g
    return PassSplit((g - 1) / g * amount, inter, inter)
