"""The project sets itself up: one source of versions, CI runs the README's test command."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def pyproject_requirements() -> list[Requirement]:
    return [Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]


def constraint_pins() -> list[str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return [line for line in lines if line and not line.startswith("#")]


def test_every_constraint_is_an_exact_pin() -> None:
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][0-9A-Za-z.]*", pin) for pin in constraint_pins())


def test_the_pins_are_what_the_package_accepts_one_per_requirement() -> None:
    pins = {Requirement(pin).name: Requirement(pin) for pin in constraint_pins()}
    requirements = {r.name: r for r in pyproject_requirements()}
    assert sorted(pins) == sorted(requirements)
    for name, requirement in requirements.items():
        (pinned,) = pins[name].specifier
        assert requirement.specifier.contains(pinned.version), f"{name}=={pinned.version} is outside {requirement}"


def test_torch_is_a_range_from_the_oldest_tested_to_the_newest_tested_with_the_cpu_build_pinned() -> None:
    (torch,) = [r for r in pyproject_requirements() if r.name == "torch"]
    makefile = (ROOT / "Makefile").read_text()
    oldest = re.search(r"^OLDEST_TORCH := (\S+)$", makefile, flags=re.M).group(1)
    newest = re.search(r"^NEWEST_TORCH := (\S+)$", makefile, flags=re.M).group(1)
    assert "torch==2.13.0" in constraint_pins()
    assert all(torch.specifier.contains(v) for v in (oldest, "2.13.0", newest))
    assert not torch.specifier.contains("2.5.1") and not torch.specifier.contains("2.16.0")
    assert "test-oldest-torch test-newest-torch" in makefile, "CI runs both ends of the range"


def test_environment_yml_installs_the_constraints() -> None:
    text = (ROOT / "environment.yml").read_text()
    conda_pins = re.findall(r"^\s*-\s+([A-Za-z0-9_.\-]+==\S+)\s*$", text, flags=re.M)
    assert sorted(conda_pins) == sorted(constraint_pins())


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make test" in ci
    assert "make test" in readme and "make demo" in readme


def test_make_release_s_glob_matches_exactly_the_assignments() -> None:
    """`make release` generates every assignment in one nbgrader call, by a glob: it must name the same ones."""
    makefile = (ROOT / "Makefile").read_text()
    listed = re.search(r"^ASSIGNMENTS := ((?:.*\\\n)*.*)$", makefile, flags=re.M).group(1).replace("\\\n", " ").split()
    glob = re.search(r"^ASSIGNMENT_GLOB := (\S+)$", makefile, flags=re.M).group(1)
    assert sorted(path.name for path in (ROOT / "solutions").glob(glob)) == sorted(listed) == sorted(
        path.name for path in (ROOT / "solutions").iterdir() if path.is_dir()
    )
