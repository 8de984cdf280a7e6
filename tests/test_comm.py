"""The ledger: one entry per collective per rank, with exactly the bytes the ring algorithm moves."""

from __future__ import annotations

import pytest
import torch

from zero_core import comm, dist
from zero_core.cluster import VirtualCluster
from zero_core.context import current, phase

WORLD_SIZES = [1, 2, 3, 7, 32]


def run_collective(world_size: int, op: str, numel: int, dtype: torch.dtype, src: int = 0) -> VirtualCluster:
    """One collective of a full buffer of `numel` elements on every rank; returns the cluster with its ledger."""

    def fn():
        full = torch.ones(numel, dtype=dtype)
        shard = torch.ones(numel // world_size, dtype=dtype)
        if op == comm.ALL_REDUCE:
            dist.all_reduce(full)
        elif op == comm.REDUCE_SCATTER:
            dist.reduce_scatter_single(shard, full)
        elif op == comm.ALL_GATHER:
            dist.all_gather_single(full, shard)
        else:
            dist.broadcast(full, src=src)

    cluster = VirtualCluster(world_size)
    cluster.run(fn)
    return cluster


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce_moves_2_n_minus_1_over_n_of_the_buffer_each_way(world_size, dtype):
    numel = 12 * world_size
    cluster = run_collective(world_size, comm.ALL_REDUCE, numel, dtype)
    full_bytes = numel * dtype.itemsize
    for rank in range(world_size):
        (entry,) = cluster.ledger.ranks[rank].entries
        assert entry.bytes_sent == entry.bytes_received == 2 * (world_size - 1) * full_bytes // world_size


@pytest.mark.parametrize("op", [comm.REDUCE_SCATTER, comm.ALL_GATHER])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter_and_all_gather_move_n_minus_1_over_n_of_the_full_buffer(world_size, dtype, op):
    numel = 10 * world_size
    cluster = run_collective(world_size, op, numel, dtype)
    full_bytes = numel * dtype.itemsize
    for rank in range(world_size):
        (entry,) = cluster.ledger.ranks[rank].entries
        assert entry.op == op
        assert entry.elements == numel
        assert entry.bytes_sent == entry.bytes_received == (world_size - 1) * full_bytes // world_size


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_broadcast_is_a_pipelined_ring_from_the_source(world_size):
    src = world_size // 2
    cluster = run_collective(world_size, comm.BROADCAST, 20, torch.float32, src=src)
    full_bytes = 20 * 4
    last_in_chain = (src - 1) % world_size
    for rank in range(world_size):
        (entry,) = cluster.ledger.ranks[rank].entries
        if world_size == 1:
            assert entry.bytes_sent == entry.bytes_received == 0
            continue
        assert entry.bytes_sent == (0 if rank == last_in_chain else full_bytes)
        assert entry.bytes_received == (0 if rank == src else full_bytes)
    total_sent = sum(cluster.ledger.ranks[r].entries[0].bytes_sent for r in range(world_size))
    assert total_sent == (world_size - 1) * full_bytes


def test_a_barrier_moves_no_bytes_but_is_on_the_ledger():
    cluster = VirtualCluster(3)
    cluster.run(dist.barrier)
    for rank in range(3):
        (entry,) = cluster.ledger.ranks[rank].entries
        assert (entry.op, entry.bytes_sent, entry.bytes_received) == (comm.BARRIER, 0, 0)


@pytest.mark.parametrize("op", [comm.REDUCE_SCATTER, comm.ALL_GATHER, comm.ALL_REDUCE])
@pytest.mark.parametrize("numel, world_size", [(10, 3), (7, 4), (2, 5), (33, 32)])
def test_uneven_buffers_are_cut_like_tensor_split_and_every_byte_sent_is_received(op, numel, world_size):
    chunks = [len(c) for c in torch.tensor_split(torch.arange(numel), world_size)]
    sent, received = zip(*(comm.ring_bytes(op, numel * 2, 2, world_size, r) for r in range(world_size)), strict=True)
    assert sum(sent) == sum(received)
    passes = 2 if op == comm.ALL_REDUCE else 1
    assert sum(sent) == passes * (world_size - 1) * numel * 2
    if op == comm.REDUCE_SCATTER:
        assert [numel * 2 - s for s in sent] == [c * 2 for c in chunks]


def test_every_collective_of_every_rank_is_one_ledger_entry_in_call_order():
    def fn():
        full, shard = torch.ones(8), torch.ones(4)
        dist.broadcast(full, src=1)
        dist.reduce_scatter_single(shard, full, tag="grads")
        dist.all_gather_single(full, shard, tag="params")
        dist.all_reduce(full)
        dist.barrier()

    cluster = VirtualCluster(2)
    cluster.run(fn)
    for rank in range(2):
        entries = cluster.ledger.ranks[rank].entries
        assert [e.seq for e in entries] == [0, 1, 2, 3, 4]
        assert [e.op for e in entries] == [
            comm.BROADCAST,
            comm.REDUCE_SCATTER,
            comm.ALL_GATHER,
            comm.ALL_REDUCE,
            comm.BARRIER,
        ]
        assert [e.tag for e in entries] == ["broadcast", "grads", "params", "all_reduce", "barrier"]
        assert all(e.dtype == "float32" for e in entries[:4])


def test_summaries_per_rank_and_per_step_add_up_the_entries():
    def fn():
        for step in range(3):
            current().step = step
            dist.all_reduce(torch.ones(40), tag="grads")
            if step == 2:
                dist.all_gather_single(torch.ones(40), torch.ones(10), tag="params")

    cluster = VirtualCluster(4)
    cluster.run(fn)
    ledger = cluster.ledger
    assert ledger.steps() == [0, 1, 2]
    one_all_reduce = 2 * 3 * 160 // 4
    one_all_gather = 3 * 160 // 4
    for rank in range(4):
        assert ledger.rank_summary(rank, step=1).bytes_sent == one_all_reduce
        last = ledger.rank_summary(rank, step=2)
        assert last.collectives == 2
        assert last.bytes_sent == last.bytes_received == one_all_reduce + one_all_gather
        assert last.by_op == {comm.ALL_REDUCE: 1, comm.ALL_GATHER: 1}
        assert last.bytes_sent_by_tag == {"grads": one_all_reduce, "params": one_all_gather}
        whole_run = ledger.rank_summary(rank)
        assert whole_run.bytes_sent == 3 * one_all_reduce + one_all_gather
        assert ledger.rank_summary(rank, exclude_tags=("params",)).bytes_sent == 3 * one_all_reduce
    assert ledger.mean_bytes_sent(step=2) == one_all_reduce + one_all_gather


def test_collective_seconds_add_up_the_collectives_of_the_steps_asked_for_without_host_copies():
    def fn():
        for step in range(3):
            current().step = step
            dist.all_reduce(torch.ones(40), tag="grads")
            dist.copy_to_host(torch.zeros(40), torch.ones(40), tag="offload")

    cluster = VirtualCluster(2)
    cluster.run(fn)
    ledger = cluster.ledger
    for steps in ([0, 2], [1]):
        per_step = sum(ledger.rank_summary(r, step=k).seconds for r in range(2) for k in steps)
        every_entry = sum(e.seconds for r in ledger.ranks for e in r.entries if e.step in steps)
        assert ledger.collective_seconds(steps) == pytest.approx(per_step)
        assert 0 < ledger.collective_seconds(steps) < every_entry  # the host copies took time, and are left out


def test_phases_label_ledger_entries():
    def fn():
        with phase("backward"):
            dist.all_reduce(torch.ones(2))
        dist.barrier()

    cluster = VirtualCluster(2)
    cluster.run(fn)
    assert [e.phase for e in cluster.ledger.ranks[0].entries] == ["backward", ""]


@pytest.mark.parametrize("world_size", [2, 4, 8, 32])
def test_psi_multiples_of_an_all_reduce_are_2_n_minus_1_over_n(world_size):
    psi = 64 * world_size

    def fn():
        dist.all_reduce(torch.ones(psi, dtype=torch.float16))

    cluster = VirtualCluster(world_size)
    cluster.run(fn)
    expected = 2 * (world_size - 1) / world_size
    assert cluster.ledger.rank_summary(0).psi_multiple(psi) == expected
    assert cluster.ledger.mean_elements_sent() / psi == expected


def test_summary_to_dict_is_plain_data():
    summary = comm.summarize([])
    assert summary.to_dict()["bytes_sent"] == 0 and summary.to_dict()["by_op"] == {}


def test_alpha_beta_time_is_latency_per_ring_step_plus_bytes_over_bandwidth():
    world_size = 4

    def fn():
        dist.all_reduce(torch.ones(1000))
        dist.all_gather_single(torch.ones(1000), torch.ones(250))

    cluster = VirtualCluster(world_size)
    cluster.run(fn)
    entries = cluster.ledger.ranks[0].entries
    bytes_sent = 2 * 3 * 4000 // 4 + 3 * 4000 // 4
    assert comm.alpha_beta_seconds(entries, world_size, 1e9) == pytest.approx(bytes_sent / 1e9, rel=1e-12)
    with_latency = comm.alpha_beta_seconds(entries, world_size, 1e9, latency_s=1e-5)
    assert with_latency == pytest.approx(bytes_sent / 1e9 + (2 * 3 + 3) * 1e-5, rel=1e-12)
    with pytest.raises(ValueError, match="bandwidth"):
        comm.alpha_beta_seconds(entries, world_size, 0.0)


def test_ring_messages_count_sequential_ring_steps():
    assert comm.ring_messages(comm.ALL_REDUCE, 8) == 14
    assert comm.ring_messages(comm.REDUCE_SCATTER, 8) == 7
    assert comm.ring_messages(comm.BROADCAST, 8) == 7
    assert comm.ring_messages(comm.ALL_REDUCE, 1) == 0


def test_an_unknown_op_is_refused():
    with pytest.raises(ValueError, match="unknown collective"):
        comm.ring_bytes("all_to_some", 16, 4, 2, 0)
