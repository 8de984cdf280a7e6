"""The test session grades with one fixed instructor's secret, so that the hidden checks' parameters, drawn
from it (`autograder.checks.drawn`), are the same in every run and in every process the tests start.

`make test` runs the tests in parallel workers (pytest-xdist, `-n`), scheduled by `tests/work_units.py`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from autograder.checks import SECRET_FILE_VARIABLE

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



@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under `make test`'s workers: xdist's scheduling by scope, the scope being `tests.work_units.work_unit`."""
    from tests.work_units import WorkUnitScheduling

    return WorkUnitScheduling(config, log)
