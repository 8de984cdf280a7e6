"""ex09: the two-level all-gather of a ZeRO-3 layer, across nodes on 1/G of it, then inside the node.

The student writes `hierarchical_all_gather(output, shard, node_group, cross_group)`, which
`HierarchicalZero3` (zero_core/variants/hierarchical.py) calls for every layer's gather, in forward and
in backward. The checks train the stage with it on N ranks in nodes of G (`GPUS_PER_NODE` for the visible
checks, drawn at grading time for the hidden ones: `draw_world_sizes`, `draw_gpus_per_node`) and judge,
each from what the course's code observed, never from what the student's code reports:

- values: the training, within the fp32 oracle's rounding (bit-identical to ZeRO-3's: gathers copy);
- memory: per gather, what the rank's memory audit saw alive beyond the gathered layer while the function
  ran (at most one staging buffer of Ψ_layer/G) and once it returned (nothing), and nothing left after a pass;
- communication: from the ledger, with each collective's group: the stage's reduce-scatters as the
  reference's; no gather collective over all N ranks; per rank and step, the gathers' bytes split by link
  (`zero_core.topology`, each collective a ring over its group's ranks) exactly the hierarchical closed
  forms, 2·Σ(M-1)/M·Ψ_layer/G across nodes and 2·Σ(G-1)/G·Ψ_layer inside them.

The ledger's groups and the shards' measurements are not part of `records.Run`: the runs here are made by
`train_linked`, which returns them beside the run, and they travel to the judge as data it validates.
"""

from __future__ import annotations

import functools
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from autograder import recorded
from autograder.checks import Check, CheckFailed
from autograder.harness import (
    CONFIG,
    STEPS,
    GradedStage,
    layer_partitions,
    run_once,
    train_observed,
)
from autograder.integrity import answer_modules, require_own_code
from autograder.plain_data import ADDRESS_SPACE_BYTES, count, is_int, require, well_formed
from autograder.records import Run, element_size, require_course_records, run_from_data, run_to_data
from autograder.stage_checks import GradedRun, Setting, StageExercise, observed_entries, observed_runs
from autograder.verdicts import check_nothing_left_behind, check_own_collectives, check_released
from zero_core import comm, memory
from zero_core.registry import answer_module
from zero_core.stages.base import OVERFLOW_TAG, TrainConfig, layer_tag
from zero_core.topology import RING, Topology, link_bytes
from zero_core.variants.hierarchical import GATHER_CALLS, GatherCall, HierarchicalZero3

ASSIGNMENT = "ex09_hierarchical_allgather"
ANSWER_MODULES = answer_modules(
    ("zero_core.stages.zero1", "zero_core.stages.zero2", "zero_core.stages.zero3", answer_module("ex04"))
)
"""Not loaded, and not loadable, where the student's code is graded (`autograder.sandbox`). ZeRO-3's layer
Functions are ex04's answer, due before this exercise: here they are the scaffolding."""

GPUS_PER_NODE = {4: 2, 6: 3, 8: 4, 9: 3}
"""G per world size of a check that sets none: 2 nodes of 2 and of 3 on the visible sizes (and 2 nodes of 4
and 3 nodes of 3 on the sizes of the solution notebook's hidden cells). 6 and 9 ranks need padding."""
VISIBLE_WORLD_SIZES, HIDDEN_CELL_WORLD_SIZES = [4, 6], [8, 9]
HIDDEN_WORLD_SIZES = (6, 8, 9, 10)
"""A hidden check's N: two of these (8 and 9 before), each in at least 2 nodes of at least 2 GPUs."""
GATHERED_ELEMENT_BYTES = 2
"""The memory and communication checks train in bf16 (`harness.CONFIG`)."""
PHASES = ("forward", "backward")


def gpus_per_node(world_size: int) -> int:
    """G on `world_size` ranks for a check that sets none."""
    if world_size not in GPUS_PER_NODE:
        raise CheckFailed(f"{ASSIGNMENT} is checked on {sorted(GPUS_PER_NODE)} ranks, not {world_size}")
    return GPUS_PER_NODE[world_size]


def node_shapes(world_size: int) -> list[int]:
    """The G a hidden check may draw on N ranks: M = N/G nodes of G, both at least 2, so both levels gather."""
    return [g for g in range(2, world_size // 2 + 1) if world_size % g == 0]


def draw_world_sizes(rng: random.Random) -> list[int]:
    return sorted(rng.sample(HIDDEN_WORLD_SIZES, 2))


def draw_gpus_per_node(rng: random.Random, world_size: int) -> int:
    return rng.choice(node_shapes(world_size))


def hierarchical_options(world_size: int, dtype: torch.dtype, g: int | None) -> dict[str, Any]:
    """Nodes of `g` ranks (None: `gpus_per_node` of the world size)."""
    return {"gpus_per_node": g or gpus_per_node(world_size)}


GRADED = GradedStage(HierarchicalZero3, ASSIGNMENT, per_rank=hierarchical_options)
"""The hierarchical ZeRO-3, recorded, in the check's nodes."""


def _build(function: Any) -> tuple[GradedStage, None]:
    """The graded stage whose layers gather with the student's `hierarchical_all_gather`."""
    return GRADED.with_options(all_gather=function), None


# -- runs with their links, made where the student's code runs ---------------------------------------------


@dataclass(frozen=True)
class Links:
    """Per rank, what `records.Run` leaves out: each collective's (group, broadcast source), in ledger order,
    and each gather as the shard measured it (`GatherCall`)."""

    groups: list[list[tuple[tuple[int, ...], int]]]
    gathers: list[list[GatherCall]]


def train_linked(graded: GradedStage, world_size: int, config: TrainConfig = CONFIG) -> tuple[Run, Links]:
    """`harness.train`, keeping the ledger's groups and the shards' gather measurements."""
    run, ledger, observed = train_observed(graded, world_size, config=config, observed=(GATHER_CALLS,))
    groups = [[(e.group, e.src) for e in ledger.entries(rank)] for rank in range(world_size)]
    return run, Links(groups, [observations[GATHER_CALLS] for observations in observed])


def links_to_data(links: Links) -> dict[str, Any]:
    return {
        "groups": [[[list(group), src] for group, src in rank] for rank in links.groups],
        "gathers": [[list(call) for call in rank] for rank in links.gathers],
    }


def _ints(values: Any) -> bool:
    return isinstance(values, list) and all(is_int(v) for v in values)


def links_from_data(data: Any, run: Run) -> Links:
    """The `Links` that `links_to_data` wrote for `run`; `ObservationInvalid` for anything else, or anything
    no run makes: per rank a group for each collective, and a measurement of each gather of each layer in
    each pass of each step, once, none holding negative or impossibly many bytes."""
    n, layers = run.world_size, list(run.partitions)
    well_formed(isinstance(data, dict) and set(data) == {"groups", "gathers"}, "links")
    well_formed(isinstance(data["groups"], list) and len(data["groups"]) == n, "groups per rank")
    well_formed(isinstance(data["gathers"], list) and len(data["gathers"]) == n, "gathers per rank")
    every_gather = Counter((layer, step, phase) for layer in layers for step in range(STEPS) for phase in PHASES)
    groups, gathers = [], []
    for rank in range(n):
        entries = data["groups"][rank]
        well_formed(isinstance(entries, list) and len(entries) == len(run.collectives[rank]), f"rank {rank}'s groups")
        for entry in entries:
            well_formed(isinstance(entry, list) and len(entry) == 2 and _ints(entry[0]) and _ints(entry[1:]), "a group")
            group, src = entry
            well_formed(group == sorted(set(group)) and all(0 <= r < n for r in group), "a group's ranks")
            well_formed((not group or rank in group) and 0 <= src < n, "a group's ranks")
        groups.append([(tuple(group), src) for group, src in entries])
        calls = data["gathers"][rank]
        well_formed(isinstance(calls, list) and len(calls) == sum(every_gather.values()), f"rank {rank}'s gathers")
        for call in calls:
            well_formed(isinstance(call, list) and len(call) == 5 and is_int(call[1]), "a gather")
            well_formed(call[0] in layers and 0 <= call[1] < STEPS and call[2] in PHASES, "a gather's layer")
            for index, what in ((3, "alive beside the layer"), (4, "left alive after it")):
                count(call[index], f"rank {rank}'s gather of {call[0]}: bytes {what}", high=ADDRESS_SPACE_BYTES)
        require(
            Counter((call[0], call[1], call[2]) for call in calls) == every_gather,
            f"rank {rank}'s gathers are not one of each layer in each pass of each step",
        )
        gathers.append([GatherCall(*call) for call in calls])
    return Links(groups, gathers)


# -- the judge's rules ---------------------------------------------------------------------------------------


def _is_stage_collective(tag: str, run: Run) -> bool:
    """The stage's own collectives: the gradient reduce-scatters and the loss scaler's flag; the rest gather."""
    return tag == OVERFLOW_TAG or tag in {layer_tag("grad", layer) for layer in run.partitions}


STAGING_ADVICE = (
    "At most one staging buffer of Ψ_layer/G elements (the 1/G of the layer a rank gathers across nodes) may be "
    "alive at once beside `output`: no full-size buffer, no second staging, no copy of the layer (reshape of a "
    "transposed view, contiguous(), cat, clone) to put blocks in order. Write each block where it belongs."
)


def check_staging(run: Run, links: Links, label: str, g: int) -> None:
    """Every gather: at most one Ψ_layer/G staging buffer alive beside `output` while it runs, none after."""
    for rank, calls in enumerate(links.gathers):
        for call in calls:
            bound = run.partitions[call.layer].padded_numel // g * GATHERED_ELEMENT_BYTES
            where = f"{label}: on rank {rank}, the {call.phase} gather of {call.layer} at step {call.step}"
            if call.transient_bytes > bound:
                raise CheckFailed(
                    f"{where}: while your function ran, the rank's memory audit saw {call.transient_bytes:,} bytes "
                    f"alive beside the gathered layer; one staging buffer of Ψ_layer/G is {bound:,} bytes. "
                    f"{STAGING_ADVICE}"
                )
            if call.left_bytes > 0:
                raise CheckFailed(
                    f"{where}: {call.left_bytes:,} bytes your function allocated were still alive after it returned. "
                    "Keep no reference to the staging buffer (no global, attribute or cache to reuse it): "
                    "the audit counts a buffer until nothing references it."
                )


def check_stage_collectives(run: Run, links: Links, reference: Run, reference_links: Links, label: str) -> None:
    """The collectives the stage makes (the gradients' reduce-scatters) are the reference's, group and all."""
    for rank in range(run.world_size):
        got, want = (
            Counter(
                (c.step, c.op, c.dtype, c.elements, group)
                for c, (group, _) in zip(r.collectives[rank], ls.groups[rank], strict=True)
                if _is_stage_collective(c.tag, r)
            )
            for r, ls in ((run, links), (reference, reference_links))
        )
        if got != want:
            raise CheckFailed(
                f"{label}: rank {rank}'s collectives tagged as the stage's gradient reduce-scatters differ from the "
                f"reference's ({sum(got.values())} against {sum(want.values())}). Leave the tags `grad <layer>` to "
                "the stage, and make only the gather's collectives."
            )


def expected_gather_bytes(run: Run, g: int) -> tuple[int, int]:
    """(inter-node, intra-node) bytes every rank sends per step in two hierarchical gathers of every layer
    in nodes of G: (M-1)·c and (G-1)·M·c per layer and gather, c its chunk (`topology.pass_split`)."""
    m = run.world_size // g
    chunks = sum(p.chunk_numel for p in run.partitions.values()) * GATHERED_ELEMENT_BYTES * len(PHASES)
    return (m - 1) * chunks, (g - 1) * m * chunks


def check_gather_links(run: Run, links: Links, label: str, g: int) -> None:
    """No gather collective over every rank; each rank's gather bytes per step, by link, the closed forms."""
    n = run.world_size
    topology = Topology(n, g)
    inter_want, intra_want = expected_gather_bytes(run, g)
    for step in range(run.steps):
        for rank in range(n):
            inter = intra = 0
            for c, (group, src) in zip(run.collectives[rank], links.groups[rank], strict=True):
                if c.step != step or _is_stage_collective(c.tag, run):
                    continue
                if len(group or range(n)) == n and c.op != comm.BARRIER:
                    raise CheckFailed(
                        f"{label}: at step {step}, rank {rank} made an {c.op} of {c.elements:,} elements over all {n} "
                        f"ranks: a flat collective, whose ring crosses from one rank of each node to the next node. "
                        "Run the gather in two levels: across nodes in cross_group, then inside the node in node_group."
                    )
                size = element_size(c.dtype, label)
                traffic = link_bytes(c.op, c.elements * size, size, topology, rank, RING, src, group=group)
                inter, intra = inter + int(traffic.inter_node_sent), intra + int(traffic.intra_node_sent)
            if (inter, intra) != (inter_want, intra_want):
                raise CheckFailed(
                    f"{label}: at step {step}, rank {rank}'s gathers sent {inter:,} bytes across nodes and {intra:,} "
                    f"inside its node ({n} ranks in {n // g} nodes of {g}, each collective a ring over its group). "
                    f"Two hierarchical gathers of every layer send {inter_want:,} across ((M-1)/M·Ψ_layer/G per "
                    f"gather) and {intra_want:,} inside ((G-1)/G·Ψ_layer). Gather across nodes first, among the ranks "
                    "with your local index (cross_group), only your own chunk; then inside the node; nothing twice."
                )


# -- the exercise ------------------------------------------------------------------------------------------


class LinkedStageExercise(StageExercise):
    """A `StageExercise` whose runs carry their `Links`, and whose memory and communication are judged on them."""

    def observe(
        self, *objects: Any, world_sizes: list[int], config: TrainConfig = CONFIG, **given: Any
    ) -> dict[str, Any]:
        require_own_code(dict(zip(self.names, objects, strict=True)), self.names, self.forbidden, self.exercise)
        stage, _ = self.build(*objects)
        settings = self.settings(world_sizes, given)

        def entry(n: int) -> dict[str, Any]:
            make = lambda: train_linked(self.configured(stage, settings[n]), n, config)  # noqa: E731
            key = (self.exercise, objects, n, config.precision, settings[n])
            run, links = run_once(key, objects, make, f"your code on {self.label(n, settings[n])}")
            return {"run": run_to_data(run), "links": links_to_data(links)}

        return observed_runs(world_sizes, entry)

    def linked_runs(self, observation: Any, world_sizes: list[int], config: TrainConfig = CONFIG, **given: Any) -> Any:
        """(label, (run, links), (reference, its links), G) per world size, validated; CheckFailed for a
        failed run."""
        settings = self.settings(world_sizes, given)
        for n, entry in observed_entries(observation, world_sizes, {"run", "links"}):
            run = run_from_data(entry["run"], n, STEPS, layer_partitions(n))
            links = links_from_data(entry["links"], run)
            check_own_collectives(run, self.reference_tags(), self.exercise)
            g = settings[n]
            reference = self.linked_reference(n, g, config)
            require_course_records(run, reference[0])
            yield self.label(n, g), (run, links), reference, g

    def linked_reference(self, n: int, g: int, config: TrainConfig) -> tuple[Run, Links]:
        """The reference run on `n` ranks in nodes of `g`, with its links, made once per process (`run_once`)."""
        key = (self.exercise, "reference", n, config.precision, g)
        make = functools.partial(self.linked_reference_run, key, n, g, config)
        return run_once(key, (), make, f"reference on {n}")

    def reference_for(self, n: int, setting: Any, config: TrainConfig) -> Run:
        """The reference run (`prepare` makes it): its links are made and kept with it."""
        return self.linked_reference(n, setting, config)[0]

    def linked_reference_run(self, key: Any, n: int, g: int, config: TrainConfig) -> tuple[Run, Links]:
        """The reference trained on `n` ranks in nodes of `g`, with its links: made here, or read from a
        student release's record (`autograder.recorded`)."""

        def make() -> tuple[Run, Links]:
            return train_linked(self.configured(self.reference_stage, g), n, config)

        def decode(data: dict[str, Any]) -> tuple[Run, Links]:
            run = run_from_data(data["run"], n, STEPS, layer_partitions(n))
            return run, links_from_data(data["links"], run)

        encode = lambda linked: {"run": run_to_data(linked[0]), "links": links_to_data(linked[1])}  # noqa: E731
        return recorded.outcome("linked run", key, make, encode, decode)

    def runs(self, observation: Any, world_sizes: list[int], config: TrainConfig = CONFIG, **given: Any) -> Any:
        for label, (run, _), (reference, _), g in self.linked_runs(observation, world_sizes, config, **given):
            yield GradedRun(label, run, reference, g)

    def judge_memory(self, observation: Any, world_sizes: list[int], **given: Any) -> str:
        for label, (run, links), (reference, _), g in self.linked_runs(observation, world_sizes, **given):
            check_staging(run, links, label, g)
            self.memory_rules(run, reference, label)
            check_nothing_left_behind(run, label)
        return f"{self.sizes(world_sizes, **given)}: {self.memory_summary}; nothing left alive after a pass"

    def judge_communication(self, observation: Any, world_sizes: list[int], **given: Any) -> str:
        linked = self.linked_runs(observation, world_sizes, **given)
        for label, (run, links), (reference, reference_links), g in linked:
            check_stage_collectives(run, links, reference, reference_links, label)
            check_gather_links(run, links, label, g)
        return f"{self.sizes(world_sizes, **given)}: {self.communication_summary}"


def gathered_memory_rules(run: Run, reference: Run, label: str) -> None:
    check_released(
        run, memory.GATHER, label, "The stage frees the gathered layer after it computes: keep no view of `output`."
    )


EXERCISE = LinkedStageExercise(
    exercise=ASSIGNMENT,
    names=("hierarchical_all_gather",),
    reference="autograder.ex09:GRADED",
    students_collectives=tuple(("param", kind) for kind in (nn.Linear, nn.Embedding, nn.LayerNorm)),
    build=_build,
    memory_rules=gathered_memory_rules,
    memory_summary="at most one staging buffer of Ψ_layer/G alive during each gather, none after it returns",
    communication_summary="no gather collective over all ranks; per rank, (M-1)/M·Ψ_layer/G across nodes and "
    "(G-1)/G·Ψ_layer inside them per gather; the reduce-scatters as the reference's",
    setting=Setting(
        "gpus_per_node",
        default=gpus_per_node,
        draw=draw_gpus_per_node,
        describe=lambda g: f"nodes of {g}",
    ),
    hidden_world_sizes=draw_world_sizes,
)

check_training = EXERCISE.check_training
check_memory = EXERCISE.check_memory
check_communication = EXERCISE.check_communication
check_memory_and_communication = EXERCISE.check_memory_and_communication

NAMES = EXERCISE.names
_VISIBLE, _HIDDEN = {"world_sizes": VISIBLE_WORLD_SIZES}, {"world_sizes": HIDDEN_CELL_WORLD_SIZES}
CHECKS = (
    Check("test_training", 2, check_training, NAMES, _VISIBLE),
    Check("test_memory", 2, check_memory, NAMES, _VISIBLE),
    Check("test_communication", 2, check_communication, NAMES, _VISIBLE),
    Check("test_hidden_training", 2, check_training, NAMES, _HIDDEN, True, EXERCISE.draw),
    Check("test_hidden_memory_communication", 2, check_memory_and_communication, NAMES, _HIDDEN, True, EXERCISE.draw),
)
