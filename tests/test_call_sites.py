"""Deadlocks a learner can read: when ranks take different paths, the cluster's message names the line of
code each waiting rank called its collective from (`zero_core.call_sites`), for the three kinds of
divergence users of DeepSpeed and FSDP report: a rank that skips a module, a data-dependent early exit, and
a loop whose length depends on the rank; and a timeout names where a stuck rank is."""

from __future__ import annotations

import inspect
import re
import time
from pathlib import Path

import pytest
import torch

from zero_core import dist, divergent_ranks
from zero_core.cluster import CollectiveDeadlock, CollectiveMismatch, CollectiveTimeout, VirtualCluster
from zero_core.model import preset
from zero_core.stages import TrainConfig, Zero3

HERE = f"tests/{Path(__file__).name}"


def line_of(function, text: str) -> str:
    """`file:line` of the line of `function` that holds `text` (this file's functions only)."""
    lines, first = inspect.getsourcelines(function)
    (offset,) = [i for i, line in enumerate(lines) if text in line]
    return f"{HERE}:{first + offset} in {function.__name__}"


def skips_a_module() -> None:
    t = torch.ones(4)
    if dist.get_rank() != 1:
        dist.all_reduce(t, tag="layer 0")  # rank 1 skips this layer's collective
    dist.all_gather_single(torch.empty(4 * dist.get_world_size()), t, tag="layer 1")


def exits_early_on_its_data() -> None:
    t = torch.ones(4)
    if dist.get_rank() == 2:  # say, its batch held no tokens to learn from
        return
    dist.all_reduce(t, tag="grad")


def loops_once_per_rank() -> None:
    t = torch.ones(4)
    for _ in range(dist.get_rank() + 1):
        dist.all_reduce(t, tag="micro-batch")


def is_stuck_in_its_own_code() -> None:
    t = torch.ones(4)
    if dist.get_rank() == 1:
        time.sleep(1)
    dist.all_reduce(t, tag="grad")


def run(function, world_size: int = 4, timeout_s: float = 10.0) -> str:
    with pytest.raises((CollectiveMismatch, CollectiveDeadlock, CollectiveTimeout)) as raised:
        VirtualCluster(world_size, timeout_s=timeout_s).run(function)
    return str(raised.value)


def test_a_rank_that_skips_a_module_is_named_with_the_line_each_rank_called_from() -> None:
    message = run(skips_a_module)  # whichever ranks meet first, one is rank 1 and one another
    assert "collective mismatch" in message
    assert f"rank 1 called it at {line_of(skips_a_module, 'all_gather_single')}" in message, message
    assert re.search(rf"rank [023] called it at {re.escape(line_of(skips_a_module, 'dist.all_reduce'))}", message), (
        message
    )


def test_an_early_exit_names_the_line_the_others_wait_at() -> None:
    message = run(exits_early_on_its_data)
    assert message.startswith("rank 2 returned without calling all_reduce #0 tag='grad'"), message
    # the ranks that had arrived when rank 2 returned: rank 0 alone, or more, whichever threads ran first
    waiting = re.escape(line_of(exits_early_on_its_data, "dist.all_reduce"))
    assert re.search(rf"\n  ranks? [0-3][0-3, -]* called it at {waiting}", message), message


def test_a_loop_whose_length_depends_on_the_rank_names_the_line_in_the_loop() -> None:
    message = run(loops_once_per_rank)
    assert "returned without calling all_reduce" in message, message
    assert f"called it at {line_of(loops_once_per_rank, 'dist.all_reduce')}" in message, message


def test_a_timeout_says_where_the_waiting_ranks_called_and_where_the_stuck_rank_is() -> None:
    message = run(is_stuck_in_its_own_code, world_size=3, timeout_s=0.3)
    waiting = line_of(is_stuck_in_its_own_code, "dist.all_reduce")
    assert f"rank 0: waiting in all_reduce #0 tag='grad' float32 [4] op=SUM, called at {waiting}" in message, message
    stuck = line_of(is_stuck_in_its_own_code, "sleep")
    assert f"rank 1: running its own code after 0 collective(s), now at {stuck}" in message, message


def test_a_zero3_rank_that_skips_a_layer_is_named_at_the_stage_s_gather_and_the_function_that_called_it() -> None:
    """Under ZeRO-3 the collective is the stage's (`LayerShard.gather_parameters`); the message names that
    line and the layer's Function that called it, two frames outside the collectives' code."""
    config = TrainConfig(model=preset("micro"))

    def forward() -> None:
        stage = Zero3(config)
        if dist.get_rank() == 1:
            stage.model.ln_f = torch.nn.Identity()  # rank 1's model skips the last LayerNorm's gather
        inputs = torch.zeros(1, 4, dtype=torch.long)
        stage.model(inputs)

    message = run(forward, world_size=2)
    assert "tag='param ln_f'" in message, message
    assert "zero_core/stages/sharding.py:" in message and "in gather_parameters <- zero_core/stages/zero3.py:" in (
        message
    ), message


@pytest.mark.parametrize(
    "kind, caller, text",
    [
        ("skip-module", divergent_ranks.skips_a_module, "gather_layer(layer)"),
        ("early-exit", divergent_ranks.exits_early_on_its_data, "gather_layer(layer)"),
        ("rank-loop", divergent_ranks.runs_a_head_per_item, "dist.all_gather_single"),
    ],
)
def test_each_divergent_program_of_lesson_07_is_named_at_the_line_of_the_program_its_ranks_waited_at(
    kind, caller, text
) -> None:
    """`zero_core.divergent_ranks`, which lesson 07 and `zero_core.launch --diverge` run: the virtual cluster
    stops each at once, and its message names the program's own line (below `gather_layer` where it gathers)."""
    message = divergent_ranks.on_virtual_cluster(kind, world_size=4)
    lines, first = inspect.getsourcelines(caller)
    (offset,) = [i for i, line in enumerate(lines) if text in line]
    site = f"zero_core/divergent_ranks.py:{first + offset} in {caller.__name__}"
    expected = "CollectiveMismatch" if kind == "skip-module" else "CollectiveDeadlock"
    assert message.startswith(expected), message
    assert re.search(rf"called it at (\S+ in gather_layer <- )?{re.escape(site)}\n", message + "\n"), message
