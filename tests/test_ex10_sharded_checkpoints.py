"""ex10's checks: what they read from the files, what they draw, and that the course's own answer earns them.

The wrong answers each check must catch are tests/fixtures/wrong/ex10_*.patch (graded in
tests/test_grading_integrity.py); here, the grader's parts that no submission changes.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from autograder import ex10
from autograder.checks import run_check
from autograder.submission import load
from zero_core.answers import ex10 as answer
from zero_core.checkpoint_files import STATES, read_rank_file
from zero_core.cluster import VirtualCluster
from zero_core.partition import FlatPartition

pytestmark = pytest.mark.ex10

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = {name: getattr(answer, name) for name in ex10.NAMES}


def test_the_course_answer_handed_in_earns_nothing() -> None:
    results = [run_check(check, REFERENCE) for check in ex10.CHECKS if not check.hidden]
    assert all(not r.passed and "zero_core.answers.ex10's, not yours" in r.message for r in results)


def test_the_course_answer_earns_the_visible_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """zero_core.answers.ex10 writes more than the format asks (ZeRO-3's parameter shard, the loss scaler,
    shapes): still within the bytes a file may hold. The refusal of the reference is set aside here only."""
    monkeypatch.setattr(ex10, "_integrity", lambda functions: None)
    results = [run_check(check, REFERENCE) for check in ex10.CHECKS if not check.hidden]
    assert [r.message for r in results if not r.passed] == []


def test_every_hidden_save_size_pads_some_layer_and_sorts_rank_10_before_rank_2_where_it_has_one() -> None:
    numels = ex10.layer_numels()
    for n in (*ex10.HIDDEN_SAVE_SIZES, ex10.VISIBLE["world_sizes"][0]):
        assert any(FlatPartition(numel, n).padding for numel in numels.values()), n
    assert all(n > 10 for n in ex10.HIDDEN_SAVE_SIZES) and sorted(map(str, range(11)))[2] == "10"
    draws = [ex10.draw_hidden(random.Random(seed)) for seed in range(200)]
    assert {d["world_sizes"][0] for d in draws} == set(ex10.HIDDEN_SAVE_SIZES)
    assert {d["world_sizes"][1] for d in draws} == set(ex10.HIDDEN_RESUME_SIZES)


def _save(world_size: int, directory: Path) -> None:
    """ZeRO-3's files as the grader has them written: `STEPS` steps, then the course's `save_shards`."""
    directory.mkdir()
    VirtualCluster(world_size).run(ex10._save_on_rank, 3, ex10.CONFIG, str(directory), answer.save_shards)


def test_the_rewritten_copy_holds_the_drawn_values_at_each_ranks_range_and_keeps_everything_else(
    tmp_path: Path,
) -> None:
    _save(3, tmp_path / "saved")
    ex10.rewrite_shards(tmp_path / "saved", tmp_path / "copy", 3, seed=7)
    numels = ex10.layer_numels()
    for rank in range(3):
        original, copy = read_rank_file(tmp_path / "saved", rank), read_rank_file(tmp_path / "copy", rank)
        assert {k: v for k, v in copy.items() if k != "shards"} == {k: v for k, v in original.items() if k != "shards"}
        assert torch.equal(copy["shards"]["param"], original["shards"]["param"])
        for state in STATES:
            want = torch.cat([ex10.drawn_values(7, state, layer, numels[layer])[start:end]
                              for layer, (start, end) in ex10.owned_ranges(3, rank).items()])
            assert torch.equal(copy["shards"][state], want)
            assert not torch.equal(copy["shards"][state], original["shards"][state])


def test_the_files_are_weighed_on_disk() -> None:
    """A file that holds the whole flat buffer a view came from fails on its size alone, its values right."""
    check = next(c for c in ex10.CHECKS if c.name == "test_files")
    namespace = load(ROOT / "solutions" / ex10.ASSIGNMENT / f"{ex10.ASSIGNMENT}.ipynb").namespace
    observation = ex10.observe_checkpoints(*(namespace[name] for name in ex10.NAMES), **check.kwargs)
    observation = json.loads(json.dumps(observation))
    assert ex10.judge_files(observation, **check.kwargs)
    owned = ex10.owned_numel(3, 0)
    observation["stages"]["2"]["files"][0]["bytes"] = owned * 12 + ex10.METADATA_BYTES + 1
    with pytest.raises(ex10.CheckFailed, match="a view's whole storage"):
        ex10.judge_files(observation, **check.kwargs)


def test_a_check_is_called_as_its_cell_calls_it() -> None:
    notebook = json.loads((ROOT / "solutions" / ex10.ASSIGNMENT / f"{ex10.ASSIGNMENT}.ipynb").read_text())
    sources = "\n".join("".join(cell["source"]) for cell in notebook["cells"])
    for check in ex10.CHECKS:
        assert check.call() in sources, check.call()
    assert replace(ex10.CHECKS[0], kwargs={}).call().startswith("grader.check_files(save_shards")
