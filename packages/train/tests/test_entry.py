"""The `openprime` program (openprime.train.entry): a launch starts its fork server first, and neither the server
nor the interpreter's teardown holds the command's output open after it is done."""

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from openprime.train.entry import starts_nodes
from openprime.train.testing import process_ended

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _alive_in_group(pgid: int) -> list[int]:
    """The processes of process group `pgid` that have not exited (a zombie waits for its new parent to reap it)."""
    alive = []
    for pid in (int(p.name) for p in pathlib.Path("/proc").iterdir() if p.name.isdigit()):
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            if os.getpgid(pid) == pgid and not process_ended(pid):
                alive.append(pid)
    return alive


def _command(pid: int) -> str:
    with contextlib.suppress(OSError):
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return "?"


@pytest.mark.parametrize(("argv", "expected"), [
    (["run", "recipes/debug.py"], True),
    (["run", "recipes/debug.py", "--nodes", "4", "--resume", "latest"], True),
    (["run", "recipes/debug.py", "--dry-run"], False),
    (["run", "--help"], False),
    (["mesh", "serve"], False),
    (["export", "runs/x", "out"], False),
    ([], False),
])
def test_only_a_launch_starts_the_fork_server(argv, expected):
    assert starts_nodes(argv) is expected


def test_a_launch_that_stops_at_a_bad_value_leaves_no_process_and_closes_its_output_as_it_exits(tmp_path):
    """The fork server started first (it imports torch for about 2 s) is killed as the command exits, and the
    command skips the interpreter's teardown: its output closes when it exits, and no process of it is left.
    Before, a reader of the output waited for the server and the teardowns (0.5 s more here)."""
    proc = subprocess.Popen([sys.executable, "-m", "openprime.train", "run", str(ROOT / "recipes" / "debug.py"),
                             "--run-dir", str(tmp_path / "run"), "--set", "model.dim=-1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, process_group=0)
    try:
        assert proc.wait(timeout=120) == 2
        exited = time.monotonic()
        err = proc.stderr.read()  # end of file once every holder of the pipe is gone
        closed_after_s = time.monotonic() - exited
        assert "openprime: error: " in err and "model.dim" in err, err
        assert closed_after_s < 0.25, closed_after_s  # measured: 0.006 s; 0.52 s without
        # Nothing of the command's process group is left running. A process that closed its end of the pipe may still
        # be inside its exit for a moment (its files are closed before it is a zombie): one CI run found such a
        # process (most likely multiprocessing's resource tracker, which ends once the command's end closes its
        # pipe). One that lives on is still there after the grace; a fork server left alive holds stderr open.
        deadline = time.monotonic() + 2.0
        while (left := _alive_in_group(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert left == [], [(pid, _command(pid)) for pid in left]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
