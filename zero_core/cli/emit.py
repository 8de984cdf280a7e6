"""`plan --nodes ... --emit deepspeed|fsdp2`: the configuration the plan ranks first, as a config to train with.

`--emit deepspeed` writes DeepSpeed's JSON (`zero_core.planner.emit_deepspeed`) and explains every key in the
ledger's terms; `--emit fsdp2` writes the FSDP2 code (`zero_core.planner.emit_fsdp2`), its knobs explained in
its comments. The batch (plan's `--micro-batch`, and `--grad-accum`, `--global-batch`) must train the tokens per GPU the
plan timed (`zero_core.planner.batch`). With `--out PATH` the config goes to PATH and the plan prints as usual;
without it the config is the only thing on stdout (so `> ds_config.json` works) and the plan goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, redirect_stdout
from pathlib import Path
from typing import Any

from zero_core.cli.errors import UsageError
from zero_core.cli.model_choice import PlannedModel
from zero_core.cli.render import WIDTH
from zero_core.configurations import Configuration
from zero_core.planner import emit_deepspeed, emit_fsdp2
from zero_core.planner.batch import Batch, plan_batch

TARGETS = ("deepspeed", "fsdp2")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--emit", choices=TARGETS, help="write the first-ranked configuration as DeepSpeed JSON or FSDP2")
    p.add_argument("--out", metavar="PATH", help="where --emit writes (default: stdout, the plan then on stderr)")
    p.add_argument("--grad-accum", type=int, help="micro-steps per optimizer step (default: what the tokens need)")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step on all GPUs, checked")
    p.add_argument("--precision", default="bf16", choices=list(emit_deepspeed.PRECISIONS), help="default bf16")


def check(args: argparse.Namespace) -> None:
    """Refuse `--emit` options without `--emit`, and `--emit` without `--nodes`, before any work."""
    if args.emit is None:
        if args.out or args.grad_accum is not None or args.global_batch is not None:
            raise UsageError("--out, --grad-accum and --global-batch describe what --emit writes: give --emit")
        return
    if args.nodes is None:
        raise UsageError("--emit writes the configuration --nodes ranks first: give --nodes and --machine")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        raise UsageError(f"--out: no folder {Path(args.out).parent} to write {Path(args.out).name} into")


@contextmanager
def plan_output(args: argparse.Namespace) -> Iterator[None]:
    """Where the plan's own text goes: stderr when the emitted config takes stdout (kept as `args.emit_stream`)."""
    args.emit_stream = sys.stdout
    with redirect_stdout(sys.stderr) if args.emit and not args.out else nullcontext():
        yield


def write(
    args: argparse.Namespace,
    planned: PlannedModel,
    best: list[dict[str, Any]],
    chosen: list[Configuration],
    n_gpus: int,
    gpus_per_node: int,
) -> int:
    """Emit the first of `best` (the ranked rows) for `args.emit`, inside `plan_output`; the explanations go
    beside the plan."""
    if not best:
        raise UsageError("--emit: no configuration fits, so there is nothing to write")
    top = least_changed_of_the_first(best, {c.name: c for c in chosen}, args.emit)
    config = next(c for c in chosen if c.name == top["config"])
    try:
        batch = plan_batch(
            args.tokens_per_gpu, planned.sequence, n_gpus, args.micro_batch, args.grad_accum, args.global_batch
        )
        text, explanation = render(args.emit, config, batch, args.precision, gpus_per_node, planned.psi, top["label"])
    except ValueError as error:
        raise UsageError(f"--emit {args.emit}: {error}") from None
    if top is not best[0]:
        print("\n" + textwrap.fill(
            f"--emit {args.emit} writes {top['label']}: of the configurations ranked first, tied within the time "
            "model's error, the one that changes the least (no quantisation, no offload, no second copy of the "
            "weights)", WIDTH))
    print(f"\n{explanation}")
    if args.out:
        Path(args.out).write_text(text)
        print(f"\nwrote {args.out}")
    else:
        args.emit_stream.write(text)
    return 0


def least_changed_of_the_first(
    best: list[dict[str, Any]], configurations: dict[str, Configuration], target: str
) -> dict[str, Any]:
    """The row to write: of the rows tied at the first rank (their times differ by less than the time model's
    error), the one that departs least from the plain stage, in this order: quantised weights or gradients (the
    numbers trained change), offload (host memory and PCIe), hpZ (a second copy of the weights); for DeepSpeed,
    never HSDP, which it has no key for. Equal departures: the plan's order."""
    tied = [row for row in best if row.get("rank") == best[0].get("rank")]
    candidates = [row for row in tied if not (target == "deepspeed" and configurations[row["config"]].hsdp)] or tied

    def departures(row: dict[str, Any]) -> tuple[bool, bool, bool]:
        config = configurations[row["config"]]
        return config.qwz or config.qgz, config.offload, config.hpz

    return min(candidates, key=departures)


def render(
    target: str, config: Configuration, batch: Batch, precision: str, gpus_per_node: int, psi: int, label: str
) -> tuple[str, str]:
    """(the config's text, what explains it) for `target`."""
    if target == "deepspeed":
        data, knobs = emit_deepspeed.deepspeed_config(config, batch, precision, gpus_per_node, psi)
        return emit_deepspeed.to_json(data), emit_deepspeed.explain(knobs, label)
    code = emit_fsdp2.fsdp2_code(config, batch, precision, gpus_per_node, label)
    return code, f"FSDP2 code for {label}: every knob is explained in its comments."
