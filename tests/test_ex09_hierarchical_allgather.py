"""ex09's stage and checks: a two-level gather changes which links carry a layer, never what training computes."""

from __future__ import annotations

import pytest
import torch

from autograder import ex09
from autograder.checks import CheckFailed, ObservationInvalid, through_json
from autograder.harness import graded_stage, train
from zero_core import dist
from zero_core.answers.ex09 import hierarchical_all_gather
from zero_core.cluster import VirtualCluster
from zero_core.stages.zero3 import Zero3
from zero_core.topology import HIERARCHICAL, Topology, pass_split
from zero_core.variants.nodes import this_ranks_groups

pytestmark = pytest.mark.ex09

REFERENCE = ex09.GRADED


def _gather_on_rank(world_size: int, gpus_per_node: int, chunk: int) -> bool:
    _, node_group, cross_group = this_ranks_groups(gpus_per_node)
    shard = torch.arange(chunk, dtype=torch.float32) + 1000 * dist.get_rank()
    two_levels, flat = torch.empty(world_size * chunk), torch.empty(world_size * chunk)
    hierarchical_all_gather(two_levels, shard, node_group, cross_group)
    dist.all_gather_single(flat, shard)
    return torch.equal(two_levels, flat)


@pytest.mark.parametrize(("world_size", "gpus_per_node"), [(4, 2), (6, 3), (6, 2), (8, 4), (9, 3), (4, 1), (4, 4)])
def test_the_two_level_gather_gives_the_flat_gathers_layout_on_any_node_shape(world_size, gpus_per_node) -> None:
    assert all(VirtualCluster(world_size).run(_gather_on_rank, world_size, gpus_per_node, 5))


@pytest.mark.parametrize("world_size", sorted(ex09.GPUS_PER_NODE))
def test_the_hierarchical_stage_trains_bit_for_bit_like_zero3(world_size: int) -> None:
    run, _ = ex09.train_linked(REFERENCE, world_size)
    reference = train(graded_stage(Zero3, "zero3"), world_size)
    assert [r.losses for r in run.ranks] == [r.losses for r in reference.ranks]
    got, want = run.master_weights(), reference.master_weights()
    assert all(torch.equal(got[layer], want[layer]) for layer in want)


@pytest.mark.parametrize("world_size", sorted(ex09.GPUS_PER_NODE))
def test_the_reference_sends_the_closed_forms_and_stages_exactly_psi_layer_over_g(world_size: int) -> None:
    run, links = ex09.train_linked(REFERENCE, world_size)
    g = ex09.GPUS_PER_NODE[world_size]
    ex09.check_gather_links(run, links, "reference", g)
    ex09.check_staging(run, links, "reference", g)
    for calls in links.gathers:
        assert {(c.transient_bytes, c.left_bytes) for c in calls if c.layer == "wte"} == {
            (run.partitions["wte"].padded_numel // g * 2, 0)
        }
    inter, intra = ex09.expected_gather_bytes(run, g)
    split = [pass_split(p.padded_numel * 2, Topology(world_size, g), HIERARCHICAL) for p in run.partitions.values()]
    assert inter == pytest.approx(2 * sum(s.inter_node_max for s in split))
    assert intra == pytest.approx(2 * sum(s.intra_node_mean for s in split))


def test_zero3s_flat_gathers_fail_the_link_check() -> None:
    run, links = ex09.train_linked(graded_stage(Zero3, "zero3"), 4)
    with pytest.raises(CheckFailed, match="over all 4 ranks"):
        ex09.check_gather_links(run, links, "4 ranks", 2)


def test_links_cross_as_data_and_forged_groups_are_refused() -> None:
    run, links = ex09.train_linked(REFERENCE, 4)
    data = through_json(ex09.links_to_data(links))
    assert ex09.links_from_data(data, run) == links
    rank_of_group = next(i for i, (group, _) in enumerate(links.groups[0]) if group)
    data["groups"][0][rank_of_group][0] = [1, 2]
    with pytest.raises(ObservationInvalid):
        ex09.links_from_data(data, run)


def test_only_the_graded_node_shapes_are_checked() -> None:
    with pytest.raises(CheckFailed, match="checked on"):
        ex09.gpus_per_node(5)
