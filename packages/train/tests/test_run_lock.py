"""One launch at a time in a run directory (openprime.train.run_lock), and `openprime run` refusing a second."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from openprime.core.errors import ConfigError
from openprime.train import cli, run_lock
from openprime.train.run_lock import JOINED_LOCK_NAME, LOCK_NAME, RunDirLock

REPO = pathlib.Path(__file__).resolve().parents[3]


def test_a_second_launch_is_refused_until_the_first_releases(tmp_path):
    run_dir = tmp_path / "run"
    first = RunDirLock(run_dir, shared=False)
    record = json.loads((run_dir / LOCK_NAME).read_text())
    assert record["pid"] == os.getpid() and record["command"].startswith("openprime")
    for shared in (False, True):  # neither a launch of its own nor one joining a run may write beside it
        with pytest.raises(ConfigError, match=rf"in use by another openprime launch .*pid {os.getpid()}, started "):
            RunDirLock(run_dir, shared=shared)
    assert json.loads((run_dir / LOCK_NAME).read_text()) == record  # a refused launch leaves the record alone
    (run_dir / "metrics.jsonl").write_text("")
    first.release()
    assert (run_dir / LOCK_NAME).read_text() == ""  # no holder: no record
    with RunDirLock(run_dir, shared=False):
        pass


def test_launches_joining_one_run_share_its_directory(tmp_path):
    with (RunDirLock(tmp_path, shared=True), RunDirLock(tmp_path, shared=True),
          # The holder's command line may hold ';' itself (a pytest-xdist worker's: `-c import sys;exec(...)`).
          pytest.raises(ConfigError, match=rf"\(pid {os.getpid()}, joined to a coordinator: .*\); two launches")):
        RunDirLock(tmp_path, shared=False)
    with RunDirLock(tmp_path, shared=False):
        pass


def test_a_directory_made_for_a_launch_that_wrote_nothing_is_removed(tmp_path):
    with RunDirLock(tmp_path / "tried", shared=False):
        pass
    assert not (tmp_path / "tried").exists()
    with RunDirLock(tmp_path / "ran", shared=False):
        (tmp_path / "ran" / "config.json").write_text("{}")
    assert sorted(p.name for p in (tmp_path / "ran").iterdir()) == sorted([LOCK_NAME, JOINED_LOCK_NAME, "config.json"])
    (tmp_path / "existing").mkdir()
    with RunDirLock(tmp_path / "existing", shared=False):
        pass
    assert (tmp_path / "existing").is_dir()  # not this launch's to remove


@pytest.mark.parametrize("shared", [True, False], ids=["joined", "own"])
def test_a_launch_whose_lock_files_were_removed_as_it_opened_them_locks_them_made_again(tmp_path, monkeypatch,
                                                                                      shared):
    """A launch that made a directory and wrote nothing removes it as it ends; another launch (here --join, or one of
    its own) that had opened the lock files just before locked the removed files, in a removed directory: it
    held nothing a third launch could see, and its run directory was gone (review of 2026-12-07)."""
    run_dir = tmp_path / "run"
    first = RunDirLock(run_dir, shared=False)  # made the directory; releases (and removes it) between open and lock
    flock = run_lock.fcntl.flock
    calls = []

    def flock_after_the_first_ended(fd, op):
        calls.append(op)
        if len(calls) == 1:
            first.release()  # its own flock (to see that no launch joined) goes through this too
        return flock(fd, op)

    monkeypatch.setattr(run_lock.fcntl, "flock", flock_after_the_first_ended)
    second = RunDirLock(run_dir, shared=shared)
    monkeypatch.undo()
    _holds_the_files_at_its_paths(second, run_dir, shared=shared)
    with pytest.raises(ConfigError, match="in use by another openprime launch"):
        RunDirLock(run_dir, shared=not shared)  # a third launch sees it
    second.release()
    assert run_dir.exists() == shared  # made again by the second, which wrote nothing: a launch of its own removes it


@pytest.mark.parametrize("shared", [True, False], ids=["joined", "own"])
def test_a_launch_whose_directory_went_away_between_its_two_opens_tries_again(tmp_path, monkeypatch, shared):
    """The same race one step earlier (found by review): removed between opening the first lock file and the second,
    the launch failed with FileNotFoundError ("cannot write the run directory") and kept the first file open."""
    run_dir = tmp_path / "run"
    first = RunDirLock(run_dir, shared=False)
    real_open, calls = os.open, []

    def open_after_the_first_ended(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:  # the second launch's second open
            first.release()
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(run_lock.os, "open", open_after_the_first_ended)
    second = RunDirLock(run_dir, shared=shared)
    monkeypatch.undo()
    _holds_the_files_at_its_paths(second, run_dir, shared=shared)
    leaked = [target for fd in os.listdir("/proc/self/fd") if str(run_dir) in (target := _target(fd))
              and target.endswith("(deleted)")]
    assert not leaked, leaked
    second.release()


def _holds_the_files_at_its_paths(lock: RunDirLock, run_dir: pathlib.Path, *, shared: bool) -> None:
    """The lock holds the file now at its path (device and inode), not one removed since it opened it."""
    held = os.fstat(lock.fileno)
    at = (run_dir / (JOINED_LOCK_NAME if shared else LOCK_NAME)).stat()
    assert (held.st_dev, held.st_ino) == (at.st_dev, at.st_ino)


def _target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def test_the_lock_goes_with_its_holder_when_it_is_killed(tmp_path):
    holder = _holding(tmp_path, shared=False)
    try:
        with pytest.raises(ConfigError, match=rf"pid {holder.pid}, started "):
            RunDirLock(tmp_path, shared=False)
        holder.send_signal(signal.SIGKILL)
        assert holder.wait(timeout=30) == -signal.SIGKILL
    finally:
        holder.kill()
        holder.wait(timeout=30)
    with RunDirLock(tmp_path, shared=False):  # no stale lock after a crash
        pass


def test_openprime_run_in_a_directory_in_use_starts_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    with RunDirLock(run_dir, shared=False):
        code = cli.main(["run", str(REPO / "recipes" / "debug.py"), "--nodes", "1", "--run-dir", str(run_dir)])
        assert code == 2
        assert f"{run_dir} is in use by another openprime launch" in capsys.readouterr().err
        assert {p.name for p in run_dir.iterdir()} == {LOCK_NAME, JOINED_LOCK_NAME}  # no config, no node started


def test_a_launch_joins_into_a_directory_in_use_only_for_the_run_there(tmp_path, capsys, monkeypatch):
    # `openprime run` (its own coordinator) holds the directory; a `--join` launch of its coordinator from the same
    # machine may add nodes beside it, as before the lock, once the running launch's nodes have said who they are.
    from openprime.mesh import Coordinator, MeshClient
    from openprime.train.recipe import recipe_config

    debug = str(REPO / "recipes" / "debug.py")
    launched = []
    monkeypatch.setattr("openprime.train.launcher.launch", lambda cfg, **kw: launched.append(kw) or 0)
    mesh = recipe_config(debug, []).mesh
    coordinator = Coordinator(mesh).start()
    live = MeshClient(coordinator.address, mesh, node_id="live-node")
    run_dir = tmp_path / "run"
    try:
        live.join()
        with RunDirLock(run_dir, shared=False):
            join = ["run", debug, "--run-dir", str(run_dir), "--join", coordinator.address]
            assert cli.main(join) == 2 and not launched
            assert "whose nodes have not started yet: join once they have" in capsys.readouterr().err
            (run_dir / "metrics.jsonl").write_text('{"kind": "start", "node": 0, "node_id": "live-node"}\n')
            assert cli.main(join) == 0 and launched[0]["first_node"] == 1
            assert cli.main([*join, "--resume", "latest"]) == 2  # a resume restarts its nodes: not beside a run
            assert f"{run_dir} is in use by another openprime launch" in capsys.readouterr().err
    finally:
        live.close()
        coordinator.stop()


def test_a_launch_joined_beside_a_run_holds_the_directory_after_that_run_ends(tmp_path):
    """A --join launch writing beside a launch with its own coordinator could not take the directory's lock and held
    none: once that launch ended, a resume started in the directory while the joined nodes still wrote into it."""
    run_dir = tmp_path / "run"
    own = RunDirLock(run_dir, shared=False)
    with pytest.raises(ConfigError, match="in use by another openprime launch"):
        RunDirLock(run_dir, shared=True)  # not beside it unless the launch asks to (it joins that very run)
    joined = _holding(run_dir, shared=True, beside=True)
    try:
        own.release()
        with pytest.raises(ConfigError, match=rf"\(pid {joined.pid}, joined to a coordinator: .*beside=True"):
            RunDirLock(run_dir, shared=False)
        with RunDirLock(run_dir, shared=True):  # more launches may join the same run
            pass
    finally:
        joined.kill()
        joined.wait(timeout=30)
    with RunDirLock(run_dir, shared=False):
        pass


def test_launches_started_in_the_same_second_get_run_directories_of_their_own(tmp_path, monkeypatch):
    # A sweep (`for lr in ...; do openprime run ... & done`) names every default run directory runs/NAME-TIMESTAMP
    # in the same second: before, all its runs trained into one directory; with the lock alone, all but one stopped.
    import datetime
    import types

    monkeypatch.chdir(tmp_path)
    noon = datetime.datetime(2026, 12, 4, 12, 0, 0)
    monkeypatch.setattr(run_lock, "datetime", types.SimpleNamespace(datetime=types.SimpleNamespace(now=lambda: noon)))
    first_dir, first = run_lock.new_run_dir(pathlib.Path("runs"), "debug", shared=False)
    second_dir, second = run_lock.new_run_dir(pathlib.Path("runs"), "debug", shared=False)
    with first, second:
        assert (first_dir, second_dir) == (tmp_path / "runs" / "debug-20261204-120000",
                                           tmp_path / "runs" / "debug-20261204-120000-2")
        with pytest.raises(FileExistsError):
            RunDirLock(first_dir, shared=False, new=True)
    assert not first_dir.exists() and not second_dir.exists()  # nothing written: nothing left behind


def test_a_refusal_names_the_launch_that_holds_the_directory_not_one_killed_before(tmp_path):
    """A launch killed with -9 leaves its record in the lock file; a --join launch then holds the directory shared
    (and writes none): a third launch's refusal named the dead one."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": int(dead.stdout), "host": os.uname().nodename,
                                                  "started": "then", "command": "openprime run killed.py"}) + "\n")
    joined = _holding(tmp_path, shared=True)
    try:
        with pytest.raises(ConfigError) as e:
            RunDirLock(tmp_path, shared=False)
        assert f"pid {joined.pid}, joined to a coordinator: " in str(e.value) and "killed.py" not in str(e.value)
    finally:
        joined.kill()
        joined.wait(timeout=30)


def _holding(run_dir: pathlib.Path, *, shared: bool, beside: bool = False) -> subprocess.Popen:
    """Another process that holds `run_dir`'s lock until its stdin closes (or it is killed)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import pathlib, sys; from openprime.train.run_lock import RunDirLock; "
         f"lock = RunDirLock(pathlib.Path({str(run_dir)!r}), shared={shared}, beside={beside}); "
         "print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder
