"""The launcher's view of a stuck node: processes still running when `Launcher.wait` times out print every
thread's stack to their output, so a rare hang leaves the place it waited on record."""

import multiprocessing as mp
import os
import pathlib
import subprocess
import sys
import threading

from openprime.train.launcher import Launcher, NodeProcess, install_stack_dump, output_to
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


def test_node_processes_write_where_the_launcher_writes_now_and_see_its_environment(tmp_path, monkeypatch):
    """Node processes fork from a server started earlier; what they print and the environment they see must still be
    the launching process's at start(), as with "spawn": tools/chaos.py and the experiments send the nodes' output
    to a log with `output_to`, and a variable set before a launch (OPENPRIME_INT8_NATIVE, ...) must reach them."""
    monkeypatch.setenv("OPENPRIME_TEST_REMOVED", "in-the-server-if-this-test-started-it")
    warm = NodeProcess(target=os.getpid)  # the fork server runs from here on, with the environment of now
    warm.start()
    warm.join(60)
    assert warm.exitcode == 0
    monkeypatch.setenv("OPENPRIME_TEST_INHERITED", "set-after-the-server-started")
    monkeypatch.delenv("OPENPRIME_TEST_REMOVED")
    log = tmp_path / "node.log"
    with output_to(log):
        proc = NodeProcess(target=os.system, args=(
            'echo "out $OPENPRIME_TEST_INHERITED ${OPENPRIME_TEST_REMOVED:-unset}"; echo err >&2',))
        proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert log.read_text().splitlines() == ["out set-after-the-server-started unset", "err"]


def test_the_fork_servers_preload_does_not_touch_cuda():
    """Node processes fork from a server that imported openprime.train.launcher: had any of its imports asked CUDA for
    its devices, every node on a GPU machine would fail ("Cannot re-initialize CUDA in forked subprocess")."""
    probe = (
        "import torch\n"
        "asked = []\n"
        "for name in ('is_available', 'device_count', '_lazy_init', 'init', 'get_device_properties'):\n"
        "    setattr(torch.cuda, name, lambda *a, _n=name, **k: asked.append(_n))\n"
        "import openprime.train.launcher\n"
        "print(asked)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
