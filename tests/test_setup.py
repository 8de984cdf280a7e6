"""The project sets itself up: one source of versions, CI runs the README's test command."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pyproject_pins() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def test_every_requirement_is_pinned_exactly() -> None:
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][0-9A-Za-z.]*", pin) for pin in pyproject_pins())


def test_torch_is_pinned_to_the_cpu_build_on_disk() -> None:
    assert "torch==2.13.0" in pyproject_pins()


def test_environment_yml_installs_the_same_pins_as_pyproject() -> None:
    text = (ROOT / "environment.yml").read_text()
    conda_pins = re.findall(r"^\s*-\s+([A-Za-z0-9_.\-]+==\S+)\s*$", text, flags=re.M)
    assert sorted(conda_pins) == sorted(pyproject_pins())


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make test" in ci
    assert "make test" in readme and "make demo" in readme
