"""The ring model: the bytes each rank sends and receives in one collective, and the ring steps it waits for.

ZeRO §7 counts communication as the bytes each GPU sends on a ring, the algorithm NCCL uses for large
messages. That arithmetic is read by three places that must agree: the counting ledger (`zero_core.comm`),
which records it for every collective that ran; the link split (`zero_core.topology`), which says which of
those bytes cross a node boundary; and the planner (`zero_core.planner`), which never runs a collective. So it
lives here, pure arithmetic that imports nothing, and each of them reads it.

Ring model, per rank r, for a full buffer of S bytes split into N chunks (chunk i as
`torch.tensor_split` would cut it):
- reduce-scatter: r sends every chunk but its own and receives every chunk but its left neighbour's,
  (N-1)/N·S each way when S divides evenly;
- all-gather: the mirror image, (N-1)/N·S;
- all-reduce: a reduce-scatter followed by an all-gather, 2(N-1)/N·S;
- broadcast: a pipelined ring from `src`: every rank but the last in the chain sends S, every rank but
  `src` receives S.
These are NCCL's bus-bandwidth factors (nccl-tests, PERFORMANCE.md): 2(N-1)/N, (N-1)/N, (N-1)/N, 1.
An all-to-all is no ring: rank r sends its input's chunk j straight to rank j and keeps chunk r, so it
sends (N-1)/N·S and receives as much, in N-1 messages (ZeRO++ §3.3's qgZ; `torch.distributed.all_to_all_single`).
"""

from __future__ import annotations

ALL_REDUCE = "all_reduce"
REDUCE_SCATTER = "reduce_scatter"
ALL_GATHER = "all_gather"
BROADCAST = "broadcast"
BARRIER = "barrier"
ALL_TO_ALL = "all_to_all"
OPS = (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, BROADCAST, BARRIER, ALL_TO_ALL)
D2H = "d2h"
H2D = "h2d"
PCIE_OPS = (D2H, H2D)
"""Copies between a rank's GPU and its host (ZeRO-Offload): on the ledger with their bytes, on no network
link. They move `elements x element_size` bytes over the GPU's PCIe link and none on the ring."""


def _chunk_bytes(total_bytes: int, element_size: int, world_size: int, index: int) -> int:
    """Bytes of ring chunk `index` of N, cut like `torch.tensor_split` (first chunks one larger)."""
    base, extra = divmod(total_bytes // element_size, world_size)
    return (base + (1 if index < extra else 0)) * element_size


def ring_bytes(
    op: str, full_bytes: int, element_size: int, world_size: int, rank: int, src: int = 0
) -> tuple[int, int]:
    """(bytes sent, bytes received) by `rank` for one collective on a buffer of `full_bytes`."""
    n = world_size
    if n == 1 or op in (BARRIER, *PCIE_OPS) or full_bytes == 0:
        return 0, 0

    def chunk(index: int) -> int:
        return _chunk_bytes(full_bytes, element_size, n, index % n)

    if op == REDUCE_SCATTER:
        return full_bytes - chunk(rank), full_bytes - chunk(rank - 1)
    if op == ALL_GATHER:
        return full_bytes - chunk(rank + 1), full_bytes - chunk(rank)
    if op == ALL_REDUCE:
        rs_sent, rs_recv = ring_bytes(REDUCE_SCATTER, full_bytes, element_size, n, rank)
        ag_sent, ag_recv = ring_bytes(ALL_GATHER, full_bytes, element_size, n, rank)
        return rs_sent + ag_sent, rs_recv + ag_recv
    if op == BROADCAST:
        last_in_chain = (src - 1) % n
        return (0 if rank == last_in_chain else full_bytes), (0 if rank == src else full_bytes)
    if op == ALL_TO_ALL:
        return full_bytes - chunk(rank), (n - 1) * chunk(rank)
    raise ValueError(f"unknown collective {op!r}; expected one of {OPS}")


def ring_messages(op: str, world_size: int) -> int:
    """Sequential ring steps (each pays the link latency once): 2(N-1) for all-reduce, N-1 otherwise (an
    all-to-all's N-1 messages, one to each peer)."""
    if world_size == 1 or op in PCIE_OPS:
        return 0
    if op == ALL_REDUCE:
        return 2 * (world_size - 1)
    if op == BARRIER:
        return 1
    return world_size - 1
