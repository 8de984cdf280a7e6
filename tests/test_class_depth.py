"""The class chains a reader climbs stay short: at most three of the project's classes deep, none made at run time.

A student reading `BucketedZero2` should find everything it does in it, `Zero2` and `ZeroStage`; the grader
builds its stages from plain classes and options (`autograder.harness.GradedStage`), never by deriving a new
class per exercise, setting or student. Depth counts the class itself and every class of the project above
it on its longest chain (`ZeroStage` is 1, `Zero2` 2, `BucketedZero2` 3); library bases do not count.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

PACKAGES = ("zero_core", "autograder")
MOST = 3
ROOT = Path(__file__).resolve().parent.parent


def project_depth(cls: type) -> int:
    """1 + the deepest of `cls`'s bases that belong to the project (0 for a class that does not)."""
    if cls.__module__.split(".")[0] not in PACKAGES:
        return 0
    return 1 + max((project_depth(base) for base in cls.__bases__), default=0)


def project_classes() -> list[type]:
    classes: dict[str, type] = {}
    for package in PACKAGES:
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            if info.name.endswith(".__main__"):
                continue  # running it is what importing it does
            module = importlib.import_module(info.name)
            for name, value in vars(module).items():
                if inspect.isclass(value) and value.__module__ == info.name:
                    classes[f"{info.name}.{name}"] = value
    return list(classes.values())


def test_no_class_of_the_project_is_more_than_three_deep() -> None:
    deep = {f"{cls.__module__}.{cls.__qualname__}": project_depth(cls) for cls in project_classes()}
    too_deep = {name: depth for name, depth in deep.items() if depth > MOST}
    assert not too_deep, f"class chains deeper than {MOST}: {too_deep}"
    assert deep["zero_core.variants.bucketed.BucketedZero2"] == MOST  # the measure sees the stages at all


def test_the_measure_fails_a_chain_of_four() -> None:
    from zero_core.variants.bucketed import BucketedZero2

    too_deep = type("TooDeep", (BucketedZero2,), {"__module__": "zero_core.variants.bucketed"})
    assert project_depth(too_deep) == MOST + 1


def runtime_classes(source: str) -> list[str]:
    """Where `source` makes a class at run time, by the function that does: a `type(name, bases, namespace)`
    call, or a class statement inside a function (a new class on every call)."""
    found = []
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.ClassDef):
                found.append(f"{function.name}(): class {node.name}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type":
                if len(node.args) == 3:
                    found.append(f"{function.name}(): type(name, bases, namespace)")
    return found


NEEDS_A_CLASS_PER_OBJECT = {"autograder/integrity.py": ["__new__(): type(name, bases, namespace)"]}
"""Where no plain class does: `StudentShard` makes one class per view, whose properties alone (closures a
graded cell cannot reach) refer to the stage's shard; an attribute holding it would hand the student the
reference's collectives."""


@pytest.mark.parametrize("package", PACKAGES)
def test_no_class_is_made_at_run_time(package: str) -> None:
    made = {
        str(path.relative_to(ROOT)): where
        for path in sorted((ROOT / package).rglob("*.py"))
        if (where := runtime_classes(path.read_text()))
    }
    for path, allowed in NEEDS_A_CLASS_PER_OBJECT.items():
        if made.get(path) == allowed:
            del made[path]
    assert not made, f"classes made at run time (use a plain class and constructor options): {made}"


def test_the_scan_finds_both_ways_of_making_a_class_at_run_time() -> None:
    source = "def f(base):\n    class Inner(base):\n        pass\n    return type('T', (base,), {})\n"
    assert sorted(runtime_classes(source)) == ["f(): class Inner", "f(): type(name, bases, namespace)"]
