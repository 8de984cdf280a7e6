"""The planner never imports the simulator, however indirectly: not at the top, not in a function, not for types.

The planner (`zero_core.planner`) answers for clusters the course never runs, from formulas and machine facts.
If one of its modules reached the ledger, a rank's context or a stage, its answers could change with the
simulator and it would load torch to size a model on paper. Every import statement counts, wherever it stands
(an import under `TYPE_CHECKING` today is a real one tomorrow), and so does every course module it reaches.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.import_graph import ROOT, import_chain, import_graph

SIMULATOR = tuple(
    f"zero_core.{name}"
    for name in (
        "cluster",
        "dist",
        "memory",
        "context",
        "backends",
        "stages",
        "experiment",
        "model",
        "optim",
        "partition",
        "oracle",
        "comm",
        "flops",
        "trace",
        "stage_pool",
        "launch",
    )
)
"""What runs ranks, collectives and stages (and counts them): a module is the simulator's if it is one of these
or inside one."""


def is_simulator(module: str) -> bool:
    return any(module == root or module.startswith(root + ".") for root in SIMULATOR)


def simulator_chains(root: Path, package: str = "zero_core.planner") -> list[list[str]]:
    """Each simulator module that `package`'s modules reach, as the shortest chain of imports that reaches it."""
    graph = import_graph(root, ("zero_core",))
    start = sorted(m for m in graph if m == package or m.startswith(package + "."))
    reached = sorted(m for m in graph if is_simulator(m))
    return [chain for m in reached if (chain := import_chain(graph, start, m)) is not None]


def test_the_planner_reaches_no_simulator_module() -> None:
    chains = simulator_chains(ROOT)
    assert not chains, "the planner imports the simulator (each module imports the next):\n" + "\n".join(
        " -> ".join(chain) for chain in chains
    )


def test_the_planner_loads_neither_the_simulator_nor_torch() -> None:
    """What the walk says, checked by importing: the modules the planner loads, in a fresh interpreter."""
    planner = sorted(p.stem for p in (ROOT / "zero_core" / "planner").glob("*.py") if p.stem != "__init__")
    code = (
        "import importlib, sys\n"
        f"for name in {planner!r}:\n"
        "    importlib.import_module('zero_core.planner.' + name)\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    modules = loaded.stdout.split()
    assert [m for m in modules if is_simulator(m) or m == "torch" or m.startswith("torch.")] == []


def test_the_walk_finds_an_import_in_a_function_or_for_types_through_a_pure_looking_module(tmp_path: Path) -> None:
    planner = tmp_path / "zero_core" / "planner"
    planner.mkdir(parents=True)
    (tmp_path / "zero_core" / "__init__.py").write_text("")
    (planner / "__init__.py").write_text('"""A planner."""\n')
    (planner / "steps.py").write_text("from zero_core import helper\n\n\ndef f():\n    from . import sizes\n")
    (planner / "sizes.py").write_text("def g():\n    from zero_core.comm import PCIE_OPS\n    return PCIE_OPS\n")
    (tmp_path / "zero_core" / "helper.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .memory import MemoryTracker\n"
    )
    for simulator in ("comm", "memory"):
        (tmp_path / "zero_core" / f"{simulator}.py").write_text("")
    assert sorted(simulator_chains(tmp_path)) == [
        ["zero_core.planner.sizes", "zero_core.comm"],
        ["zero_core.planner.steps", "zero_core.helper", "zero_core.memory"],
    ]


def test_the_walk_passes_a_planner_that_reads_only_formulas(tmp_path: Path) -> None:
    planner = tmp_path / "zero_core" / "planner"
    planner.mkdir(parents=True)
    (tmp_path / "zero_core" / "__init__.py").write_text("from importlib import import_module\n")
    (planner / "__init__.py").write_text("")
    (planner / "steps.py").write_text("import math\n\nfrom zero_core import formulas\n")
    (tmp_path / "zero_core" / "formulas.py").write_text("from zero_core.ring import PCIE_OPS\n")
    (tmp_path / "zero_core" / "ring.py").write_text("PCIE_OPS = ('d2h', 'h2d')\n")
    assert simulator_chains(tmp_path) == []
