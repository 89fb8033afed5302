"""Helpers for tests that watch a run's metrics while its node processes train (tests/test_elastic*.py).

Test modules run under --import-mode=importlib and cannot import each other, so what several of them need
lives here, as openprime.core.testing does for the transports. Every wait is bounded.
"""

from __future__ import annotations

import multiprocessing as mp
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from openprime.train.metrics import METRICS_FILE, MetricsTail, read_records

Records = list[dict[str, Any]]
POLL_S = 0.1  # how often a wait polls the metrics file or its condition


def run_records(run_dir: pathlib.Path) -> Records:
    """The run's metrics records so far (none before the first node wrote one)."""
    return read_records(run_dir) if (run_dir / METRICS_FILE).exists() else []


def wait_for(run_dir: pathlib.Path, predicate: Callable[[Records], bool], timeout_s: float = 120, *,
             unless_dead: Sequence[mp.Process] = ()) -> None:
    """Until `predicate(records)`; fails at `timeout_s`, or at once when every process of `unless_dead` died."""
    tail = MetricsTail(run_dir)  # reads only what was appended since the last poll
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        tail.poll()
        if predicate(tail.records):
            return
        if unless_dead and not any(p.is_alive() for p in unless_dead):
            raise AssertionError(f"the processes died first: {[(p.name, p.exitcode) for p in unless_dead]}")
        time.sleep(POLL_S)
    raise AssertionError(f"condition not reached in {timeout_s}s")


def outer_records(recs: Records, node: int) -> Records:
    """`node`'s "outer" records, in the order written."""
    return [r for r in recs if r["kind"] == "outer" and r["node"] == node]


def outer_done(node: int, outer_step: int) -> Callable[[Records], bool]:
    """A predicate for `wait_for`: `node` finished outer step `outer_step` (or a later one)."""
    return lambda recs: any(r["outer_step"] >= outer_step for r in outer_records(recs, node))


def wait_until(condition: Callable[[], bool], timeout_s: float) -> None:
    """Until `condition()` (of anything but the metrics, e.g. the in-process coordinator's state); fails at
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"condition not reached in {timeout_s}s"
        time.sleep(POLL_S)
