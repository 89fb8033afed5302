"""A node as a process of its own: how it starts, what it inherits, how it stops, and how to see where it waits.

The launcher (launcher.py) starts one process per local rank of each node from a fork server that imported
torch and openprime.train once (`NodeProcess`); each runs `node_main`. A node process leaves the run
gracefully on SIGTERM or SIGHUP (its checkpoint closed, its deathrattle sent; leaving.py says when), exits
`REFUSED_EXIT` where running the same command again would fail the same way, prints its threads' stacks on
SIGUSR1, and leaves once the process that launched it is gone.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import pathlib
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from multiprocessing import connection as mp_connection
from multiprocessing import popen_forkserver, reduction
from typing import Any

from openprime.ckpt import Checkpoint
from openprime.core.errors import ConfigError
from openprime.core.transport import Rendezvous
from openprime.mesh import JoinRefused
from openprime.train.config import RunConfig
from openprime.train.entry import FORK_SERVER_PRELOAD
from openprime.train.guard import Diverged
from openprime.train.leaving import STOP_SIGNALS, leave, stop_signals_handled
from openprime.train.metrics import show_info_logs
from openprime.train.trainer import run_node


@contextlib.contextmanager
def output_to(path: pathlib.Path | None) -> Iterator[None]:
    """Point this process's stdout and stderr at `path` (None: leave them) while nodes are started: they inherit them.

    Tools that print their own progress (tools/chaos.py, tools/experiments) send the nodes' output to a log this way.
    """
    global _output_redirected
    if path is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    was, _output_redirected = _output_redirected, True
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        _output_redirected = was
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


_output_redirected = False  # inside output_to(): descriptors 1 and 2 are the log's, whatever the process began with


def _own_output(fd: int) -> bool:
    """Whether descriptor `fd` (1, 2) is this process's output to hand its nodes: one it began with, or output_to's.
    A process started with it closed (`openprime run ... >&-`) has none: the next file it opened took that number
    (the run directory's lock file), and its nodes, handed that descriptor as their stdout, wrote every progress
    line into RUN_DIR/.openprime.lock (found 2026-12-08 by review)."""
    return _output_redirected or (sys.__stdout__ if fd == 1 else sys.__stderr__) is not None


# The exit code of a node refused by the coordinator or stopped by a config error: its message says what to change;
# running the same command again would fail the same way (1: any other error).
REFUSED_EXIT = 2

# How often the launcher's watchdog looks for a node process that ended (Launcher._watch), and how long a process of
# a node with several local ranks that failed waits for the watchdog's SIGTERM before it reports its own error: a
# rank whose local collective broke because another rank of its node left (SIGTERM or kill of that one process)
# then says so in one line instead of a traceback that reads like a crash of its own.
WATCHDOG_POLL_S = 0.2
NODE_STOP_GRACE_S = 5 * WATCHDOG_POLL_S

# `kill -USR1 PID` makes a node process print every thread's Python stack to its stderr (and go on): how to see
# where a node that is alive but stuck waits. Launcher.wait does it to every node still running at its timeout.
STACKS_SIGNAL = signal.SIGUSR1


def install_stack_dump() -> None:
    """In a node process: print all threads' stacks to stderr on STACKS_SIGNAL (faulthandler, no Python code
    needs to run, so it works even when the interpreter is stuck in a C call holding the GIL)."""
    faulthandler.register(STACKS_SIGNAL, file=2, all_threads=True)  # fd 2 itself, wherever sys.stderr points


def is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP, a debugger), by its state in /proc (False where there is none)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")  # after "(comm)", which may hold spaces
    except (OSError, IndexError):
        return False


def dump_stacks(procs: list[tuple[str, int]], settle_s: float = 0.5) -> list[str]:
    """Ask processes (name, pid) that run `install_stack_dump` for their threads' stacks (STACKS_SIGNAL), one at a
    time under a line naming each (asked all at once, processes sharing an output wrote their stacks into one
    another); returns the names of those asked.

    A stopped process is not asked: the signal would wait for it to continue, and the dump (faulthandler reads the
    other threads' frames without the GIL) would then run as every thread wakes at once. In a chaos.py run a stall
    dump asked a node's SIGSTOPped local rank 1; when the harness continued it, a segfault in libpython (a Gloo
    thread, by the kernel's log) ended it and its node exited, a fault nobody injected. Its stack is where it was
    stopped."""
    asked = []
    for name, pid in procs:
        if is_stopped(pid):
            print(f"== {name}, pid {pid}, is stopped (SIGSTOP): not asked for its stacks", file=sys.stderr, flush=True)
            continue
        print(f"== stacks of {name}, pid {pid}:", file=sys.stderr, flush=True)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, STACKS_SIGNAL)
            asked.append(name)
            time.sleep(settle_s)  # faulthandler writes from the signal handler; give it a moment
    if asked:
        print(f"openprime: still running, stacks printed to their output: {', '.join(asked)}", file=sys.stderr,
              flush=True)
    return asked


# The descriptor of the run directory's lock (openprime.train.run_lock) that the launching process holds, if any:
# every node process started while it is handed (`nodes_hold_run_lock`) holds it too.
_run_lock_fd: int | None = None


@contextlib.contextmanager
def nodes_hold_run_lock(fd: int) -> Iterator[None]:
    """The node processes started inside this block hold the run directory's lock (`fd`, the launcher's lock file)
    too, as long as they live. The lock is the open file's (flock), so the launch holds its directory until its last
    node has exited: after a kill -9 of the launcher its nodes went on for seconds (a checkpoint write under way, up
    to checkpoint.stop_wait_s) while a new launch could take the directory and resume beside them (found 2026-12-07).

    The block must end before the lock file is closed. A plain setter left the number behind once a launch ended:
    in a process that launched again (the suite runs `openprime run` in-process), every later node was sent that
    closed or reused descriptor through the fork server; one CI run's send failed and killed the server, and 17
    elastic tests after it could not start a node (2026-12-07)."""
    global _run_lock_fd
    if _run_lock_fd is not None:
        raise RuntimeError(f"the nodes already hold a run lock (descriptor {_run_lock_fd}): one launch per process")
    _run_lock_fd = fd
    try:
        yield
    finally:
        _run_lock_fd = None


def run_lock_handed() -> int | None:
    """The descriptor the node processes started now are handed (`nodes_hold_run_lock`), or None."""
    return _run_lock_fd


_CLOSED = "closed"  # in place of a descriptor the launching process does not have (`_own_output`)


class _Inherited:
    """The launching process's stdout, stderr and environment at `NodeProcess.start()`, for the new process, and the
    run directory's lock while it is handed to them (`nodes_hold_run_lock`).

    Pickled with the process object: the descriptors travel with the start request (`reduction.DupFd`: SCM_RIGHTS
    through the fork server); `adopt()` in the new process points its own 1 and 2 at them and keeps the lock's open.
    """

    def __init__(self, stdout: Any = None, stderr: Any = None, environ: dict[str, str] | None = None,
                 launcher_pid: int | None = None, run_lock: Any = None) -> None:
        self._fds = (stdout, stderr)
        self._environ = environ
        self.launcher_pid = launcher_pid
        self._run_lock = run_lock
        self.run_lock_fd: int | None = None  # in the node: open until it exits, never closed

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        lock = reduction.DupFd(_run_lock_fd) if _run_lock_fd is not None else None
        out, err = (reduction.DupFd(fd) if _own_output(fd) else _CLOSED for fd in (1, 2))
        return _Inherited, (out, err, dict(os.environ), os.getpid(), lock)

    def adopt(self) -> None:
        if self._run_lock is not None:
            self.run_lock_fd = self._run_lock.detach()
        for target, fd in zip((1, 2), self._fds, strict=True):
            if fd == _CLOSED:  # the launcher has none: neither has the node. /dev/null holds the number, so that no
                # file the node opens takes it and gets what C code or a child process writes there
                null = os.open(os.devnull, os.O_WRONLY)
                if null != target:
                    os.dup2(null, target)
                    os.close(null)
                if target == 1:
                    sys.stdout = None  # as in a process started with it closed: its lines are dropped (metrics.say)
            elif fd is not None and (fd := fd.detach()) != target:
                os.dup2(fd, target)
                os.close(fd)
        if self._environ is not None:
            for name in set(os.environ) - set(self._environ):
                del os.environ[name]
            os.environ.update(self._environ)


class _OnePoller(popen_forkserver.Popen):
    """A fork-server process whose exit code may be asked for from several threads (the launcher's watchdog and its
    main thread). The code is 8 bytes read once from the sentinel pipe; two threads that both found the pipe
    readable both read it, and the one that got end-of-file set the exit code to 255, multiprocessing's "the fork
    server got killed?" (a CI run saw a node that trained to its end reported so). Reads are serialised here; the
    blocking wait of `join()` stays outside the lock."""

    def __init__(self, process_obj: mp.process.BaseProcess) -> None:
        self._poll_lock = threading.Lock()
        super().__init__(process_obj)

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        if flag != os.WNOHANG and self.returncode is None:
            mp_connection.wait([self.sentinel])
        with self._poll_lock:
            return super().poll(os.WNOHANG)


class NodeProcess(mp.context.ForkServerProcess):
    """A node process, forked from a server ("forkserver") that imported torch and openprime.train once.

    With "spawn" every node process imported them itself, about 3 CPU-s each here: 12 CPU-s, 6 s of wall on 2 cores,
    before a 4-node run's first step, and again for every node that joins later (measured on 2 cores, a run of 20
    short steps: 2 nodes 10.8 s with spawn, 8.9 s with this; 4 nodes 17.7 s, 11.9 s). The server is a fresh
    interpreter that has started no thread and touched no CUDA device (nothing openprime.train imports asks CUDA
    anything: tested), so forking it is safe. Its children would write to the server's stdout and stderr and see
    its environment, as they were when it started; a NodeProcess takes the launching process's as they are at
    `start()` instead, as with "spawn" (`output_to` depends on it).
    """

    @staticmethod
    def _Popen(process_obj: mp.process.BaseProcess) -> _OnePoller:  # noqa: N802 (multiprocessing's name)
        return _OnePoller(process_obj)

    def start(self) -> None:
        # No effect once the server runs. openprime.train.forkserver makes the server ignore stop signals.
        mp.set_forkserver_preload(list(FORK_SERVER_PRELOAD))
        self._inherited = _Inherited()
        self._stop_signals = stop_signals_handled()  # the launcher's: under nohup, SIGHUP is not among them
        super().start()

    def run(self) -> None:
        for stop in STOP_SIGNALS:  # ignored by the fork server (openprime.train.forkserver), not by its children
            signal.signal(stop, signal.SIG_DFL if stop in self._stop_signals else signal.SIG_IGN)
        self._inherited.adopt()
        if self._inherited.launcher_pid is not None:
            leave_when_gone(self._inherited.launcher_pid)
        super().run()


def leave_when_gone(launcher_pid: int, poll_s: float = 1.0) -> threading.Thread:
    """In a node process: leave the run gracefully (SIGTERM to itself) once the process that launched it is gone.

    A launcher killed outright (SIGKILL, the OOM killer) cannot stop its nodes, and their parent is the fork server,
    not the launcher: without this they would go on training with nobody to read their output or stop them, and
    when the coordinator ran in the launcher, wait at the next outer-step barrier for `mesh.sync_timeout_s`. On
    Linux a pidfd says at once that the launcher ended; elsewhere it is polled every `poll_s`.
    """
    def watch() -> None:
        try:
            pidfd = os.pidfd_open(launcher_pid)
        except (AttributeError, OSError):  # no pidfd (not Linux 5.3+), or the launcher is already gone
            pidfd = None
        if pidfd is not None:
            select.select([pidfd], [], [])  # readable when the process has ended
            os.close(pidfd)
        else:
            while True:
                try:
                    os.kill(launcher_pid, 0)
                except (ProcessLookupError, PermissionError):  # gone (PermissionError: another user's now)
                    break
                time.sleep(poll_s)
        with contextlib.suppress(OSError):  # its output may have gone with it
            print(f"[{mp.current_process().name}] the process that launched it (pid {launcher_pid}) is gone; "
                  f"leaving the run", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    watcher = threading.Thread(target=watch, name="openprime-launcher-watch", daemon=True)
    watcher.start()
    return watcher


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (a container's or taskset's share) where the OS has one."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def node_main(cfg: RunConfig, node: int, coordinator: str, run_dir: pathlib.Path, num_threads: int,
              resume: Checkpoint | None = None, local_rank: int = 0,
              local_rendezvous: Rendezvous | None = None, first_device: int = 0, slot: int = -1) -> None:
    """The body of one node process (one local rank): SIGTERM leaves gracefully (the deathrattle), errors exit 1."""
    for stop in stop_signals_handled():  # a SIGHUP ignored by the launcher (nohup) stays ignored
        signal.signal(stop, leave)
    # Ctrl-C in a terminal sends SIGINT to the launcher and every node (one process group); a node that took it
    # ended at once, with no deathrattle and no line, and its checkpoint write under way was lost (2026-12-06). The
    # launcher's handler stops the nodes (SIGTERM: they leave gracefully).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    install_stack_dump()
    if local_rank == 0:  # it speaks for the node (its other ranks' transfers are the same size and pace)
        show_info_logs(node)
    try:
        run_node(cfg, node=node, coordinator=coordinator, run_dir=run_dir, num_threads=num_threads, resume=resume,
                 local_rank=local_rank, local_rendezvous=local_rendezvous, first_device=first_device, slot=slot)
    except BaseException as e:
        where = f"node {node}" + (f" local rank {local_rank}" if cfg.fsdp.sharded else "")
        if isinstance(e, ConfigError | JoinRefused):  # the user's to fix, and the message says how: no traceback
            print(f"[{where}] error: {e}", file=sys.stderr, flush=True)
            sys.exit(REFUSED_EXIT)
        if isinstance(e, Diverged):  # the message says where it began and how to continue: no traceback
            print(f"[{where}] error: {e}", file=sys.stderr, flush=True)
        elif not isinstance(e, SystemExit):
            if cfg.fsdp.sharded and (signum := _stop_signal_within(NODE_STOP_GRACE_S)) is not None:
                print(f"[{where}] stopped with its node: another of its processes ended first (here, then: "
                      f"{type(e).__name__}: {str(e)[:160]})", file=sys.stderr, flush=True)
                sys.exit(128 + signum)
            print(f"[{where}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.exit(e.code if isinstance(e, SystemExit) else 1)


def _stop_signal_within(timeout_s: float) -> int | None:
    """The stop signal (SIGTERM, SIGHUP) this process gets within `timeout_s`, or None."""
    got: list[int] = []
    for stop in stop_signals_handled():
        signal.signal(stop, lambda signum, _frame: got.append(signum))
    deadline = time.monotonic() + timeout_s
    while not got and time.monotonic() < deadline:
        time.sleep(0.02)
    return got[0] if got else None
