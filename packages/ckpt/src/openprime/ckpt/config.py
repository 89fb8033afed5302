"""The checkpoint config: when, how and how many checkpoints a node keeps."""

from __future__ import annotations

import enum

from openprime.core.config import config, field, instance_of, one_of_enum, positive_float, positive_int


class SaveMode(enum.Enum):
    """How a checkpoint is written."""

    OFF = "off"  # no checkpoints (throwaway runs, tests)
    SYNC = "sync"  # training waits until the checkpoint is on disk
    ASYNC = "async"  # training waits only for a snapshot in host memory; the write overlaps training


@config
class CheckpointConfig:
    """Checkpoints of one node: the defaults write one at every INTELLECT-1 outer step and keep two."""

    mode: SaveMode = field(SaveMode.ASYNC, doc="off, sync or async (snapshot, then write in the background)",
                           validator=one_of_enum(SaveMode))
    interval_steps: int = field(100, doc="inner steps between checkpoints; a multiple of diloco.num_inner_steps",
                                validator=positive_int())
    num_keep: int = field(2, doc="newest checkpoints kept; older ones are deleted after a save succeeds",
                          validator=positive_int())
    directory: str = field("", doc="where checkpoints go; empty: RUN_DIR/checkpoints", validator=instance_of(str))
    stop_wait_s: float = field(900.0, doc="how long a stopped launch waits for a node's checkpoint write under way "
                               "before it kills the node, losing that save (older ones stay)",
                               validator=positive_float())
