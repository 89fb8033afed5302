"""openprime.diloco: the DiLoCo outer loop (INTELLECT-1 paper, section 2.1) around an ordinary loop."""

from openprime.diloco.config import (
    Compression,
    DiLoCoConfig,
    OuterLrSchedule,
    OuterOptimizer,
    PseudoGradientDevice,
    RecoveryMode,
)
from openprime.diloco.diloco import DiLoCo, OuterStepResult
from openprime.diloco.outer import OuterState, outer_update_
from openprime.diloco.recovery import ExtraState

__all__ = [
    "Compression",
    "DiLoCo",
    "DiLoCoConfig",
    "ExtraState",
    "OuterLrSchedule",
    "OuterOptimizer",
    "OuterState",
    "OuterStepResult",
    "PseudoGradientDevice",
    "RecoveryMode",
    "outer_update_",
]
