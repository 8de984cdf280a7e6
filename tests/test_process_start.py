"""What a course program pays before its work: torch only where the work needs it, the cycle collector kept off
what the program loaded (`zero_core.long_lived`), and the answer modules found without importing their packages.

Each test starts a fresh interpreter: what this test process has loaded says nothing about a program's start.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from autograder import walls
from autograder.child_process import MiB
from autograder.integrity import REFERENCE_CODE
from autograder.sandbox import Limits, grade_notebook
from autograder.submission import cells_name_torch
from tests.solution_notebooks import solution_cell, solution_notebook, with_cell

ROOT = Path(__file__).resolve().parents[1]


def fresh(code: str) -> dict:
    """What `code` prints as JSON, run in a new `python -I` with the course first on its path."""
    program = f"import sys; sys.path.insert(0, {str(ROOT)!r})\n{code}"
    done = subprocess.run([sys.executable, "-I", "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_grader_s_command_line_loads_no_torch_before_a_command_needs_it() -> None:
    """`--help`, `scores`, `new-key`, `merge` and every usage error answer at once; `grade` starts itself again
    isolated (`python -I`) before it has loaded torch for nothing. `scores` prints its table with
    `zero_core.cli.render`, which loads none of the course's commands (each imports torch: 1.6 s of a `scores`)."""
    loaded = fresh(
        "import json, autograder.cli, zero_core.cli.render\n"
        "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith('zero_core.stages'))))"
    )
    assert loaded == []


def test_a_formula_exercise_is_graded_by_a_parent_that_never_loads_torch() -> None:
    """ex05's judges read returned values (`autograder.plain_data`): its grading parent, nbgrader's included, has
    no use for torch (nor has its child, unless a cell names torch: the next test)."""
    notebook = ROOT / "solutions" / "ex05_memory_planning" / "ex05_memory_planning.ipynb"
    graded = fresh(
        "import json\nimport autograder.nbgrader_grading\nfrom autograder.sandbox import Limits, grade_notebook\n"
        f"results = grade_notebook({str(notebook)!r}, limits=Limits(walls=False))\n"
        "loaded = [m for m in ('torch', 'zero_core.stages') if m in sys.modules]\n"
        "print(json.dumps([sum(r.points for r in results), loaded]))"
    )
    assert graded == [10, []]


def test_an_oracle_run_loads_no_compiler_stack() -> None:
    """The single-device oracle (the judges' references, `python -m autograder check`, lesson 8) steps PyTorch's
    Adam through the function the class's `step` calls: the class's first construction in a process imports
    `torch._dynamo`, about 1.3 s of CPU."""
    loaded = fresh(
        "import json\nfrom zero_core.model import preset\nfrom zero_core.oracle import train_single_device\n"
        "from zero_core.stages import TrainConfig\n"
        "train_single_device(TrainConfig(model=preset('micro')), 2, 1)\n"
        "print(json.dumps('torch._dynamo' in sys.modules))"
    )
    assert loaded is False


MAPS_NO_TORCH = 200 * MiB
"""An address space in which torch's libraries cannot be mapped (`import torch` fails at libtorch_cpu.so), and in
which Python grades a formula exercise."""


@pytest.mark.parametrize("walled", [True, False], ids=["walls", "audit-hook-only"])
def test_a_formula_exercise_s_child_loads_torch_only_for_a_notebook_that_names_it(walled: bool, tmp_path: Path) -> None:
    """The grading child imports torch before its audit hook only where a cell it runs names torch or the course
    (`submission.cells_name_torch`). So the ex05 solution earns every point in an address space too small for
    torch; the same notebook with `import torch` in its formulas cell (which the rules allow) loses every point
    there, as the child then loads torch, and gets all of them with the usual limit."""
    if walled and isinstance(walls.available(), str):
        pytest.skip(f"no walls on this machine: {walls.available()}")
    ex05 = "ex05_memory_planning"
    solution = solution_notebook(ex05)
    importing = with_cell(ex05, "formulas", "import torch\n\n" + solution_cell(ex05, "formulas"),
                          tmp_path / f"{ex05}.ipynb")
    assert not cells_name_torch(solution, ex05) and cells_name_torch(importing, ex05)

    def points(path: Path, memory_bytes: int) -> int:
        return sum(r.points for r in grade_notebook(path, limits=Limits(walls=walled, memory_bytes=memory_bytes)))

    assert points(solution, MAPS_NO_TORCH) == 10
    assert points(importing, MAPS_NO_TORCH) == 0
    assert points(importing, Limits().memory_bytes) == 10


def test_the_answer_files_are_the_ones_importlib_finds_and_no_package_is_imported_to_find_them() -> None:
    def by_importlib(name: str) -> list[Path]:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, name
        origin = Path(spec.origin).resolve()
        if spec.submodule_search_locations:
            return [origin.parent]
        return [origin, *sorted((origin.parent / "__pycache__").glob(f"{origin.stem}.*.pyc"))]

    assert list(walls.module_files(REFERENCE_CODE)) == [p for name in REFERENCE_CODE for p in by_importlib(name)]
    loaded = fresh(
        "import json\nfrom autograder import walls\nfrom autograder.integrity import REFERENCE_CODE\n"
        "files = walls.module_files(REFERENCE_CODE)\n"
        "print(json.dumps([len(files), sorted(m for m in sys.modules if m == 'torch' or m in REFERENCE_CODE)]))"
    )
    assert loaded == [len(walls.module_files(REFERENCE_CODE)), []]


def test_what_is_loaded_is_frozen_once_and_what_comes_later_is_collected_as_before() -> None:
    counts = fresh(
        "import gc, json\nfrom zero_core.long_lived import freeze_what_is_loaded\n"
        "before = gc.get_freeze_count()\nfreeze_what_is_loaded()\nfrozen = gc.get_freeze_count()\n"
        "class Cycle: pass\n"
        "later = [Cycle() for _ in range(1000)]\nfor c in later: c.me = c\n"
        "freeze_what_is_loaded()\nagain = gc.get_freeze_count()\n"
        "del later, c\ncollected = gc.collect()\n"
        "print(json.dumps([before, frozen, again, collected]))"
    )
    before, frozen, again, collected = counts
    assert before == 0 and frozen > 1000
    assert again == frozen, "a second call froze the work done since the first"
    assert collected >= 1000, "the cycles made after the freeze were not collected"


def test_the_commands_freeze_what_they_loaded_only_as_their_process_s_program() -> None:
    """`python -m zero_core` and `zero_core.launch` freeze (`program=True`); their `main` called by other code (the
    tests call the CLIs' `main` in their workers from 76 call sites) leaves that process's objects to its collector.
    The freeze was the check's cost too: `gc.get_freeze_count()` walks every frozen object, 8.6 s of the test
    workers' CPU in one profiled run of the suite."""
    counts = fresh(
        "import contextlib, gc, io, json\nfrom zero_core import launch\nfrom zero_core.cli import main\n"
        "args = ['table', '--params', '1B', '--gpus', '8']\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    codes = [main(args)]\n    called = gc.get_freeze_count()\n"
        "    codes.append(launch.main(['--stages', '0']))\n    launched = gc.get_freeze_count()\n"
        "    codes.append(main(args, program=True))\n"
        "print(json.dumps([codes, called, launched, gc.get_freeze_count()]))"
    )
    codes, called, launched, program = counts
    assert codes == [0, 2, 0], "the table printed, and the launcher (outside torchrun) said how to start it"
    assert called == launched == 0 and program > 1000
