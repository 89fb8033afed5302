"""`openprime status RUN_DIR`: where a run stands, read from its directory while it trains or after it ended.

A run of weeks is looked at from a terminal far from its nodes' logs. What its directory holds answers the
questions asked then: is a launch still running in it (the run-directory lock's record of this machine's
launch, openprime.train.run_lock), how far it is (the nodes' step and outer-step records in metrics.jsonl),
whether the replicas agree (the global-state hashes of the last outer step), how long ago a node last wrote,
and what is saved (the newest checkpoint that finished saving, and the saves that did not). Nothing is locked
or written: reading never gets in the way of the launch.
"""

from __future__ import annotations

import pathlib
import time
from typing import Any

import attrs

from openprime.ckpt import list_steps
from openprime.core.errors import ConfigError
from openprime.train.checkpointing import newest_saved, resolved_config, run_checkpoint_root
from openprime.train.metrics import METRICS_FILE, read_records, summarize_records
from openprime.train.run_lock import LOCK_NAME, lock_holders


@attrs.frozen
class NodeStatus:
    """One node's latest records."""

    node: int
    step: int  # where its newest record puts it: an inner step, or the step it started, resumed or joined at
    loss: float | None  # of its newest inner step; None before its first
    seconds_ago: float  # since its last record of any kind
    ended: bool  # it wrote its "end" record
    num_skipped: int  # inner steps skipped for a NaN/inf gradient


@attrs.frozen
class RunStatus:
    name: str
    num_steps: int
    launch: str | None  # this machine's launch running in the directory (pid, start, command), if any
    nodes: list[NodeStatus]
    outer_step: int | None  # the newest outer step any node finished
    members: int | None  # nodes in it
    hashes_agree: bool | None  # the nodes that finished it hold the same global state
    val_loss: tuple[int, float] | None  # (step, validation loss) of the newest evaluation
    saved: int | None  # newest checkpoint step that finished saving
    unfinished: list[int]  # checkpoint steps after it that were begun (records, directories) but not finished


def run_status(run_dir: pathlib.Path, *, now: float | None = None) -> RunStatus:
    """What `run_dir` says of its run; ConfigError if it holds none."""
    resolved = resolved_config(run_dir)  # the newest launch's: a resume may move the checkpoints or the end
    if resolved is None:
        raise ConfigError(f"{run_dir} holds no run (no config.json): give the --run-dir of an `openprime run`")
    records = read_records(run_dir) if (run_dir / METRICS_FILE).exists() else []
    now = time.time() if now is None else now
    summary = summarize_records(records)
    last: dict[int, dict[str, Any]] = {}
    last_step: dict[int, dict[str, Any]] = {}
    ended = set()
    position: dict[int, int] = {}  # node -> the step of its newest record that names one
    for r in records:
        node = r["node"]
        last[node] = r
        if isinstance(r.get("step"), int):
            position[node] = r["step"]
        if r["kind"] == "step":
            last_step[node] = r
        elif r["kind"] == "end":
            ended.add(node)
        elif r["kind"] == "start":
            ended.discard(node)
            last_step.pop(node, None)  # a node number another launch used before: its loss is not this one's
    # A node that joined took the run's step with the state (its start and outer records say it); before 2026-12-07
    # one that left before its first inner step read "step 0, loss nan".
    nodes = [NodeStatus(node=node, step=position.get(node, 0),
                        loss=last_step[node]["loss"] if node in last_step else None,
                        seconds_ago=now - r["time"], ended=node in ended,
                        num_skipped=summary.num_skipped.get(node, 0))
             for node, r in sorted(last.items())]
    outer = summary.hashes  # outer step -> node -> global-state hash
    newest = max(outer, default=None)
    root = run_checkpoint_root(run_dir, resolved)
    saved = newest_saved(root)
    return RunStatus(name=resolved["name"], num_steps=resolved["train"]["num_steps"],
                     launch=lock_holders(run_dir / LOCK_NAME),
                     nodes=nodes, outer_step=newest, members=len(outer[newest]) if newest is not None else None,
                     hashes_agree=len(set(outer[newest].values())) == 1 if newest is not None else None,
                     # The summary's, not every record's: those of a timeline that a resume from an older step
                     # abandoned named its later saves unfinished and showed its validation loss.
                     val_loss=summary.val_loss, saved=saved,
                     unfinished=sorted(s for s in set(summary.checkpoint_steps).union(list_steps(root))
                                       if saved is None or s > saved))


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def format_status(s: RunStatus, run_dir: pathlib.Path) -> str:
    launch = f"running here ({s.launch})" if s.launch else "no launch of this machine is running in it"
    lines = [f"run {s.name!r} in {run_dir}: {launch}"]
    if s.outer_step is not None:
        agree = "global state hashes identical" if s.hashes_agree else "global state hashes DIFFER"
        lines.append(f"  outer step {s.outer_step}: {s.members} node(s), {agree}")
    for n in s.nodes:
        state = "ended" if n.ended else f"last record {_ago(n.seconds_ago)}"
        skipped = f", {n.num_skipped} step(s) skipped for a NaN/inf gradient" if n.num_skipped else ""
        loss = f"loss {n.loss:.4f}" if n.loss is not None else "no inner step yet"
        lines.append(f"  node {n.node}: step {n.step}/{s.num_steps}, {loss}, {state}{skipped}")
    if not s.nodes:
        lines.append("  no node has written a record yet")
    if s.val_loss is not None:
        lines.append(f"  validation loss {s.val_loss[1]:.4f} at step {s.val_loss[0]}")
    unfinished = f"; the saves of step(s) {s.unfinished} did not finish" if s.unfinished else ""
    saved = f"newest step {s.saved}" if s.saved is not None else "none saved"
    lines.append(f"  checkpoints: {saved}{unfinished}")
    return "\n".join(lines)
