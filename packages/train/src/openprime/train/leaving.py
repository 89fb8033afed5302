"""How a node process leaves the run on SIGTERM or SIGHUP: at once, from wherever its main thread is, except
inside `stop_deferred()`, where the stop waits for the block's end.

Leaving at once is what a stop needs almost everywhere: a node waiting in a collective for a peer must not wait
out the deadline (`sys.exit` unwinds it, the node's `finally` blocks close its checkpoint and send the
deathrattle). One stretch must not be cut: from an outer step's end to its checkpoint's snapshot. Every node
finished that outer step; a node stopped before its snapshot leaves the step without its part, and `--resume
latest` with all the run's nodes has to fall back to the step before (a test's Ctrl-C caught node 0 there after
node 1 had saved, 2026-12-06). The stretch is short (the step's records, the snapshot's host copy; the write goes
on in a thread that the exit waits for), so a stop that comes inside it is honoured at its end.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator

# Signals that stop a node, or a whole launch, gracefully: `kill` and job schedulers send SIGTERM; a closed terminal
# or ssh session sends SIGHUP to the launcher and its nodes (their process group).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def stop_signals_handled() -> tuple[signal.Signals, ...]:
    """The STOP_SIGNALS that stop this launch or node: all of them, but SIGHUP only if this process did not inherit it
    ignored. `nohup openprime run ... &` ignores SIGHUP so that the run outlives its terminal: the shell sends its
    jobs SIGHUP when the ssh session drops, and the launcher and its nodes, which put their own handlers in place,
    stopped the run there (2026-12-06). SIGTERM always stops: it is how a launcher stops its nodes."""
    hangup_ignored = signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    return tuple(s for s in STOP_SIGNALS if not (s == signal.SIGHUP and hangup_ignored))


_num_deferring = 0  # how many stop_deferred() blocks the main thread is in
_received: list[int] = []  # the stop signals this process got (the first one counts)


def stop_received() -> bool:
    """This process got a stop signal: it is leaving (now, or at the end of a `stop_deferred()` block)."""
    return bool(_received)


def leave(signum: int = signal.SIGTERM, *_: object) -> None:
    """The node's handler of STOP_SIGNALS: exit 128 + signum (SystemExit) now, or at the end of the
    `stop_deferred()` block the main thread is in. Only the first stop counts: a second one (the launcher's
    SIGTERM after a closed terminal's SIGHUP, its watchdog stopping the node's other processes) does not
    interrupt the first exit. It is caught and dropped, not ignored: a signal that arrived with the first, before
    this ran, would find SIG_IGN and raise OSError ("Signal 15 ignored due to race condition") in the middle of
    the exit (seen with SIGHUP to the launcher's process group, 2026-12-06)."""
    _received.append(signum)
    for stop in STOP_SIGNALS:
        signal.signal(stop, _ignore)
    if not _num_deferring:
        sys.exit(128 + signum)


def _ignore(*_: object) -> None:
    """A stop signal after the first: the node is already leaving."""


@contextlib.contextmanager
def stop_deferred() -> Iterator[None]:
    """A stop signal that comes inside this block (main thread, `leave` installed) exits when the block ends
    normally; an exception from the block goes on as it would have (the stop is then moot: the node is leaving)."""
    global _num_deferring
    _num_deferring += 1
    try:
        yield
    finally:
        _num_deferring -= 1
    if not _num_deferring and _received:  # a stop outside a block exited at once: this one came inside
        sys.exit(128 + _received[0])
