"""Process groups: `dist.new_group(ranks)` and `group=` on every collective, on the virtual cluster.

A group's collective meets its ranks only, numbers its collectives on its own, combines in group order,
fails with errors that name the group, and is recorded with the group and its ring bytes over the group.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as torch_dist

from tests.gloo_ranks import start_ranks
from zero_core import dist
from zero_core.backends.torch_distributed import TorchBackend, process_context
from zero_core.cluster import CollectiveDeadlock, CollectiveMismatch, CollectiveTimeout, RankFailed, VirtualCluster
from zero_core.comm import ring_bytes
from zero_core.context import activate, current
from zero_core.launch import leave
from zero_core.topology import HIERARCHICAL, RING, Topology, link_bytes


def halves(world_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    half = world_size // 2
    return dist.new_group(range(half)), dist.new_group(range(half, world_size))


def test_a_group_all_reduce_sums_only_the_groups_ranks():
    def fn():
        low, high = halves(8)
        mine = low if dist.get_rank() < 4 else high
        value = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(value, group=mine)
        return value.item()

    assert VirtualCluster(8).run(fn) == [6.0] * 4 + [22.0] * 4


def test_disjoint_groups_proceed_independently_with_their_own_sequences():
    def fn():
        low, high = halves(4)
        if dist.get_rank() < 2:
            for _ in range(5):
                dist.all_reduce(torch.ones(2), group=low)
        else:
            dist.barrier(group=high)
        dist.barrier()
        return dist.get_rank()

    assert VirtualCluster(4, timeout_s=10.0).run(fn) == [0, 1, 2, 3]


def test_results_come_in_group_order_and_chunks_go_by_index_in_the_group():
    def fn():
        odd = dist.new_group([5, 3, 1])
        if dist.get_rank() not in odd.ranks:
            return None
        index = dist.get_rank(odd)
        gathered = torch.empty(3)
        dist.all_gather_single(gathered, torch.tensor([float(dist.get_rank())]), group=odd)
        chunk = torch.empty(1)
        dist.reduce_scatter_single(chunk, torch.arange(3.0) * (index + 1), group=odd)
        from_global = torch.tensor([float(dist.get_rank())])
        dist.broadcast(from_global, src=5, group=odd)
        from_index = torch.tensor([float(dist.get_rank())])
        dist.broadcast(from_index, group=odd, group_src=0)
        return gathered.tolist(), chunk.item(), from_global.item(), from_index.item()

    results = VirtualCluster(6).run(fn)
    assert [results[r] for r in (0, 2, 4)] == [None] * 3
    for index, rank in enumerate((1, 3, 5)):
        assert results[rank] == ([1.0, 3.0, 5.0], 6.0 * index, 5.0, 1.0)


def test_get_rank_and_world_size_answer_for_the_group_as_torch_does():
    def fn():
        group = dist.new_group([2, 3])
        return dist.get_rank(group), dist.get_world_size(group), dist.get_rank(), dist.get_world_size()

    assert VirtualCluster(4).run(fn) == [(-1, 2, 0, 4), (-1, 2, 1, 4), (0, 2, 2, 4), (1, 2, 3, 4)]


def test_a_collective_in_a_group_the_rank_is_not_in_raises_at_once():
    def fn():
        group = dist.new_group([0, 1])
        dist.all_reduce(torch.ones(1), group=group)

    with pytest.raises(RankFailed, match=r"rank 2: all_reduce in group \[0, 1\], which rank 2 is not in"):
        VirtualCluster(3, timeout_s=10.0).run(fn)


@pytest.mark.parametrize("ranks", [[], [0, 0], [0, 4]])
def test_new_group_rejects_bad_ranks(ranks):
    with pytest.raises(RankFailed, match="new_group needs distinct ranks in 0..3"):
        VirtualCluster(4).run(lambda: dist.new_group(ranks))


def test_a_shape_check_uses_the_groups_size():
    def fn():
        group = dist.new_group([0, 1])
        dist.reduce_scatter_single(torch.empty(1), torch.ones(4), group=group)

    with pytest.raises(RankFailed, match=r"world_size \(2\) x output"):
        VirtualCluster(2, timeout_s=10.0).run(fn)


def test_a_mismatch_inside_a_group_names_the_group():
    def fn():
        low, high = halves(4)
        if dist.get_rank() >= 2:
            return
        dist.all_reduce(torch.ones(3 if dist.get_rank() == 0 else 4), group=low)

    with pytest.raises(CollectiveMismatch, match=r"position #0 in group \[0, 1\]"):
        VirtualCluster(4, timeout_s=10.0).run(fn)


def test_a_rank_that_skips_a_group_collective_gives_a_deadlock_error_naming_the_group():
    def fn():
        low, _ = halves(4)
        if dist.get_rank() == 1:
            time.sleep(0.2)
            return
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(2), group=low, tag="grad")

    with pytest.raises(CollectiveDeadlock, match=r"rank 1 returned without calling all_reduce #0 .*in group \[0, 1\]"):
        VirtualCluster(4, timeout_s=10.0).run(fn)


@pytest.mark.timeout(20)
def test_ranks_waiting_in_different_groups_time_out_with_the_group_in_the_message():
    def fn():
        low, _ = halves(4)
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(2), group=low)
        dist.barrier()

    with pytest.raises(CollectiveTimeout, match=r"all_reduce #0 float32 \[2\] op=SUM in group \[0, 1\]"):
        VirtualCluster(4, timeout_s=0.5).run(fn)


def test_the_ledger_records_the_group_and_ring_bytes_over_the_group():
    def fn():
        low, high = halves(8)
        dist.all_reduce(torch.ones(256), group=low if dist.get_rank() < 4 else high)
        dist.all_reduce(torch.ones(256))

    cluster = VirtualCluster(8)
    cluster.run(fn)
    for rank in range(8):
        in_group, world = cluster.ledger.ranks[rank].entries
        assert in_group.group == tuple(range(4)) if rank < 4 else tuple(range(4, 8))
        assert in_group.bytes_sent == 2 * 3 * 1024 // 4 == ring_bytes("all_reduce", 1024, 4, 4, rank % 4)[0]
        assert (world.group, world.bytes_sent) == ((), 2 * 7 * 1024 // 8)


def test_a_group_inside_one_node_is_all_intra_node_and_one_rank_per_node_all_inter_node():
    topology = Topology(8, 4)
    for algorithm in (RING, HIERARCHICAL):
        for rank in range(4):
            inside = link_bytes("all_reduce", 4096, 2, topology, rank, algorithm, group=(0, 1, 2, 3))
            assert (inside.inter_node_sent, inside.intra_node_sent) == (0, 2 * 3 * 4096 / 4)
        for rank in (1, 5):
            across = link_bytes("all_reduce", 4096, 2, topology, rank, algorithm, group=(1, 5))
            assert (across.intra_node_sent, across.inter_node_sent) == (0, 4096)


def test_link_traffic_of_a_run_with_groups_follows_the_groups():
    def fn():
        node = dist.new_group(range(4 * (dist.get_rank() // 4), 4 * (dist.get_rank() // 4) + 4))
        replicas = [dist.new_group([i, i + 4]) for i in range(4)]
        dist.all_gather_single(torch.empty(64), torch.ones(16), group=node)
        dist.all_reduce(torch.ones(16), group=replicas[dist.get_rank() % 4])
        dist.broadcast(torch.ones(16), src=4 + dist.get_rank() % 4, group=replicas[dist.get_rank() % 4])

    cluster = VirtualCluster(8)
    cluster.run(fn)
    traffic = cluster.ledger.link_traffic(Topology(8, 4))
    for rank, link in enumerate(traffic):
        assert link.intra_node_sent == 3 * 16 * 4
        assert link.inter_node_sent == 16 * 4 + (16 * 4 if rank >= 4 else 0)


def test_a_group_of_every_rank_is_the_default_group():
    def fn():
        everyone = dist.new_group()
        dist.all_reduce(torch.ones(8), group=everyone)

    cluster = VirtualCluster(3)
    cluster.run(fn)
    assert all(ledger.entries[0].group == () for ledger in cluster.ledger.ranks)


def group_scenario() -> dict:
    """Collectives in the two halves and in the odd ranks, with AVG (divides by the group's size)."""
    rank = dist.get_rank()
    low, high = halves(4)
    odd = dist.new_group([1, 3])
    mine = low if rank < 2 else high
    out: dict = {}
    value = torch.tensor([float(rank + 1)] * 4)
    dist.all_reduce(value, op=dist.ReduceOp.AVG, group=mine)
    out["all_reduce avg"] = value
    gathered = torch.empty(4)
    dist.all_gather_single(gathered, torch.tensor([float(rank), float(rank) + 0.5]), group=mine)
    out["all_gather"] = gathered
    chunk = torch.empty(2)
    dist.reduce_scatter_single(chunk, torch.arange(4.0) * (rank + 1), group=mine)
    out["reduce_scatter"] = chunk
    if rank in odd.ranks:
        source = torch.tensor([float(rank)])
        dist.broadcast(source, src=3, group=odd)
        out["broadcast"] = source
        dist.barrier(group=odd)
    out["ledger"] = [(e.op, e.group, e.bytes_sent, e.bytes_received) for e in current().ledger.entries]
    return out


def _gloo_rank(rank: int, folder: str) -> None:
    torch_dist.init_process_group(
        "gloo", init_method=f"file://{folder}/store", rank=rank, world_size=4, timeout=timedelta(seconds=60)
    )
    with activate(process_context(TorchBackend(timeout=timedelta(seconds=60)))):
        torch.save(group_scenario(), f"{folder}/rank{rank}.pt")
    leave(0)  # exit as zero_core.launch does: destroying the group can deadlock a finished rank


@pytest.mark.timeout(120)
def test_groups_on_gloo_processes_give_the_virtual_clusters_results_and_ledgers(tmp_path):
    start_ranks(_gloo_rank, (str(tmp_path),), 4)
    real = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(4)]
    virtual = VirtualCluster(4).run(group_scenario)
    for rank in range(4):
        assert real[rank].keys() == virtual[rank].keys()
        for name, value in virtual[rank].items():
            got = real[rank][name]
            same = torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value
            assert same, f"rank {rank}: {name}: gloo {got} vs virtual {value}"
    assert virtual[0]["all_reduce avg"].tolist() == [1.5] * 4
