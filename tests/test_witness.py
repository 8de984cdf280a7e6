"""The witness of graded runs (`autograder.witness`, `zero_core.backends.witnessed`): it carries out every
collective bit for bit as the virtual cluster does, records what each rank did on its own clock, and holds
a run's reported collectives against that record."""

from __future__ import annotations

import copy
import functools
import socket
import time

import pytest
import torch

from autograder import witness as witness_module
from autograder.checks import ObservationInvalid
from zero_core import dist
from zero_core.backends.witnessed import WitnessedBackend, WitnessLink, write_frame
from zero_core.cluster import VirtualCluster

WORLD_SIZE = 4


def every_collective() -> dict[str, torch.Tensor]:
    """Each kind of collective once, blocking and async_op, in the whole world and in a group."""
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(rank)
    values = torch.randn(24, generator=generator).to(torch.bfloat16)
    out = {}
    summed = values.clone()
    dist.all_reduce(summed)
    out["all_reduce"] = summed
    averaged = values.float()
    dist.all_reduce(averaged, op=dist.ReduceOp.AVG)
    out["all_reduce_avg"] = averaged
    shard = torch.empty(6, dtype=torch.bfloat16)
    work = dist.reduce_scatter_single(shard, values, async_op=True)
    time.sleep(0.05)  # the wait starts well after the issue, however loaded the machine
    work.wait()
    out["reduce_scatter"] = shard
    gathered = torch.empty(24 * WORLD_SIZE, dtype=torch.bfloat16)
    dist.all_gather_single(gathered, values)
    out["all_gather"] = gathered
    exchanged = torch.empty(24, dtype=torch.bfloat16)
    dist.all_to_all_single(exchanged, values)
    out["all_to_all"] = exchanged
    sent = values.clone()
    dist.broadcast(sent, src=2)
    out["broadcast"] = sent
    pair = dist.new_group([0, 1]), dist.new_group([2, 3])
    mine = pair[0] if rank < 2 else pair[1]
    in_group = values.clone()
    dist.all_reduce(in_group, group=mine)
    out["group_all_reduce"] = in_group
    dist.barrier()
    return out


def run(backend=None) -> tuple[list[dict], VirtualCluster]:
    options = {} if backend is None else {"backend": backend}
    cluster = VirtualCluster(WORLD_SIZE, timeout_s=30, **options)
    return cluster.run(every_collective), cluster


def witnessed_run() -> tuple[list[dict], VirtualCluster, witness_module.Witness]:
    witness, fd = witness_module.start()
    link = WitnessLink(socket.socket(fileno=fd))
    link.begin_run(WORLD_SIZE)
    results, cluster = run(functools.partial(WitnessedBackend, link=link))
    link.sock.close()
    witness.join(timeout=10)
    return results, cluster, witness


def test_a_witnessed_run_is_bit_for_bit_the_virtual_clusters() -> None:
    plain, _ = run()
    witnessed, _, witness = witnessed_run()
    assert witness.problem is None
    for mine, theirs in zip(witnessed, plain, strict=True):
        assert mine.keys() == theirs.keys()
        for name in mine:
            assert torch.equal(mine[name], theirs[name]), name


def test_the_witness_records_each_ranks_collectives_in_order_with_its_own_times() -> None:
    started = time.perf_counter()
    _, cluster, witness = witnessed_run()
    (seen,) = witness.runs
    for rank in range(WORLD_SIZE):
        ledger = cluster.ledger.entries(rank)
        assert [(e.op, e.dtype, e.elements) for e in ledger] == [(w.op, w.dtype, w.elements) for w in seen.ranks[rank]]
        assert all(w.carried for w in seen.ranks[rank])
        times = [w.started_s for w in seen.ranks[rank]]
        assert times == sorted(times) and times[0] >= started
        (async_entry,) = [w for w in seen.ranks[rank] if not w.blocking]
        assert async_entry.op == "reduce_scatter" and async_entry.wait_started_s - async_entry.started_s >= 0.02


def reported(cluster: VirtualCluster, index: int = 0) -> dict:
    """A run's data as `records.run_to_data` writes it, with the ledger's entries."""
    collectives = [
        [[e.op, e.dtype, e.elements, e.tag, e.step, e.bytes_sent, e.issuer, e.started_s, e.wait_started_s]
         for e in cluster.ledger.entries(rank)]
        for rank in range(WORLD_SIZE)
    ]
    ranks = [{"schedule": []} for _ in range(WORLD_SIZE)]
    return {"world_size": WORLD_SIZE, "steps": 1, "ranks": ranks, "memory": [], "collectives": collectives,
            witness_module.WITNESS_KEY: index}


def test_a_run_as_witnessed_is_accepted_with_the_witnesses_times() -> None:
    _, cluster, witness = witnessed_run()
    data = reported(cluster)
    verified = witness_module.verify_runs({"runs": [data]}, witness)["runs"][0]
    for rank in range(WORLD_SIZE):
        for entry, seen in zip(verified["collectives"][rank], witness.runs[0].ranks[rank], strict=True):
            assert entry[7:] == [seen.started_s, seen.wait_started_s]


@pytest.mark.parametrize(
    "lie",
    ["rewritten wait", "missing collective", "extra collective", "other size", "no witness", "other run"],
)
def test_a_run_that_differs_from_what_the_witness_saw_earns_nothing(lie: str) -> None:
    _, cluster, witness = witnessed_run()
    data = copy.deepcopy(reported(cluster))
    rank0 = data["collectives"][0]
    if lie == "rewritten wait":  # the times are the witness's whatever the child says: the lie is undone
        rank0[2][8] = rank0[2][7] + 100.0
        verified = witness_module.verify_runs(data, witness)
        assert verified["collectives"][0][2][8] == witness.runs[0].ranks[0][2].wait_started_s
        return
    if lie == "missing collective":
        del rank0[0]
    elif lie == "extra collective":
        rank0.append(list(rank0[0]))
    elif lie == "other size":
        rank0[0][2] += 1
    elif lie == "no witness":
        del data[witness_module.WITNESS_KEY]
    else:
        data[witness_module.WITNESS_KEY] = 1
    with pytest.raises(ObservationInvalid, match="no points"):
        witness_module.verify_runs(data, witness)


def test_the_witness_refuses_a_collective_no_rank_arrived_at_and_says_so() -> None:
    witness, fd = witness_module.start()
    sock = socket.socket(fileno=fd)
    write_frame(sock, {"kind": "run", "world_size": 2})
    write_frame(sock, {"kind": "carry", "op": "all_reduce", "group": [], "reduce": "sum"},
                [torch.ones(2), torch.ones(2)])
    sock.settimeout(10)
    assert b"never arrived" in sock.recv(4096)
    sock.close()
    witness.join(timeout=10)
    assert "never arrived" in witness.problem
    with pytest.raises(ObservationInvalid, match="refused by the witness"):
        witness_module.verify_runs({}, witness)


@pytest.mark.ex06
def test_a_ledger_rewritten_in_the_child_fools_only_a_grade_without_the_witness(tmp_path) -> None:
    """The control: graded in one process, the rewritten ledger is what the judge reads, and the submission
    that never overlaps keeps every point. Through the child, the judge reads the witness's times (the
    child run itself is graded by tests/test_grading_integrity.py like every `CHILD = True` fixture)."""
    from autograder.checks import total
    from tests.test_grading_integrity import FIXTURES, WrongSubmission, grade_in_process

    wrong = WrongSubmission.read(FIXTURES / "ex06_rewrites_its_waits_in_the_ledger.patch")
    assert total(grade_in_process(wrong.notebook(tmp_path))) == (10, 10)
