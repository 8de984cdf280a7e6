"""Check a notebook's graded cells against the rules of `autograder.policy`, on their syntax trees.

`GradedCells(forbidden, setup)` reads the notebook's setup cells (trusted: what they import is allowed, and
the names they bind are known), then `check` takes the solution cells in the notebook's order and returns
the rules each breaks (`policy.Problem`: line, rule, what to do instead). Names are resolved as Python
resolves them (`symtable`): a variable called `vars`, or `self` in a method of the cell's own class, is the
student's, whatever it is called. A chain of attributes on an imported module (`torch.sys.modules`) is
followed through the modules themselves, imported here only if they are on the list: the grader's process
runs no code of the cell.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import symtable
import sys
import types
from collections.abc import Iterable
from typing import Any

from autograder.policy import (
    ALLOWED_MODULES,
    BY_NAME,
    DUNDERS,
    ESCAPE,
    ESCAPE_BUILTINS,
    ESCAPES,
    FRAME_ATTRIBUTES,
    IMPORTS,
    OFF_LIMITS,
    PRIVATE,
    REFUSED_MODULES,
    Problem,
    module_of,
    under,
)


def _is_module(path: str) -> bool:
    try:
        return importlib.util.find_spec(path) is not None
    except (ImportError, ValueError):
        return False


def imported_names(source: str) -> dict[str, str]:
    """{name: dotted path} for each name the cell's imports bind (`import torch.nn` binds `torch`)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                path = alias.name if alias.asname else alias.name.split(".")[0]
                names[alias.asname or path] = path
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update({alias.asname or alias.name: f"{node.module}.{alias.name}" for alias in node.names})
    return names


class GradedCells:
    """The rules for one notebook: `setup` is its setup cells' code (trusted: what they import is allowed
    and what they bind is known), then `check` each solution cell in the notebook's order."""

    def __init__(self, forbidden: tuple[str, ...], setup: Iterable[str] = ()) -> None:
        self.forbidden = forbidden
        self.bound: dict[str, str] = {}
        """Names bound by the imports of the cells before the one checked: {name: dotted path}."""
        for source in setup:
            self.bound.update(imported_names(source))
        paths = [path for path in self.bound.values() if not self.off_limits(path)]
        imported = {path if _is_module(path) else path.rpartition(".")[0] for path in paths}
        self.allowed = ALLOWED_MODULES + tuple(sorted(module for module in imported if module))

    def check(self, source: str) -> list[Problem]:
        """The rules this cell breaks, in line order; a cell that does not parse breaks none (it fails to run)."""
        try:
            tree = ast.parse(source)
            table = symtable.symtable(source, "<cell>", "exec")
        except SyntaxError:
            return []
        checker = _Checker(self, source, tree, table)
        checker.visit(tree)
        self.bound.update(imported_names(source))
        return sorted(set(checker.problems), key=lambda p: (p.line, p.text))

    def off_limits(self, module: str) -> str | None:
        return under(module, self.forbidden)

    def on_the_list(self, module: str) -> bool:
        private = any(part.startswith("_") for part in module.split(".")) and module != "__future__"
        return not private and not under(module, REFUSED_MODULES) and under(module, self.allowed) is not None

    def holds_allowed(self, package: str) -> bool:
        """Is `package` a package of a module on the list (`zero_core`)?"""
        return any(module.startswith(package + ".") for module in self.allowed)

    def load(self, path: str) -> Any:
        """The module or object `path` names, imported only from modules on the list (or their packages, such
        as `zero_core`); None for anything else."""
        if self.off_limits(path):
            return None
        if self.on_the_list(path) or self.holds_allowed(path):
            try:
                return importlib.import_module(path)
            except ImportError:
                pass
        parent, _, name = path.rpartition(".")
        module = self.load(parent) if parent else None
        return getattr(module, name, None) if isinstance(module, types.ModuleType) else None


def _escapes() -> dict[int, str]:
    """{id of the function: `ESCAPES`'s line on it}, for the modules already imported: imports nothing itself
    (the checker has imported what a cell names before it looks a value up), so checking a cell in a grading
    child, behind its audit hook, never loads torch for a cell that does not use it."""
    found = {}
    for path, what in ESCAPES.items():
        module, _, name = path.rpartition(".")
        loaded = sys.modules.get(module)
        if loaded is not None and hasattr(loaded, name):
            found[id(getattr(loaded, name))] = f"{path}: it {what}"
    return found


_PARSER_LINES = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


class _Checker(ast.NodeVisitor):
    """One cell's walk: the scopes it is in (from `symtable`), and the problems found."""

    def __init__(self, rules: GradedCells, source: str, tree: ast.AST, table: symtable.SymbolTable) -> None:
        self.rules, self.imports = rules, imported_names(source)
        self.lines = _PARSER_LINES.findall(source)
        """The cell's lines, ends kept, split where the parser splits them (not at a form feed)."""
        self.scopes: list[tuple[symtable.SymbolTable, ast.AST | None]] = [(table, None)]
        self.tables = {(t.get_lineno(), t.get_name()): t for t in _all_tables(table)}
        self.stored = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
        """Names the cell assigns (not by `def` or `class`): a class name assigned too is not surely a class."""
        self.called: set[int] = set()
        """The `Name` nodes of `getattr`-like calls with a literal name: judged at the call."""
        self.problems: list[Problem] = []

    # -- where a name comes from ----------------------------------------------------------------------

    def _binding(self, name: str) -> tuple[int, symtable.Symbol] | None:
        """(index in `scopes` of the scope that binds `name` where it is used, its symbol there); None if the
        cell does not bind it: a builtin, or a name of the cells before."""
        for index in range(len(self.scopes) - 1, -1, -1):
            table = self.scopes[index][0]
            if index and index < len(self.scopes) - 1 and table.get_type() == "class":
                continue  # a class body's names are not visible inside its methods
            try:
                symbol = table.lookup(name)
            except KeyError:
                continue
            if index and (symbol.is_global() or symbol.is_declared_global()):
                try:
                    index, symbol = 0, self.scopes[0][0].lookup(name)
                except KeyError:
                    return None
            elif symbol.is_free():
                continue
            bound = symbol.is_assigned() or symbol.is_imported() or symbol.is_parameter() or symbol.is_namespace()
            return (index, symbol) if bound else None
        return None

    def _own(self, node: ast.expr) -> bool:
        """Is `node` the cell's own object: the first parameter of a method of a class the cell defines (not
        a static method, never rebound), or a class the cell defines (its name never assigned otherwise)?"""
        if not isinstance(node, ast.Name):
            return False
        found = self._binding(node.id)
        if found is None:
            return False
        index, symbol = found
        if symbol.is_namespace() and not symbol.is_parameter():
            classes = all(t.get_type() == "class" for t in symbol.get_namespaces())
            return classes and node.id not in self.stored and not symbol.is_imported()
        table, function = self.scopes[index]
        if not symbol.is_parameter() or symbol.is_assigned() or not isinstance(table, symtable.Function):
            return False
        in_class = index > 0 and self.scopes[index - 1][0].get_type() == "class"
        decorators = getattr(function, "decorator_list", [])
        static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in decorators)
        parameters = table.get_parameters()
        return in_class and not static and bool(parameters) and parameters[0] == node.id

    def _resolve(self, node: ast.expr) -> Any:
        """The module (or a module's attribute) `node` names, if it is a chain of public attributes on a name
        bound by an import; None otherwise."""
        if isinstance(node, ast.Name):
            found = self._binding(node.id)
            if found is None:
                path = self.rules.bound.get(node.id)
            elif found[1].is_imported():
                path = self.imports.get(node.id)
            else:
                return None
            return self.rules.load(path) if path else None
        if isinstance(node, ast.Attribute) and not node.attr.startswith("_"):
            base = self._resolve(node.value)
            if not isinstance(base, types.ModuleType):
                return None
            value = getattr(base, node.attr, None)  # a submodule not imported yet is no attribute, but loads
            return self.rules.load(f"{base.__name__}.{node.attr}") if value is None else value
        return None

    # -- reporting ------------------------------------------------------------------------------------

    def _code(self, node: ast.AST) -> str:
        code = " ".join((self._segment(node) or ast.unparse(node)).split())
        return code if len(code) <= 70 else code[:67] + "..."

    def _segment(self, node: ast.AST) -> str | None:
        """`ast.get_source_segment` of the cell for `node`, given only the node's own lines: that function splits
        the whole cell, a character at a time, on every call, and the walk quotes every attribute it checks."""
        if getattr(node, "end_lineno", None) is None or getattr(node, "end_col_offset", None) is None:
            return None
        lines = self.lines[node.lineno - 1 : node.end_lineno]
        span = types.SimpleNamespace(
            lineno=1, end_lineno=len(lines), col_offset=node.col_offset, end_col_offset=node.end_col_offset
        )
        return ast.get_source_segment("".join(lines), span)

    def _report(self, node: ast.AST, rule: str, text: str) -> None:
        self.problems.append(Problem(getattr(node, "lineno", 0), rule, text))

    def _check_module(self, node: ast.AST, module: str, how: str) -> None:
        """Report `module` if the cell may not use it (`how` quotes where the cell names it)."""
        if self.rules.off_limits(module):
            self._report(
                node,
                OFF_LIMITS,
                f"{how} uses {module}, which is off limits in this exercise (it holds the reference implementation "
                "of what you are asked to write, or grades it): write that code yourself",
            )
        elif under(module, REFUSED_MODULES):
            self._report(
                node,
                IMPORTS,
                f"{how} uses the module {module}, which compiles or loads code the cell does not show: a graded "
                "cell does not use it",
            )
        elif not self.rules.on_the_list(module):
            self._report(
                node,
                IMPORTS,
                f"{how} uses the module {module}, which is not on the list of modules a graded cell may import "
                "(the rules below): remove it, and use torch and the zero_core modules the exercise names",
            )

    def _check_value(self, node: ast.AST, value: Any, how: str) -> None:
        """Report a module or object reached through an allowed module that the cell may not use."""
        if isinstance(value, types.ModuleType):
            self._check_module(node, value.__name__, how)
        elif value is not None and self.rules.off_limits(module_of(value)):
            self._check_module(node, module_of(value), how)
        elif id(value) in (escapes := _escapes()):
            self._report(node, ESCAPE, f"{how} is {escapes[id(value)]}; a graded cell does not use it")

    def _check_attribute(self, node: ast.AST, base: ast.expr, attr: str) -> None:
        code = self._code(node)
        if attr.startswith("__") and attr.endswith("__"):
            if attr not in DUNDERS:
                self._report(
                    node,
                    PRIVATE,
                    f"`{code}`: a graded cell uses no dunder attribute but {', '.join(DUNDERS)} (the others reach "
                    "the code around yours); write what you need without it",
                )
        elif attr.startswith("_"):
            foreach = attr.startswith("_foreach_") and self._resolve(base) is importlib.import_module("torch")
            if not foreach and not self._own(base):
                self._report(
                    node,
                    PRIVATE,
                    f"`{code}`: `{attr}` starts with `_`, and a graded cell uses such names only on its own objects "
                    f"(`self.{attr}` in a method of a class it defines); use the public attributes the exercise "
                    "documents",
                )
        elif attr in FRAME_ATTRIBUTES:
            if not (isinstance(base, ast.Attribute) and base.attr in FRAME_ATTRIBUTES):  # once per chain
                self._report(
                    node, ESCAPE, f"`{code}` reaches the interpreter's frames: a graded cell does not use them"
                )
        else:
            base_module = self._resolve(base)
            path = f"{base_module.__name__}.{attr}" if isinstance(base_module, types.ModuleType) else ""
            if path and getattr(base_module, attr, None) is None and (self.rules.off_limits(path) or _is_module(path)):
                self._check_module(node, path, f"`{code}`")  # a submodule, imported or not
            else:
                self._check_value(node, self._resolve(ast.Attribute(value=base, attr=attr)), f"`{code}`")

    # -- the visit ------------------------------------------------------------------------------------

    def _scoped(self, node: ast.AST, name: str, inside: Iterable[ast.AST], outside: Iterable[ast.AST]) -> None:
        for child in outside:
            self.visit(child)
        table = self.tables.get((getattr(node, "lineno", 0), name))
        if table is not None:
            self.scopes.append((table, node))
        for child in inside:
            self.visit(child)
        if table is not None:
            self.scopes.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        annotations = [a.annotation for a in _arguments(node.args) if a.annotation is not None]
        returns = [node.returns] if node.returns else []
        outside = [*node.decorator_list, *_defaults(node.args), *annotations, *returns]
        self._scoped(node, node.name, node.body, outside)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._scoped(node, "lambda", [node.body], _defaults(node.args))

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scoped(node, node.name, node.body, [*node.decorator_list, *node.bases, *(k.value for k in node.keywords)])

    def visit_ListComp(self, node: ast.ListComp) -> None:
        self._scoped(node, "listcomp", ast.iter_child_nodes(node), [])

    def visit_SetComp(self, node: ast.SetComp) -> None:
        self._scoped(node, "setcomp", ast.iter_child_nodes(node), [])

    def visit_DictComp(self, node: ast.DictComp) -> None:
        self._scoped(node, "dictcomp", ast.iter_child_nodes(node), [])

    def visit_GeneratorExp(self, node: ast.GeneratorExp) -> None:
        self._scoped(node, "genexpr", ast.iter_child_nodes(node), [])

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._check_module(node, alias.name, f"`import {alias.name}`")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        code, module = self._code(node), node.module or ""
        if node.level or not module:
            self._report(node, IMPORTS, f"`{code}` is a relative import; a graded cell imports modules by full name")
        elif any(alias.name == "*" for alias in node.names):
            self._report(node, IMPORTS, f"`{code}`: a graded cell names what it imports (`from {module} import name`)")
        elif self.rules.off_limits(module):
            self._check_module(node, module, f"`{code}`")
        else:
            loaded = self.rules.load(module) if self.rules.on_the_list(module) else None
            for alias in node.names:
                path = f"{module}.{alias.name}"
                if alias.name.startswith("_") and not (alias.name.startswith("_foreach_") and module == "torch"):
                    self._report(node, PRIVATE, f"`{code}`: `{alias.name}` starts with `_`; import only public names")
                elif isinstance(loaded, types.ModuleType):
                    self._check_value(node, getattr(loaded, alias.name, None), f"`{code}`")
                else:  # `from zero_core import dist`: the name must be a module on the list
                    named = self.rules.off_limits(path) or self.rules.on_the_list(path)
                    submodule = named or (self.rules.holds_allowed(module) and _is_module(path))
                    self._check_module(node, path if submodule else module, f"`{code}`")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._check_attribute(node, node.value, node.attr)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        function, args = node.func, node.args
        if isinstance(function, ast.Name) and function.id in BY_NAME and self._binding(function.id) is None:
            if (
                len(args) >= 2
                and not any(isinstance(a, ast.Starred) for a in args[:2])
                and isinstance(args[1], ast.Constant)
                and isinstance(args[1].value, str)
                and args[1].value.isidentifier()
            ):
                self.called.add(id(function))
                self._check_attribute(node, args[0], args[1].value)
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        name = node.id
        if not isinstance(node.ctx, ast.Load) or self._binding(name) is not None:
            return  # the cell's own name: a variable called `vars` is the student's
        if name in self.rules.bound:
            if self.rules.off_limits(self.rules.bound[name]):
                self._check_module(node, self.rules.bound[name], f"`{name}`")
        elif name in BY_NAME and id(node) not in self.called:
            self._report(
                node,
                ESCAPE,
                f"`{self._code(node)}` is used without a literal attribute name: in a graded cell, {name} is only "
                f'called, with the name written out (`{name}(obj, "name")`); or write `obj.name`',
            )
        elif name in ESCAPE_BUILTINS:
            others = ", ".join(b for b in ESCAPE_BUILTINS if b != name)
            self._report(
                node,
                ESCAPE,
                f"`{name}` reaches code and data around yours, and a graded cell does not use it (nor {others}): "
                "write the code out",
            )
        elif name.startswith("__") and name.endswith("__") and name != "__name__":
            self._report(
                node, ESCAPE, f"`{name}` reaches the interpreter around your code: a graded cell does not use it"
            )


def _arguments(arguments: ast.arguments) -> list[ast.arg]:
    vararg = [arguments.vararg] if arguments.vararg else []
    kwarg = [arguments.kwarg] if arguments.kwarg else []
    return [*arguments.posonlyargs, *arguments.args, *vararg, *arguments.kwonlyargs, *kwarg]


def _defaults(arguments: ast.arguments) -> list[ast.expr]:
    return [*arguments.defaults, *(d for d in arguments.kw_defaults if d is not None)]


def _all_tables(table: symtable.SymbolTable) -> Iterable[symtable.SymbolTable]:
    for child in table.get_children():
        yield child
        yield from _all_tables(child)
