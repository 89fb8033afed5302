"""The launcher's view of a stuck node: processes still running when `Launcher.wait` times out print every
thread's stack to their output, so a rare hang leaves the place it waited on record."""

import multiprocessing as mp
import pathlib
import threading

from openprime.train.launcher import Launcher, install_stack_dump, output_to
from openprime.train.recipe import recipe_config

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _stuck_in_a_wait(ready) -> None:
    """A stand-in node process that hangs the way a stuck node does: a thread blocked on a wait that never ends."""
    install_stack_dump()
    ready.set()
    threading.Event().wait(60)


def test_wait_prints_the_stacks_of_nodes_still_running(tmp_path):
    launcher = Launcher(recipe_config(ROOT / "recipes" / "debug.py", []), tmp_path / "run", num_nodes=1)
    log = tmp_path / "node.log"
    ready = mp.get_context("fork").Event()
    proc = mp.get_context("fork").Process(target=_stuck_in_a_wait, args=(ready,), name="node-0")
    try:
        with output_to(log):
            proc.start()
        assert ready.wait(30)
        launcher.procs[0], launcher.local_procs[0] = proc, [proc]
        codes = launcher.wait(timeout_s=0.5)
        assert codes == {0: None} and proc.is_alive()  # the stack dump does not stop it
    finally:
        launcher.stop()
    text = log.read_text()
    assert "most recent call first" in text and "_stuck_in_a_wait" in text, text
