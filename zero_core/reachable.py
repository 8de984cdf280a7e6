"""Every storage reachable from a rank's objects: the check of the memory ledger that trusts nobody.

The memory tracker counts what a rank allocates; this module finds what a rank *holds*, by walking
from a few roots (a stage, the loss whose autograd graph backward will run) through attributes,
containers, closures, modules, each tensor's `.grad` and `grad_fn`, the autograd graph's nodes and the
tensors they saved for backward, and an autograd Function's `ctx`. Tests compare the two: a storage
that is reachable but not named on the ledger is memory the course's numbers would leave out.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from zero_core.memory import UNLABELLED, MemoryTracker

_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, range)
_OPAQUE = (type, types.ModuleType, types.FrameType, types.CodeType)


@dataclass(frozen=True)
class ReachedStorage:
    """A storage found by the walk: its size now, and the first path that reached it."""

    key: int
    nbytes: int
    path: str
    device: str = "cpu"


def reachable_storages(*roots: tuple[str, Any], stop: tuple[type, ...] = ()) -> dict[int, ReachedStorage]:
    """The storages reachable from `roots` (pairs of a name and an object), keyed like
    `memory.storage_key`. Objects of a `stop` type (shared infrastructure, such as the cluster every rank
    talks to) are not entered."""
    found: dict[int, ReachedStorage] = {}
    seen: set[int] = set()
    stack = list(reversed(roots))
    while stack:
        path, obj = stack.pop()
        if isinstance(obj, _ATOMS) or isinstance(obj, _OPAQUE) or isinstance(obj, stop) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            found.setdefault(
                storage._cdata, ReachedStorage(storage._cdata, storage.nbytes(), path, storage.device.type)
            )
        stack.extend(reversed(list(_children(path, obj))))
    return found


def unaccounted(reached: dict[int, ReachedStorage], tracker: MemoryTracker) -> list[tuple[ReachedStorage, str]]:
    """The reached storages the tracker does not name at their true size, each with what the tracker says
    of it; storages of no bytes (ZeRO-3's released gather buffers) hold nothing and are left out."""
    held = tracker.held_storages()
    gaps = []
    for found in reached.values():
        if not found.nbytes:
            continue
        entry = held.get(found.key)
        if entry is None:
            gaps.append((found, "not on the ledger"))
        elif entry.category in UNLABELLED:
            gaps.append((found, f"counted as {entry.category}"))
        elif entry.nbytes != found.nbytes:
            gaps.append((found, f"counted as {entry.nbytes:,} bytes"))
    return gaps


def _children(path: str, obj: Any) -> Iterator[tuple[str, Any]]:
    """What `obj` holds, with the path to each part."""
    if isinstance(obj, torch.Tensor):
        if obj.is_leaf:
            yield f"{path}.grad", obj.grad
        yield f"{path}.grad_fn", obj.grad_fn
        yield from _attributes(path, obj)
    elif _is_autograd_node(obj):
        yield from _node_children(path, obj)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield f"{path}[{key!r}]", value
    elif isinstance(obj, list | tuple | set | frozenset):
        for index, value in enumerate(obj):
            yield f"{path}[{index}]", value
    elif isinstance(obj, types.FunctionType):
        for cell, name in zip(obj.__closure__ or (), obj.__code__.co_freevars, strict=True):
            try:
                yield f"{path}.<closure {name}>", cell.cell_contents
            except ValueError:  # a cell not filled yet
                continue
        yield f"{path}.__defaults__", obj.__defaults__
        yield f"{path}.__kwdefaults__", obj.__kwdefaults__
    elif isinstance(obj, types.MethodType):
        yield f"{path}.__self__", obj.__self__
    else:
        yield from _attributes(path, obj)  # an nn.Module's parameters and submodules are in its __dict__


def _attributes(path: str, obj: Any) -> Iterator[tuple[str, Any]]:
    """An object's instance attributes, from its `__dict__` and its `__slots__`."""
    for name, value in getattr(obj, "__dict__", {}).items():
        yield f"{path}.{name}", value
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                yield f"{path}.{name}", getattr(obj, name)


def _is_autograd_node(obj: Any) -> bool:
    return isinstance(obj, torch.autograd.graph.Node)


def _node_children(path: str, node: Any) -> Iterator[tuple[str, Any]]:
    """An autograd node's inputs' nodes, what it saved for backward, and (a custom Function) its ctx."""
    for index, (child, _) in enumerate(node.next_functions):
        yield f"{path}.next_functions[{index}]<{type(child).__name__}>", child
    variable = getattr(node, "variable", None)
    if isinstance(variable, torch.Tensor):
        yield f"{path}.variable", variable
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        yield from _attributes(path, node)
        yield from _saved(path, node, "saved_tensors")
    else:
        for attribute in dir(node):
            if attribute.startswith("_saved_"):
                yield from _saved(path, node, attribute)


def _saved(path: str, node: Any, attribute: str) -> Iterator[tuple[str, Any]]:
    """A saved-for-backward attribute, unless backward has already freed it, or it is a Python number.

    Autograd saves a Python number operand (`scores * 0.125`) as a 0-d double or long tensor, a "wrapped
    number", which stays a CPU scalar even when the computation runs on a GPU: no device memory.
    """
    try:
        value = getattr(node, attribute)
    except RuntimeError:
        return
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype in (torch.float64, torch.int64):
        return
    yield f"{path}.{attribute}", value
