"""The test session grades with one fixed instructor's secret, so that the hidden checks' parameters, drawn
from it (`autograder.checks.drawn`), are the same in every run and in every process the tests start; and with
one reference store (`autograder.reference_store`), new for each session and shared by its workers and the
graders they start, so that each reference is made once per session, as once per machine for an instructor.

`make test` runs the tests in parallel workers (pytest-xdist, `-n`), scheduled by `tests/work_units.py`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from autograder.checks import SECRET_FILE_VARIABLE
from autograder.reference_store import STORE_VARIABLE

TEST_SECRET = "the course's tests draw their hidden parameters from this"


@pytest.fixture(scope="session", autouse=True)
def fixed_grading_secret(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("secret") / ".grading-secret"
    path.write_text(TEST_SECRET)
    path.chmod(0o600)
    previous = os.environ.get(SECRET_FILE_VARIABLE)
    os.environ[SECRET_FILE_VARIABLE] = str(path)
    yield path
    if previous is None:
        os.environ.pop(SECRET_FILE_VARIABLE, None)
    else:
        os.environ[SECRET_FILE_VARIABLE] = previous


_STORE_MADE = pytest.StashKey[str]()
"""The reference store this session made (and removes at its end), if it made one."""


def pytest_configure(config: pytest.Config) -> None:
    """In the process that starts the workers (or runs alone): a new, empty reference store, named in the
    environment that the workers and every grader the tests start inherit."""
    if not hasattr(config, "workerinput") and STORE_VARIABLE not in os.environ:
        os.environ[STORE_VARIABLE] = tempfile.mkdtemp(prefix="reference-store-")
        config.stash[_STORE_MADE] = os.environ[STORE_VARIABLE]


def pytest_unconfigure(config: pytest.Config) -> None:
    made = config.stash.get(_STORE_MADE, None)
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)
        os.environ.pop(STORE_VARIABLE, None)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under `make test`'s workers: xdist's scheduling by scope, the scope being `tests.work_units.work_unit`."""
    from tests.work_units import WorkUnitScheduling

    return WorkUnitScheduling(config, log)
