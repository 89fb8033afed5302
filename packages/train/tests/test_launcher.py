"""The launcher's view of a stuck node: processes still running when `Launcher.wait` times out print every
thread's stack to their output, so a rare hang leaves the place it waited on record."""

import io
import multiprocessing as mp
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import torch

from openprime.ckpt import Checkpoint, write_part
from openprime.train.entry import FORK_SERVER_PRELOAD
from openprime.train.launcher import Launcher, _print_checkpoints, data_slots, ended_how, tell
from openprime.train.processes import NodeProcess, dump_stacks, install_stack_dump, is_stopped, output_to
from openprime.train.recipe import recipe_config
from openprime.train.testing import process_ended

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


def test_a_stopped_process_is_not_asked_for_its_stacks(tmp_path, capsys):
    """A SIGSTOPped process asked for its stacks dumps them the moment it continues, every thread waking at once:
    chaos.py saw one segfault there. It is named as stopped and not signalled; the running one is asked."""
    log = tmp_path / "node.log"
    ctx = mp.get_context("fork")
    ready = [ctx.Event(), ctx.Event()]
    procs = [ctx.Process(target=_stuck_in_a_wait, args=(r,), name=f"node-{i}") for i, r in enumerate(ready)]
    try:
        with output_to(log):
            for p in procs:
                p.start()
        assert all(r.wait(30) for r in ready)
        os.kill(procs[1].pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not is_stopped(procs[1].pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        with output_to(log):
            asked = dump_stacks([(p.name, p.pid) for p in procs], settle_s=0.5)
        assert asked == ["node-0"]
        os.kill(procs[1].pid, signal.SIGCONT)
        time.sleep(1.0)  # a signal left pending would be handled now, and its stacks printed
        assert all(p.is_alive() for p in procs)
    finally:
        for p in procs:
            p.kill()
            p.join(10)
    assert f"node-1, pid {procs[1].pid}, is stopped (SIGSTOP)" in capsys.readouterr().err
    text = log.read_text()
    assert text.count("_stuck_in_a_wait") == 1, text  # node-0's stack only


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


def test_the_fork_servers_preload_does_not_touch_cuda_or_start_a_thread():
    """Node processes fork from a server that imported FORK_SERVER_PRELOAD: had any of its imports asked CUDA for
    its devices, every node on a GPU machine would fail ("Cannot re-initialize CUDA in forked subprocess"); a
    thread it started would not exist in the nodes (and a lock it held would stay held there)."""
    probe = (
        "import importlib, os, sys\n"
        "import torch\n"
        "threads = len(os.listdir('/proc/self/task'))\n"  # torch's own, before any of ours
        "asked = []\n"
        "for name in ('is_available', 'device_count', '_lazy_init', 'init', 'get_device_properties'):\n"
        "    setattr(torch.cuda, name, lambda *a, _n=name, **k: asked.append(_n))\n"
        "for module in sys.argv[1:]:\n"
        "    importlib.import_module(module)\n"
        "print(asked, len(os.listdir('/proc/self/task')) - threads)\n")
    out = subprocess.run([sys.executable, "-c", probe, *FORK_SERVER_PRELOAD], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[] 0", out.stdout + out.stderr


LAUNCH_AND_HANG = """
import time
from openprime.train.processes import NodeProcess
if __name__ == "__main__":
    node = NodeProcess(target=time.sleep, args=(120,), name="node-0")
    node.start()
    print(node.pid, flush=True)
    time.sleep(120)
"""


def test_node_processes_leave_when_their_launcher_is_killed(tmp_path):
    """A launcher killed outright (SIGKILL: the OOM killer, a scheduler) cannot stop its nodes, and their parent is
    the fork server: each node watches the launching process and leaves (SIGTERM to itself) when it is gone."""
    script = tmp_path / "launch.py"
    script.write_text(LAUNCH_AND_HANG)
    launcher = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    node_pid = None
    try:
        node_pid = int(launcher.stdout.readline())
        assert not process_ended(node_pid)
        launcher.kill()
        killed = time.monotonic()
        launcher.wait(timeout=30)
        out = launcher.stdout.read()  # until the node, which holds the pipe too, has exited
        assert f"[node-0] the process that launched it (pid {launcher.pid}) is gone; leaving the run" in out, out
        # It left, not slept its 120 s out (a node inheriting the fork server's ignored SIGTERM did, 2026-12-06).
        assert time.monotonic() - killed < 30
        deadline = time.monotonic() + 10
        while not process_ended(node_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert process_ended(node_pid)
    finally:
        launcher.kill()
        if node_pid is not None and not process_ended(node_pid):
            os.kill(node_pid, 9)


def test_exit_codes_read_from_two_threads_at_once_are_the_real_ones():
    """The launcher's watchdog thread polls its node processes while its main thread waits for them. A fork-server
    process's exit code is 8 bytes read once from a pipe: two threads that both saw the pipe readable both read it,
    one got the code and the other end-of-file, which multiprocessing turns into 255 ("the fork server got killed?").
    A CI run saw a node that trained to its end reported as 255 that way."""
    bad = []
    for _ in range(20):
        proc = NodeProcess(target=time.sleep, args=(0.05,))
        proc.start()
        seen: list[int | None] = []

        def poll(p=proc, out=seen) -> None:
            while (code := p.exitcode) is None:
                pass
            out.append(code)

        threads = [threading.Thread(target=poll) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        proc.join(timeout=30)
        bad += [code for code in seen if code != 0]
    assert bad == [], bad


class _FakeNodeProcess:
    """A stand-in for NodeProcess that records the node's arguments and stays alive until `alive` is cleared."""

    started: list[tuple] = []

    def __init__(self, *, target, name, args) -> None:
        self.name, self.args, self.alive = name, args, True

    def start(self) -> None:
        _FakeNodeProcess.started.append(self.args)

    def is_alive(self) -> bool:
        return self.alive


def test_nodes_on_one_machine_compute_on_gpus_of_their_own(tmp_path, monkeypatch):
    # Before, every node of `openprime run --nodes N` on a machine of several GPUs computed on GPU 0 (local rank r
    # on GPU r), and the other GPUs idled. The ninth argument of node_main is the node's first GPU.
    import openprime.train.launcher as launcher_module
    from openprime.train.hardware import device_blocks, least_used_block

    assert [device_blocks(d, r) for d, r in ((0, 1), (1, 1), (8, 1), (8, 2), (6, 4), (8, 8))] == [1, 1, 8, 4, 1, 1]
    assert least_used_block([0, 1, 3], num_blocks=4) == 2 and least_used_block([0, 1], num_blocks=2) == 0

    monkeypatch.setattr(launcher_module, "detect_device_type", lambda: "cuda")
    monkeypatch.setattr(launcher_module.torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(launcher_module, "NodeProcess", _FakeNodeProcess)
    _FakeNodeProcess.started = []
    cfg = recipe_config(ROOT / "recipes" / "debug.py", ["fsdp.num_local_ranks=2", "train.micro_batch_size=2"])
    launcher = Launcher(cfg, tmp_path / "run", num_nodes=3)
    try:
        for _ in range(3):
            launcher.start_node()
        # Node 0 on GPUs 0-1, node 1 on GPUs 2-3, node 2 shares node 0's (4 GPUs hold 2 nodes of 2 ranks).
        assert [(args[1], args[6], args[8]) for args in _FakeNodeProcess.started] == [
            (0, 0, 0), (0, 1, 0), (1, 0, 2), (1, 1, 2), (2, 0, 0), (2, 1, 0)]
        launcher.procs[1].alive = False  # node 1 died: its replacement takes its GPUs
        _FakeNodeProcess.started = []
        launcher.start_node()
        assert [(args[1], args[8]) for args in _FakeNodeProcess.started] == [(3, 2), (3, 2)]
    finally:
        launcher.procs.clear()
        launcher.local_procs.clear()
        launcher.stop()


def _saved(root: pathlib.Path, step: int, *slots: int) -> None:
    """Step `step` of a 2-node run of which the nodes in `slots` finished saving their parts."""
    for slot in slots:
        write_part(root, step, f"slot-{slot}", {"w": torch.zeros(2)}, parts=["slot-0", "slot-1"])


def test_the_command_that_continues_a_run_resumes_from_a_step_that_holds_every_node(tmp_path, capsys):
    """A stop can leave a step that one node saved and the other did not (stopped inside the outer step): the end
    of the launch names the step that `--resume latest` with all the nodes takes, or a command that works."""
    cfg = recipe_config(ROOT / "recipes" / "debug.py", [])
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    _saved(root, 20, 1)
    assert _print_checkpoints(cfg, run_dir, num_nodes=2, joined=None) == 20
    out = capsys.readouterr().out
    assert (f"no checkpoint holds the parts of all 2 nodes: continue with `openprime run RECIPE --nodes 1 --run-dir "
            f"{run_dir} --resume latest` (step 20;") in out, out
    _saved(root, 10, 0, 1)
    assert _print_checkpoints(cfg, run_dir, num_nodes=2, joined=None) == 20
    out = capsys.readouterr().out
    assert (f"(newest: step 20); continue with `openprime run RECIPE --nodes 2 --run-dir {run_dir} --resume latest` "
            f"(from step 10, the newest that holds every node's parts); or from the newest step, 20, which 1 of the 2 "
            f"nodes saved: `openprime run RECIPE --nodes 2 --run-dir {run_dir} --resume {root / 'step-00000020'}` (the "
            f"others take the state from a peer") in out, out  # after a node died, the others' steps go on
    _saved(root, 20, 0)
    assert _print_checkpoints(cfg, run_dir, num_nodes=2, joined="tcp://10.0.0.1:29400") == 20
    out = capsys.readouterr().out
    assert (f"(newest: step 20); continue with `openprime run RECIPE --nodes 2 --join tcp://10.0.0.1:29400 --run-dir "
            f"{run_dir} --resume latest`; export") in out, out


def _deaf(ready) -> None:
    """A node process that ignores SIGTERM (it never gets to leave): only SIGKILL ends it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    time.sleep(120)


def test_stop_waits_longer_only_for_a_process_whose_checkpoint_write_is_under_way(tmp_path, monkeypatch, capsys):
    import openprime.train.launcher as launcher_module

    monkeypatch.setattr(launcher_module, "LEAVE_S", 0.5)
    cfg = recipe_config(ROOT / "recipes" / "debug.py", ["checkpoint.stop_wait_s=3"])
    launcher = Launcher(cfg, tmp_path / "run", num_nodes=2)
    ctx = mp.get_context("fork")
    procs, ended = [], {}
    try:
        for node in (0, 1):
            ready = ctx.Event()
            proc = ctx.Process(target=_deaf, args=(ready,), name=f"node-{node}")
            proc.start()
            assert ready.wait(30)
            procs.append(proc)
            launcher.local_procs[node] = [proc]
        # Node 1 writes its part of step 10 (the temporary directory write_part names with its pid).
        (tmp_path / "run" / "checkpoints" / "step-00000010" / f".tmp-slot-1-{procs[1].pid}-0123abcd").mkdir(
            parents=True)
        watchers = [threading.Thread(target=lambda p=p: (p.join(60), ended.setdefault(p.name, time.monotonic())))
                    for p in procs]
        start = time.monotonic()
        for w in watchers:
            w.start()
        launcher.stop()
        for w in watchers:
            w.join(60)
    finally:
        for proc in procs:
            proc.kill()
    assert 0.5 <= ended["node-0"] - start < 2.5, ended["node-0"] - start  # LEAVE_S, then SIGKILL
    assert 3.0 <= ended["node-1"] - start < 5.0, ended["node-1"] - start  # the write: checkpoint.stop_wait_s
    assert "openprime: waiting for node(s) [1] to finish writing their checkpoint (at most " \
           "checkpoint.stop_wait_s=3;" in capsys.readouterr().err


class _GoneStream:
    """A stream whose reader is gone: every write fails as a pipe's does (EPIPE) or a closed terminal's (EIO)."""

    def __init__(self, error: type[OSError]) -> None:
        self.error = error

    def write(self, text: str) -> int:
        raise self.error("gone")

    def flush(self) -> None:
        raise self.error("gone")


def test_the_launchers_lines_go_to_stderr_once_stdout_is_gone_and_are_dropped_when_both_are(monkeypatch, capsys):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    tell("to stdout")  # capsys's stdout is there
    monkeypatch.setattr(sys, "stdout", _GoneStream(BrokenPipeError))
    tell("continue with this")
    tell("and this", err=True)
    tell("and then this")  # stdout stays given up: stderr takes the rest
    assert err.getvalue().splitlines() == ["continue with this", "and this", "and then this"]
    monkeypatch.setattr(sys, "stderr", _GoneStream(OSError))  # the terminal closed (EIO): nobody can read them
    monkeypatch.setattr(sys, "stdout", _GoneStream(OSError))
    tell("dropped")
    tell("dropped too", err=True)
    assert capsys.readouterr().out == "to stdout\n"


def test_a_nodes_end_is_told_by_its_signal():
    assert ended_how(1) == "exited with code 1"
    assert ended_how(143) == "exited with code 143 (it left on SIGTERM)"
    assert ended_how(129) == "exited with code 129 (it left on SIGHUP)"
    assert ended_how(-9).startswith("was killed by SIGKILL (out of memory? The kernel's OOM killer")
    assert ended_how(-11) == "was killed by SIGSEGV"
    assert ended_how(-200) == "was killed by signal 200"


def test_the_launchers_lines_go_to_stderr_when_it_started_without_stdout(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(sys, "stdout", None)  # `openprime run ... >&-`: print() would drop them unsaid
    tell("continue with this")
    assert err.getvalue() == "continue with this\n"


def test_the_commands_printed_at_the_end_of_a_launch_quote_a_run_directory_with_a_space(tmp_path, capsys):
    """`--run-dir "runs/my run"`: the printed commands cut the path in two when pasted (review of 2026-12-07)."""
    import shlex

    cfg = recipe_config(ROOT / "recipes" / "debug.py", [])
    run_dir = tmp_path / "my run"
    _saved(run_dir / "checkpoints", 20, 0, 1)
    _print_checkpoints(cfg, run_dir, num_nodes=2, joined=None)
    out = capsys.readouterr().out
    resume = out.split("continue with `")[1].split("`")[0]
    export = out.split("export the model with `")[1].split("`")[0]
    assert shlex.split(resume)[-4:] == ["--run-dir", str(run_dir), "--resume", "latest"], resume
    assert shlex.split(export) == ["openprime", "export", str(run_dir), "OUT_DIR"], export


def test_the_nodes_a_launch_adds_to_a_resumed_checkpoint_ask_for_slots_no_saved_node_holds(tmp_path):
    """`--nodes 3 --resume latest` of a checkpoint of slots 0 and 2: the third node asked for any slot and could take
    slot 0 before the node resuming it joined (which then read slot 0's data again from the start, its own left
    unread). It asks for slot 1, the first that no saved node holds."""
    saved = Checkpoint(step=20, path=tmp_path, parts=("slot-0", "slot-2"))
    assert data_slots(saved, num_nodes=3, max_nodes=4) == [0, 2, 1]
    assert data_slots(saved, num_nodes=4, max_nodes=4) == [0, 2, 1, 3]
    assert data_slots(saved, num_nodes=5, max_nodes=4) == [0, 2, 1, 3, -1]  # the coordinator refuses a fifth
    assert data_slots(saved, num_nodes=1, max_nodes=4) == [0]  # a machine resuming its own node of a shared disk
    sharded = Checkpoint(step=20, path=tmp_path, parts=("slot-1-rank-0", "slot-1-rank-1"))
    assert data_slots(sharded, num_nodes=2, max_nodes=8) == [1, 0]
    # A new run's node N asks for slot N, as its resume numbers nodes by slot (they got slots in join order).
    assert data_slots(None, num_nodes=2, max_nodes=8) == [0, 1]
    assert data_slots(None, num_nodes=2, max_nodes=8, first_node=7) == [7, -1]  # a second launch sharing the disk


def test_run_files_keep_recipes_of_the_same_name_and_a_joined_launchs_config_apart(tmp_path):
    """An experiment's `debug.py` deriving from `recipes/debug.py`: the base, copied second, replaced the recipe that
    ran. A launch that joined the run of the launch holding the directory replaced that launch's config.json. The
    config is the one the launch runs (mesh.min_nodes: its nodes)."""
    import json

    from openprime.train.launcher import write_run_files

    mine = tmp_path / "myexp" / "debug.py"
    mine.parent.mkdir()
    mine.write_text("# MY EXPERIMENT\n")
    base = ROOT / "recipes" / "debug.py"
    cfg = recipe_config(base, [])
    run_dir = tmp_path / "run"
    write_run_files(run_dir, cfg, recipe=mine, recipe_files=[mine, base], overrides=[], num_nodes=2)
    assert (run_dir / "recipe" / "debug.py").read_text() == "# MY EXPERIMENT\n"
    assert (run_dir / "recipe" / "debug.2.py").read_text() == base.read_text()
    first = json.loads((run_dir / "config.json").read_text())
    assert first["recipe_files"] == {"debug.py": str(mine), "debug.2.py": str(base)}
    assert first["config"]["mesh"]["min_nodes"] == 2
    write_run_files(run_dir, cfg, recipe=base, recipe_files=[base], overrides=["train.log_every=7"], num_nodes=1,
                    joined=True)
    assert json.loads((run_dir / "config.json").read_text()) == first
    assert json.loads((run_dir / "config.joined-1.json").read_text())["overrides"] == ["train.log_every=7"]
    assert (run_dir / "recipe.joined-1" / "debug.py").read_text() == base.read_text()


LOCK_LAUNCH_AND_HANG = """
import pathlib, sys, time
from openprime.train.processes import NodeProcess, nodes_hold_run_lock
from openprime.train.run_lock import RunDirLock
if __name__ == "__main__":
    lock = RunDirLock(pathlib.Path(sys.argv[1]), shared=False)
    with nodes_hold_run_lock(lock.fileno):
        node = NodeProcess(target=time.sleep, args=(120,), name="node-0")
        node.start()
    print(node.pid, flush=True)
    time.sleep(120)
"""


def test_a_killed_launchers_nodes_hold_its_run_directory_until_they_exit(tmp_path):
    """The nodes hold the run directory's lock with their launcher (the same open lock file): after a kill -9 of the
    launcher its nodes went on for seconds (a checkpoint write under way: up to checkpoint.stop_wait_s) while a new
    launch could take the directory and resume beside them. The refusal names the ended launch's nodes."""
    from openprime.core.errors import ConfigError
    from openprime.train.run_lock import RunDirLock

    script, run_dir = tmp_path / "launch.py", tmp_path / "run"
    script.write_text(LOCK_LAUNCH_AND_HANG)
    launcher = subprocess.Popen([sys.executable, str(script), str(run_dir)], stdout=subprocess.PIPE, text=True)
    node_pid = None
    try:
        node_pid = int(launcher.stdout.readline())
        os.kill(node_pid, signal.SIGSTOP)  # it cannot leave (it would at once): the window a write keeps open
        launcher.kill()
        launcher.wait(timeout=30)
        try:
            RunDirLock(run_dir, shared=False)
            raise AssertionError("a new launch took the directory while the killed launcher's node lived")
        except ConfigError as e:
            assert f"the node processes of launch pid {launcher.pid}, which ended" in str(e), e
        os.kill(node_pid, signal.SIGCONT)  # it sees its launcher gone and leaves
        deadline = time.monotonic() + 30
        while not process_ended(node_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert process_ended(node_pid)
        with RunDirLock(run_dir, shared=False):
            pass
    finally:
        launcher.kill()
        if node_pid is not None and not process_ended(node_pid):
            os.kill(node_pid, signal.SIGCONT)
            os.kill(node_pid, 9)


def test_a_run_whose_records_show_different_global_states_is_an_error():
    # The launch exited 0 with "global state hashes DIFFER" in its summary line.
    from openprime.train.launcher import divergence
    from openprime.train.metrics import summarize_records

    def outer(node, step, state):
        return {"kind": "outer", "node": node, "time": 0.0, "outer_step": step, "state_hash": state, "skipped": False,
                "bytes_sent": 0}

    agree = summarize_records([outer(0, 1, "aa"), outer(1, 1, "aa"), outer(0, 2, "bb"), outer(1, 2, "bb")])
    assert divergence(agree) is None
    differ = summarize_records([outer(0, 1, "aa"), outer(1, 1, "aa"), outer(0, 2, "bb"), outer(1, 2, "cc"),
                                outer(0, 3, "dd"), outer(1, 3, "ee")])
    message = divergence(differ)
    assert message is not None and message.startswith("the nodes' records show different global states after outer "
                                                       "step(s) [2, 3]: the replicas diverged"), message
    assert "resume from a checkpoint saved before outer step 2" in message
