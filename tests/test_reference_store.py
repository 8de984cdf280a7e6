"""The reference store (`autograder.reference_store`): a reference made once is read back, signed; a file that
does not verify is made again, never read; without the instructor's secret, or in a folder others may enter,
nothing is stored; a changed course file starts an empty folder; and the judges really read from it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from autograder import checks, harness, reference_store, stage_checks
from autograder.checks import SECRET_FILE_VARIABLE
from autograder.sandbox import grade_submission
from autograder.submission import exercise_module, load
from autograder.walls import COURSE_PACKAGES

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty store of this test's, under a secret of its own."""
    secret = tmp_path / "secret"
    secret.write_text("a secret of this test")
    secret.chmod(0o600)
    monkeypatch.setenv(SECRET_FILE_VARIABLE, str(secret))
    monkeypatch.setenv(reference_store.STORE_VARIABLE, str(tmp_path / "store"))
    return tmp_path / "store"


class Maker:
    """`make` for `kept`, counting its calls."""

    def __init__(self, value: object) -> None:
        self.value, self.calls = value, 0

    def __call__(self) -> object:
        self.calls += 1
        return self.value


def keep(maker: Maker, key: object = ("ex03", "reference", 4)) -> object:
    return reference_store.kept("run", key, maker, lambda value: value, lambda data: data)


def stored(store: Path) -> list[Path]:
    return sorted(store.glob("*/*.json"))


def test_a_reference_is_made_once_then_read_back(store: Path) -> None:
    maker = Maker({"losses": [1.5, 1.25], "layers": [[0, 1]]})
    assert keep(maker) == maker.value
    assert keep(maker) == maker.value
    assert maker.calls == 1
    assert keep(maker, ("ex03", "reference", 5)) == maker.value and maker.calls == 2  # another key, made
    [folder] = store.iterdir()
    assert len(stored(store)) == 2
    assert all(path.stat().st_mode & 0o777 == 0o600 for path in stored(store)) and folder.stat().st_mode & 0o077 == 0


def test_a_file_that_does_not_verify_is_made_again_and_replaced(store: Path) -> None:
    maker = Maker([1.0, 2.0])
    keep(maker)
    [path] = stored(store)
    entry = json.loads(path.read_text())
    forged = dict(entry, payload=json.dumps([9.0, 9.0]))  # a reference that would let a wrong answer pass
    path.write_text(json.dumps(forged))
    assert keep(maker) == [1.0, 2.0] and maker.calls == 2
    assert json.loads(path.read_text()) == entry
    path.write_text("{not json")
    assert keep(maker) == [1.0, 2.0] and maker.calls == 3


def test_a_file_signed_under_another_secret_is_not_read(store: Path, tmp_path: Path) -> None:
    keep(Maker([1.0]))
    [ours] = stored(store)
    other = tmp_path / "other-secret"
    other.write_text("another instructor's secret")
    other.chmod(0o600)
    os.environ[SECRET_FILE_VARIABLE] = str(other)
    keep(Maker([7.0]))
    [theirs] = [path for path in stored(store) if path != ours]
    assert theirs.name == ours.name  # the same reference, in the other secret's folder
    ours.write_text(theirs.read_text())  # signed, but not with this secret
    os.environ[SECRET_FILE_VARIABLE] = str(tmp_path / "secret")
    maker = Maker([1.0])
    assert keep(maker) == [1.0] and maker.calls == 1


def test_without_a_secret_file_nothing_is_stored(store: Path, tmp_path: Path, monkeypatch) -> None:
    """As in a student's copy of the course: no secret file where the variable or the course's root says."""
    (tmp_path / "secret").unlink()
    monkeypatch.delenv(SECRET_FILE_VARIABLE)
    monkeypatch.setattr(checks, "SECRET_FILE", tmp_path / "no-secret-here")
    maker = Maker([1.0])
    keep(maker), keep(maker)
    assert maker.calls == 2 and not store.exists()


def test_a_folder_other_users_may_enter_is_not_used(store: Path) -> None:
    store.mkdir(mode=0o755)
    store.chmod(0o755)
    maker = Maker([1.0])
    keep(maker), keep(maker)
    assert maker.calls == 2 and stored(store) == []


def test_a_store_inside_the_course_code_is_refused_in_one_line(store: Path) -> None:
    os.environ[reference_store.STORE_VARIABLE] = str(ROOT / "autograder" / "references")
    with pytest.raises(ValueError, match="inside the course's code, which the grading child may read"):
        keep(Maker([1.0]))


def test_a_changed_course_file_starts_an_empty_folder(store: Path, tmp_path: Path, monkeypatch) -> None:
    course = tmp_path / "course"
    for package in COURSE_PACKAGES:
        (course / package).mkdir(parents=True)
        (course / package / "stage.py").write_text("STEPS = 2\n")
    monkeypatch.setattr(reference_store, "ROOT", course)
    reference_store.fingerprint.cache_clear()
    try:
        keep(Maker([1.0]))
        [before] = store.iterdir()
        (course / "zero_core" / "stage.py").write_text("STEPS = 3\n")
        reference_store.fingerprint.cache_clear()
        maker = Maker([1.0])
        keep(maker)
        assert maker.calls == 1
        assert [folder.name for folder in store.iterdir()] != [before.name] and not before.exists()
    finally:
        monkeypatch.undo()
        reference_store.fingerprint.cache_clear()


def test_the_judges_read_their_references_from_the_store(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ex03 solution graded twice, each time as a new grading process would (nothing kept in memory): the
    second grading trains nothing but the student's runs."""
    assignment = "ex03_zero2_reduce_scatter_backward"
    exercise = exercise_module(assignment)
    trained: list[bool] = []
    train = harness.train

    def counted(graded, world_size, functions=None, *args, **kwargs):
        trained.append(functions is None)  # the reference stage is trained without student functions
        return train(graded, world_size, functions, *args, **kwargs)

    monkeypatch.setattr(stage_checks, "train", counted)
    for _ in range(2):
        harness.forget_runs()
        stage_checks.oracle_run.cache_clear()
        trained.clear()
        submission = load(ROOT / "solutions" / assignment / f"{assignment}.ipynb")
        results = list(grade_submission(submission, exercise.CHECKS))
        assert all(result.passed for result in results), results
        if not stored(store):
            pytest.fail("the first grading stored nothing")
        references_made = trained.count(True)
    assert references_made == 0 and trained.count(False) > 0
    harness.forget_runs()
    stage_checks.oracle_run.cache_clear()
