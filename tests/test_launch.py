"""`torchrun -m zero_core.launch`: the stages on real gloo processes report what the virtual cluster reports.

Tolerances, measured and explained. With 2 processes a reduction is one addition, and addition
commutes, so a real run equals a virtual run bit for bit, in bf16 (whose reductions travel as fp32 on
gloo, as the virtual cluster accumulates) as in fp32. With 4 processes gloo adds in its own order, so an
fp32 averaged gradient can differ in its last bit (~6e-8 relative) from the rank-order sum: losses then
agree to ~3e-8 relative, and after 5 steps each layer's weights to ~1.2e-7 of its norm, except the
attention key bias. Its exact gradient is zero (softmax ignores a shift of every score in a row), so its
float gradient is rounding noise that Adam rescales into steps, and its value depends on the rounding
order: it alone takes the layer-wise error to ~1e-5. We assert losses within 1e-6 relative, each layer
within 1e-4 of its norm (the fp32 tolerance of the single-device oracle test), and within 1e-6 with the
key bias cut out. The ledger counts bytes under the ring model from shapes alone: equal, rank by rank.
"""

from __future__ import annotations

import inspect
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from zero_core import divergent_ranks, launch
from zero_core.cli import main as cli_main
from zero_core.experiment import run_stage
from zero_core.model import preset
from zero_core.stages import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3
LEDGER_FIELDS = ("op", "tag", "dtype", "elements", "element_size", "bytes_sent", "bytes_received", "step", "phase")
CLOCK_FIELDS = {"step_seconds", "typical_step_seconds", "collective_seconds_per_step_mean"}


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in launch.TORCHRUN_VARIABLES}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}


def torchrun(nproc: int, *args: str, timeout_s: float = 110.0) -> subprocess.CompletedProcess:
    """`torchrun --standalone` (a free port of its own choosing) running zero_core.launch.

    Past `timeout_s` the whole process group (torchrun and its ranks) is killed, so no orphaned rank
    slows the tests after it, and the test fails with what the run had printed: the ranks print their
    threads' stacks 15 s before that (`--stacks-after`), so a hang says where it is.
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command += ["-m", "zero_core.launch", "--preset", "micro", "--no-progress", *args]
    command += ["--stacks-after", f"{timeout_s - 15:g}"]  # where each rank is, should it hang
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    run = subprocess.Popen(command, cwd=ROOT, env=child_env(), start_new_session=True, **pipes)
    try:
        out, err = run.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        divergent_ranks.kill_tree(run.pid)
        out, err = run.communicate(timeout=30)
        pytest.fail(
            f"torchrun with {nproc} processes did not finish within {timeout_s:g} s; "
            f"its stdout ended with:\n{out[-1500:]}\nits stderr ended with:\n{err[-3000:]}"
        )
    return subprocess.CompletedProcess(command, run.returncode, out, err)


def real_run(
    tmp_path: Path, nproc: int, stages: str, precision: str, *extra: str, steps: int = STEPS, timeout_s: float = 110.0
) -> dict:
    save, report = tmp_path / "run.pt", tmp_path / "run.json"
    started = time.monotonic()
    options = ["--stages", stages, "--steps", str(steps), "--precision", precision, "--save", str(save)]
    done = torchrun(nproc, *options, "--json", str(report), *extra, timeout_s=timeout_s)
    assert done.returncode == 0, done.stderr[-3000:]
    return {
        "seconds": time.monotonic() - started,
        "stdout": done.stdout,
        "saved": torch.load(save),
        "json": json.loads(report.read_text()),
    }


def virtual_run(stage: int, world_size: int, precision: str, steps: int = STEPS):
    return run_stage(stage, world_size, steps, TrainConfig(model=preset("micro"), precision=precision))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def without_key_bias(name: str, flat: torch.Tensor, n_embd: int) -> torch.Tensor:
    """A layer's flat weights with the attention key bias cut out (a qkv layer: (3C, C) weight, then 3C bias)."""
    if not name.endswith("attn.qkv"):
        return flat
    start = 3 * n_embd * n_embd + n_embd
    return torch.cat([flat[:start], flat[start + n_embd :]])


def ledger_rows(entries: list) -> list[tuple]:
    return [tuple(e[k] if isinstance(e, dict) else getattr(e, k) for k in LEDGER_FIELDS) for e in entries]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict:
    """CI: ZeRO-0 and ZeRO-3 on 2 gloo processes, the default bf16 precision."""
    return real_run(tmp_path_factory.mktemp("two"), 2, "0,3", "bf16", "--check-virtual")


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory) -> dict:
    """Four processes on two cores: 9 s here. On CI machines with torch 2.6 this run twice outlasted its limit;
    the second time the stacks showed a rank deadlocked at its exit in `destroy_process_group`, which no rank
    calls any more (`launch.leave` says why). A limit for a hang, not a timing."""
    return real_run(tmp_path_factory.mktemp("four"), 4, "0,1,2,3", "fp32", steps=5, timeout_s=240.0)


def test_two_gloo_processes_train_zero0_and_zero3_in_under_two_minutes(two_processes) -> None:
    assert two_processes["seconds"] < 120
    assert "ZeRO on 2 processes (gloo, CPU)" in two_processes["stdout"]
    for title in ("Model states per GPU", "Equivalence", "Compute per GPU", "Memory breakdown per GPU"):
        assert title in two_processes["stdout"]


def test_check_virtual_prints_how_far_the_real_run_is_from_the_virtual_one(two_processes) -> None:
    table = two_processes["stdout"].split("Against 2 virtual ranks")[1]
    rows = [line.split() for line in table.splitlines() if line.startswith("ZeRO-")]
    assert rows == [[f"ZeRO-{stage}", "0.0e+00", "0.0e+00", "yes", "equal"] for stage in (0, 3)]


@pytest.mark.parametrize("stage", [0, 3])
def test_two_processes_train_bit_for_bit_like_two_virtual_ranks(two_processes, stage) -> None:
    real = two_processes["saved"]["stages"][stage]
    virtual = virtual_run(stage, 2, "bf16")
    assert real["losses"] == virtual.losses
    assert real["master_weights"].keys() == virtual.master_weights.keys()
    for name, weights in virtual.master_weights.items():
        assert torch.equal(real["master_weights"][name], weights), name


def test_a_real_report_is_a_virtual_report_but_for_the_clocks(two_processes, tmp_path) -> None:
    path = tmp_path / "virtual.json"
    args = ["compare", "--world-size", "2", "--stages", "0,3", "--steps", str(STEPS), "--preset", "micro"]
    assert cli_main([*args, "--no-progress", "--json", str(path)]) == 0
    virtual, real = json.loads(path.read_text()), two_processes["json"]
    assert real.keys() == virtual.keys()
    assert real["equivalence"] == virtual["equivalence"]
    for real_stage, virtual_stage in zip(real["stages"], virtual["stages"], strict=True):
        assert real_stage.keys() == virtual_stage.keys()
        for key in real_stage.keys() - CLOCK_FIELDS:
            assert real_stage[key] == virtual_stage[key], key


@pytest.mark.parametrize("stage", [0, 3])
def test_the_real_ledger_counts_each_ranks_bytes_exactly_as_the_virtual_one(two_processes, stage) -> None:
    real = two_processes["saved"]["stages"][stage]["ledgers"]
    virtual = virtual_run(stage, 2, "bf16").ledger.ranks
    assert [ledger_rows(entries) for entries in real] == [ledger_rows(ledger.entries) for ledger in virtual]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_four_processes_agree_with_four_virtual_ranks_within_fp32_rounding(four_processes, stage) -> None:
    real = four_processes["saved"]["stages"][stage]
    virtual = virtual_run(stage, 4, "fp32", steps=5)
    for got, want in zip(real["losses"], virtual.losses, strict=True):
        assert abs(got - want) <= 1e-6 * abs(want)
    n_embd = preset("micro").n_embd
    for name, weights in virtual.master_weights.items():
        got = real["master_weights"][name]
        assert relative_error(got, weights) <= 1e-4, name
        assert relative_error(without_key_bias(name, got, n_embd), without_key_bias(name, weights, n_embd)) <= 1e-6
    assert [ledger_rows(e) for e in real["ledgers"]] == [ledger_rows(r.entries) for r in virtual.ledger.ranks]


@pytest.mark.slow
def test_on_gloo_every_stage_trains_to_the_same_bits_as_zero0(four_processes) -> None:
    """Measured on torch 2.13: gloo's reduce-scatter adds each element in its all-reduce's order, so the stages
    still agree with each other bit for bit, though not with the virtual cluster's rank-order sums."""
    assert all(e["bit_identical"] for e in four_processes["json"]["equivalence"])


# -- errors: one line, exit code 2 for what cannot run; a dead or stuck rank ends the others ----------


def run_main(monkeypatch, capsys, env: dict[str, str], *args: str) -> tuple[int, str]:
    for name in launch.TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = launch.main(list(args))
    return code, capsys.readouterr().err


def fake_torchrun_env(rank: int, world_size: int, port: int = 1) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": str(port),
    }


def test_a_run_past_the_tests_limit_fails_with_the_ranks_stacks_and_leaves_no_rank_behind(tmp_path) -> None:
    """The limit of `torchrun` above: killing only torchrun's process group left the ranks (each in a session
    of its own) running and holding the pipes, so reading what they printed waited for ever.

    Rank 1 hangs on purpose and rank 0 waits for it far longer than the limit, so the run cannot end by
    itself on any machine (with 10,000 steps of training instead, `torchrun` once ended within the limit on CI)."""
    marker = str(tmp_path / "endless.json")
    endless = ["--stages", "0", "--steps", "3", "--timeout", "600", "--json", marker]
    endless += ["--fail-rank", "1", "--fail-at-step", "1", "--fail-mode", "hang"]
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="did not finish within 17 s") as failure:
        done = torchrun(2, *endless, timeout_s=17.0)
        print(f"the endless run ended by itself, exit code {done.returncode}:\n{done.stderr[-3000:]}")
    assert time.monotonic() - started < 60
    assert "most recent call first" in str(failure.value)  # the ranks' stacks, printed 2 s in
    left = [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    assert left == []


def test_outside_torchrun_the_launcher_says_how_to_start_it(monkeypatch, capsys) -> None:
    code, err = run_main(monkeypatch, capsys, {}, "--stage", "3")
    assert code == 2
    assert err.count("\n") == 1
    assert "torchrun --nproc-per-node" in err


def test_a_world_size_the_virtual_cluster_cannot_reproduce_is_refused(monkeypatch, capsys) -> None:
    code, err = run_main(monkeypatch, capsys, fake_torchrun_env(0, 5000), "--stage", "3")
    assert code == 2
    assert err.count("\n") == 1
    assert "world size 5000 is not usable" in err and "4096" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--stage", "4"], "--stages takes stages from 0 to 3"),
        (["--steps", "0"], "--steps must be between"),
        (["--timeout", "0"], "--timeout must be positive"),
        (["--stacks-after", "-1"], "--stacks-after must be positive"),
        (["--fail-rank", "2"], "--fail-rank 2 is outside 0..1"),
    ],
)
def test_bad_arguments_end_in_one_line_and_exit_code_2(monkeypatch, capsys, args, message) -> None:
    code, err = run_main(monkeypatch, capsys, fake_torchrun_env(0, 2), *args)
    assert code == 2
    assert err.count("\n") == 1 and message in err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def spawn_ranks(
    world_size: int, *args: str, only_rank: int | None = None, port: int | None = None
) -> list[subprocess.Popen]:
    """The processes torchrun would start, started by hand: nobody kills the survivors but themselves."""
    port = port or free_port()
    command = [sys.executable, "-m", "zero_core.launch", "--preset", "micro", "--no-progress", *args]
    return [
        subprocess.Popen(
            command,
            cwd=ROOT,
            env=child_env(**fake_torchrun_env(rank, world_size, port)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
        if only_rank in (None, rank)
    ]


@pytest.mark.parametrize("mode, bound_s", [("exit", 30.0), ("hang", 40.0)])
def test_when_a_rank_dies_or_hangs_the_survivor_exits_non_zero_naming_the_collective(mode, bound_s) -> None:
    ranks = spawn_ranks(
        2,
        "--stage",
        "3",
        "--steps",
        "4",
        "--timeout",
        "8",
        "--fail-rank",
        "1",
        "--fail-at-step",
        "2",
        "--fail-mode",
        mode,
    )
    started = time.monotonic()
    try:
        _, err = ranks[0].communicate(timeout=bound_s + 30)
        elapsed = time.monotonic() - started
    finally:
        for process in ranks:
            process.kill()
        _, failing_err = ranks[1].communicate()
        ranks[0].communicate()
    # rank 1 failed the way it was told to, not some other way (it once died of an AttributeError at setup)
    doing = {"exit": "exiting", "hang": "hanging"}[mode]
    assert f"rank 1: {doing} at step 2 on purpose (--fail-rank)" in failing_err, failing_err[-3000:]
    assert "Traceback" not in failing_err, failing_err[-3000:]
    assert ranks[0].returncode == 1
    assert elapsed < bound_s
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("python -m zero_core.launch: rank 0: ")
    assert "failed in the gloo process group" in lines[0]
    assert "Another rank has most likely died or stopped responding" in lines[0]


def test_a_rank_that_never_starts_stops_the_others_after_the_timeout() -> None:
    (rank0,) = spawn_ranks(2, "--stage", "3", "--timeout", "5", only_rank=0)
    started = time.monotonic()
    try:
        _, err = rank0.communicate(timeout=60)
    finally:
        rank0.kill()
    assert rank0.returncode == 1
    assert time.monotonic() - started < 30
    assert err.strip().count("\n") == 0, err
    assert "rank 0: could not join the process group within 5 s" in err


def test_a_port_already_taken_is_named_at_once_not_waited_for() -> None:
    with socket.socket() as taken:
        taken.bind(("localhost", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (rank0,) = spawn_ranks(2, "--stage", "3", "--timeout", "60", only_rank=0, port=port)
        try:
            _, err = rank0.communicate(timeout=60)
        finally:
            rank0.kill()
    assert rank0.returncode == 1
    assert err.strip().count("\n") == 0, err
    assert "rank 0: could not join the process group (" in err and f"is MASTER_PORT {port} free" in err, err
    assert "within 60 s" not in err


def test_a_report_longer_than_the_timeout_still_ends_the_run_well(tmp_path) -> None:
    """Rank 0 reports alone after the last collective (`--check-virtual` trains every stage again): the
    other ranks do not wait for it under the group's timeout, which the report here outlasts on purpose."""
    report = tmp_path / "run.json"
    options = ["--stages", "0", "--steps", "2", "--timeout", "4", "--slow-report", "7", "--json", str(report)]
    done = torchrun(2, *options, timeout_s=60.0)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(report.read_text())["world_size"] == 2


def test_stacks_after_prints_where_a_waiting_rank_is() -> None:
    """`--stacks-after`: a rank still running after the given seconds prints its threads' stacks, so a run
    that hangs (in a test that kills it, say) says where; here rank 0 waits for a rank that never starts."""
    (rank0,) = spawn_ranks(2, "--stage", "3", "--timeout", "6", "--stacks-after", "2", only_rank=0)
    try:
        _, err = rank0.communicate(timeout=60)
    finally:
        rank0.kill()
    assert "Thread 0x" in err and "most recent call first" in err
    assert 'in join_process_group' in err
    assert "rank 0: could not join the process group within 6 s" in err


def test_leaving_flushes_both_streams_and_exits_with_the_code() -> None:
    """`leave` skips the interpreter's finalization, so nothing but its own flush writes what is buffered."""
    program = (
        "import sys; from zero_core.launch import leave; print('written', end=''); sys.stderr.write('said'); leave(3)"
    )
    buffered = {k: v for k, v in child_env().items() if k != "PYTHONUNBUFFERED"}
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, env=buffered, capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout, done.stderr) == (3, "written", "said")


def test_the_launcher_imports_no_plotting_library() -> None:
    """A cluster's environment runs `zero_core.launch` with torch and little else (the oldest-torch venv has no
    matplotlib): the launcher, and the CLI it shares code with, must not import one."""
    code = "import sys, zero_core.launch; sys.exit('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1]).returncode == 0


# -- ranks that take different paths: the run ends by itself, and says where each rank waited ---------------

DIVERGENT_TIMEOUT_S, DIVERGENT_STACKS_AFTER_S, DIVERGENT_BOUND_S = 15.0, 7.0, 90.0
WAITING_RANK = {"skip-module": 0, "early-exit": 0, "rank-loop": 1}
"""The rank of each program that waits in a collective the other never calls (or gets a message of the wrong size)."""


@pytest.fixture(scope="module")
def divergent_runs() -> dict[str, divergent_ranks.TorchrunRun]:
    """`--diverge` with each program, three torchruns of 2 processes side by side (about 25 s here), with
    Python's fault handler on, as lesson 07 runs them but with wider margins: the stacks are printed 7 s
    after a rank starts, long after it reached the collective it waits in, and 8 s before the timeout."""
    runs = divergent_ranks.under_torchrun(
        [(kind, {"PYTHONFAULTHANDLER": "1"}) for kind in divergent_ranks.PROGRAMS],
        timeout_s=DIVERGENT_TIMEOUT_S,
        stacks_after_s=DIVERGENT_STACKS_AFTER_S,
        bound_s=DIVERGENT_BOUND_S,
    )
    return {run.kind: run for run in runs}


def frame_of(function, text: str) -> str:
    """The fault handler's line for the line of `function` (in zero_core/divergent_ranks.py) that holds `text`."""
    lines, first = inspect.getsourcelines(function)
    (offset,) = [i for i, line in enumerate(lines) if text in line]
    return f'File "zero_core/divergent_ranks.py", line {first + offset} in {function.__name__}'


DIVERGENT_LINES = {
    "skip-module": (divergent_ranks.skips_a_module, "gather_layer(layer)"),
    "early-exit": (divergent_ranks.exits_early_on_its_data, "gather_layer(layer)"),
    "rank-loop": (divergent_ranks.runs_a_head_per_item, "dist.all_gather_single"),
}


@pytest.mark.parametrize("kind", list(divergent_ranks.PROGRAMS))
def test_a_divergent_run_ends_by_itself_with_the_waiting_rank_s_stack_at_its_divergent_line(
    divergent_runs, kind
) -> None:
    """Whether gloo notices (messages of different sizes: it aborts the rank, and the fault handler prints
    its stack) or not (a collective the other rank never calls: the rank waits, `--stacks-after` prints its
    stack, then the timeout ends it), the run ends with an error, and the waiting rank's stack names the
    line of the program where the ranks parted."""
    run = divergent_runs[kind]
    text = "\n".join(run.rank_lines)
    assert run.exit_code is not None, f"{kind} was still running after {DIVERGENT_BOUND_S:g} s:\n{text}"
    assert run.exit_code != 0 and run.seconds < DIVERGENT_BOUND_S, text
    waiting = "\n".join(run.lines_of(WAITING_RANK[kind]))
    assert frame_of(*DIVERGENT_LINES[kind]) in waiting, text


@pytest.mark.parametrize("kind", ["early-exit", "rank-loop"])
def test_each_rank_left_waiting_ends_in_one_line_and_a_timeout_names_the_collective_it_waited_in(
    divergent_runs, kind
) -> None:
    """The waiting rank waits in the program's all-gather, the finished one in the barrier after its program.
    Whichever times out first names its collective and exits; the other then fails as well, in one line of its
    own: it times out too, or its peer is gone (a connection reset), or torchrun stops it (SIGTERM)."""
    run = divergent_runs[kind]
    text = "\n".join(run.rank_lines)
    waiting, finished = WAITING_RANK[kind], 1 - WAITING_RANK[kind]
    assert any("Timeout (0:00:07)!" in line for line in run.lines_of(waiting)), text  # the stacks, 7 s in
    errors = [line for line in run.rank_lines if "python -m zero_core.launch: rank" in line]
    assert sorted(int(e.split(": rank ")[1][0]) for e in errors) == [0, 1], text
    assert all("failed in the gloo process group" in e or "stopped by SIGTERM" in e for e in errors), text
    collectives = (f"rank {waiting}: all_gather #", "tag='param "), (
        f"rank {finished}: barrier #",
        f"tag='{divergent_ranks.END_OF_RUN_TAG}'",
    )
    named = [e for e in errors if "Timed out" in e and any(op in e and tag in e for op, tag in collectives)]
    assert named, text
