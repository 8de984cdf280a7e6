"""Students write the ZeRO pieces themselves: using the reference implementation scores 0 for the exercise.

The reference stages (`zero_core.stages`) hold exactly the code the exercises ask for, and the grader
(`autograder`) runs it, so a submission may use neither. Three nets catch it:

- `scan_source`: the AST of the solution cells (the grader reads them before running anything): imports
  of a forbidden module, by statement or by a call naming it (`importlib.import_module("...")`,
  `sys.modules["..."]`), and calls of the reference `LayerShard` methods. A string, comment or docstring
  that merely mentions a module is never held against a submission;
- `scan_objects`: the student's classes and functions at run time (what nbgrader's test cells see):
  a base class from a forbidden module, or a global name used by the student's code that refers to one;
- `StudentShard`: the `shard` a student's autograd Function receives raises `ReferenceUsed` if the
  reference's collectives are called on it.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import types
from collections.abc import Iterable
from typing import Any

from autograder.checks import CheckFailed

REFERENCE_MODULES = ("zero_core.stages", "zero_core.experiment", "zero_core.cli", "autograder")
"""Off limits in every exercise: the reference stages, what runs them, and the grader itself."""

REFERENCE_CODE = (
    "zero_core.stages.zero0",
    "zero_core.stages.zero1",
    "zero_core.stages.zero2",
    "zero_core.stages.zero2_linear",
    "zero_core.stages.zero2_buckets",
    "zero_core.stages.clip_accumulate",
    "zero_core.stages.zero3",
    "zero_core.stages.zero3_gather",
    "zero_core.stages.zero3_prefetch",
    "zero_core.stages.hierarchical_gather",
    "zero_core.formulas",
    "zero_core.deepspeed_estimators",
    "zero_core.experiment",
    "zero_core.oracle",
    "zero_core.cli",
)
"""The modules of the course that hold an exercise's answer or run the reference stages."""


def answer_modules(scaffolding: tuple[str, ...] = ()) -> tuple[str, ...]:
    """What a grading child may neither have loaded nor load: the reference code, except the `scaffolding`
    the exercise's checks plug the student's code into (ZeRO-2 for ex03, ZeRO-3 for ex04)."""
    return tuple(module for module in REFERENCE_CODE if module not in scaffolding)


SHARD_REFERENCE_METHODS = ("reduce_scatter_gradients", "gather_parameters", "release_parameters", "allocate_gathered")


class ReferenceUsed(RuntimeError):
    """Raised when a submission calls the reference implementation it is asked to write."""


def _forbidden(name: str, forbidden: tuple[str, ...]) -> str | None:
    for module in forbidden:
        if name == module or name.startswith(module + "."):
            return module
    return None


IMPORT_CALLS = ("import_module", "__import__")
"""Calls that import a module named by a string: `importlib.import_module(...)`, `__import__(...)`."""


def _imported_by_call(node: ast.AST) -> list[str]:
    """The module a call or a `sys.modules[...]` lookup names with a literal string, if it does."""
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        function = node.func
        name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")
        if name in IMPORT_CALLS and isinstance(node.args[0].value, str):
            return [node.args[0].value.strip()]
    if (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "modules"
        and isinstance(node.slice, ast.Constant)
        and isinstance(node.slice.value, str)
    ):
        return [node.slice.value.strip()]
    return []


def scan_source(source: str, forbidden: tuple[str, ...]) -> list[str]:
    """Problems in one solution cell's code, with lines: imports of a forbidden module (statements, and calls
    that import a module named by a literal string), and calls of the reference's shard methods. Strings,
    comments and docstrings that merely name a module are never a problem."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    problems = []
    for node in ast.walk(tree):
        names: list[str] = _imported_by_call(node)
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute) and node.attr in SHARD_REFERENCE_METHODS:
            problems.append(f"line {node.lineno}: `.{node.attr}` is the reference's collective; write it yourself")
        for name in names:
            module = _forbidden(name, forbidden)
            if module:
                problems.append(f"line {node.lineno}: uses `{name}` ({module} is off limits in this exercise)")
                break
    return problems


def _module_of(value: Any) -> str:
    if isinstance(value, types.ModuleType):
        return value.__name__
    return getattr(value, "__module__", None) or ""


def _functions_of(obj: Any) -> Iterable[types.FunctionType]:
    if isinstance(obj, types.FunctionType):
        yield obj
    elif inspect.isclass(obj):
        for value in vars(obj).values():
            function = getattr(value, "__func__", value)
            if isinstance(function, types.FunctionType):
                yield function


def _code_objects(code: types.CodeType) -> Iterable[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _written_beside(value: Any, function: types.FunctionType) -> bool:
    """Is `value` the student's own helper: a function with the same globals, or a class defined there?"""
    if isinstance(value, types.FunctionType):
        return value.__globals__ is function.__globals__
    return inspect.isclass(value) and value.__module__ == function.__globals__.get("__name__")


def scan_objects(objects: dict[str, Any], forbidden: tuple[str, ...]) -> list[str]:
    """Problems in the student's objects: inheriting from, or referring to, a forbidden module's code.

    Follows the student's own helper functions (same globals) so that a helper cannot hide the use.
    """
    problems: list[str] = []
    seen: set[int] = set()

    def visit(label: str, obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if inspect.isclass(obj):
            for base in obj.__mro__[1:]:
                module = _forbidden(_module_of(base), forbidden)
                if module:
                    problems.append(f"`{label}` subclasses {base.__module__}.{base.__qualname__} ({module})")
        if _forbidden(_module_of(obj), forbidden):
            problems.append(f"`{label}` is {_module_of(obj)}'s, not yours")
            return
        for function in _functions_of(obj):
            for code in _code_objects(function.__code__):
                for name in code.co_names:
                    if name not in function.__globals__:
                        continue
                    value = function.__globals__[name]
                    module = _forbidden(_module_of(value), forbidden)
                    if module:
                        problems.append(f"`{function.__qualname__}` uses `{name}` from {_module_of(value)}")
                    elif isinstance(value, types.ModuleType):
                        for attr in code.co_names:
                            inner = getattr(value, attr, None)
                            if inner is not None and _forbidden(_module_of(inner), forbidden):
                                problems.append(f"`{function.__qualname__}` uses `{name}.{attr}` ({_module_of(inner)})")
                    elif _written_beside(value, function):
                        visit(name, value)

    for label, obj in objects.items():
        visit(label, obj)
    return sorted(set(problems))


def verdict(problems: list[str], exercise: str) -> str:
    """The message that costs the exercise all its points."""
    listed = "\n".join(f"  - {p}" for p in problems)
    return (
        f"0 points for {exercise}: the submission uses the reference implementation it is asked to write.\n"
        f"{listed}\nWrite it yourself, with what the exercise's introduction allows."
    )


def _defining_cells(objects: dict[str, Any]) -> dict[str, str]:
    """{name of the notebook cell where it was written: object name}, for the student's code.

    Cells are the sources Python knows only from memory (IPython and `autograder.submission` put them in
    `linecache` without a modification time); code imported from a file on disk is judged by its objects.
    """
    cells: dict[str, str] = {}
    for name, obj in objects.items():
        for function in _functions_of(obj):
            filename = function.__code__.co_filename
            entry = linecache.cache.get(filename)
            if entry is not None and len(entry) == 4 and entry[1] is None:
                cells.setdefault(filename, name)
    return cells


def require_own_code(
    objects: dict[str, Any], names: tuple[str, ...], forbidden: tuple[str, ...], exercise: str
) -> None:
    """Raise `CheckFailed` (0 points) if the exercise's objects use the reference implementation.

    Looks at every object the exercise asks for (`names`, found next to `objects` in their globals, so a
    check of one function judges the whole exercise), at their classes and globals, and at the source
    of the cells that define them.
    """
    everything = dict(objects)
    for obj in objects.values():
        for function in _functions_of(obj):
            for name in names:
                if name not in everything and name in function.__globals__:
                    everything[name] = function.__globals__[name]
    problems = scan_objects(everything, forbidden)
    for filename, name in _defining_cells(everything).items():
        source = "".join(linecache.getlines(filename))
        problems += [f"in the cell of `{name}`, {p}" for p in scan_source(source, forbidden)]
    if problems:
        raise CheckFailed(verdict(sorted(set(problems)), exercise))


class StudentShard:
    """The `shard` a student's Function receives: the reference `LayerShard`'s data, not its collectives.

    Attributes read and written go to the real shard (`name`, `shapes`, `partition`, `rank`, `grad`,
    `param`, `tracker`, `dtype`), so the stage sees what the student's code wrote.
    """

    def __init__(self, shard: Any, exercise: str) -> None:
        object.__setattr__(self, "_shard", shard)
        object.__setattr__(self, "_exercise", exercise)

    def __getattr__(self, name: str) -> Any:
        if name in SHARD_REFERENCE_METHODS:
            raise ReferenceUsed(
                f"{self._exercise}: `shard.{name}` is the reference implementation; write the collective "
                "yourself with zero_core.dist (0 points for this exercise)"
            )
        return getattr(self._shard, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._shard, name, value)

    def __repr__(self) -> str:
        return f"<shard of {self._shard.name}>"
