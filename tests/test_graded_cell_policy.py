"""The rules for graded cells (`autograder.policy`): what a student may write, what the rules refuse (each
refusal with its line, its rule and what to do instead), and what breaking one costs. Every solution and
release notebook follows them, and every fixture breaks exactly the rules its header names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autograder.checks import total
from autograder.graded_cells import GradedCells
from autograder.integrity import REFERENCE_MODULES
from autograder.policy import (
    ALLOWED_MODULES,
    BY_NAME,
    DUNDERS,
    ESCAPE,
    ESCAPE_BUILTINS,
    IMPORTS,
    OFF_LIMITS,
    POLICY_LINE,
    PRIVATE,
    Problem,
)
from autograder.sandbox import Limits, grade_notebook
from autograder.submission import EXERCISES, reference_uses
from tests.solution_notebooks import solution_notebook
from tests.test_grading_integrity import (
    UNUSUAL,
    WRONG,
    WrongSubmission,
    grade_in_process,
    marker,
    release_notebook,
)

SETUP = (
    "import torch\nimport torch.nn.functional as F\n\nfrom zero_core import dist, memory\n"
    "from zero_core.partition import unflatten\nfrom autograder import ex07 as grader\n"
)
"""ex07's setup cell."""
FORBIDDEN = REFERENCE_MODULES + ("zero_core.schedule",)


def problems(source: str, setup: str = SETUP) -> list[Problem]:
    return GradedCells(FORBIDDEN, [setup]).check(source)


def test_a_refusal_quotes_the_code_the_parser_read_whatever_the_line_ends() -> None:
    """Windows and old Mac line ends, a form feed (which ends no line for the parser) and a character of two bytes
    before the refused attributes: each is quoted as `ast.get_source_segment` cuts it from the cell."""
    source = 'note = "\u00e9"\r\n\x0cx = (torch\r\n     .nn._private_thing)\ry = torch.__dict__\n'
    found = problems(source)
    assert [(p.line, p.text.split("`")[1]) for p in found] == [(2, "torch .nn._private_thing"), (4, "torch.__dict__")]


@pytest.mark.parametrize("notebook", [solution_notebook, release_notebook], ids=["solution", "release"])
@pytest.mark.parametrize("assignment", [pytest.param(a, marks=marker(a)) for a in EXERCISES])
def test_every_solution_and_release_notebook_follows_the_rules(assignment: str, notebook) -> None:
    assert reference_uses(notebook(assignment), assignment) == []


OWN_NAMES = '''
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import zero_core.dist
from zero_core import dist


class Prefetcher:
    """Unlike zero_core.answers.ex07, mine."""

    _instances = 0

    def __init__(self, shards: list, window: int) -> None:
        super().__init__()
        self._shards = list(shards)
        self._pending: deque[Any] = deque()
        Prefetcher._instances += 1

    @classmethod
    def count(cls) -> int:
        return cls._instances

    def gather_parameters(self, shard):
        flat = torch.empty(shard.partition.padded_numel, dtype=shard.param.dtype)
        work = zero_core.dist.all_gather_single(flat, shard.param, async_op=True)
        self._pending.append(lambda: self._shards and work.wait())
        return flat

    def release_parameters(self, shard, getattr=None):
        vars = [shard.name, getattr]
        return vars

    def gather(self, shard, backward: bool):
        flat = self.gather_parameters(shard)
        if hasattr(shard, "param") and getattr(F, "linear") is not None:
            torch._foreach_mul_([flat], 1.0)
        return unflatten(flat, shard.shapes)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self._shards)}), {self.__class__.__qualname__}"


@dataclass
class Plan:
    sizes: list[int]


print("compare with zero_core.stages.zero3", math.prod([2, 3]), dist.ReduceOp.AVG)
if __name__ == "__main__":
    Prefetcher([], 1).gather_parameters(None)
'''


def test_a_students_own_names_never_break_a_rule() -> None:
    """Methods named like the reference's and called on the student's own object, `self._...`, `cls._...`, a
    variable called `vars`, a parameter called `getattr`, literal `getattr`/`hasattr`, `super().__init__`,
    `torch._foreach_*`, and the modules on the list."""
    assert problems(OWN_NAMES) == []


REFUSED = [
    ("import os", "import math\nimport os\n", 2, IMPORTS, "`import os` uses the module os"),
    ("import gc", "import gc\n", 1, IMPORTS, "`import gc` uses the module gc"),
    ("importlib", "from importlib import import_module\n", 1, IMPORTS, "the module importlib"),
    ("a module on a module", "modules = torch.sys.modules\n", 1, IMPORTS, "`torch.sys` uses the module sys"),
    ("dist.comm", "ring = dist.comm.ring_bytes\n", 1, IMPORTS, "`dist.comm` uses the module zero_core.comm"),
    ("from a module on the list", "from zero_core.dist import comm\n", 1, IMPORTS, "the module zero_core.comm"),
    ("code loader", "import torch.utils.cpp_extension\n", 1, IMPORTS, "torch.utils.cpp_extension"),
    ("star", "from torch import *\n", 1, IMPORTS, "names what it imports"),
    ("reference", "from zero_core.stages import zero3\n", 1, OFF_LIMITS, "zero_core.stages, which is off limits"),
    ("under a package", "import zero_core.dist\nx = zero_core.stages\n", 2, OFF_LIMITS, "`zero_core.stages` uses"),
    ("the exercise's own", "from zero_core import schedule\n", 1, OFF_LIMITS, "zero_core.schedule, which is off"),
    ("the setup's grader", "grader.check_training = print\n", 1, OFF_LIMITS, "`grader` uses autograder.ex07"),
    ("private on the shard", "def gather(shard):\n    return shard._shard\n", 2, PRIVATE, "`_shard` starts"),
    ("self outside a class", "def gather(self):\n    return self._shard\n", 2, PRIVATE, "`self._shard`"),
    ("second parameter", "class A:\n    def m(self, shard):\n        return shard._shard\n", 3, PRIVATE, "`_shard`"),
    (
        "a static method's ctx",
        "class F:\n    @staticmethod\n    def forward(ctx, x):\n        return ctx._saved\n",
        4,
        PRIVATE,
        "`ctx._saved`",
    ),
    (
        "self rebound",
        "class A:\n    def m(self, shard):\n        self = shard\n        return self._shard\n",
        4,
        PRIVATE,
        "`self._shard`",
    ),
    ("a class name rebound", "class A:\n    pass\n\n\nA = shard\nA._shard\n", 6, PRIVATE, "`A._shard`"),
    ("private import", "from torch import _C\n", 1, PRIVATE, "`_C` starts with `_`"),
    ("mro", "bases = type(shard).__mro__\n", 1, PRIVATE, "no dunder attribute but"),
    ("subclasses", "found = object.__subclasses__()\n", 1, PRIVATE, "`object.__subclasses__`"),
    ("a function's globals", "found = unflatten.__globals__\n", 1, PRIVATE, "`unflatten.__globals__`"),
    ("computed name", "real = getattr(shard, '_' + 'shard')\n", 1, ESCAPE, "without a literal attribute name"),
    ("literal private name", "real = getattr(shard, '_shard')\n", 1, PRIVATE, "`_shard` starts with `_`"),
    ("getattr passed on", "import functools\nread = functools.partial(getattr, shard)\n", 2, ESCAPE, "`getattr`"),
    ("builtins", "table = __builtins__\n", 1, ESCAPE, "`__builtins__` reaches the interpreter"),
    ("frames", "def g():\n    yield\n\n\nframe = g().gi_frame\n", 5, ESCAPE, "the interpreter's frames"),
    ("torch.load", "state = torch.load('state.pt')\n", 1, ESCAPE, "unpickles"),
    ("get_type_hints", "from typing import get_type_hints\n", 1, ESCAPE, "evaluates strings as code"),
] + [(name, f"x = {name}\n", 1, ESCAPE, f"`{name}` reaches code and data around yours") for name in ESCAPE_BUILTINS]


@pytest.mark.parametrize(("source", "line", "rule", "phrase"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_a_refused_cell_is_told_the_line_and_the_rule(source: str, line: int, rule: str, phrase: str) -> None:
    found = problems(source)
    assert [(p.line, p.rule) for p in found if phrase in p.text] == [(line, rule)], found


def test_a_problem_says_what_to_write_instead() -> None:
    (problem,) = problems("class Prefetcher:\n    def gather(self, shard, backward):\n        return shard._shard\n")
    assert str(problem).startswith("line 3: `shard._shard`: `_shard` starts with `_`")
    assert str(problem).endswith("use the public attributes the exercise documents")


def test_what_the_setup_cells_import_may_be_imported_in_that_notebook_only() -> None:
    source = "from zero_core.context import current\n"
    assert problems(source, setup="from zero_core.context import current\n") == []
    assert [p.rule for p in problems(source)] == [IMPORTS]


def test_a_cell_that_does_not_parse_breaks_no_rule() -> None:
    """It fails to load, which costs the checks that need it, with the SyntaxError in their message."""
    assert problems("def gather(:\n    import os\n") == []


def test_a_magic_line_does_not_hide_a_cell_from_the_rules(tmp_path: Path) -> None:
    cell = WrongSubmission(
        Path("magic"), "ex05_memory_planning", "formulas", frozenset(), "", False, "%time x = 1\nimport os\n"
    )
    (problem,) = reference_uses(cell.notebook(tmp_path), "ex05_memory_planning")
    assert problem.startswith("cell `formulas`, line 2: `import os`")


def test_the_policy_line_is_one_line_that_names_every_rule() -> None:
    assert "\n" not in POLICY_LINE
    for name in (*ALLOWED_MODULES, *ESCAPE_BUILTINS, *DUNDERS, *BY_NAME, "`_`", "frames", "scores 0"):
        if name == "__future__":  # `from __future__ import annotations` goes without saying
            continue
        assert name in POLICY_LINE, name


FIXTURES = [
    pytest.param(f, id=f"{f.path.parent.name}/{f.path.stem}", marks=marker(f.exercise)) for f in WRONG + UNUSUAL
]


@pytest.mark.parametrize("fixture", FIXTURES)
def test_a_fixture_breaks_a_rule_exactly_when_its_header_says_which(fixture: WrongSubmission, tmp_path: Path) -> None:
    found = reference_uses(fixture.notebook(tmp_path), fixture.exercise)
    if fixture.rules is None:
        assert found == []
    else:
        assert any(fixture.rules in problem for problem in found), found


@pytest.mark.ex07
def test_a_cell_that_breaks_a_rule_loses_every_check_before_anything_runs(tmp_path: Path) -> None:
    """In the grading parent (no child is started) and in the process that loads the cells alike."""
    (wrong,) = [w for w in WRONG if w.path.stem == "ex07_reaches_the_reference_shard_through_a_private_attribute"]
    notebook = wrong.notebook(tmp_path)
    for results in (grade_notebook(notebook, limits=Limits(walls=False, time_s=1)), grade_in_process(notebook)):
        assert total(results) == (0, 10)
        for result in results:
            assert result.message.startswith("0 points for ex07_zero3_prefetch"), result.message
            assert "cell `prefetcher`, line 6: `shard._shard`" in result.message
            assert result.message.endswith(f"The rules: {POLICY_LINE}")


@pytest.mark.parametrize("folder", ["solutions", "exercises"])
def test_every_notebook_states_the_rules_in_the_words_the_grader_applies(folder: str) -> None:
    from autograder.policy import POLICY_LINE
    from autograder.submission import EXERCISES

    root = Path(__file__).resolve().parents[1]
    for assignment in EXERCISES:
        text = (root / folder / assignment / f"{assignment}.ipynb").read_text()
        assert json.dumps(POLICY_LINE)[1:-1] in text, f"{folder}/{assignment} does not state the rules"
