"""The reference ZeRO stages: one module per stage, one interface (`ZeroStage`)."""

from zero_core.stages.base import TrainConfig, ZeroStage
from zero_core.stages.zero0 import Zero0
from zero_core.stages.zero1 import Zero1
from zero_core.stages.zero2 import Zero2
from zero_core.stages.zero3 import Zero3

STAGES: dict[int, type[ZeroStage]] = {0: Zero0, 1: Zero1, 2: Zero2, 3: Zero3}

__all__ = ["STAGES", "TrainConfig", "ZeroStage", "Zero0", "Zero1", "Zero2", "Zero3"]
