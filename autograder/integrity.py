"""Students write the ZeRO pieces themselves: using the reference implementation scores 0 for the exercise.

The reference stages (`zero_core.stages`, `zero_core.variants`) and the answers they plug in
(`zero_core.answers`, found through `zero_core.registry`) hold exactly the code the exercises ask for, and
the grader (`autograder`) runs it, so a submission may use neither. Three nets keep it out, none of which looks for
the reference's names (a student's own method may well be called `gather_parameters`):

- the rules for graded cells (`autograder.policy`, `POLICY_LINE`): checked on the solution cells' source
  before anything runs (`submission.reference_uses`); among them, that a cell imports no module the
  exercise puts off limits. A cell that breaks a rule costs the exercise every point (`verdict`);
- `require_own_code`, at run time (what nbgrader's test cells and the grading child see): the student's
  classes and functions (`scan_objects`: a base class from a forbidden module, or a global name of the
  student's code that refers to one) and the imports of the cells that define them;
- what the student's code is handed: `StudentShard`, the `shard` of the exercises, has the layer's data
  and none of the reference's collectives, and keeps the stage's shard in no attribute.

Behind them, the grading child's walls leave the answers out (`autograder.walls`), and the judge tells
collectives the course's code issued from the student's (`autograder.verdicts`).
"""

from __future__ import annotations

import inspect
import linecache
import types
from collections.abc import Iterable
from typing import Any

from autograder.checks import CheckFailed
from autograder.graded_cells import GradedCells
from autograder.policy import OFF_LIMITS, POLICY_LINE, module_of, under
from zero_core import registry

REFERENCE_MODULES = (
    "zero_core.stages",
    "zero_core.variants",
    "zero_core.answers",
    "zero_core.registry",
    "zero_core.experiment",
    "zero_core.report",
    "zero_core.cli",
    "autograder",
)
"""Off limits in every exercise: the reference stages, their answers and the registry that finds them, what
runs them, and the grader itself."""

REFERENCE_CODE = (
    "zero_core.stages.zero0",
    "zero_core.stages.zero1",
    "zero_core.stages.zero2",
    "zero_core.stages.zero3",
    *(registry.answer_module(exercise) for exercise in registry.ANSWERS),
    "zero_core.answers.ex10",  # sharded checkpoints: written between steps, so no stage plugs it in
    "zero_core.formulas",
    "zero_core.planner.deepspeed_estimators",
    "zero_core.experiment",
    "zero_core.report",
    "zero_core.oracle",
    "zero_core.cli",
)
"""The modules of the course that hold an exercise's answer or run the reference stages."""


def answer_modules(scaffolding: tuple[str, ...] = ()) -> tuple[str, ...]:
    """What a grading child may neither have loaded nor load: the reference code, except the `scaffolding`
    the exercise's checks plug the student's code into (ZeRO-2 for ex03, ZeRO-3 for ex04, and an earlier
    exercise's answer, `registry.answer_module("ex03")`, for ex06 and ex08)."""
    return tuple(module for module in REFERENCE_CODE if module not in scaffolding)


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
                module = under(module_of(base), forbidden)
                if module:
                    problems.append(f"`{label}` subclasses {base.__module__}.{base.__qualname__} ({module})")
        if under(module_of(obj), forbidden):
            problems.append(f"`{label}` is {module_of(obj)}'s, not yours")
            return
        for function in _functions_of(obj):
            for code in _code_objects(function.__code__):
                for name in code.co_names:
                    if name not in function.__globals__:
                        continue
                    value = function.__globals__[name]
                    module = under(module_of(value), forbidden)
                    if module:
                        problems.append(f"`{function.__qualname__}` uses `{name}` from {module_of(value)}")
                    elif isinstance(value, types.ModuleType):
                        for attr in code.co_names:
                            inner = getattr(value, attr, None)
                            if inner is not None and under(module_of(inner), forbidden):
                                problems.append(f"`{function.__qualname__}` uses `{name}.{attr}` ({module_of(inner)})")
                    elif _written_beside(value, function):
                        visit(name, value)

    for label, obj in objects.items():
        visit(label, obj)
    return sorted(set(problems))


def verdict(problems: list[str], exercise: str) -> str:
    """The message that costs the exercise all its points."""
    listed = "\n".join(f"  - {p}" for p in problems)
    return (
        f"0 points for {exercise}: the submission uses the reference implementation it is asked to write, or "
        f"breaks a rule for graded cells.\n{listed}\nThe rules: {POLICY_LINE}"
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
    check of one function judges the whole exercise), at their classes and globals, and at the imports of
    the cells that define them. The other rules for graded cells are the grader's to judge, on the
    notebook (`submission.reference_uses`).
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
        uses = [p for p in GradedCells(forbidden).check(source) if p.rule == OFF_LIMITS]
        problems += [f"in the cell of `{name}`, {p}" for p in uses]
    if problems:
        raise CheckFailed(verdict(sorted(set(problems)), exercise))


SHARD_DATA = ("name", "shapes", "partition", "rank", "tracker", "dtype", "grad", "param", "micro_step", "micro_steps")
"""What the exercises' tables of the `shard` argument promise: the layer's data, read from the stage's shard
when the student's code asks (ex08's `micro_step` changes between micro-batches)."""
SHARD_TENSORS = ("grad", "param")
"""The data a student's code may assign (`shard.grad += chunk` assigns the tensor it added into)."""


def _live(shard: Any, name: str) -> property:
    def read(view: StudentShard) -> Any:
        return getattr(shard, name)

    def write(view: StudentShard, value: Any) -> None:
        setattr(shard, name, value)

    return property(read, write if name in SHARD_TENSORS else None, doc=f"The stage's `shard.{name}`.")


class StudentShard:
    """The `shard` a student's code receives: the layer's data (`SHARD_DATA`), and nothing else.

    The stage's own shard (`LayerShard`) also does the layer's collectives, which are the exercises'
    answers: this view has no method of it, and keeps it in no attribute. Each view gets a class of its
    own whose properties read (and, for `SHARD_TENSORS`, write) the data of that one shard: only their
    closures refer to it, and reaching a closure takes a dunder the rules for graded cells refuse. A
    student's code may keep its own attributes on the view.
    """

    def __new__(cls, shard: Any, exercise: str) -> StudentShard:
        held = tuple(name for name in SHARD_DATA if hasattr(shard, name))
        attributes: dict[str, Any] = {name: _live(shard, name) for name in held}
        attributes.update(_exercise=exercise, _held=held)
        return object.__new__(type(cls.__name__, (cls,), attributes))

    def __getattr__(self, name: str) -> Any:
        """Only for a name the view does not have: say what it has, and that the collectives are the student's."""
        raise AttributeError(
            f"{type(self)._exercise}: the shard you receive holds the layer's data ({', '.join(type(self)._held)}) "
            f"and has no `{name}`: its collectives are the reference implementation, not part of it. Write yours "
            "with zero_core.dist."
        )

    def __repr__(self) -> str:
        return f"<shard of {self.name}>"
