"""Asynchronous checkpointing: training waits for a host-memory snapshot, not for the disk (paper, section 2.3).

`Checkpointer.save(step, state)` first waits for the previous save to finish (so at most one write is
in flight and snapshots never pile up), copies the state to host memory (the blocking part), and
hands the copy to a writer thread that writes it with `openprime.ckpt.store.write_part` and then
prunes old checkpoints. A failed write (a full disk, a permission error) is logged with its cause and
counted; the previous checkpoints stay intact and training goes on. A process killed during a write
leaves only a temporary directory, which the next successful save of that part removes. A save whose part is in
place but whose rename the disk did not confirm durable (store.SaveNotDurable) is done, with a warning, and
prunes nothing.
"""

from __future__ import annotations

import itertools
import logging
import pathlib
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from torch.distributed.checkpoint.api import CheckpointException

from openprime.ckpt.config import SaveMode
from openprime.ckpt.state import flatten, snapshot
from openprime.ckpt.store import (
    Fingerprint,
    PartsCheck,
    SaveNotDurable,
    check_num_keep,
    dcp_cause,
    prune,
    write_error_hint,
    write_part,
)

log = logging.getLogger("openprime.ckpt")


@attrs.frozen
class SaveResult:
    """What one save did: how long training was blocked, and how long the whole save took."""

    step: int
    path: pathlib.Path | None  # None when the write failed
    blocking_s: float
    total_s: float
    error: str = ""
    warning: str = ""  # a save that is done, but whose durability the disk did not confirm (store.SaveNotDurable)


class Checkpointer:
    """Saves the parts of one node (one `part` name) under a checkpoint root, synchronously or not."""

    def __init__(self, root: pathlib.Path, *, part: str, mode: SaveMode, num_keep: int,
                 usable: PartsCheck | None = None) -> None:
        """`usable`: what a step must hold to count among the `num_keep` kept (store.prune)."""
        if mode is SaveMode.OFF:
            raise ValueError("a Checkpointer with SaveMode.OFF would save nothing; do not build one")
        check_num_keep(num_keep)
        self.root, self.part, self.mode, self.num_keep, self.usable = root, part, mode, num_keep, usable
        self.results: list[SaveResult] = []
        self._thread: threading.Thread | None = None
        self._host: Any = None

    @property
    def num_failed(self) -> int:
        return sum(1 for r in self.results if r.path is None)

    def save(self, step: int, state: Mapping[str, Any], *, parts: Sequence[str],
             fingerprint: Fingerprint | None = None) -> float:
        """Checkpoint `state` as step `step`; returns the seconds training was blocked.

        `parts` names every part this step needs (the nodes of the outer step), so that a resume can tell
        a complete step from one that some node did not finish; `fingerprint`, what this part shares with them
        (store.Fingerprint), so that it can tell a step that mixes two saves of it. A state that can never be
        saved (a value neither a tensor nor JSON) raises TypeError here, before anything is written.
        """
        # A value that is neither a tensor nor JSON (numpy's int64, an object) fails every save of this state, not
        # this one: in the writer thread it was logged as a failed write ("is the disk full?") and the run went on
        # saving nothing. The TypeError names the value to convert. (Walks the state; copies no tensor.)
        flatten(state)
        start = time.monotonic()
        self.wait()
        host = self._host = snapshot(state, reuse=self._host)  # the previous snapshot is on disk: reuse its memory
        blocking_s = time.monotonic() - start
        if self.mode is SaveMode.SYNC:
            self._write(step, host, tuple(parts), fingerprint, start, blocking_s)
            return time.monotonic() - start
        self._thread = threading.Thread(target=self._write,
                                        args=(step, host, tuple(parts), fingerprint, start, blocking_s),
                                        name=f"ckpt-{self.part}-{step}", daemon=True)
        self._thread.start()
        return blocking_s

    def wait(self) -> SaveResult | None:
        """Wait for the save in flight, if any; returns the newest result."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self.results[-1] if self.results else None

    def close(self) -> None:
        self.wait()

    def _write(self, step: int, host: Mapping[str, Any], parts: tuple[str, ...], fingerprint: Fingerprint | None,
               start: float, blocking_s: float) -> None:
        try:
            path = write_part(self.root, step, self.part, host, parts=parts, fingerprint=fingerprint)
        except SaveNotDurable as e:
            # Complete and in place (a resume uses it): a save done, not failed. Only a power cut could lose it, so
            # no older checkpoint is pruned on its account; the next confirmed save prunes them.
            self.results.append(SaveResult(step=step, path=e.path, blocking_s=blocking_s,
                                           total_s=time.monotonic() - start, warning=str(e.cause)))
            log.warning("checkpoint of step %d saved to %s, but the disk did not confirm it durable (%s): it is "
                        "complete and in place, but a power cut might lose it; older checkpoints are kept until a "
                        "save is confirmed", step, e.path, e.cause)
            return
        except (Exception, CheckpointException) as e:  # the run must go on; the previous checkpoint is untouched
            cause = dcp_cause(e)
            self.results.append(SaveResult(step=step, path=None, blocking_s=blocking_s,
                                           total_s=time.monotonic() - start, error=cause))
            failed = list(itertools.takewhile(lambda r: r.path is None, reversed(self.results)))
            newest = next((r.step for r in reversed(self.results) if r.path is not None), None)
            log.error("checkpoint of step %d (%s) under %s FAILED: %s (%s); %d save(s) of this part "
                      "failed in a row, %s; training continues, but a crash would lose the steps since",
                      step, self.part, self.root, cause, write_error_hint(e), len(failed),
                      f"its newest save is step {newest}" if newest is not None else "no save of it finished yet")
            return
        try:
            later = prune(self.root, self.part, num_keep=self.num_keep, saved=step, usable=self.usable)
            if later:
                log.warning("checkpoints of later steps %s under %s are left alone: they are not this run's timeline "
                            "(it resumed from an older step), and `--resume latest` takes the newest complete one",
                            later, self.root)
        except Exception as e:  # the save is done and in place whatever went wrong after it: an error
            # other than OSError here (a part's state.json half-written by another machine, a `usable` check's bug)
            # ended the writer thread before this save's result was recorded, and it read as never saved
            log.warning("could not prune old checkpoints under %s: %s: %s", self.root, type(e).__name__, e)
        self.results.append(SaveResult(step=step, path=path, blocking_s=blocking_s, total_s=time.monotonic() - start))
        log.info("checkpoint of step %d saved to %s in %.2fs (training blocked %.2fs)", step, path,
                 self.results[-1].total_s, blocking_s)
