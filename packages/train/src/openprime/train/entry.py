"""The `openprime` command's entry point: a launch starts its fork server before its own imports.

Nodes are forked from a server that imported torch and openprime.train once (processes.NodeProcess). Started when
the first node starts, that import ran after the launcher's own import of the same modules, one after the other:
about 2.3 s, then 2.3 s more, of a 2-node launch's 11 s on 2 cores (2026-12-06). `openprime run` now starts the
server first, with nothing but the standard library imported, and the two imports run side by side while the
launcher builds the config and checks the data and the checkpoint. The server's import is wasted on a command that
stops at a bad value (2.5 s of one core, in the background). Only this module and openprime.train.cli's imports
decide what comes first, so it imports nothing of openprime or torch at the top.

At its end a launch kills the server and exits without the interpreter's teardown. Both held the command's stdout
and stderr while they freed torch's modules, about 0.7-0.9 s each, which kept a reader of them (`| tee`, a script's
pipe, a test) waiting after the command was done: 2 s of a short launch. By then every node has ended (the launcher
waits for them or kills them), the server has nothing to save, and the launcher's threads are joined and its
exit handlers (logging's, multiprocessing's) have run.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import signal
import sys
from multiprocessing import forkserver

# What the fork server imports before it forks a node. openprime.train.forkserver first: it makes the server ignore
# the signals that stop a run, and a Ctrl-C while the server imports torch would otherwise end it. torch._dynamo:
# the first normal_() on a meta tensor (the model is built on the meta device) imports it, 1.0-1.4 s of every node's
# start here; it starts no thread and asks CUDA nothing (test_launcher.py).
FORK_SERVER_PRELOAD = ("openprime.train.forkserver", "torch", "torch._dynamo", "openprime.train.launcher")


def start_fork_server() -> None:
    """Start the fork server now (it imports FORK_SERVER_PRELOAD in the background); no effect once it runs."""
    mp.set_forkserver_preload(list(FORK_SERVER_PRELOAD))
    forkserver.ensure_running()


def stop_fork_server() -> None:
    """Kill this process's fork server, if it started one: only once every node it forked has ended."""
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)  # CPython's; None when none was started
    if pid is None:
        return
    with contextlib.suppress(ChildProcessError, ProcessLookupError):
        os.kill(pid, signal.SIGKILL)  # it ignores SIGTERM (openprime.train.forkserver)
        os.waitpid(pid, 0)


_exit_code: list[int] = []  # the command's, once it returned


def _exit_now() -> None:
    """The last exit handler (registered first): flush the output and end without freeing the modules."""
    stop_fork_server()
    if not _exit_code:  # the command raised: leave its traceback and exit to the interpreter
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # closed, or a pipe whose reader is gone
            if stream is not None:
                stream.flush()
    os._exit(_exit_code[0])


def starts_nodes(argv: list[str]) -> bool:
    """Whether the command line launches nodes: `openprime run`, not its --dry-run or --help."""
    return bool(argv) and argv[0] == "run" and not {"--dry-run", "-h", "--help"} & set(argv)


def main(argv: list[str] | None = None) -> int:
    """The program (the `openprime` script, `python -m openprime.train`). A launch ends the whole process when it
    exits, without the interpreter's teardown and with its code: inside another program (a test) call
    openprime.train.cli.main instead."""
    argv = sys.argv[1:] if argv is None else argv
    if starts_nodes(argv):
        atexit.register(_exit_now)  # first, so that it runs last
        start_fork_server()
    from openprime.train.cli import main as cli_main  # the command's imports: torch and all of openprime.train

    code = cli_main(argv)
    _exit_code.append(code)  # read by _exit_now, registered for a launch only
    return code
