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


def test_a_leaving_node_drops_the_lines_its_gone_terminal_cannot_take():
    """A closed terminal sends SIGHUP and takes stdout with it: inside the block (saving the checkpoint of the outer
    step just done) the node's lines are dropped; a node that is not leaving still fails on a broken stdout."""
    code, said = _child("""
        from openprime.train.metrics import say
        read, write = os.pipe()
        os.close(read)
        os.dup2(write, 1)
        try:
            say("nobody reads this")
        except BrokenPipeError:
            sys.stderr.write("raised ")
        with stop_deferred():
            os.kill(os.getpid(), signal.SIGHUP)
            say("nor this")
            sys.stderr.write("dropped ")
    """, out="stderr")
    assert (code, said) == (128 + signal.SIGHUP, ["raised", "dropped"])


def test_a_node_goes_on_after_ctrl_c_dropping_the_lines_whose_pipe_it_took_until_its_stop_comes():
    """`openprime run ... | tee run.log` and Ctrl-C: the SIGINT ends the tee and reaches the node, whose launcher
    stops it a moment later; until then it goes on, and its lines, with no reader left, are dropped."""
    code, said = _child("""
        from openprime.train.leaving import interrupted
        from openprime.train.metrics import say
        signal.signal(signal.SIGINT, interrupted)
        read, write = os.pipe()
        os.close(read)
        os.dup2(write, 1)
        os.kill(os.getpid(), signal.SIGINT)
        say("the tee took the same Ctrl-C")
        sys.stderr.write("on ")
        os.kill(os.getpid(), signal.SIGTERM)
        sys.stderr.write("never ")
    """, out="stderr")
    assert (code, said) == (128 + signal.SIGTERM, ["on"])
