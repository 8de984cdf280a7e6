"""What a graded cell may contain: the course's rules, said once (`POLICY_LINE`), and checked on each
solution cell's syntax tree before anything runs (`autograder.graded_cells`).

A submission must be the student's own code, and the reference implementation of every exercise lives
in the same checkout. Looking for the reference's names in a cell cannot tell the two apart: a student's
own class may well have a method called `gather_parameters`. So the rules say instead what a cell may
reach, and each is checked exactly, on names Python resolves (`symtable`), never on spelling alone:

- imports: only `ALLOWED_MODULES` and what the notebook's setup cells import, never a module the exercise
  puts off limits (`FORBIDDEN` in `autograder.exNN`: the reference stages, the grader, the exercise's own);
  an attribute of an imported module that is another module (`torch.sys`) counts as importing that one;
- attributes that start with `_`: only on the cell's own objects, i.e. on the first parameter of a method
  of a class the cell defines (`self._cache`) or on such a class, besides the dunders of `DUNDERS` (what
  `super().__init__` and a `repr` need) and PyTorch's `torch._foreach_*` ops;
- the escapes that would defeat the first two: `getattr`, `setattr`, `hasattr`, `delattr` but with a
  literal name (`getattr(x, "name")` is judged as `x.name`), and only called; the builtins of
  `ESCAPE_BUILTINS`; dunder names (`__builtins__`); frames (`FRAME_ATTRIBUTES`); and what allowed modules
  offer to run code from strings or files (`ESCAPES`). A name the cell binds itself (a variable called
  `vars`, a method called `getattr`) is the student's, and never a problem.

The rules are a tripwire in front of the walls, not a wall: they refuse what a cell's code shows. What it
does not show, an object of the course reached through public attributes (the autograd graph leads to the
stage's own shards) or a file reached through torch, still meets the grading child's walls
(`autograder.walls`: the answers are absent there) and the judge, who knows which collectives the course's
own code issued (`autograder.verdicts`).
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

COURSE_MODULES = ("torch", "zero_core.dist", "zero_core.memory", "zero_core.partition", "zero_core.topology")
"""What the exercises let students use. A graded cell may also import whatever its notebook's setup cells
import (`zero_core.cluster`, `zero_core.context` and `zero_core.optim` in exercises 1 and 2)."""
STANDARD_MODULES = (
    "math",
    "typing",
    "dataclasses",
    "functools",
    "itertools",
    "collections",
    "heapq",
    "bisect",
    "enum",
    "abc",
    "numbers",
    "fractions",
    "statistics",
    "logging",
    "warnings",
)
"""Standard modules that only compute (and log, and warn)."""
ALLOWED_MODULES = (*COURSE_MODULES, *STANDARD_MODULES, "__future__")
"""What a graded cell may import, submodules included (less `REFUSED_MODULES`)."""

REFUSED_MODULES = ("torch.fx", "torch.hub", "torch.jit", "torch.package", "torch.utils.cpp_extension", "logging.config")
"""Submodules of allowed packages that compile, load or name-resolve code a cell does not show."""

ESCAPES = {
    "torch.load": "unpickles, and a pickle runs whatever code it names",
    "typing.get_type_hints": "evaluates strings as code",
    "functools.singledispatch": "evaluates annotations as code",
    "functools.singledispatchmethod": "evaluates annotations as code",
}
"""Functions of allowed modules that run code a cell does not show, and what they do."""

DUNDERS = ("__init__", "__name__", "__qualname__", "__doc__", "__class__")
"""The dunder attributes a graded cell may use: `super().__init__(...)`, and a class's name for a message."""

ESCAPE_BUILTINS = ("eval", "exec", "compile", "vars", "globals", "locals", "__import__", "open", "breakpoint")
BY_NAME = ("getattr", "setattr", "hasattr", "delattr")
FRAME_ATTRIBUTES = ("gi_frame", "cr_frame", "ag_frame", "tb_frame", "f_back", "f_globals", "f_locals", "f_builtins")


def _listed(names: tuple[str, ...], separator: str = ", ") -> str:
    return separator.join(f"`{name}`" for name in names)


POLICY_LINE = (
    f"Graded cells import only {_listed(COURSE_MODULES)}, what the setup cells import, and the standard modules "
    f"{_listed(STANDARD_MODULES)} (never what the exercise puts off limits); they use names that start with `_` "
    f"only on their own objects (`self._cache`), no dunder but {_listed(DUNDERS)}, {_listed(BY_NAME, '/')} only "
    f'with a literal name (`getattr(x, "name")`), and no {_listed(ESCAPE_BUILTINS)} or frames: a notebook that '
    "breaks a rule scores 0 for the exercise."
)
"""The rules in one line of Markdown, for each notebook's introduction."""

OFF_LIMITS, IMPORTS, PRIVATE, ESCAPE = "off limits", "imports", "private", "escape"


@dataclass(frozen=True)
class Problem:
    """One broken rule: the cell's line, which rule (`OFF_LIMITS`, `IMPORTS`, `PRIVATE`, `ESCAPE`), and
    what the student should do instead."""

    line: int
    rule: str
    text: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.text}"


def under(module: str, roots: Iterable[str]) -> str | None:
    """The first of `roots` that is `module` or a package of it."""
    return next((root for root in roots if module == root or module.startswith(root + ".")), None)


def module_of(value: Any) -> str:
    """The module `value` is, or was defined in ("" if it does not say)."""
    if isinstance(value, types.ModuleType):
        return value.__name__
    module = getattr(value, "__module__", None)
    return module if isinstance(module, str) else ""
