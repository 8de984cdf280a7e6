"""Nodes of G GPUs: each collective's bytes split into intra- and inter-node, flat ring and hierarchical."""

from __future__ import annotations

import pytest
import torch

from zero_core import comm, dist
from zero_core.cluster import VirtualCluster
from zero_core.topology import HIERARCHICAL, RING, LinkTraffic, Topology, link_bytes, pass_split

COLLECTIVES = [comm.ALL_REDUCE, comm.REDUCE_SCATTER, comm.ALL_GATHER, comm.BROADCAST]
LAYOUTS = [(4, 2), (8, 2), (8, 4), (12, 3), (16, 4), (64, 8)]  # (N, G) with G < N: several nodes


def per_rank(op: str, full_bytes: int, topology: Topology, algorithm: str, src: int = 0) -> list[LinkTraffic]:
    return [link_bytes(op, full_bytes, 2, topology, r, algorithm, src) for r in range(topology.world_size)]


def test_rank_r_sits_on_node_r_floordiv_g():
    t = Topology(12, 4)
    assert t.nodes == 3
    assert [t.node_of(r) for r in range(12)] == [0] * 4 + [1] * 4 + [2] * 4
    assert [t.local_index(r) for r in range(12)] == [0, 1, 2, 3] * 3
    assert t.rank_at(3, 1) == 1 and t.rank_at(-1, 2) == 10


@pytest.mark.parametrize(("world_size", "gpus_per_node"), [(8, 3), (8, 0), (8, -2), (8, 16), (6, 4)])
def test_gpus_per_node_must_divide_the_world_size(world_size, gpus_per_node):
    with pytest.raises(ValueError, match=rf"{gpus_per_node} GPUs per node do not divide {world_size} ranks"):
        Topology(world_size, gpus_per_node)


def test_the_error_lists_the_node_sizes_that_work():
    with pytest.raises(ValueError, match="choose one of 1, 2, 3, 4, 6, 12"):
        Topology(12, 5)


def test_an_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="tree"):
        link_bytes(comm.ALL_REDUCE, 64, 2, Topology(4, 2), 0, "tree")
    with pytest.raises(ValueError, match="tree"):
        pass_split(64, Topology(4, 2), "tree")


@pytest.mark.parametrize("algorithm", [RING, HIERARCHICAL])
@pytest.mark.parametrize("op", COLLECTIVES)
@pytest.mark.parametrize("world_size", [1, 2, 5, 8])
def test_one_node_sends_nothing_across_and_is_todays_ring(world_size, op, algorithm):
    t = Topology.single_node(world_size)
    full_bytes = 2 * (7 * world_size + 3)
    for src in range(world_size) if op == comm.BROADCAST else [0]:
        for rank, link in enumerate(per_rank(op, full_bytes, t, algorithm, src)):
            assert link.inter_node_sent == link.inter_node_received == 0
            assert (link.intra_node_sent, link.intra_node_received) == comm.ring_bytes(
                op, full_bytes, 2, world_size, rank, src
            )


@pytest.mark.parametrize("op", COLLECTIVES)
@pytest.mark.parametrize(("world_size", "gpus_per_node"), LAYOUTS)
def test_flat_ring_intra_plus_inter_is_todays_ring_bytes(world_size, gpus_per_node, op):
    t = Topology(world_size, gpus_per_node)
    full_bytes = 2 * (5 * world_size + 3)  # uneven: the first chunks are one element larger
    for src in (0, world_size - 1):
        for rank, link in enumerate(per_rank(op, full_bytes, t, RING, src)):
            assert (link.sent, link.received) == comm.ring_bytes(op, full_bytes, 2, world_size, rank, src)


@pytest.mark.parametrize(("world_size", "gpus_per_node"), LAYOUTS)
def test_flat_ring_all_reduce_crosses_only_from_the_last_rank_of_each_node(world_size, gpus_per_node):
    n, g = world_size, gpus_per_node
    full_bytes = 2 * 10 * n
    for rank, link in enumerate(per_rank(comm.ALL_REDUCE, full_bytes, Topology(n, g), RING)):
        boundary = rank % g == g - 1
        assert link.inter_node_sent == (2 * (n - 1) * full_bytes // n if boundary else 0)
        assert link.intra_node_sent == (0 if boundary else 2 * (n - 1) * full_bytes // n)
        assert link.inter_node_received == (2 * (n - 1) * full_bytes // n if rank % g == 0 else 0)


@pytest.mark.parametrize(("world_size", "gpus_per_node"), LAYOUTS)
def test_hierarchical_all_reduce_sends_2_m_minus_1_over_m_of_s_over_g_across(world_size, gpus_per_node):
    n, g = world_size, gpus_per_node
    m, full_bytes = n // g, 2 * 12 * n
    for link in per_rank(comm.ALL_REDUCE, full_bytes, Topology(n, g), HIERARCHICAL):
        assert link.inter_node_sent == link.inter_node_received == pytest.approx(2 * (m - 1) / m * full_bytes / g)
        assert link.intra_node_sent == link.intra_node_received == pytest.approx(2 * (g - 1) / g * full_bytes)


@pytest.mark.parametrize("op", [comm.REDUCE_SCATTER, comm.ALL_GATHER])
@pytest.mark.parametrize(("world_size", "gpus_per_node"), LAYOUTS)
def test_hierarchical_reduce_scatter_and_all_gather_are_half_an_all_reduce(world_size, gpus_per_node, op):
    n, g = world_size, gpus_per_node
    m, full_bytes = n // g, 2 * 12 * n
    for link in per_rank(op, full_bytes, Topology(n, g), HIERARCHICAL):
        assert link.inter_node_sent == pytest.approx((m - 1) / m * full_bytes / g)
        assert link.intra_node_sent == pytest.approx((g - 1) / g * full_bytes)


@pytest.mark.parametrize("op", COLLECTIVES)
@pytest.mark.parametrize(("world_size", "gpus_per_node"), LAYOUTS)
def test_hierarchical_moves_bytes_between_links_but_sends_as_many(world_size, gpus_per_node, op):
    t = Topology(world_size, gpus_per_node)
    full_bytes = 2 * 6 * world_size
    flat, hierarchical = per_rank(op, full_bytes, t, RING), per_rank(op, full_bytes, t, HIERARCHICAL)
    across_flat = sum(f.inter_node_sent for f in flat)
    across_hierarchical = sum(h.inter_node_sent for h in hierarchical)
    if op == comm.BROADCAST:  # every rank but the source receives the buffer once; M-1 copies cross either way
        assert [h.received for h in hierarchical] == [f.received for f in flat]
        assert across_hierarchical == across_flat == (t.nodes - 1) * full_bytes
    else:
        assert [h.sent for h in hierarchical] == [f.sent for f in flat]
        assert across_hierarchical < across_flat


@pytest.mark.parametrize(("world_size", "gpus_per_node"), LAYOUTS)
def test_hierarchical_busiest_inter_node_sender_sends_n_minus_1_over_m_minus_1_times_less(world_size, gpus_per_node):
    n, g = world_size, gpus_per_node
    m, t, full_bytes = n // g, Topology(n, g), 2 * 12 * n
    flat = per_rank(comm.ALL_REDUCE, full_bytes, t, RING)
    hierarchical = per_rank(comm.ALL_REDUCE, full_bytes, t, HIERARCHICAL)
    busiest_flat = max(f.inter_node_sent for f in flat)
    busiest_hierarchical = max(h.inter_node_sent for h in hierarchical)
    assert busiest_flat / busiest_hierarchical == pytest.approx((n - 1) / (m - 1))
    mean_flat = sum(f.inter_node_sent for f in flat) / n
    mean_hierarchical = sum(h.inter_node_sent for h in hierarchical) / n
    assert mean_flat / mean_hierarchical == pytest.approx(m * (n - 1) / (n * (m - 1)))


@pytest.mark.parametrize("algorithm", [RING, HIERARCHICAL])
@pytest.mark.parametrize("op", COLLECTIVES)
@pytest.mark.parametrize(("world_size", "gpus_per_node"), [*LAYOUTS, (6, 1), (6, 6)])
@pytest.mark.parametrize("extra_elements", [0, 1, 5])
def test_every_byte_sent_on_a_link_class_is_received_on_it(world_size, gpus_per_node, op, algorithm, extra_elements):
    t = Topology(world_size, gpus_per_node)
    full_bytes = 2 * (3 * world_size + extra_elements)
    for src in range(world_size) if op == comm.BROADCAST else [0]:
        links = per_rank(op, full_bytes, t, algorithm, src)
        assert sum(x.intra_node_sent for x in links) == sum(x.intra_node_received for x in links)
        assert sum(x.inter_node_sent for x in links) == sum(x.inter_node_received for x in links)


@pytest.mark.parametrize("op", COLLECTIVES)
@pytest.mark.parametrize(("world_size", "gpus_per_node"), [*LAYOUTS, (6, 1), (6, 6)])
@pytest.mark.parametrize("extra_elements", [1, 5])
def test_what_a_rank_sends_its_ring_neighbour_receives(world_size, gpus_per_node, op, extra_elements):
    """Every step is a ring: flat, r sends to r+1; hierarchical, to the next node's rank of the same local
    index (across) and to the next local index on its own node (inside). Uneven chunks make it rank-exact."""
    t = Topology(world_size, gpus_per_node)
    full_bytes = 2 * (3 * world_size + extra_elements)
    for src in range(world_size) if op == comm.BROADCAST else [0]:
        flat = per_rank(op, full_bytes, t, RING, src)
        for r in range(world_size):
            assert flat[r].sent == flat[(r + 1) % world_size].received
        hierarchical = per_rank(op, full_bytes, t, HIERARCHICAL, src)
        for r in range(world_size):
            node, local = t.node_of(r), t.local_index(r)
            assert hierarchical[r].inter_node_sent == hierarchical[t.rank_at(node + 1, local)].inter_node_received
            assert hierarchical[r].intra_node_sent == hierarchical[t.rank_at(node, local + 1)].intra_node_received


def test_hierarchical_broadcast_crosses_once_per_node_from_the_sources_local_index():
    t, full_bytes, src = Topology(12, 4), 800, 6  # node 1, local index 2
    links = per_rank(comm.BROADCAST, full_bytes, t, HIERARCHICAL, src)
    assert [r for r, x in enumerate(links) if x.inter_node_received] == [2, 10]
    assert [r for r, x in enumerate(links) if x.inter_node_sent] == [6, 10]
    assert [x.received for x in links] == [0 if r == src else full_bytes for r in range(12)]


def test_one_gpu_per_node_sends_everything_across():
    t = Topology(6, 1)
    for op in COLLECTIVES:
        for algorithm in (RING, HIERARCHICAL):
            for rank, link in enumerate(per_rank(op, 2 * 6 * 4, t, algorithm)):
                assert link.intra_node_sent == link.intra_node_received == 0
                assert (link.inter_node_sent, link.inter_node_received) == comm.ring_bytes(op, 48, 2, 6, rank)


@pytest.mark.parametrize("algorithm", [RING, HIERARCHICAL])
@pytest.mark.parametrize(("world_size", "gpus_per_node"), [*LAYOUTS, (8, 8), (8, 1)])
def test_the_tables_closed_forms_match_rank_by_rank_bytes(world_size, gpus_per_node, algorithm):
    t, full_bytes = Topology(world_size, gpus_per_node), 2 * 24 * world_size
    split = pass_split(full_bytes, t, algorithm)
    for op in (comm.REDUCE_SCATTER, comm.ALL_GATHER):
        links = per_rank(op, full_bytes, t, algorithm)
        assert split.intra_node_mean == pytest.approx(sum(x.intra_node_sent for x in links) / world_size)
        assert split.inter_node_mean == pytest.approx(sum(x.inter_node_sent for x in links) / world_size)
        assert split.inter_node_max == pytest.approx(max(x.inter_node_sent for x in links))


def run_mixed_collectives(world_size: int) -> VirtualCluster:
    """An all-reduce, a reduce-scatter, an all-gather (fp32, uneven) and a broadcast from rank 2 on every rank."""

    def fn():
        full = torch.ones(5 * world_size + 3)
        dist.all_reduce(full)
        shard = torch.ones(4, dtype=torch.bfloat16)
        gathered = torch.ones(4 * world_size, dtype=torch.bfloat16)
        dist.reduce_scatter_single(shard, gathered.clone())
        dist.all_gather_single(gathered, shard)
        dist.broadcast(full, src=2)

    cluster = VirtualCluster(world_size)
    cluster.run(fn)
    return cluster


def test_the_ledger_splits_what_ran_by_link_class():
    ledger = run_mixed_collectives(8).ledger
    t = Topology(8, 4)
    flat = ledger.link_traffic(t, RING)
    hierarchical = ledger.link_traffic(t, HIERARCHICAL)
    for rank in range(8):
        summary = ledger.rank_summary(rank)
        assert (flat[rank].sent, flat[rank].received) == (summary.bytes_sent, summary.bytes_received)
        expected = LinkTraffic()
        for e in ledger.ranks[rank].entries:
            expected += link_bytes(e.op, e.elements * e.element_size, e.element_size, t, rank, HIERARCHICAL, src=2)
        assert hierarchical[rank] == expected
    assert [x.inter_node_sent > 0 for x in flat] == [r in (3, 7) for r in range(8)]
    assert all(x.inter_node_sent > 0 for x in hierarchical)


def test_the_ledger_counts_elements_per_link_class_in_each_collectives_dtype():
    ledger = run_mixed_collectives(4).ledger
    t = Topology(4, 2)
    in_bytes = ledger.link_traffic(t, HIERARCHICAL)
    in_elements = ledger.link_traffic(t, HIERARCHICAL, in_elements=True)
    elements_sent = sum(ledger.rank_summary(r).elements_sent for r in range(4))
    assert sum(x.sent for x in in_elements) == pytest.approx(elements_sent)
    assert in_elements[0].inter_node_sent < in_bytes[0].inter_node_sent / 2  # fp32 entries count 4 bytes each


def test_the_ledger_refuses_a_topology_of_another_size():
    ledger = run_mixed_collectives(4).ledger
    with pytest.raises(ValueError, match="8 ranks, the ledger 4"):
        ledger.link_traffic(Topology(8, 4))
