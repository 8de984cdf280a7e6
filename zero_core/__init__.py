"""zero_core: a byte-counting virtual GPU cluster and reference ZeRO-0/1/2/3 (arXiv:1910.02054).

Submodules are imported on first use, so that `zero_core.formulas` and `zero_core.units` stay pure
arithmetic and never load torch.
"""

from importlib import import_module
from typing import Any

__all__ = ["VirtualCluster"]


def __getattr__(name: str) -> Any:
    if name == "VirtualCluster":
        return import_module("zero_core.cluster").VirtualCluster
    raise AttributeError(f"module 'zero_core' has no attribute {name!r}")
