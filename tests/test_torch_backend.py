"""The torch.distributed backend: the same SPMD code on 3 gloo processes and on 3 virtual ranks, compared.

Every scenario below uses only `zero_core.dist`. It runs once on a `VirtualCluster(3)` in this process
and once on three spawned processes joined in a gloo process group through `TorchBackend`. Inputs are
small integers (exact in fp16 and bf16, and summed exactly in any order), so the two backends must
agree bit for bit, and their ledgers entry for entry; one scenario uses random fp32 data, where gloo's
own summation order shows in the last bits.
"""

from __future__ import annotations

import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as torch_dist

from tests.gloo_ranks import start_ranks
from zero_core import dist
from zero_core.backends.torch_distributed import TorchBackend, process_context, upcasts_reductions, wire_dtype
from zero_core.cluster import VirtualCluster
from zero_core.comm import ALL_REDUCE, ring_bytes
from zero_core.context import activate
from zero_core.launch import leave

WORLD_SIZE = 3
FLOATS = [torch.float32, torch.bfloat16, torch.float16]


def small_integers(shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0, rank: int | None = None) -> torch.Tensor:
    """Rank-dependent values in -8..8: exact in every dtype here, so sums are exact in any order."""
    rank = dist.get_rank() if rank is None else rank
    values = (torch.arange(torch.Size(shape).numel()) * (rank + 3 + salt)) % 17 - 8
    return values.reshape(shape).to(dtype)


def collectives() -> dict[str, object]:
    """Every collective, op and dtype once; the results by name."""
    out: dict[str, object] = {}
    for dtype in [*FLOATS, torch.int64]:
        for op in dist.ReduceOp:
            tensor = small_integers((5,), dtype)
            dist.all_reduce(tensor, op=op, tag=f"all_reduce {op.name} {dtype}")
            out[f"all_reduce {op.name} {dtype}"] = tensor
    for dtype in FLOATS:
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            full = small_integers((2 * WORLD_SIZE, 4), dtype, salt=1)
            kept = full.clone()
            shard = torch.empty(2, 4, dtype=dtype)
            dist.reduce_scatter_single(shard, full, op=op)
            out[f"reduce_scatter {op.name} {dtype}"] = shard
            out[f"reduce_scatter {op.name} {dtype} leaves its input"] = torch.equal(full, kept)
        gathered = torch.empty(WORLD_SIZE * 3, dtype=dtype)
        dist.all_gather_single(gathered, small_integers((3,), dtype, salt=2))
        out[f"all_gather {dtype}"] = gathered
        tensor = small_integers((4,), dtype, salt=3)
        dist.broadcast(tensor, src=WORLD_SIZE - 1)
        out[f"broadcast {dtype}"] = tensor
    out["async work"] = dist.all_reduce(torch.ones(2), async_op=True).is_completed()
    out["barrier"] = dist.barrier(tag="end")
    return out


def half_precision_sums() -> dict[str, torch.Tensor]:
    """256 + 1 + 1 in bf16: added in bf16 the ones vanish (257 is not a bf16), in fp32 they make 258."""
    value = [256.0, 1.0, 1.0][dist.get_rank()]
    reduced = torch.tensor([value], dtype=torch.bfloat16)
    dist.all_reduce(reduced)
    shard = torch.empty(1, dtype=torch.bfloat16)
    dist.reduce_scatter_single(shard, torch.full((WORLD_SIZE,), value, dtype=torch.bfloat16))
    return {"all_reduce": reduced, "reduce_scatter": shard}


def random_fp32_sum() -> torch.Tensor:
    generator = torch.Generator().manual_seed(dist.get_rank())
    tensor = torch.randn(4096, generator=generator) * torch.logspace(-3, 3, 4096)
    dist.all_reduce(tensor, op=dist.ReduceOp.AVG)
    return tensor


def argument_errors() -> list[str]:
    """Calls refused on the calling rank, before anything moves (every rank makes them, so none waits)."""
    messages = []
    for bad in (
        lambda: dist.reduce_scatter_single(torch.empty(3), torch.ones(8)),
        lambda: dist.all_gather_single(torch.empty(7), torch.ones(2)),
        lambda: dist.broadcast(torch.ones(3), src=WORLD_SIZE),
    ):
        try:
            bad()
        except ValueError as error:
            messages.append(str(error))
    return messages


def everything() -> dict[str, object]:
    return {
        "collectives": collectives(),
        "half": half_precision_sums(),
        "random": random_fp32_sum(),
        "errors": argument_errors(),
    }


def _process(rank: int, folder: str) -> None:
    """One spawned rank: join the gloo group, run `everything` through TorchBackend, send back what it saw."""
    torch_dist.init_process_group(
        "gloo", init_method=f"file://{folder}/store", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=60)
    )
    ctx = process_context(TorchBackend())
    with warnings.catch_warnings(record=True) as caught, activate(ctx):
        warnings.simplefilter("always")
        outcome = everything()
    outcome["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    outcome["ledger"] = [entry._asdict() for entry in ctx.ledger.entries]
    torch.save(outcome, f"{folder}/rank{rank}.pt")
    leave(0)  # exit as zero_core.launch does: destroying the group can deadlock a finished rank


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("gloo")
    start_ranks(_process, (str(folder),), WORLD_SIZE)
    return [torch.load(folder / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def virtual() -> tuple[list[dict], VirtualCluster]:
    cluster = VirtualCluster(WORLD_SIZE)
    return cluster.run(everything), cluster


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def test_every_collective_op_and_dtype_gives_the_virtual_clusters_bits(real, virtual) -> None:
    outcomes, _ = virtual
    names = outcomes[0]["collectives"].keys()
    for rank in range(WORLD_SIZE):
        assert real[rank]["collectives"].keys() == names
        for name in names:
            assert same(real[rank]["collectives"][name], outcomes[rank]["collectives"][name]), f"rank {rank}: {name}"


def test_avg_is_one_division_of_the_sum_even_for_integers(real) -> None:
    for dtype, expected in [(torch.float32, torch.float32), (torch.int64, torch.int64)]:
        tensors = [small_integers((5,), dtype, rank=rank) for rank in range(WORLD_SIZE)]
        total = sum(t.to(torch.float64) for t in tensors)
        want = (total / WORLD_SIZE).to(expected) if dtype.is_floating_point else (total // WORLD_SIZE).to(expected)
        assert torch.equal(real[0]["collectives"][f"all_reduce AVG {dtype}"], want)


def test_half_precision_reductions_travel_and_accumulate_in_fp32_on_gloo(real, virtual) -> None:
    outcomes, _ = virtual
    for rank in range(WORLD_SIZE):
        assert real[rank]["half"]["all_reduce"].item() == 258.0
        assert same(real[rank]["half"]["all_reduce"], outcomes[rank]["half"]["all_reduce"])
        assert same(real[rank]["half"]["reduce_scatter"], outcomes[rank]["half"]["reduce_scatter"])


def test_random_fp32_sums_agree_with_the_rank_ordered_sum_to_the_last_bits(real, virtual) -> None:
    outcomes, _ = virtual
    torch.testing.assert_close(real[0]["random"], outcomes[0]["random"], rtol=1e-6, atol=1e-6)
    assert all(torch.equal(real[rank]["random"], real[0]["random"]) for rank in range(WORLD_SIZE))


def test_each_real_rank_records_the_same_ledger_as_its_virtual_twin(real, virtual) -> None:
    _, cluster = virtual
    ignore = {"seconds", "started_s", "wait_started_s", "waited_s"}
    for rank in range(WORLD_SIZE):
        want = [{k: v for k, v in e._asdict().items() if k not in ignore} for e in cluster.ledger.ranks[rank].entries]
        got = [{k: v for k, v in e.items() if k not in ignore} for e in real[rank]["ledger"]]
        assert got == want


def test_the_ledger_counts_the_logical_dtype_not_the_fp32_wire(real) -> None:
    entry = next(e for e in real[1]["ledger"] if e["tag"] == "all_reduce SUM torch.bfloat16")
    assert (entry["dtype"], entry["element_size"], entry["elements"]) == ("bfloat16", 2, 5)
    bf16_bytes, fp32_bytes = (ring_bytes(ALL_REDUCE, 5 * size, size, WORLD_SIZE, rank=1)[0] for size in (2, 4))
    assert entry["bytes_sent"] == bf16_bytes != fp32_bytes


def test_argument_errors_are_the_same_on_both_backends(real, virtual) -> None:
    outcomes, _ = virtual
    for rank in range(WORLD_SIZE):
        assert len(real[rank]["errors"]) == 3
        assert real[rank]["errors"] == outcomes[rank]["errors"]
        assert all(message.startswith(f"rank {rank}: ") for message in real[rank]["errors"])


def test_no_collective_warns_not_even_a_future_warning_about_old_names(real) -> None:
    assert [rank["warnings"] for rank in real] == [[]] * WORLD_SIZE


def test_only_gloo_reductions_travel_in_fp32() -> None:
    assert upcasts_reductions("gloo") and not upcasts_reductions("nccl")
    assert wire_dtype(torch.bfloat16, reduction=True, upcast=True) == torch.float32
    assert wire_dtype(torch.float16, reduction=True, upcast=True) == torch.float32
    assert wire_dtype(torch.float64, reduction=True, upcast=True) == torch.float64
    assert wire_dtype(torch.bfloat16, reduction=False, upcast=True) == torch.bfloat16
    assert wire_dtype(torch.bfloat16, reduction=True, upcast=False) == torch.bfloat16
