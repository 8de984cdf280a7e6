"""`dist.all_to_all_single`: chunk j of every rank's input to rank j, on the virtual cluster and on gloo.

The collective qgZ (ZeRO++ §3.3) is built on. Each test states what it measures: the values each rank ends
with, the bytes the ledger records ((N-1)/N of the input sent, as much received), and how a node topology
splits them (chunks for ranks on other nodes cross, the others stay).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as torch_dist

from tests.gloo_ranks import start_ranks
from zero_core import dist
from zero_core.backends.torch_distributed import TorchBackend, process_context
from zero_core.cluster import RankFailed, VirtualCluster
from zero_core.comm import ALL_TO_ALL, ring_bytes, ring_messages
from zero_core.context import activate
from zero_core.launch import leave
from zero_core.topology import HIERARCHICAL, Topology, link_bytes

WORLD_SIZE = 4
DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.uint8)


def exchanges() -> dict[str, object]:
    """Every dtype the ZeRO++ stages send, over all ranks, in a group of two, and asynchronously."""
    rank, out = dist.get_rank(), {}
    for dtype in DTYPES:
        sent = (torch.arange(2 * WORLD_SIZE) + 10 * rank).to(dtype)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, tag=f"a2a {dtype}")
        out[str(dtype)] = received
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    sent = torch.arange(6.0).view(2, 3) + 10 * rank
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=pairs[rank // 2], tag="a2a pair")
    out["pair"] = received
    out["async"] = torch.empty(WORLD_SIZE)
    dist.all_to_all_single(out["async"], torch.full((WORLD_SIZE,), 1.0 * rank), async_op=True).wait()
    return out


@pytest.fixture(scope="module")
def virtual() -> tuple[list[dict], VirtualCluster]:
    cluster = VirtualCluster(WORLD_SIZE)
    return cluster.run(exchanges), cluster


def test_rank_r_receives_chunk_r_of_every_rank_in_rank_order(virtual) -> None:
    results, _ = virtual
    for rank, out in enumerate(results):
        expected = torch.tensor([10 * sender + 2 * rank + k for sender in range(WORLD_SIZE) for k in range(2)])
        for dtype in DTYPES:
            assert torch.equal(out[str(dtype)], expected.to(dtype)), (rank, dtype)
        assert torch.equal(out["async"], torch.arange(WORLD_SIZE, dtype=torch.float32))


def test_in_a_group_chunks_are_exchanged_among_its_ranks_only(virtual) -> None:
    results, _ = virtual
    for rank, out in enumerate(results):
        peers = [rank - rank % 2, rank - rank % 2 + 1]
        expected = torch.stack([torch.arange(3.0) + 3 * (rank % 2) + 10 * peer for peer in peers])
        assert torch.equal(out["pair"], expected)


def test_the_ledger_records_n_minus_1_over_n_of_the_input_each_way(virtual) -> None:
    _, cluster = virtual
    for rank in range(WORLD_SIZE):
        entries = {e.tag: e for e in cluster.ledger.ranks[rank].entries}
        int8 = entries[f"a2a {torch.int8}"]
        assert (int8.op, int8.elements, int8.bytes_sent, int8.bytes_received) == (ALL_TO_ALL, 8, 6, 6)
        fp32 = entries[f"a2a {torch.float32}"]
        assert fp32.bytes_sent == fp32.bytes_received == 3 * 2 * 4
        pair = entries["a2a pair"]
        assert pair.group == (rank - rank % 2, rank - rank % 2 + 1) and pair.bytes_sent == 3 * 4


def test_an_all_to_all_takes_one_message_per_peer() -> None:
    assert ring_messages(ALL_TO_ALL, 8) == 7
    assert ring_bytes(ALL_TO_ALL, 800, 4, 8, 3) == (700, 700)


@pytest.mark.parametrize("algorithm", ["ring", HIERARCHICAL])
def test_chunks_for_other_nodes_cross_and_the_rest_stay_whatever_the_algorithm(algorithm) -> None:
    """8 ranks in 2 nodes of 4, S = 800 bytes: chunks of 100; 3 peers in the node, 4 on the other."""
    topology = Topology(8, 4)
    for rank in range(8):
        link = link_bytes(ALL_TO_ALL, 800, 4, topology, rank, algorithm)
        assert (link.intra_node_sent, link.inter_node_sent) == (300, 400)
        assert (link.intra_node_received, link.inter_node_received) == (300, 400)
    one_per_node = (1, 5)
    across = link_bytes(ALL_TO_ALL, 800, 4, topology, 5, group=one_per_node)
    assert (across.intra_node_sent, across.inter_node_sent) == (0, 400)


def test_mismatched_shapes_are_refused_on_the_calling_rank() -> None:
    def uneven() -> None:
        dist.all_to_all_single(torch.empty(5), torch.zeros(5))

    with pytest.raises(RankFailed, match=r"all_to_all input \[5\].*divides"):
        VirtualCluster(2).run(uneven)


def _process(rank: int, folder: str) -> None:
    torch_dist.init_process_group(
        "gloo", init_method=f"file://{folder}/store", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=60)
    )
    ctx = process_context(TorchBackend())
    with activate(ctx):
        outcome = exchanges()
    outcome["ledger"] = [entry._asdict() for entry in ctx.ledger.entries]
    torch.save(outcome, f"{folder}/rank{rank}.pt")
    leave(0)  # exit as zero_core.launch does: destroying the group can deadlock a finished rank


def test_gloo_processes_exchange_the_same_values_and_record_the_same_ledger(virtual, tmp_path) -> None:
    """torch.distributed.all_to_all_single on gloo (every dtype above, in groups too) matches the virtual cluster."""
    start_ranks(_process, (str(tmp_path),), WORLD_SIZE)
    results, cluster = virtual
    for rank in range(WORLD_SIZE):
        real = torch.load(tmp_path / f"rank{rank}.pt")
        for key, value in results[rank].items():
            assert real[key].dtype == value.dtype and torch.equal(real[key], value), (rank, key)
        keep = ("op", "tag", "dtype", "elements", "bytes_sent", "bytes_received", "group")
        twin = [{k: e._asdict()[k] for k in keep} for e in cluster.ledger.ranks[rank].entries]
        assert [{k: e[k] for k in keep} for e in real["ledger"]] == twin
