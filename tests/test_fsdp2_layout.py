"""`zero_core.fsdp2_layout`, lesson 8's FSDP2 run: it counts the collectives FSDP2 calls, and its ranks report
FSDP2's own shards, what each rank holds, and one step's collectives."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

import pytest
import torch
import torch.distributed as torch_dist

from zero_core import fsdp2_layout
from zero_core.model import build_model, parameter_layers, preset


@pytest.mark.parametrize("world_size", [0, 1, 3])
def test_a_world_size_without_a_2_x_n_over_2_mesh_is_refused_before_any_process_starts(world_size: int) -> None:
    with pytest.raises(ValueError, match="even and at least 2"):
        fsdp2_layout.measure(world_size)


def test_each_counted_collective_is_listed_with_its_size_and_group_and_torch_is_restored_after(tmp_path) -> None:
    names = {op: name for op, name, _ in fsdp2_layout.COUNTED}
    originals = {name: getattr(torch_dist, name) for name in names.values()}
    torch_dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1, timeout=timedelta(seconds=20)
    )
    try:
        with fsdp2_layout.counting_collectives() as calls:
            getattr(torch_dist, names["all_gather"])(
                torch.zeros(6, dtype=torch.float16), torch.ones(6, dtype=torch.float16)
            )
            getattr(torch_dist, names["reduce_scatter"])(
                torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
            )
            torch_dist.all_reduce(torch.ones(5))
        torch_dist.all_reduce(torch.ones(7))  # after the block: not listed
    finally:
        torch_dist.destroy_process_group()
    assert calls == [["all_gather", 6, 2, 1, 0], ["reduce_scatter", 3, 8, 1, 0], ["all_reduce", 5, 4, 1, 0]]
    assert {name: getattr(torch_dist, name) for name in originals} == originals


@pytest.mark.slow
def test_two_ranks_report_fsdp2s_dim_0_chunks_and_one_steps_collectives() -> None:
    model = build_model(preset(fsdp2_layout.PRESET))
    psi = sum(p.numel() for p in model.parameters())
    layers = len(list(parameter_layers(model)))
    reports = fsdp2_layout.measure(2)
    assert len(reports) == 2
    for rank, report in enumerate(reports):
        assert list(report) == list(fsdp2_layout.RUNS)
        for name, p in model.named_parameters():
            assert report["reshard"]["shards"][name][0] == list(torch.chunk(p.detach(), 2, dim=0)[rank].shape)
            assert report["hsdp"]["shards"][name] == [list(p.shape), "(Replicate(), Shard(dim=0))"]
        held = {run: report[run]["held"] for run in fsdp2_layout.RUNS}
        assert held["reshard"] == {
            "param": psi // 2,
            "grad": psi // 2,
            "unsharded after forward": 0,
            "adam.m + adam.v": psi,
        }
        assert held["keep"]["param"] == psi // 2 and held["keep"]["unsharded after forward"] == psi
        assert held["hsdp"]["param"] == psi  # a shard group of one rank holds everything
        ops = {run: Counter((op, size) for op, _, _, size, _ in report[run]["calls"]) for run in fsdp2_layout.RUNS}
        assert ops["reshard"] == {("all_gather", 2): 2 * layers, ("reduce_scatter", 2): layers}
        assert ops["keep"] == {("all_gather", 2): layers, ("reduce_scatter", 2): layers}
        elements = Counter()
        for op, numel, _, _, _ in report["reshard"]["calls"]:
            elements[op] += numel
        assert elements == {"all_gather": 2 * psi, "reduce_scatter": psi}  # the gathered output, the scattered input
        # HSDP on 2 x 1: shard groups of one rank have nothing to gather or scatter, only the replicas' all-reduce
        assert ops["hsdp"] == {("all_reduce", 2): layers}
