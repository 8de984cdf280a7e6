"""The import graph of the course's packages, read from the source: every import statement counts.

An import at the top, inside a function or under `TYPE_CHECKING` is an edge alike. What the walk cannot see
is an import by a computed name (`importlib.import_module(f"...{name}")`), which the stage registry uses to
load a stage's module only when it is named. Used by `test_import_graph.py` (no circles) and
`test_planner_apart.py` (the planner reaches no simulator module).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
def module_names(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Every module of `packages` under `root`, by dotted name (a package by its own name)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def imported_modules(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that `source` (module `module`) imports anywhere in its text.

    `from package import name` imports `package.name` when that is a module, else `package` itself.
    """
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import zero_core.stages.base as b` names a module; a
                target = target.rpartition(".")[0]  # name inside one resolves to its module
            if target and target != module:
                found.add(target)
    return found


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    modules = module_names(root, packages)
    known = set(modules)
    return {
        name: imported_modules(path.read_text(), name, path.name == "__init__.py", known)
        for name, path in modules.items()
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected group of more than one module (Tarjan), as one circle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_path_through(graph, group) for group in groups]


def _path_through(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """A circle of imports inside `group` from its first module back to it (breadth first: the shortest)."""
    start, members = group[0], set(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for other in sorted(graph[node] & members):
                if other == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if other not in came_from:
                    came_from[other] = node
                    following.append(other)
        frontier = following
    return group


def import_chain(graph: dict[str, set[str]], start: list[str], reached: str) -> list[str] | None:
    """The shortest chain of imports from one of `start` to `reached`, or None if none reaches it."""
    came_from: dict[str, str | None] = dict.fromkeys(start)
    frontier = list(start)
    while frontier:
        following = []
        for node in frontier:
            if node == reached:
                chain = [node]
                while came_from[chain[-1]] is not None:
                    chain.append(came_from[chain[-1]])
                return chain[::-1]
            for other in sorted(graph.get(node, ())):
                if other not in came_from:
                    came_from[other] = node
                    following.append(other)
        frontier = following
    return None
