"""The collectives against plain torch arithmetic, their determinism, and their argument checks."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed

from zero_core import dist
from zero_core.cluster import CollectiveDeadlock, CollectiveTimeout, RankFailed, VirtualCluster

WORLD_SIZES = [1, 2, 3, 7, 32]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rank_inputs(world_size: int, numel: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """Every rank's input, made outside the cluster so the test can compute the expected result itself."""
    generator = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-3, 3, numel)
    return [(torch.randn(numel, generator=generator) * scales).to(dtype) for _ in range(world_size)]


def sum_in_rank_order(inputs: list[torch.Tensor]) -> torch.Tensor:
    """x_0 + x_1 + ... + x_{N-1}, left to right, in fp32."""
    total = inputs[0].float()
    for tensor in inputs[1:]:
        total = total + tensor.float()
    return total


def expected_reduction(inputs: list[torch.Tensor], op: dist.ReduceOp) -> torch.Tensor:
    if op == dist.ReduceOp.SUM:
        return sum_in_rank_order(inputs).to(inputs[0].dtype)
    if op == dist.ReduceOp.AVG:
        return (sum_in_rank_order(inputs) / len(inputs)).to(inputs[0].dtype)
    if op == dist.ReduceOp.MAX:
        return torch.stack(inputs).amax(dim=0)
    return torch.stack(inputs).amin(dim=0)


def test_get_rank_and_world_size_inside_a_rank():
    assert VirtualCluster(3).run(lambda: (dist.get_rank(), dist.get_world_size(), dist.is_initialized())) == [
        (0, 3, True),
        (1, 3, True),
        (2, 3, True),
    ]


def test_calling_a_collective_outside_a_rank_says_how_to_run_it():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="VirtualCluster.run"):
        dist.all_reduce(torch.ones(2))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce_equals_the_rank_ordered_reduction_for_every_op(world_size, dtype):
    inputs = rank_inputs(world_size, 37, dtype)
    ops = list(dist.ReduceOp)

    def fn():
        outputs = {}
        for op in ops:
            tensor = inputs[dist.get_rank()].clone()
            dist.all_reduce(tensor, op=op)
            outputs[op] = tensor
        return outputs

    for outputs in VirtualCluster(world_size).run(fn):
        for op in ops:
            assert outputs[op].dtype == dtype
            assert torch.equal(outputs[op], expected_reduction(inputs, op)), op


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter_gives_rank_r_chunk_r_of_the_reduction(world_size, dtype):
    chunk = 5
    inputs = rank_inputs(world_size, chunk * world_size, dtype, seed=1)

    def fn():
        rank = dist.get_rank()
        summed, averaged = torch.empty(chunk, dtype=dtype), torch.empty(chunk, dtype=dtype)
        dist.reduce_scatter_single(summed, inputs[rank].clone(), op=dist.ReduceOp.SUM)
        dist.reduce_scatter_single(averaged, inputs[rank].clone(), op=dist.ReduceOp.AVG)
        return summed, averaged

    total = expected_reduction(inputs, dist.ReduceOp.SUM)
    mean = expected_reduction(inputs, dist.ReduceOp.AVG)
    for rank, (summed, averaged) in enumerate(VirtualCluster(world_size).run(fn)):
        assert torch.equal(summed, total[rank * chunk : (rank + 1) * chunk])
        assert torch.equal(averaged, mean[rank * chunk : (rank + 1) * chunk])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather_concatenates_the_ranks_inputs_in_rank_order(world_size, dtype):
    inputs = rank_inputs(world_size, 6, dtype, seed=2)

    def fn():
        output = torch.empty(6 * world_size, dtype=dtype)
        dist.all_gather_single(output, inputs[dist.get_rank()])
        return output

    for output in VirtualCluster(world_size).run(fn):
        assert torch.equal(output, torch.cat(inputs))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_broadcast_copies_the_source_ranks_tensor_to_every_rank(world_size, dtype):
    inputs = rank_inputs(world_size, 9, dtype, seed=3)
    src = world_size - 1

    def fn():
        tensor = inputs[dist.get_rank()].clone()
        dist.broadcast(tensor, src=src)
        return tensor

    for tensor in VirtualCluster(world_size).run(fn):
        assert torch.equal(tensor, inputs[src])


@pytest.mark.parametrize("op", [dist.ReduceOp.SUM, dist.ReduceOp.AVG], ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce_then_slice_is_bit_for_bit_reduce_scatter(world_size, dtype, op):
    chunk = 67
    inputs = rank_inputs(world_size, chunk * world_size, dtype, seed=world_size)

    def fn():
        rank = dist.get_rank()
        reduced = inputs[rank].clone()
        dist.all_reduce(reduced, op=op)
        scattered = torch.empty(chunk, dtype=dtype)
        dist.reduce_scatter_single(scattered, inputs[rank], op=op)
        return reduced[rank * chunk : (rank + 1) * chunk], scattered

    for sliced, scattered in VirtualCluster(world_size).run(fn):
        assert torch.equal(sliced, scattered)


def test_half_precision_sums_accumulate_in_fp32():
    # 2048 + 1 + 1 in fp16: accumulating in fp16 loses both ones (2049 is not representable), fp32 keeps them.
    values = [2048.0, 1.0, 1.0]

    def fn():
        tensor = torch.tensor([values[dist.get_rank()]], dtype=torch.float16)
        dist.all_reduce(tensor)
        return tensor

    assert VirtualCluster(3).run(fn)[0].item() == 2050.0


def test_reductions_take_multidimensional_tensors_and_chunk_them_row_major():
    def fn():
        rank = dist.get_rank()
        full = torch.arange(12.0).reshape(4, 3) * (rank + 1)
        output = torch.empty(2, 3)
        dist.reduce_scatter_single(output, full)
        gathered = torch.empty(4, 3)
        dist.all_gather_single(gathered, output)
        return output, gathered

    total = torch.arange(12.0).reshape(4, 3) * 3
    for rank, (output, gathered) in enumerate(VirtualCluster(2).run(fn)):
        assert torch.equal(output, total[2 * rank : 2 * rank + 2])
        assert torch.equal(gathered, total)


def test_reduce_scatter_and_all_gather_leave_their_inputs_unchanged():
    def fn():
        full = torch.arange(4.0)
        shard = torch.empty(2)
        dist.reduce_scatter_single(shard, full)
        gathered = torch.empty(4)
        dist.all_gather_single(gathered, shard)
        return full

    assert all(torch.equal(full, torch.arange(4.0)) for full in VirtualCluster(2).run(fn))


def test_torch_distributed_reduce_ops_are_accepted():
    def fn():
        tensor = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(tensor, op=torch.distributed.ReduceOp.AVG)
        return tensor.item()

    assert VirtualCluster(4).run(fn) == [1.5] * 4


def test_the_older_torch_names_are_aliases_that_warn_nothing(recwarn):
    assert dist.reduce_scatter_tensor is dist.reduce_scatter_single
    assert dist.all_gather_into_tensor is dist.all_gather_single

    def fn():
        shard, full = torch.empty(1), torch.ones(2)
        dist.reduce_scatter_tensor(shard, full)
        dist.all_gather_into_tensor(full, shard)
        return full

    assert all(torch.equal(full, torch.full((2,), 2.0)) for full in VirtualCluster(2).run(fn))
    assert len(recwarn) == 0


def test_an_async_reduce_scatter_lets_the_rank_run_on_and_fills_the_output_when_waited_for():
    inputs = rank_inputs(3, 6, torch.float32)

    def fn():
        rank = dist.get_rank()
        if rank == 2:
            time.sleep(0.3)  # the last to arrive, long after the others have started
        output = torch.full((2,), -1.0)
        work = dist.reduce_scatter_single(output, inputs[rank], async_op=True)
        returned = time.monotonic()
        before_wait = output.clone(), work.is_completed()
        assert work.wait() is True
        work.wait()  # a second wait does nothing
        return returned, before_wait, output, work.is_completed()

    started = time.monotonic()
    results = VirtualCluster(3).run(fn)
    expected = expected_reduction(inputs, dist.ReduceOp.SUM).view(3, 2)
    for rank, (_, (before, completed_before), output, completed_after) in enumerate(results):
        assert torch.equal(before, torch.full((2,), -1.0)) and not completed_before
        assert torch.equal(output, expected[rank]) and completed_after
    assert results[0][0] - started < 0.2 and results[1][0] - started < 0.2, "an async call waited for rank 2"


def test_an_async_collective_keeps_its_place_in_the_ledger_and_counts_the_wait():
    def fn():
        if dist.get_rank() == 0:
            time.sleep(0.3)
        work = dist.reduce_scatter_single(torch.empty(1), torch.ones(2), async_op=True, tag="grad a")
        work.wait()  # rank 1 waits here for rank 0
        dist.all_reduce(torch.ones(1), tag="grad b")

    cluster = VirtualCluster(2)
    cluster.run(fn)
    for rank in (0, 1):
        assert [e.tag for e in cluster.ledger.ranks[rank].entries] == ["grad a", "grad b"]
    assert cluster.ledger.ranks[1].entries[0].seconds >= 0.25


def test_a_rank_waiting_for_an_async_collective_another_rank_skips_gets_a_deadlock_error():
    def fn():
        if dist.get_rank() == 1:
            time.sleep(0.5)
            return
        work = dist.reduce_scatter_single(torch.empty(1), torch.ones(2), async_op=True, tag="grad blocks.0")
        work.wait()

    with pytest.raises(CollectiveDeadlock, match=r"rank 1 returned without calling reduce_scatter #0"):
        VirtualCluster(2, timeout_s=10.0).run(fn)


def test_waiting_for_an_async_collective_that_does_not_complete_times_out_naming_it():
    def fn():
        if dist.get_rank() == 1:
            time.sleep(2.0)
        work = dist.reduce_scatter_single(torch.empty(1), torch.ones(2), async_op=True, tag="grad blocks.0")
        work.wait()

    started = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=r"rank 0: waiting in reduce_scatter #0 tag='grad blocks.0'"):
        VirtualCluster(2, timeout_s=0.5).run(fn)
    assert time.monotonic() - started < 5.0


@pytest.mark.parametrize("async_op", [False, True])
def test_every_collective_gives_the_same_result_with_or_without_async_op(async_op):
    def fn():
        rank = dist.get_rank()
        full, shard, gathered = torch.full((3,), float(rank + 1)), torch.empty(1), torch.empty(3)
        works = [
            dist.all_reduce(full, async_op=async_op),
            dist.reduce_scatter_single(shard, torch.arange(3.0), async_op=async_op),
            dist.all_gather_single(gathered, torch.tensor([float(rank)]), async_op=async_op),
            dist.broadcast(src_tensor := torch.tensor([float(rank)]), src=2, async_op=async_op),
            dist.barrier(async_op=async_op),
        ]
        for work in works:
            if async_op:
                work.wait()
            else:
                assert work is None
        return full, shard, gathered, src_tensor

    for rank, (full, shard, gathered, src_tensor) in enumerate(VirtualCluster(3).run(fn)):
        assert torch.equal(full, torch.full((3,), 6.0))
        assert torch.equal(shard, torch.tensor([3.0 * rank]))
        assert torch.equal(gathered, torch.tensor([0.0, 1.0, 2.0]))
        assert torch.equal(src_tensor, torch.tensor([2.0]))


def test_the_tag_labels_the_ledger_entry_and_defaults_to_the_op():
    def fn():
        dist.all_reduce(torch.ones(4), tag="grad blocks.0.mlp")
        dist.all_reduce(torch.ones(4))
        dist.barrier(tag="end of step")

    cluster = VirtualCluster(2)
    cluster.run(fn)
    assert [e.tag for e in cluster.ledger.ranks[1].entries] == ["grad blocks.0.mlp", "all_reduce", "end of step"]


def bad_reduce_scatter_output():
    dist.reduce_scatter_single(torch.empty(3), torch.ones(8))


def bad_reduce_scatter_indivisible():
    dist.reduce_scatter_single(torch.empty(2), torch.ones(10))


def bad_all_gather_output():
    dist.all_gather_single(torch.empty(7), torch.ones(2))


def bad_mixed_dtypes():
    dist.all_gather_single(torch.empty(8, dtype=torch.float32), torch.ones(2, dtype=torch.float16))


def bad_reduce_scatter_dtypes():
    dist.reduce_scatter_single(torch.empty(2, dtype=torch.bfloat16), torch.ones(8))


def bad_broadcast_source():
    dist.broadcast(torch.ones(3), src=4)


def good_call_of(bad):
    return {
        bad_reduce_scatter_output: lambda: dist.reduce_scatter_single(torch.empty(2), torch.ones(8)),
        bad_reduce_scatter_indivisible: lambda: dist.reduce_scatter_single(torch.empty(2), torch.ones(8)),
        bad_all_gather_output: lambda: dist.all_gather_single(torch.empty(8), torch.ones(2)),
        bad_mixed_dtypes: lambda: dist.all_gather_single(torch.empty(8), torch.ones(2)),
        bad_reduce_scatter_dtypes: lambda: dist.reduce_scatter_single(torch.empty(2), torch.ones(8)),
        bad_broadcast_source: lambda: dist.broadcast(torch.ones(3), src=0),
    }[bad]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "bad_call, shapes",
    [
        (bad_reduce_scatter_output, ["[8]", "[3]"]),
        (bad_reduce_scatter_indivisible, ["[10]", "[2]"]),
        (bad_all_gather_output, ["[7]", "[2]"]),
        (bad_mixed_dtypes, ["[2]", "[8]", "float16", "float32"]),
        (bad_reduce_scatter_dtypes, ["[8]", "[2]", "float32", "bfloat16"]),
        (bad_broadcast_source, ["src", "0..3", "4"]),
    ],
    ids=[
        "reduce_scatter_output",
        "reduce_scatter_indivisible",
        "all_gather_output",
        "mixed_dtypes",
        "reduce_scatter_dtypes",
        "broadcast_source",
    ],
)
def test_bad_arguments_fail_the_run_at_once_with_a_value_error_naming_the_rank_and_shapes(bad_call, shapes):
    def fn():
        if dist.get_rank() == 1:
            bad_call()
        else:
            good_call_of(bad_call)()

    started = time.monotonic()
    with pytest.raises(RankFailed) as info:
        VirtualCluster(4, timeout_s=30.0).run(fn)
    assert time.monotonic() - started < 1.0
    assert info.value.rank == 1
    error = info.value.__cause__
    assert isinstance(error, ValueError)
    assert str(error).startswith("rank 1: ")
    for text in shapes:
        assert text in str(error)


def test_a_non_contiguous_tensor_is_refused_before_the_collective():
    def fn():
        dist.all_reduce(torch.ones(4, 4).t())

    with pytest.raises(RankFailed, match="contiguous"):
        VirtualCluster(1, timeout_s=30.0).run(fn)


def test_an_unknown_reduce_op_is_refused():
    with pytest.raises(RankFailed, match="unsupported reduce op"):
        VirtualCluster(1).run(lambda: dist.all_reduce(torch.ones(2), op="product"))
