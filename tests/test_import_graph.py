"""The course's packages import in one direction: no module imports, however indirectly, one that imports it.

An import circle is a design that two modules each need the other's inside; it is held together only by an
import deferred into a function or behind `TYPE_CHECKING`, and a reader following either file climbs back
to where they started. So every import counts here (`tests/import_graph.py`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.import_graph import ROOT, circles, import_graph

PACKAGES = ("zero_core", "autograder")


def test_the_packages_have_no_import_circles() -> None:
    found = circles(import_graph(ROOT, PACKAGES))
    assert not found, "import circles (each module imports the next):\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_walk_sees_imports_inside_functions_and_type_checking_blocks(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import High\n"
    )
    (package / "high.py").write_text("def f():\n    from . import low\n    return low\n")
    (package / "other.py").write_text("import pkg.low as low\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.low"] == {"pkg.high"}
    assert graph["pkg.high"] == {"pkg.low"}
    assert graph["pkg.other"] == {"pkg.low"}
    assert circles(graph) == [["pkg.high", "pkg.low", "pkg.high"]]


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, [["a", "b", "c", "a"]]),
        ({"a": {"b", "c"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["c", "d", "c"], ["a", "b", "a"]]),
    ],
)
def test_circles_are_found_and_named_in_import_order(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert circles(graph) == expected


LAYERS = (
    ("units", "facts", "ring", "formulas", "topology", "configurations", "quantized_bytes", "quantize"),
    ("context",),
    ("comm", "memory", "schedule", "flops", "reachable"),
    ("backends", "call_sites", "cluster", "cpu_turns", "dist"),
    ("model", "partition", "optim", "divergent_ranks", "checkpoint_files"),
    ("registry",),
    ("stages",),
    ("variants", "answers"),
    ("experiment", "report", "stage_pool", "oracle", "divergence"),
    ("planner",),
    ("cli", "plots", "trace", "launch", "fsdp2_layout", "planner_check", "long_lived", "__main__"),
)
"""`zero_core`'s layers, as docs/architecture.md draws them: a module imports only from its layer or those before it."""


def layer_of(module: str) -> int:
    top = module.split(".")[1]
    return next(i for i, layer in enumerate(LAYERS) if top in layer)


def test_every_module_imports_only_from_its_layer_or_the_ones_before() -> None:
    graph = import_graph(ROOT, ("zero_core",))
    unplaced = sorted(m for m in graph if m != "zero_core" and not any(m.split(".")[1] in lay for lay in LAYERS))
    assert unplaced == [], f"place these modules in a layer of LAYERS and docs/architecture.md: {unplaced}"
    upward = [
        f"{module} imports {other}"
        for module, imports in sorted(graph.items())
        if module != "zero_core"
        for other in sorted(imports)
        if other != "zero_core" and layer_of(other) > layer_of(module)
    ]
    assert upward == [], "imports from a later layer:\n" + "\n".join(upward)
