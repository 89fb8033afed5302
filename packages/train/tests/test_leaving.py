"""A node's stop signal: at once outside `stop_deferred()`, at the block's end inside it (openprime.train.leaving).

Each case runs in a fresh interpreter that installs `leave` as a node process does and signals itself, so that
pytest's own signal handling is not involved; what the child prints shows how far it got.
"""

import signal
import subprocess
import sys
import textwrap

import pytest

PRELUDE = """
import os, signal, sys
from openprime.train.leaving import STOP_SIGNALS, leave, stop_deferred
for stop in STOP_SIGNALS:
    signal.signal(stop, leave)
"""


def _child(body: str, out: str = "stdout") -> tuple[int, list[str]]:
    """The child's exit code and the words it wrote to `out` (stdout, or stderr when its stdout is the test)."""
    proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                          timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, getattr(proc, out).split()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_outside_a_deferred_block_exits_at_once(signum):
    code, said = _child(f"""
        print("before", flush=True)
        os.kill(os.getpid(), {int(signum)})
        print("after", flush=True)
    """)
    assert (code, said) == (128 + signum, ["before"])


def test_a_stop_inside_a_deferred_block_exits_at_its_end_and_finally_blocks_run():
    code, said = _child("""
        try:
            with stop_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                print("inside", flush=True)
                with stop_deferred():  # a nested block does not end the outer one's deferral
                    print("nested", flush=True)
                print("still", flush=True)
            print("after", flush=True)
        finally:
            print("closed", flush=True)
    """)
    assert (code, said) == (128 + signal.SIGTERM, ["inside", "nested", "still", "closed"])


def test_a_second_stop_is_ignored_and_the_first_signal_is_the_exit_code():
    code, said = _child("""
        with stop_deferred():
            os.kill(os.getpid(), signal.SIGHUP)
            os.kill(os.getpid(), signal.SIGTERM)
            print("inside", flush=True)
    """)
    assert (code, said) == (128 + signal.SIGHUP, ["inside"])


def test_an_error_inside_a_deferred_block_goes_on_as_it_would_have():
    code, said = _child("""
        try:
            with stop_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                raise ValueError("the block failed")
        except ValueError as e:
            print("caught", flush=True)
            sys.exit(7)
    """)
    assert (code, said) == (7, ["caught"])


def test_without_a_stop_a_deferred_block_changes_nothing():
    code, said = _child("""
        with stop_deferred():
            print("inside", flush=True)
        print("after", flush=True)
    """)
    assert (code, said) == (0, ["inside", "after"])


def test_a_node_drops_the_lines_it_cannot_write_warns_once_and_goes_on():
    """A log on a full disk (ENOSPC), a reader that is gone (EPIPE), a closed terminal (EIO): the node's lines are
    dropped with one warning on stderr, and it trains on (it failed on the write, and with it the run, until
    2026-12-06). A leaving node (SIGHUP from the closed terminal) still saves the checkpoint of the outer step it
    just finished, after that step's lines."""
    code, said = _child("""
        from openprime.train.metrics import say
        read, write = os.pipe()
        os.close(read)
        os.dup2(write, 1)
        say("nobody reads this")
        say("nor this")
        sys.stderr.write("went-on ")
        with stop_deferred():
            os.kill(os.getpid(), signal.SIGHUP)
            say("nor this")
            sys.stderr.write("dropped ")
    """, out="stderr")
    assert code == 128 + signal.SIGHUP
    assert " ".join(said).count("output cannot be written ([Errno 32] Broken pipe); it trains on") == 1, said
    assert said[-2:] == ["went-on", "dropped"], said


def test_a_node_writes_its_lines_again_once_its_disk_has_room(tmp_path):
    """/dev/full stands in for the full disk under `openprime run ... > run.log`; the log file for the disk with
    room again (the same process's stdout, moved by dup2)."""
    log = tmp_path / "run.log"
    code, said = _child(f"""
        from openprime.train.metrics import say
        full = os.open("/dev/full", os.O_WRONLY)
        os.dup2(full, 1)
        say("lost")
        room = os.open({str(log)!r}, os.O_WRONLY | os.O_CREAT)
        os.dup2(room, 1)
        say("kept")
        sys.stderr.write("went-on ")
    """, out="stderr")
    assert code == 0 and said[-1] == "went-on", said
    assert "([Errno 28] No space left on device); it trains on" in " ".join(said), said
    assert log.read_text() == "kept\n"  # the line that failed is not written later



def test_a_hang_up_ignored_when_the_process_began_stays_ignored_a_terminate_never():
    """`nohup` starts the command with SIGHUP ignored: the launch and its nodes must not handle it (the run stopped
    when the ssh session dropped). SIGTERM stops a node whatever it inherited: it is how its launcher stops it."""
    code, said = _child("""
        from openprime.train.leaving import stop_signals_handled
        print(*(s.name for s in stop_signals_handled()))
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(*(s.name for s in stop_signals_handled()))
    """)
    assert (code, said) == (0, ["SIGTERM", "SIGHUP", "SIGTERM"])


def test_a_node_started_with_stdout_closed_drops_its_lines_and_goes_on():
    """`openprime run ... >&-`: Python has no sys.stdout then, and every node failed on its first line."""
    code, said = _child("""
        from openprime.train.metrics import say
        sys.stdout = None
        say("nowhere to go")
        sys.stderr.write("went-on ")
    """, out="stderr")
    assert code == 0 and said[-1] == "went-on", said
    assert "([Errno 9] stdout is closed); it trains on" in " ".join(said), said
