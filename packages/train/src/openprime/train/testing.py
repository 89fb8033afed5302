"""Helpers for tests that watch a run's metrics while its node processes train (tests/test_elastic*.py), a
standalone coordinator for nodes launched separately (tests/test_resume.py), and a way into a run's processes
(`injecting`).

Test modules run under --import-mode=importlib and cannot import each other, so what several of them need
lives here, as openprime.core.testing does for the transports. Every wait is bounded.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from openprime.core.harness import free_port  # noqa: F401  (the tests take it from here too)
from openprime.train.metrics import METRICS_FILE, MetricsTail, read_records

Records = list[dict[str, Any]]
POLL_S = 0.1  # how often a wait polls the metrics file or its condition

# Overrides of the debug recipe for the elastic tests: H = 5, fast heartbeats, short deadlines, and steps of 2
# sequences of 32 tokens instead of 8 of 128. These tests are about membership, not learning: the model (and so every
# all-reduce and state transfer) keeps its size, while a step of 3 nodes sharing 2 cores takes about 0.06 s instead of
# 0.36 s, which was most of these tests' time.
ELASTIC_H = 5
ELASTIC_FAST = (f"diloco.num_inner_steps={ELASTIC_H}", "train.log_every=20", "mesh.heartbeat_interval_s=0.5",
                "mesh.sync_timeout_s=60", "timeouts.connect_s=10", "timeouts.op_s=5", "train.seq_len=32",
                "train.batch_size=2")
# Runs as short as each test with one process a node allows (the schedule shrunk to fit): a node lost at outer step 2
# needs a few outer steps after it (SHORT), a frozen node or a restarted coordinator also the rejoin (MEDIUM), a node
# started mid-run time to start and be admitted, a few seconds on a busy machine (LONG: one started after outer step 3
# was admitted at outer step 4, half a second later; the 16 outer steps after leave it about 8 s. 150 steps until
# 2026-12-07: 5 s more of each such test).
SHORT_RUN = ("schedule.num_warmup_steps=10", "schedule.num_decay_steps=20", "train.num_steps=50")
MEDIUM_RUN = ("schedule.num_warmup_steps=10", "schedule.num_decay_steps=40", "train.num_steps=80")
LONG_RUN = ("schedule.num_warmup_steps=20", "schedule.num_decay_steps=60", "train.num_steps=100")


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


def process_ended(pid: int) -> bool:
    """The process has exited (Linux /proc; a zombie its new parent has not reaped yet counts as ended)."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def node_pids(records: Records) -> list[int]:
    """The process ids of the nodes that started, from their ids (hostname-pid-random) in the start records."""
    return [int(r["node_id"].rsplit("-", 2)[1]) for r in records if r["kind"] == "start"]


def serve_coordinator(port: int, *, min_nodes: int, store_port: int | None = None,
                      settings: Sequence[str] = ()) -> subprocess.Popen:
    """`openprime mesh serve` as a subprocess at 127.0.0.1:`port` (output discarded): a coordinator that separate
    launches join with `--join`, and that a test can kill and restart at the same ports. The caller stops it."""
    store = ("--store-port", str(store_port)) if store_port is not None else ()
    sets = [arg for setting in settings for arg in ("--set", setting)]
    return subprocess.Popen([sys.executable, "-m", "openprime.train", "mesh", "serve", "--bind",
                             f"tcp://127.0.0.1:{port}", *store, "--min-nodes", str(min_nodes), *sets],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def injecting(directory: pathlib.Path, source: str) -> dict[str, str]:
    """The environment in which every Python process of a run (launcher, fork server, nodes) first runs `source`
    (a sitecustomize.py, written under `directory`, on PYTHONPATH): how tests reach inside the nodes at a chosen
    moment."""
    inject = directory / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(source)
    return {"PYTHONPATH": os.pathsep.join([str(inject), os.environ.get("PYTHONPATH", "")])}
