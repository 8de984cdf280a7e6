"""The reference ZeRO stages: one module per stage, one interface (`ZeroStage`).

The stage modules are imported when first named (`zero_core.stages.Zero2`, `STAGES`), not with the
package: the grader imports `zero_core.stages.base` and one stage's scaffolding without loading the
modules that hold an exercise's answer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from zero_core.stages.base import TrainConfig, ZeroStage

if TYPE_CHECKING:
    from zero_core.stages.zero0 import Zero0
    from zero_core.stages.zero1 import Zero1
    from zero_core.stages.zero2 import Zero2
    from zero_core.stages.zero3 import Zero3

_STAGE_MODULES = {"Zero0": "zero0", "Zero1": "zero1", "Zero2": "zero2", "Zero3": "zero3"}


def __getattr__(name: str) -> Any:
    if name in _STAGE_MODULES:
        return getattr(importlib.import_module(f"{__name__}.{_STAGE_MODULES[name]}"), name)
    if name == "STAGES":
        stages: dict[int, type[ZeroStage]] = {i: __getattr__(f"Zero{i}") for i in range(4)}
        return stages
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["STAGES", "TrainConfig", "ZeroStage", "Zero0", "Zero1", "Zero2", "Zero3"]
