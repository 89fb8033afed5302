"""openprime.diloco: the DiLoCo outer loop (INTELLECT-1 paper, section 2.1) around an ordinary loop."""

from openprime.diloco.config import Compression, DiLoCoConfig, OuterOptimizer
from openprime.diloco.diloco import DiLoCo, OuterStepResult
from openprime.diloco.outer import OuterState, outer_update_

__all__ = [
    "Compression",
    "DiLoCo",
    "DiLoCoConfig",
    "OuterOptimizer",
    "OuterState",
    "OuterStepResult",
    "outer_update_",
]
