"""Three programs whose ranks take different paths (the divergences users of ZeRO-3 report), on both clusters.

Every rank of a data-parallel run must call the same collectives in the same order. ZeRO-3 makes that
easy to break without noticing: each layer's forward all-gathers the layer's parameters, so a rank that
runs a layer fewer or more times than the others calls one collective fewer or more. Each program below
is the smallest form of one kind of divergence, written against `zero_core.dist`:

- `skips_a_module`: rank 1 does not run layer 1, so its next gather is layer 2's while the others
  gather layer 1 (deepspeedai/DeepSpeed#4910: one process does not call `generate()`);
- `exits_early_on_its_data`: a rank whose sequence has ended leaves the generation loop while the
  others decode the next token (#860, #8262: ranks finish generating at different lengths);
- `runs_a_head_per_item`: a task head runs once per item of the rank's batch, a number that differs
  from rank to rank (#7998).

`on_virtual_cluster(kind)` runs one on the virtual cluster, whose error names at once the line each
waiting rank called its collective from (`zero_core.call_sites`). `under_torchrun(kinds)` runs them,
unchanged, on real gloo processes (`torchrun ... -m zero_core.launch --diverge KIND`): there a rank waits
until the process group's timeout, and `--stacks-after` prints where each rank is while it waits.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from zero_core import dist
from zero_core.cluster import ClusterError, VirtualCluster

LAYER_SHARD_ELEMENTS = (6, 4, 8)
"""Elements of each layer's parameters a rank holds (its ZeRO-3 shard): layers differ in size."""
HEAD_SHARD_ELEMENTS = 2


def gather_layer(layer: int) -> torch.Tensor:
    """ZeRO-3's gather on demand, reduced to its collective: layer `layer`'s full parameters from every
    rank's shard, before its forward."""
    shard = torch.full((LAYER_SHARD_ELEMENTS[layer],), float(dist.get_rank()))
    full = torch.empty(shard.numel() * dist.get_world_size())
    dist.all_gather_single(full, shard, tag=f"param layer {layer}")
    return full


def skips_a_module() -> None:
    """One forward, each layer gathered when it runs. Rank 1's forward leaves out layer 1 (a branch its
    input does not take, an expert none of its tokens were routed to): its second all-gather is layer 2's,
    the others' is layer 1's."""
    for layer in range(len(LAYER_SHARD_ELEMENTS)):
        if dist.get_rank() == 1 and layer == 1:
            continue
        gather_layer(layer)


def exits_early_on_its_data(max_new_tokens: int = 3) -> None:
    """Generation: one forward per new token until the rank's own sequence ends. Rank 1's sequence ends
    after its first token (it sampled the end-of-sequence token), the others' run to `max_new_tokens`."""
    ends_after = 1 if dist.get_rank() == 1 else max_new_tokens
    for token in range(max_new_tokens):
        for layer in range(len(LAYER_SHARD_ELEMENTS)):
            gather_layer(layer)
        if token + 1 == ends_after:
            break


def runs_a_head_per_item() -> None:
    """A task head runs once per item in the rank's batch, and rank r's batch holds r + 1 items: rank 0
    gathers the head once, rank 1 twice, and its second gather waits for a rank that never comes."""
    items = dist.get_rank() + 1
    for _ in range(items):
        head = torch.empty(HEAD_SHARD_ELEMENTS * dist.get_world_size())
        dist.all_gather_single(head, torch.zeros(HEAD_SHARD_ELEMENTS), tag="param head")


PROGRAMS: dict[str, Callable[[], None]] = {
    "skip-module": skips_a_module,
    "early-exit": exits_early_on_its_data,
    "rank-loop": runs_a_head_per_item,
}
"""Each program by the name `zero_core.launch --diverge` takes."""
END_OF_RUN_TAG = "end of run"
"""The barrier every rank of `zero_core.launch --diverge` calls after its program: where a rank that has
finished waits for the others, as a finished rank of a real run waits in its next collective."""


def on_virtual_cluster(kind: str, world_size: int = 4) -> str:
    """The virtual cluster's error for program `kind` on `world_size` ranks (it names the call sites)."""
    try:
        VirtualCluster(world_size, timeout_s=30.0).run(PROGRAMS[kind])
    except ClusterError as error:
        return f"{type(error).__name__}: {error}"
    raise AssertionError(f"{kind} ran to the end on {world_size} ranks: its ranks did not diverge")


# -- the same programs on real processes -------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets for each process (`zero_core.launch` requires them; a run started from here drops the
caller's own, so that a launch inside a torchrun job starts a group of its own)."""
_RANK_LINE = re.compile(r"^\[default(\d+)\]:(.*)$")


@dataclass(frozen=True)
class TorchrunRun:
    """One `torchrun ... --diverge KIND` run: how it ended and what its ranks wrote to stderr."""

    kind: str
    environment: dict[str, str]
    """The variables the run had on top of the caller's environment."""
    command: list[str]
    exit_code: int | None
    """torchrun's exit code; None if the run was still going at the bound and was killed."""
    seconds: float
    rank_lines: list[str]
    """What the ranks wrote, in order, each line as torchrun tees it (`[default0]:` is local rank 0), with
    this checkout's and the site-packages' folders cut from file names and faulthandler's list of extension
    modules left out; torchrun's own report of the failed ranks is not among them."""

    def lines_of(self, rank: int) -> list[str]:
        return [line for line in self.rank_lines if line.startswith(f"[default{rank}]:")]

    def command_line(self) -> str:
        """The run as one would type it: its variables, `torchrun` and its arguments (not its log folder)."""
        words = [f"{name}={value}" for name, value in self.environment.items()]
        words += ["torchrun", *(w for w in self.command[3:] if not w.startswith("--log-dir"))]
        return " ".join(words)


def torchrun_command(
    kind: str, timeout_s: float, stacks_after_s: float, processes: int = 2, log_dir: str | None = None
) -> list[str]:
    """`torchrun` (as `python -m torch.distributed.run`, standalone) on `processes` gloo processes running
    program `kind`; each rank prints its stacks after `stacks_after_s` and gives up after `timeout_s`.
    `--tee=3` has torchrun copy each rank's output to the console line by line, each line prefixed with the
    rank, so two ranks' stack dumps cannot interleave; it keeps the copies in `log_dir` (a new temporary
    folder if None)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
    command += ["--tee=3", *([f"--log-dir={log_dir}"] if log_dir else [])]
    command += ["-m", "zero_core.launch", "--diverge", kind]
    return command + ["--timeout", f"{timeout_s:g}", "--stacks-after", f"{stacks_after_s:g}"]


def under_torchrun(
    runs: list[tuple[str, dict[str, str]]], timeout_s: float = 8.0, stacks_after_s: float = 4.0, bound_s: float = 60.0
) -> list[TorchrunRun]:
    """Each (program, extra environment variables) of `runs` under a `torchrun` of its own, all at once, on
    2 processes each. Their ranks end by themselves within `timeout_s` of a collective that cannot complete;
    a run still going `bound_s` after the start is killed, torchrun and its ranks (each rank is in a session
    of its own), and says so (`exit_code` None)."""
    base = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    path = os.pathsep.join(p for p in (str(ROOT), base.get("PYTHONPATH", "")) if p)
    base = {**base, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    started = time.monotonic()

    def run(index: int, kind: str, environment: dict[str, str], logs: str) -> TorchrunRun:
        command = torchrun_command(kind, timeout_s, stacks_after_s, log_dir=f"{logs}/{index}")
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        process = subprocess.Popen(command, cwd=ROOT, env={**base, **environment}, **pipes)
        try:
            _, err = process.communicate(timeout=bound_s)
            exit_code: int | None = process.returncode
        except subprocess.TimeoutExpired:
            kill_tree(process.pid)
            _, err = process.communicate()
            exit_code = None
        return TorchrunRun(kind, environment, command, exit_code, time.monotonic() - started, rank_lines(err))

    with tempfile.TemporaryDirectory(prefix="diverge-") as logs, ThreadPoolExecutor(len(runs)) as pool:
        return list(pool.map(run, range(len(runs)), *zip(*runs, strict=True), [logs] * len(runs)))


def rank_lines(stderr: str) -> list[str]:
    """The lines of torchrun's stderr that its ranks wrote (see `TorchrunRun.rank_lines`)."""
    site_packages = re.compile(r'File "[^"]*/site-packages/')
    lines = []
    for line in stderr.splitlines():
        match = _RANK_LINE.match(line)
        if match is None or not match.group(2).strip() or match.group(2).startswith("Extension modules:"):
            continue
        lines.append(site_packages.sub('File "', line.replace(f"{ROOT}/", "")))
    return lines


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants. torchrun starts each rank in a session of its own, so
    killing torchrun's process group would leave the ranks running, holding the pipes the caller reads."""
    try:
        parent = psutil.Process(pid)
        processes = [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(processes, timeout=10)
