"""Flat partitioning: N contiguous chunks of ceil(numel / N) elements, padding at the end, reported apart."""

from __future__ import annotations

import math

import pytest
import torch

from zero_core import dist
from zero_core.cluster import VirtualCluster
from zero_core.partition import FlatPartition, flatten, unflatten

SIZES = [(1, 1), (1, 4), (3, 7), (5, 2), (10, 4), (12, 4), (1000, 1), (1001, 32), (97, 7)]


@pytest.mark.parametrize("numel, world_size", SIZES)
def test_chunks_are_ceil_of_numel_over_n_and_padding_fills_the_last_one(numel, world_size):
    part = FlatPartition(numel, world_size)
    assert part.chunk_numel == math.ceil(numel / world_size)
    assert part.padded_numel == part.chunk_numel * world_size
    assert part.padding == part.padded_numel - numel
    assert 0 <= part.padding < world_size


@pytest.mark.parametrize("numel, world_size", SIZES)
def test_owned_ranges_are_contiguous_in_rank_order_and_cover_every_element_once(numel, world_size):
    part = FlatPartition(numel, world_size)
    ranges = [part.owned_range(rank) for rank in range(world_size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == numel
    for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False):
        assert end == start
    assert sum(part.owned_numel(rank) for rank in range(world_size)) == numel


@pytest.mark.parametrize("numel, world_size", SIZES)
def test_padding_is_at_the_end_and_reported_per_rank(numel, world_size):
    part = FlatPartition(numel, world_size)
    owned = [part.owned_numel(rank) for rank in range(world_size)]
    assert owned == sorted(owned, reverse=True)
    assert all(part.owned_numel(rank) == part.chunk_numel for rank in range(world_size) if part.padding_of(rank) == 0)
    assert sum(part.padding_of(rank) for rank in range(world_size)) == part.padding
    assert all(part.owned_numel(r) + part.padding_of(r) == part.chunk_numel for r in range(world_size))


@pytest.mark.parametrize("numel, world_size", SIZES)
def test_the_shards_in_rank_order_are_the_padded_flat_vector(numel, world_size):
    part = FlatPartition(numel, world_size)
    flat = torch.arange(1, numel + 1, dtype=torch.float32)
    shards = [part.shard(flat, rank) for rank in range(world_size)]
    assert all(shard.numel() == part.chunk_numel for shard in shards)
    padded = part.pad(flat)
    assert torch.equal(torch.cat(shards), padded)
    assert torch.equal(padded[:numel], flat)
    assert torch.count_nonzero(padded[numel:]) == 0


def test_fewer_elements_than_ranks_leaves_the_last_ranks_only_padding():
    part = FlatPartition(3, 5)
    assert (part.chunk_numel, part.padding) == (1, 2)
    assert [part.owned_range(rank) for rank in range(5)] == [(0, 1), (1, 2), (2, 3), (3, 3), (3, 3)]
    assert [part.padding_of(rank) for rank in range(5)] == [0, 0, 0, 1, 1]
    assert torch.equal(part.shard(torch.tensor([7.0, 8.0, 9.0]), 4), torch.zeros(1))


def test_one_rank_owns_everything_without_padding():
    part = FlatPartition(11, 1)
    flat = torch.randn(11)
    assert (part.chunk_numel, part.padding, part.owned_range(0)) == (11, 0, (0, 11))
    assert torch.equal(part.shard(flat, 0), flat)


def test_shards_are_copies_not_views():
    part = FlatPartition(4, 2)
    flat = torch.zeros(4)
    part.shard(flat, 0).fill_(1.0)
    part.pad(flat).fill_(1.0)
    assert torch.count_nonzero(flat) == 0


@pytest.mark.parametrize("world_size", [1, 3, 7])
def test_reduce_scatter_of_the_padded_vector_gives_each_rank_its_shard_of_the_sum(world_size):
    shapes = [torch.Size([5, 3]), torch.Size([5])]
    part = FlatPartition(20, world_size)

    def fn():
        rank = dist.get_rank()
        grads = [torch.full(shape, float(rank + 1)) for shape in shapes]
        shard = torch.empty(part.chunk_numel)
        dist.reduce_scatter_single(shard, part.pad(flatten(grads)))
        return shard

    total = float(sum(range(1, world_size + 1)))
    for rank, shard in enumerate(VirtualCluster(world_size).run(fn)):
        assert torch.equal(shard, part.shard(torch.full((20,), total), rank))


def test_flatten_and_unflatten_round_trip_weight_and_bias():
    weight, bias = torch.randn(4, 3), torch.randn(4)
    flat = flatten([weight, bias])
    assert flat.shape == (16,)
    padded = FlatPartition(16, 3).pad(flat)
    views = unflatten(padded, [weight.shape, bias.shape])
    assert torch.equal(views[0], weight) and torch.equal(views[1], bias)
    assert all(view.untyped_storage().data_ptr() == padded.untyped_storage().data_ptr() for view in views)


def test_unflatten_refuses_a_vector_too_short_for_the_shapes():
    with pytest.raises(ValueError, match="need 16 elements"):
        unflatten(torch.zeros(15), [torch.Size([4, 3]), torch.Size([4])])


@pytest.mark.parametrize("numel, world_size", [(0, 2), (4, 0)])
def test_empty_parameters_and_empty_worlds_are_refused(numel, world_size):
    with pytest.raises(ValueError):
        FlatPartition(numel, world_size)


def test_a_rank_outside_the_world_and_a_flat_tensor_of_the_wrong_size_are_refused():
    part = FlatPartition(10, 4)
    with pytest.raises(ValueError, match="rank 4 is outside 0..3"):
        part.owned_range(4)
    with pytest.raises(ValueError, match="10"):
        part.shard(torch.zeros(9), 0)
    with pytest.raises(ValueError, match="10"):
        part.pad(torch.zeros(11))
