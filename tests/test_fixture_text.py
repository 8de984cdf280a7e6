"""Every wrong answer kept as a patch (tests/fixtures/wrong/*.patch) applies to the plain answer it names, and
a patch that no longer matches its base says which fixture, which hunk and which line differ."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixture_text import CELL_MARKER, FIXTURES, PatchError, fixture_text, patched_cell, wrong_fixtures

PATCHES = [
    pytest.param(path, id=path.stem, marks=getattr(pytest.mark, path.stem[:4]))
    for path in wrong_fixtures()
    if path.suffix == ".patch"
]


def header(text: str) -> dict:
    meta: dict = {}
    exec(text.split(CELL_MARKER, 1)[0], meta)
    return meta


@pytest.mark.parametrize("patch", PATCHES)
def test_a_wrong_answer_kept_as_a_patch_applies_to_the_plain_answer_of_its_cell(patch: Path) -> None:
    text = fixture_text(patch)
    base = patch.read_text().split(CELL_MARKER, 1)[1].splitlines()[0].removeprefix("--- ")
    answer, plain = header(text), header((FIXTURES / base).read_text())
    assert (answer["EXERCISE"], answer["CELL"]) == (plain["EXERCISE"], plain["CELL"]), f"{patch.name} patches {base}"
    compile(text.split(CELL_MARKER, 1)[1], patch.name, "exec")


@pytest.mark.ex03
def test_a_patch_whose_context_differs_from_its_base_names_the_fixture_the_hunk_and_the_line() -> None:
    diff = (FIXTURES / "wrong" / "ex03_sum_instead_of_average.patch").read_text().split(CELL_MARKER, 1)[1]
    assert "-        dist.reduce_scatter_single(shard.grad, bucket, op=dist.ReduceOp.AVG)\n" in diff
    stale = diff.replace("op=dist.ReduceOp.AVG)\n", "op=dist.ReduceOp.MAX)\n")
    expected = (
        r"ex03_sum_instead_of_average\.patch, hunk 1 \(@@ -\d+,\d+ \+\d+,\d+ @@\): line \d+ of "
        r"plain/ex03_reduce_scatter_linear\.py is '.*ReduceOp\.AVG\)\\n', the patch expects '.*ReduceOp\.MAX\)\\n'"
    )
    with pytest.raises(PatchError, match=expected):
        patched_cell("ex03_sum_instead_of_average.patch", stale)
