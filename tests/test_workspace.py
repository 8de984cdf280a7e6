"""`make lab`'s working copy (`autograder.workspace`): the learner's runs and answers land in `work/`, never in a
tracked notebook; a copy is made once, made again when missing, and never overwritten."""

from __future__ import annotations

import shutil
from pathlib import Path

from autograder.workspace import make_workspace

ROOT = Path(__file__).resolve().parents[1]


def test_copies_are_made_once_kept_and_a_changed_source_is_reported(tmp_path: Path) -> None:
    root = tmp_path / "course"
    for folder in ("lessons", "exercises/ex01_collectives", "solutions/ex01_collectives"):
        (root / folder).mkdir(parents=True)
    (root / "lessons" / "00_a.ipynb").write_text("lesson v1")
    (root / "exercises" / "ex01_collectives" / "ex01_collectives.ipynb").write_text("exercise v1")
    (root / "solutions" / "ex01_collectives" / "ex01_collectives.ipynb").write_text("answers")
    work = root / "work"

    said = make_workspace(root, work)
    exercise = "exercises/ex01_collectives/ex01_collectives.ipynb"
    lesson = "lessons/00_a.ipynb"
    assert sorted(said) == [f"copied {exercise} to {work}/{exercise}", f"copied {lesson} to {work}/{lesson}"]
    assert not (work / "solutions").exists(), "the answers are not part of a learner's copy"

    mine = work / "exercises" / "ex01_collectives" / "ex01_collectives.ipynb"
    mine.write_text("my answer")
    (work / "lessons" / "00_a.ipynb").unlink()
    assert make_workspace(root, work) == [f"copied lessons/00_a.ipynb to {work}/lessons/00_a.ipynb"]
    assert mine.read_text() == "my answer"

    (root / "exercises" / "ex01_collectives" / "ex01_collectives.ipynb").write_text("exercise v2")  # a git pull
    (said,) = make_workspace(root, work)
    assert said.startswith("exercises/ex01_collectives/ex01_collectives.ipynb changed since") and "kept" in said
    assert mine.read_text() == "my answer"


def test_the_course_s_copy_holds_every_lesson_and_exercise(tmp_path: Path) -> None:
    work = tmp_path / "work"
    make_workspace(ROOT, work)
    for folder in ("lessons", "exercises"):
        notebooks = (ROOT / folder).rglob("*.ipynb")
        tracked = sorted(p.relative_to(ROOT) for p in notebooks if ".ipynb_checkpoints" not in p.parts)
        copied = sorted(p.relative_to(work) for p in (work / folder).rglob("*.ipynb"))
        assert copied == tracked
    shutil.rmtree(work)
