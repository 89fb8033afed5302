"""Metrics of a run: one JSONL file in the run directory, written by every node, and the progress line.

Each record is one JSON object on one line with `kind` ("step", "outer", "start", "end"), `node`,
and a wall-clock `time`. Nodes append whole lines with single O_APPEND writes, so their records
interleave but never tear. `summarize` reads a run back (the launcher's closing table, the tests).

A full disk must not end a run (its checkpoints already fall back, openprime.ckpt): a record that cannot be
written is dropped with one warning per node, and the readers skip a line a short write left unfinished.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import logging
import multiprocessing as mp
import os
import pathlib
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import attrs

from openprime.train.leaving import stop_received

METRICS_FILE = "metrics.jsonl"

log = logging.getLogger("openprime.train.metrics")


class MetricsWriter:
    """Appends this node's records to the run's metrics file (and, given a directory, as TensorBoard scalars)."""

    def __init__(self, run_dir: pathlib.Path, node: int, *, tensorboard_dir: pathlib.Path | None = None) -> None:
        self.node = node
        self.num_dropped = 0  # records that could not be written
        self._fd = os.open(run_dir / METRICS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._tb = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            self._tb = SummaryWriter(str(tensorboard_dir / f"node-{node}"))

    def write(self, kind: str, **fields: Any) -> None:
        record = {"kind": kind, "node": self.node, "time": round(time.time(), 3), **fields}
        line = (json.dumps(record) + "\n").encode()
        try:
            written = os.write(self._fd, line)
            if written < len(line):  # the disk filled within the record: the rest would land after other records
                raise OSError(errno.ENOSPC, f"wrote {written} of the record's {len(line)} bytes")
        except OSError as e:  # a full disk (ENOSPC), a quota: training goes on without its records
            if not self.num_dropped:
                log.warning("node %d: cannot write its metrics (%s); training goes on, its records are dropped "
                            "until the disk has room (this warning is not repeated)", self.node, e)
            self.num_dropped += 1
        if self._tb is not None and isinstance(fields.get("step"), int):
            for name, value in fields.items():
                if isinstance(value, int | float) and not isinstance(value, bool) and name != "step":
                    self._tb.add_scalar(f"{kind}/{name}", value, fields["step"])

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def tensorboard_installed() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


@attrs.define
class WallClock:
    """A node's wall time since its loop started, split into training and outer steps (waiting at the barrier,
    all-reduce, state transfers): compute utilisation is the share spent training, as in the paper's Table 2."""

    start: float = attrs.field(factory=time.monotonic)
    outer_s: float = 0.0

    def compute_utilisation(self) -> float:
        elapsed = time.monotonic() - self.start
        return max(0.0, 1.0 - self.outer_s / elapsed) if elapsed > 0 else 1.0


def model_flops_utilisation(*, tokens_per_s: float, flops_per_token: float, peak_flops: float,
                            num_devices: int) -> float | None:
    """MFU: the FLOP/s the model's arithmetic needs at this throughput (6N plus attention per token, forward
    and backward) over the devices' peak; None when the peak is unknown (CPU)."""
    if peak_flops <= 0:
        return None
    return tokens_per_s * flops_per_token / (peak_flops * num_devices)


def say(line: str) -> None:
    """Print one line with a single write, so that lines of concurrent nodes never tear.

    A line that cannot be written is dropped, and training goes on: with `openprime run ... > run.log` on the disk
    that the checkpoints fill, every node failed on its next progress line at the same step (ENOSPC; EFBIG under
    a file-size limit, 2026-12-06), which ended the run that the checkpoints' and metrics' own handling of a full
    disk keeps going. The same for a reader that is gone (EPIPE: a `tee` that ended) and a closed terminal (EIO).
    The first such line warns on stderr, unless the node is leaving (a closed terminal's SIGHUP:
    openprime.train.leaving), where that is expected. Lines are written again once they can be (the disk has room);
    the metrics file keeps every record it can meanwhile. A process started with stdout closed (`>&-`) has none
    (sys.stdout is None): the same."""
    try:
        if sys.stdout is None:
            raise OSError(errno.EBADF, "stdout is closed")
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except OSError as e:
        global _num_unsaid
        if not _num_unsaid and not stop_received():
            with contextlib.suppress(AttributeError, OSError):  # stderr may be the same full file, or closed too
                sys.stderr.write(f"[{mp.current_process().name}] its output cannot be written ({e}); it trains on "
                                 f"without it (this warning is not repeated; the run's metrics.jsonl has its "
                                 f"records)\n")  # one write: the other nodes' lines do not tear it
                sys.stderr.flush()
        _num_unsaid += 1


_num_unsaid = 0  # lines that say() could not write


# Whose INFO records a node prints: live recovery, whose transfers (30-60 minutes in INTELLECT-1) say how far they are.
SHOWN_INFO_LOGGERS = ("openprime.core.state_transfer", "openprime.diloco.recovery")


class _SayHandler(logging.Handler):
    def __init__(self, prefix: str) -> None:
        super().__init__(logging.INFO)
        self.prefix = prefix
        self.addFilter(lambda record: record.levelno < logging.WARNING)  # warnings: the stderr handler beside

    def emit(self, record: logging.LogRecord) -> None:
        say(self.prefix + record.getMessage())


def show_info_logs(node: int, loggers: tuple[str, ...] = SHOWN_INFO_LOGGERS) -> None:
    """Print the INFO records of `loggers` as this node's lines on stdout ("[node N] ..."), beside its progress
    lines; their warnings and errors stay on stderr, bare, as Python prints them when nothing is configured."""
    for name in loggers:
        logger = logging.getLogger(name)
        if any(isinstance(h, _SayHandler) for h in logger.handlers):
            continue
        warnings = logging.StreamHandler(sys.stderr)
        warnings.setLevel(logging.WARNING)
        logger.addHandler(warnings)
        logger.addHandler(_SayHandler(f"[node {node}] "))
        logger.setLevel(logging.INFO)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def progress_line(*, node: int, step: int, num_steps: int, loss: float, tokens_per_s: float, outer_steps: int,
                  bytes_sent: int, lr: float, compute_utilisation: float | None = None, mfu: float | None = None,
                  num_nodes: int | None = None) -> str:
    extra = ""
    if mfu is not None:
        extra += f" | MFU {100 * mfu:.1f}%"
    if compute_utilisation is not None:
        extra += f" | compute {100 * compute_utilisation:.1f}%"
    if num_nodes is not None:
        extra += f" | {num_nodes} nodes"
    return (f"[node {node}] step {step}/{num_steps} | loss {loss:.4f} | lr {lr:.2e} | "
            f"{tokens_per_s / 1000:.1f}k tok/s{extra} | outer syncs {outer_steps} | sent {human_bytes(bytes_sent)}")


@attrs.frozen
class RunSummary:
    """What a finished run's metrics say."""

    num_nodes: int
    losses: dict[int, list[float]]  # node -> loss per inner step
    hashes: dict[int, dict[int, str]]  # outer step -> node -> hash of the global state
    bytes_sent: dict[int, int]  # node -> bytes sent in all outer steps
    num_skipped: dict[int, int] = attrs.field(factory=dict)  # node -> inner steps skipped for a NaN/inf gradient
    checkpoint_steps: list[int] = attrs.field(factory=list)  # the steps any node started to checkpoint, oldest first
    val_loss: tuple[int, float] | None = None  # (step, validation loss) of the newest evaluation

    @property
    def last_checkpoint_step(self) -> int | None:
        """The newest step any node started to checkpoint."""
        return self.checkpoint_steps[-1] if self.checkpoint_steps else None

    @property
    def num_outer_steps(self) -> int:
        return len(self.hashes)

    @property
    def distinct_hashes(self) -> dict[int, set[str]]:
        """Outer step -> the distinct global-state hashes the nodes reported (one when they agree).

        Comparing two runs by these ignores which node number held which state, which may differ per launch.
        """
        return {step: set(by_node.values()) for step, by_node in self.hashes.items()}

    @property
    def hashes_agree(self) -> bool:
        """Every node that finished an outer step holds the same global state after it."""
        return all(len(h) == 1 for h in self.distinct_hashes.values())


class MetricsTail:
    """A run's metrics file read incrementally while the run goes (whole lines only); `records` holds all so far."""

    def __init__(self, run_dir: pathlib.Path) -> None:
        self.path, self._offset, self._partial = run_dir / METRICS_FILE, 0, b""
        self.records: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        """The records appended since the last poll (a line still being written waits for the next)."""
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        new = _parse(lines, self.path)
        self.records.extend(new)
        return new


_RECORD_START = b'{"kind": '  # how MetricsWriter begins every record (json.dumps escapes the quotes inside values)


def _parse(lines: list[bytes], path: pathlib.Path) -> list[dict[str, Any]]:
    """The records of whole lines; a line that is not one (a write cut short by a full disk) is skipped, logged.

    A write cut short leaves no newline, so the next record any node appends lands on the same line: that record,
    whole, is read from where it begins (before, it was skipped with the torn one: an "end" or an outer step's hash
    lost). A line that is JSON but not a record (`null`, an object without "kind": a damaged or
    hand-edited file) is skipped too: the summary and status failed on it with a TypeError or KeyError."""
    records = []
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:  # UnicodeDecodeError too: garbage bytes
            start = line.rfind(_RECORD_START)
            try:
                record = json.loads(line[start:]) if start > 0 else None
            except ValueError:
                record = None
        if isinstance(record, dict) and "kind" in record:
            records.append(record)
        else:
            log.warning("%s: skipping a line that is not a whole record (a write cut short?): %.80r", path,
                        line.decode(errors="backslashreplace"))
    return records


def read_records(run_dir: pathlib.Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS_FILE
    # Bytes, as MetricsTail reads: a line of bytes that are not UTF-8 (garbage a crash left) is skipped, where
    # read_text() raised UnicodeDecodeError and `openprime status` could not read the run at all.
    return _parse(path.read_bytes().splitlines(), path)


def records_of_kind(run_dir: pathlib.Path, kind: str) -> Iterator[dict[str, Any]]:
    """The run's records of one `kind`, in the order written, reading the metrics file as they are asked for (none
    if there is no file). Lines are parsed only if they name the kind, so a weeks-long run's file is cheap to scan."""
    path = run_dir / METRICS_FILE
    if not path.exists():
        return
    marker = f'"kind": {json.dumps(kind)}'.encode()  # as MetricsWriter writes it
    with path.open("rb") as f:
        for line in f:
            if marker in line:
                yield from (r for r in _parse([line], path) if r.get("kind") == kind)


def holds_outer_steps(run_dir: pathlib.Path) -> bool:
    """Whether this machine's nodes of the run took part in an outer step: reads only up to the first "outer"
    record, which follows the first H step records."""
    return next(records_of_kind(run_dir, "outer"), None) is not None


def summarize(run_dir: pathlib.Path) -> RunSummary:
    return summarize_records(read_records(run_dir))


def summarize_records(records: list[dict[str, Any]]) -> RunSummary:
    """The run's summary from its records. A node's step record at or below a step it already recorded starts a
    new timeline (a resume from a checkpoint): its earlier records from that step on are dropped, so a step trained
    again counts once (a 200-step run read "over 206 steps") and a resumed launch that stops earlier than the
    abandoned one got ends on its own last loss. The first such restart of a resume also drops every node's
    global-state hashes from that step on (the resumed launch's other nodes restart at the same step without
    writing in between, and drop nothing more): left beside the new timeline's, the hashes of nodes the resumed
    launch left out, or that came back only later, were a disagreement that never happened, and status named an
    outer step the resumed launch had not reached."""
    step_losses: dict[int, dict[int, float]] = defaultdict(dict)
    step_skipped: dict[int, dict[int, bool]] = defaultdict(dict)
    hashes: dict[int, dict[int, str]] = defaultdict(dict)
    sent: dict[int, int] = defaultdict(int)
    hash_at: dict[int, int] = {}  # outer step -> the inner step its records followed
    resume: tuple[int, int] | None = None  # (record index, step) of the first restart of the latest resume
    last_record: dict[int, int] = {}  # node -> the index of its latest step or outer record
    nodes = set()
    checkpoint_steps: set[int] = set()
    val_losses: dict[int, float] = {}  # step -> validation loss
    for i, r in enumerate(records):
        nodes.add(r["node"])
        before = last_record.get(r["node"], -1)
        if r["kind"] in ("step", "outer"):  # what a node writes as it trains (a resumed one writes "start" first)
            last_record[r["node"]] = i
        if r["kind"] == "checkpoint":
            checkpoint_steps.add(r["step"])
        elif r["kind"] == "eval":
            val_losses[r["step"]] = r["val_loss"]
        if r["kind"] == "step":
            mine, k = step_losses[r["node"]], r["step"]
            if mine and k <= next(reversed(mine)):  # kept in step order: the last is the highest
                for later in [s for s in mine if s >= k]:
                    del mine[later]
                    step_skipped[r["node"]].pop(later, None)
                # Another node of the same resume: the same step, and nothing written since that resume began.
                if resume is None or resume[1] != k or before > resume[0]:
                    resume = (i, k)
                    for outer_step in [o for o, at in hash_at.items() if at >= k]:
                        del hash_at[outer_step]
                        hashes.pop(outer_step, None)
                    # The abandoned timeline's saves and evaluations from that step on go with it too: its last
                    # checkpoint record, past where the resumed launch stopped, ended that launch in "the run's
                    # last checkpoint, of step N, did not finish saving" (exit 1), and status named that save
                    # unfinished and showed that timeline's validation loss.
                    checkpoint_steps = {s for s in checkpoint_steps if s < k}
                    val_losses = {s: v for s, v in val_losses.items() if s < k}
            mine[k] = r["loss"]
            step_skipped[r["node"]][k] = bool(r.get("skipped"))
        elif r["kind"] == "outer":
            sent[r["node"]] += r["bytes_sent"]  # a skipped outer step's failed tries sent bytes too, as nodes count
            if not r.get("skipped"):
                hashes[r["outer_step"]][r["node"]] = r["state_hash"]
                if "step" in r:  # not in older files: such hashes are kept
                    hash_at[r["outer_step"]] = r["step"]
    losses = {node: list(by_step.values()) for node, by_step in step_losses.items()}
    skipped = {node: sum(by_step.values()) for node, by_step in step_skipped.items()}
    newest_eval = max(val_losses, default=None)
    return RunSummary(num_nodes=len(nodes), losses=losses, hashes=dict(hashes), bytes_sent=dict(sent),
                      num_skipped={node: k for node, k in skipped.items() if k},
                      checkpoint_steps=sorted(checkpoint_steps),
                      val_loss=(newest_eval, val_losses[newest_eval]) if newest_eval is not None else None)
