"""ex10: sharded checkpoints. Each rank saves its shards, one process consolidates them, another N resumes.

The student writes `save_shards(stage, rank, directory)`, `consolidate(directory)` and `load_into(stage,
state)`; the files' names and what the course reads of them are `zero_core.checkpoint_files`'s. The checks
train ZeRO-1, ZeRO-2 and ZeRO-3 on N ranks (the micro GPT, `STEPS` steps), let every rank save, and observe
with the course's own code, never from what the student's code reports:

- the files: what `torch.load` reads back from each rank's file (its step and its master, m and v: fp32, the
  rank's owned elements in layer order, no padding) and the file's size on disk;
- memory: what the rank's memory audit saw allocated while it saved (its shards plus one layer's fp32 values
  at most: no rank builds the full state);
- the consolidation: `consolidate` of those files, and of a copy whose master, m and v the course rewrote with
  values drawn from a seed (so only an answer that reads the files gets them back);
- the resume: `load_into` fresh stages on the same N, then `STEPS` more steps; and on M ranks (fp32), the same.

The judge compares with ZeRO-0's trajectory (every stage is bit-identical to it, lessons 2 to 4): the files'
shards are its masters and moments cut at each rank's owned range, the consolidation is its full state bit for
bit, a resume on the same N continues it bit for bit, and one on M ranks trains like the single-device oracle
given the same global batches, within the tolerances the course uses across world sizes.
"""

from __future__ import annotations

import random
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from autograder import recorded
from autograder.checks import Check, CheckFailed, describe_exception, graded
from autograder.harness import explain_failure, run_once
from autograder.integrity import REFERENCE_MODULES, answer_modules, require_own_code
from autograder.plain_data import count, is_int, is_number, well_formed
from autograder.records import decode_floats, encode_floats
from zero_core.checkpoint_files import STATES, rank_file, read_rank_file
from zero_core.cluster import VirtualCluster, one_torch_thread
from zero_core.context import current
from zero_core.model import build_model, parameter_layers, preset
from zero_core.partition import FlatPartition
from zero_core.registry import answer_module, stage_class
from zero_core.stages.base import TrainConfig

ASSIGNMENT = "ex10_sharded_checkpoints"
NAMES = ("save_shards", "consolidate", "load_into")
ANSWER_MODULES = answer_modules(
    ("zero_core.stages.zero0", "zero_core.stages.zero1", "zero_core.stages.zero2", "zero_core.stages.zero3",
     answer_module("ex03"), answer_module("ex04"))
)
"""Not loaded, and not loadable, where the student's code is graded (`autograder.sandbox`): ex10's answer and
the oracle. The stages, and the earlier exercises' answers they run, are the scaffolding that trains."""

STAGES = (1, 2, 3)
"""The stages whose ranks save; the resume on another world size reads ZeRO-3's files (the most sharded)."""
RESIZED_STAGES = (1, 3)
STEPS = 2
CONFIG = TrainConfig(model=preset("micro"))
FP32 = TrainConfig(model=preset("micro"), precision="fp32")
ORACLE_TOLERANCE = (1e-5, 1e-4)
"""tests/test_oracle.py's fp32 tolerances across world sizes: |Δ mean loss| and relative weight error."""
METADATA_BYTES = 8192
"""What a rank file may hold beyond its shards: names, shapes, ranges, step, and torch.save's zip records (the
reference's files hold about 2 KB of it)."""
PARAM_BYTES = {1: 0, 2: 0, 3: 2}
"""Per owned element, what a rank may save beyond its 12 bytes of fp32 master, m and v: ZeRO-3's low-precision
parameter shard (ZeRO-1/2 keep the parameters whole: the masters rounded give them back)."""
VISIBLE = {"world_sizes": [3, 4]}
"""Save on 3 ranks (where the micro GPT's layers need padding: 2,048 elements are not a multiple of 3), resume
on 3 and on 4."""
HIDDEN_CELL = {"world_sizes": [12, 5]}
"""Save on the first world size, resume on it and on the second. 12 ranks name files 10 and 11, which a plain
sort of the names puts before 2."""
HIDDEN_SAVE_SIZES = (11, 12, 13)
"""More than 10 ranks, so that there is a rank 10 (whose file a plain sort of the names puts before rank 2's)."""
HIDDEN_RESUME_SIZES = (2, 3, 5, 6, 7)


def draw_hidden(rng: random.Random) -> dict[str, Any]:
    """A world size to save on, one to resume on, and the seed of the values written into the files' copy."""
    return {"world_sizes": [rng.choice(HIDDEN_SAVE_SIZES), rng.choice(HIDDEN_RESUME_SIZES)],
            "seed": rng.randrange(1, 2**31)}


# -- the model's layers, from the course's code --------------------------------------------------------------


def layer_numels(config: TrainConfig = CONFIG) -> dict[str, int]:
    layers = parameter_layers(build_model(config.model))
    return {name: sum(p.numel() for p in module.parameters()) for name, module in layers}


def owned_ranges(world_size: int, rank: int) -> dict[str, tuple[int, int]]:
    """Per layer, [start, end) of its flat parameters that `rank` owns (`FlatPartition`: no padding)."""
    return {name: FlatPartition(numel, world_size).owned_range(rank) for name, numel in layer_numels().items()}


def owned_numel(world_size: int, rank: int) -> int:
    return sum(end - start for start, end in owned_ranges(world_size, rank).values())


def drawn_values(seed: int, state: str, layer: str, numel: int) -> torch.Tensor:
    """The values the course writes over a layer's `state` in the rewritten copy: the same in the child that
    writes them and in the judge that expects them back."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{state}:{layer}".encode()))
    return torch.randn(numel, generator=generator)


# -- observing, where the student's code runs ----------------------------------------------------------------


def _integrity(functions: dict[str, Any]) -> None:
    require_own_code(functions, NAMES, REFERENCE_MODULES + ("zero_core.oracle",), ASSIGNMENT)


def _save_on_rank(stage_number: int, config: TrainConfig, directory: str, save_shards: Callable) -> int:
    """Train `STEPS` steps, then save; returns what the rank's memory audit saw allocated while it saved."""
    stage = stage_class(stage_number)(config)
    for step in range(STEPS):
        stage.train_step(step, count_activations=False)
    tracker = current().tracker
    tracker.reset_peaks()
    held = tracker.current_bytes()
    with tracker.audit():
        save_shards(stage, stage.rank, directory)
    return tracker.peak_bytes() - held


def _resume_on_rank(stage_number: int, config: TrainConfig, state: Any, load_into: Callable) -> dict[str, Any]:
    """Load the consolidated `state` into a fresh stage, train `STEPS` more steps; the losses and the fp32
    masters of the rank's master range, read from the stage."""
    stage = stage_class(stage_number)(config)
    load_into(stage, state)
    losses = [stage.train_step(step, count_activations=False) for step in range(STEPS, 2 * STEPS)]
    masters = {layer.name: (*stage.master_range(layer), layer.master.master.detach().clone()) for layer in stage.layers}
    return {"losses": losses, "masters": masters}


def _attempt(what: str, make: Callable[[], Any]) -> Any:
    """`make()`, or {"error": why} when the student's code raised: one failing function costs its own parts."""
    try:
        return make()
    except CheckFailed as error:
        return {"error": str(error)}
    except Exception as error:  # the student's code: whatever it raises is the verdict's evidence
        return {"error": explain_failure(error, what)}


def _file_data(directory: Path, rank: int) -> dict[str, Any]:
    """What the course reads of rank `rank`'s file: its size, its step, and its master, m and v."""
    path = rank_file(directory, rank)
    if not path.is_file():
        return {"error": f"rank {rank} wrote no {path.name} (checkpoint_files.rank_file names it)"}
    try:
        checkpoint = read_rank_file(directory, rank)
    except Exception as error:
        return {"error": f"{path.name} cannot be read by torch.load(weights_only=True): {describe_exception(error, 0)}"}
    shards = checkpoint.get("shards") if isinstance(checkpoint, dict) else None
    if not isinstance(shards, dict) or not all(isinstance(shards.get(s), torch.Tensor) for s in STATES):
        return {"error": f"{path.name} holds no 'shards' dict with a tensor for each of {', '.join(STATES)}"}
    step = checkpoint.get("step")
    return {
        "bytes": path.stat().st_size,
        "step": int(step) if isinstance(step, int) else None,
        "shards": {s: [str(shards[s].dtype), list(shards[s].shape), encode_floats(shards[s].flatten())]
                   for s in STATES},
    }


def _state_data(state: Any, numels: dict[str, int]) -> dict[str, Any]:
    """A consolidated state as data: its step and each state's layers, or {"error": ...} for another shape."""
    if not isinstance(state, dict) or not is_int(state.get("step")):
        return {"error": "consolidate returned no dict with an int 'step'"}
    data: dict[str, Any] = {"step": state["step"]}
    for name in STATES:
        layers = state.get(name)
        if not isinstance(layers, dict) or set(layers) != set(numels):
            return {"error": f"the consolidated state's {name!r} is not a dict of the {len(numels)} layers"}
        for layer, values in layers.items():
            if not isinstance(values, torch.Tensor) or values.dtype != torch.float32 or values.numel() != numels[layer]:
                return {"error": f"the consolidated {name} of {layer} is not {numels[layer]} fp32 values"}
        data[name] = {layer: encode_floats(values.flatten()) for layer, values in layers.items()}
    return data


def rewrite_shards(source: Path, target: Path, world_size: int, seed: int) -> None:
    """Copy the rank files to `target` with master, m and v replaced by `drawn_values` at each rank's owned
    range; every other key the student wrote is kept as it is."""
    target.mkdir(parents=True)
    numels = layer_numels()
    for rank in range(world_size):
        checkpoint = read_rank_file(source, rank)
        ranges = owned_ranges(world_size, rank)
        for state in STATES:
            pieces = [drawn_values(seed, state, layer, numels[layer])[start:end]
                      for layer, (start, end) in ranges.items()]
            checkpoint["shards"][state] = torch.cat(pieces)
        torch.save(checkpoint, rank_file(target, rank))


def _resumed_data(results: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "losses": [[float(loss) for loss in rank["losses"]] for rank in results],
        "masters": [{name: [start, end, encode_floats(values)]
                     for name, (start, end, values) in rank["masters"].items()} for rank in results],
    }


def _observe_stage(functions: dict[str, Any], stage_number: int, world_size: int, seed: int, scratch: Path) -> dict:
    """Save on `world_size` ranks, consolidate the files and a rewritten copy, resume on the same ranks."""
    saved = scratch / f"zero{stage_number}_n{world_size}"
    saved.mkdir()
    growths = _attempt("save_shards", lambda: VirtualCluster(world_size).run(
        _save_on_rank, stage_number, CONFIG, str(saved), functions["save_shards"]))
    if isinstance(growths, dict):
        return growths
    observed: dict[str, Any] = {"growth": growths, "files": [_file_data(saved, r) for r in range(world_size)]}
    numels = layer_numels()
    state = _attempt("consolidate", lambda: functions["consolidate"](str(saved)))
    observed["consolidated"] = state if isinstance(state, dict) and "error" in state else _state_data(state, numels)
    if any("error" in f for f in observed["files"]):
        observed["rewritten"] = {"error": "not tried: the files are not what checkpoint_files asks for"}
    else:
        rewritten = scratch / f"rewritten_zero{stage_number}_n{world_size}"
        rewrite_shards(saved, rewritten, world_size, seed)
        again = _attempt("consolidate", lambda: functions["consolidate"](str(rewritten)))
        observed["rewritten"] = again if isinstance(again, dict) and "error" in again else _state_data(again, numels)
    if "error" in observed["consolidated"]:
        observed["resumed"] = {"error": "not tried: the consolidation failed"}
    else:
        results = _attempt("load_into", lambda: VirtualCluster(world_size).run(
            _resume_on_rank, stage_number, CONFIG, state, functions["load_into"]))
        observed["resumed"] = results if isinstance(results, dict) else _resumed_data(results)
    return observed


def _observe_resized(functions: dict[str, Any], world_size: int, new_world_size: int, scratch: Path) -> dict:
    """ZeRO-3 saves in fp32 on `world_size` ranks; the consolidation resumes on `new_world_size` ranks."""
    saved = scratch / f"fp32_zero3_n{world_size}"
    saved.mkdir()
    done = _attempt("save_shards", lambda: VirtualCluster(world_size).run(
        _save_on_rank, 3, FP32, str(saved), functions["save_shards"]))
    if isinstance(done, dict):
        return {stage: done for stage in map(str, RESIZED_STAGES)}
    state = _attempt("consolidate", lambda: functions["consolidate"](str(saved)))
    observed = {}
    for stage_number in RESIZED_STAGES:
        results = state if isinstance(state, dict) and "error" in state else _attempt(
            "load_into", lambda s=stage_number: VirtualCluster(new_world_size).run(
                _resume_on_rank, s, FP32, state, functions["load_into"]))
        observed[str(stage_number)] = results if isinstance(results, dict) else _resumed_data(results)
    return observed


def observe_checkpoints(*functions: Callable, world_sizes: list[int], seed: int = 0) -> dict[str, Any]:
    """Everything the checks judge, observed once per student and arguments (the checks share it)."""
    named = dict(zip(NAMES, functions, strict=True))
    _integrity(named)
    world_size, new_world_size = world_sizes

    def make() -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="ex10-") as scratch, one_torch_thread():
            return {
                "stages": {str(s): _observe_stage(named, s, world_size, seed, Path(scratch)) for s in STAGES},
                "resized": _observe_resized(named, world_size, new_world_size, Path(scratch)),
            }

    return run_once((ASSIGNMENT, tuple(map(id, functions)), world_size, new_world_size, seed), functions, make,
                    "saving, consolidating and resuming")


# -- the references, made where the student's code never runs ------------------------------------------------


def _zero0_on_rank(config: TrainConfig, steps: int) -> dict[str, Any]:
    stage = stage_class(0)(config)
    losses = [stage.train_step(step, count_activations=False) for step in range(steps)]
    full = {name: {layer.name: getattr(layer.master, name).clone() for layer in stage.layers} for name in STATES}
    return {"losses": losses, "step": stage.adam_steps, **full}


def _trajectory_to_data(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    return {"ranks": [{"losses": r["losses"], "step": r["step"],
                       **{s: {k: recorded.tensor_to_data(v) for k, v in r[s].items()} for s in STATES}} for r in ranks]}


def _trajectory_from_data(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"losses": r["losses"], "step": r["step"],
             **{s: {k: recorded.tensor_from_data(v) for k, v in r[s].items()} for s in STATES}} for r in data["ranks"]]


def zero0_trajectory(world_size: int, steps: int, config: TrainConfig = CONFIG) -> list[dict[str, Any]]:
    """Per rank, ZeRO-0's losses, and its full fp32 masters, m, v and step after `steps` steps (rank 0's are the
    full state every stage's ranks hold between them, bit for bit)."""
    key = (world_size, steps, config.precision)

    def make() -> list[dict[str, Any]]:
        with one_torch_thread():  # as the grading child runs (`OMP_NUM_THREADS=1`): the same bits
            return VirtualCluster(world_size).run(_zero0_on_rank, config, steps)

    return recorded.outcome("ex10_zero0", key, make, _trajectory_to_data, _trajectory_from_data)


def oracle_resumed(world_size: int, new_world_size: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-device oracle's losses and weights, `STEPS` steps on from ZeRO-0's fp32 state after `STEPS`
    steps on `world_size` ranks, on the global batches of `new_world_size` ranks."""

    def make() -> tuple[list[float], dict[str, torch.Tensor]]:
        from zero_core.oracle import resume_single_device  # the parent's only: off limits where students' code runs

        state = zero0_trajectory(world_size, STEPS, FP32)[0]
        return resume_single_device(FP32, state, new_world_size, STEPS, STEPS)

    return recorded.outcome(
        "ex10_oracle", (world_size, new_world_size), make,
        lambda o: {"losses": o[0], "weights": {k: recorded.tensor_to_data(v) for k, v in o[1].items()}},
        lambda d: (d["losses"], {k: recorded.tensor_from_data(v) for k, v in d["weights"].items()}))


# -- judging ---------------------------------------------------------------------------------------------------


def _part(observation: Any, *keys: str) -> Any:
    """observation[keys...], or `ObservationInvalid` where the data is not what `observe_checkpoints` makes; a
    part the student's code failed to make is `CheckFailed` with its message."""
    value = observation
    for key in keys:
        well_formed(isinstance(value, dict) and key in value, f"the observation has no {'/'.join(keys)}")
        value = value[key]
        if isinstance(value, dict) and "error" in value:
            well_formed(isinstance(value["error"], str), "an error that is not text")
            raise CheckFailed(value["error"])
    return value


def _differing(state: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    """`CheckFailed` naming the first state and layers that are not bit for bit the expected ones."""
    well_formed(isinstance(state, dict) and is_int(state.get("step")) and all(
        isinstance(state.get(name), dict) and set(state[name]) == set(expected[name]) for name in STATES),
        f"{what}: the state's step and layers")
    if state["step"] != expected["step"]:
        raise CheckFailed(f"{what} says step {state['step']}; ZeRO-0 took {expected['step']} steps. Adam's bias "
                          "correction divides by 1 - beta^t: the step is part of the state")
    for name in STATES:
        wrong = [layer for layer, values in expected[name].items()
                 if not torch.equal(decode_floats(state[name][layer], values.numel(), what), values.flatten())]
        if wrong:
            raise CheckFailed(f"{what}: {name} of {', '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''} is not "
                              "ZeRO-0's, bit for bit. Are the ranks' pieces put back at the ranges they own, "
                              "in rank order (rank 10 after rank 9), without padding?")


def judge_files(observation: Any, world_sizes: list[int], seed: int = 0) -> str:
    """Each rank's file: its master, m and v are its owned elements of ZeRO-0's, fp32, in layer order, no padding;
    the step; and no more bytes on disk than those shards and a little metadata."""
    n = world_sizes[0]
    expected = zero0_trajectory(n, STEPS)[0]
    for stage in STAGES:
        files = _part(observation, "stages", str(stage), "files")
        well_formed(isinstance(files, list) and len(files) == n, "not one file per rank")
        for rank, data in enumerate(files):
            well_formed(isinstance(data, dict), "a file's data")
            if "error" in data:
                raise CheckFailed(f"ZeRO-{stage} on {n} ranks: {data['error']}")
            ranges = owned_ranges(n, rank)
            owned = sum(end - start for start, end in ranges.values())
            label = f"ZeRO-{stage} on {n} ranks, rank {rank}'s file"
            if data.get("step") != expected["step"]:
                raise CheckFailed(f"{label} says step {data.get('step')!r}; the rank took {expected['step']} steps")
            for name in STATES:
                well_formed(isinstance(data.get("shards"), dict) and isinstance(data["shards"].get(name), list)
                            and len(data["shards"][name]) == 3, f"{label}: its shards")
                dtype, shape, values = data["shards"][name]
                if dtype != "torch.float32" or shape != [owned]:
                    raise CheckFailed(f"{label}: shards[{name!r}] is {dtype} of shape {shape}; it should be the "
                                      f"{owned} fp32 elements the rank owns (padding is not saved)")
                want = torch.cat([expected[name][layer][start:end] for layer, (start, end) in ranges.items()])
                if not torch.equal(decode_floats(values, owned, label), want):
                    raise CheckFailed(f"{label}: shards[{name!r}] is not the rank's own {name}, layer by layer in "
                                      "model order")
            allowed = owned * (12 + PARAM_BYTES[stage]) + METADATA_BYTES
            written = count(data["bytes"], f"{label}'s size")
            if written > allowed:
                raise CheckFailed(f"{label} is {written:,} bytes; its shards are {owned * 12:,} (fp32 master, m, v of "
                                  f"{owned:,} elements) and at most {allowed:,} is expected. torch.save writes a "
                                  "view's whole storage: save a copy of the owned part, not a slice of a bigger buffer")
    return f"ZeRO-1/2/3 on {n} ranks: every rank file holds its own unpadded fp32 shards and the step"


def judge_memory(observation: Any, world_sizes: list[int], seed: int = 0) -> str:
    """While saving, a rank's audit sees at most its shards (master, m, v and ZeRO-3's parameter shard) plus one
    layer's fp32 values: no rank builds the full state."""
    n = world_sizes[0]
    largest = 4 * max(layer_numels().values())
    for stage in STAGES:
        growths = _part(observation, "stages", str(stage), "growth")
        well_formed(isinstance(growths, list) and len(growths) == n, "not one memory figure per rank")
        for rank, growth in enumerate(growths):
            bound = owned_numel(n, rank) * (12 + PARAM_BYTES[stage]) + largest
            if count(growth, "a memory figure") > bound:
                raise CheckFailed(f"ZeRO-{stage} on {n} ranks: rank {rank} allocated {growth:,} bytes while saving; "
                                  f"its shards and one layer's fp32 values are {bound:,}. Save the owned elements "
                                  "only: no full-size tensor on a rank")
    return f"on {n} ranks, saving allocated no more than each rank's shards plus one layer"


def judge_consolidation(observation: Any, world_sizes: list[int], seed: int = 0) -> str:
    """`consolidate` gives ZeRO-0's full fp32 state bit for bit from every stage's files, and gives back the
    values the course wrote into a copy of them."""
    n = world_sizes[0]
    expected = zero0_trajectory(n, STEPS)[0]
    numels = layer_numels()
    drawn = {"step": expected["step"]} | {
        s: {layer: drawn_values(seed, s, layer, numel) for layer, numel in numels.items()} for s in STATES}
    for stage in STAGES:
        _differing(_part(observation, "stages", str(stage), "consolidated"), expected,
                   f"consolidate of ZeRO-{stage}'s {n} rank files")
        _differing(_part(observation, "stages", str(stage), "rewritten"), drawn,
                   f"consolidate of ZeRO-{stage}'s files with new values written into their shards (it must read "
                   "them from the files)")
    return f"ZeRO-1/2/3's files from {n} ranks consolidate to ZeRO-0's fp32 masters, m, v and step, bit for bit"


def _assembled(masters: list[dict[str, Any]], numels: dict[str, int], what: str) -> dict[str, torch.Tensor]:
    """The full masters from each rank's [start, end, values] per layer (ZeRO-0's ranks each hold all)."""
    full = {layer: torch.full((numel,), float("nan")) for layer, numel in numels.items()}
    well_formed(isinstance(masters, list), f"{what}: the masters")
    for rank in masters:
        well_formed(isinstance(rank, dict) and set(rank) == set(numels), f"{what}: not every layer")
        for layer, entry in rank.items():
            well_formed(isinstance(entry, list) and len(entry) == 3, f"{what}: a layer's masters")
            start, end, values = entry
            well_formed(is_int(start) and is_int(end) and 0 <= start <= end <= numels[layer], f"{what}: a range")
            full[layer][start:end] = decode_floats(values, end - start, what)
    return full


def _losses(resumed: Any, ranks: int, what: str) -> list[list[float]]:
    """Each rank's `STEPS` resumed losses, as numbers; `ObservationInvalid` for anything else."""
    losses = resumed.get("losses") if isinstance(resumed, dict) else None
    well_formed(isinstance(losses, list) and len(losses) == ranks, f"{what}: not one list of losses per rank")
    for rank in losses:
        well_formed(isinstance(rank, list) and len(rank) == STEPS and all(is_number(x) for x in rank),
                    f"{what}: a rank's losses are not {STEPS} numbers")
    return losses


def judge_resume(observation: Any, world_sizes: list[int], seed: int = 0) -> str:
    """Resumed on the same ranks: losses and masters bit for bit the run that never stopped. Resumed on M ranks
    in fp32: the single-device oracle's losses and weights, within the course's tolerances across world sizes."""
    n, m = world_sizes
    numels = layer_numels()
    whole = zero0_trajectory(n, 2 * STEPS)
    for stage in STAGES:
        resumed = _part(observation, "stages", str(stage), "resumed")
        what = f"ZeRO-{stage} resumed on {n} ranks"
        for rank, losses in enumerate(_losses(resumed, n, what)):
            if losses != whole[rank]["losses"][STEPS:]:
                raise CheckFailed(f"{what}: rank {rank}'s losses {losses} are not those of the run that never stopped "
                                  f"({whole[rank]['losses'][STEPS:]}). Does load_into give every rank its masters, m, "
                                  "v, the step, and refresh the low-precision parameters from the masters?")
        masters = _assembled(resumed.get("masters"), numels, what)
        wrong = [layer for layer, values in masters.items() if not torch.equal(values, whole[0]["master"][layer])]
        if wrong:
            raise CheckFailed(f"{what}: the masters of {', '.join(wrong[:3])} differ from the run that never stopped")
    oracle_losses, oracle_weights = oracle_resumed(n, m)
    loss_tolerance, weight_tolerance = ORACLE_TOLERANCE
    for stage in RESIZED_STAGES:
        resumed = _part(observation, "resized", str(stage))
        what = f"ZeRO-3's fp32 files from {n} ranks resumed as ZeRO-{stage} on {m} ranks"
        mean = [sum(step) / m for step in zip(*_losses(resumed, m, what), strict=True)]
        gap = max(abs(a - b) for a, b in zip(mean, oracle_losses, strict=True))
        masters = _assembled(resumed.get("masters"), numels, what)
        error = max(((oracle_weights[k] - w).norm() / oracle_weights[k].norm()).item() for k, w in masters.items())
        if not (gap < loss_tolerance and error < weight_tolerance):
            raise CheckFailed(f"{what}: |Δ loss| {gap:.2e} and relative weight error {error:.2e} from the "
                              f"single-device oracle (at most {loss_tolerance:g} and {weight_tolerance:g}). Does "
                              "load_into cut the full state at the new world size's ranges?")
    return f"resumed on {n} ranks bit for bit, and on {m} ranks as the single-device oracle trains"


def judge_everything(observation: Any, world_sizes: list[int], seed: int = 0) -> str:
    for judge in (judge_files, judge_memory, judge_consolidation, judge_resume):
        judge(observation, world_sizes, seed)
    return (f"saved on {world_sizes[0]} ranks, consolidated, and resumed on {world_sizes[0]} ranks and on "
            f"{world_sizes[1]} ranks")


check_files = graded("check_files", observe_checkpoints, judge_files)
check_memory = graded("check_memory", observe_checkpoints, judge_memory)
check_consolidation = graded("check_consolidation", observe_checkpoints, judge_consolidation)
check_resume = graded("check_resume", observe_checkpoints, judge_resume)
check_everything = graded("check_everything", observe_checkpoints, judge_everything)

CHECKS = (
    Check("test_files", 2, check_files, NAMES, VISIBLE),
    Check("test_memory", 2, check_memory, NAMES, VISIBLE),
    Check("test_consolidation", 2, check_consolidation, NAMES, VISIBLE),
    Check("test_resume", 2, check_resume, NAMES, VISIBLE),
    Check("test_hidden", 2, check_everything, NAMES, HIDDEN_CELL, hidden=True, draw=draw_hidden),
)

