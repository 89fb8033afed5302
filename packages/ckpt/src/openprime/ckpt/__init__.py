"""openprime.ckpt: checkpoints that never lose a run (DESIGN.md, "Live checkpoint recovery")."""

from openprime.ckpt.config import CheckpointConfig, SaveMode
from openprime.ckpt.manifest import CorruptCheckpoint, verify_manifest
from openprime.ckpt.saver import Checkpointer, SaveResult
from openprime.ckpt.store import (
    Checkpoint,
    CheckpointMismatch,
    CheckpointNotFound,
    Fingerprint,
    PartsCheck,
    SaveNotDurable,
    abandoned_steps,
    check_compatible,
    latest,
    list_steps,
    prune,
    read_part,
    resolve,
    step_dir,
    write_part,
    writing_pids,
)

__all__ = [
    "Checkpoint",
    "CheckpointConfig",
    "CheckpointMismatch",
    "CheckpointNotFound",
    "Checkpointer",
    "CorruptCheckpoint",
    "Fingerprint",
    "PartsCheck",
    "SaveMode",
    "SaveNotDurable",
    "SaveResult",
    "abandoned_steps",
    "check_compatible",
    "latest",
    "list_steps",
    "prune",
    "read_part",
    "resolve",
    "step_dir",
    "verify_manifest",
    "write_part",
    "writing_pids",
]
