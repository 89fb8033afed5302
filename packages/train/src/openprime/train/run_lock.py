"""One launch at a time in a run directory: an advisory lock that `openprime run` holds while its nodes run.

Two launches writing into one run directory mix their nodes' records in one metrics.jsonl and save checkpoints of
the same steps over each other; the second launch's checks (a run directory that holds a run is resumed, not
started again) cannot see the first before its nodes have written anything. Seen by hand: a second
`openprime run ... --run-dir D` started 1.5 s after the first trained beside it, and the summary read
"loss 8.826 -> 6.187 over 80 steps" for a run of 40.

The lock is `flock(2)` on RUN_DIR/.openprime.lock. The kernel releases it when its holder exits, however it exits
(kill -9 too), so a crash never leaves a stale lock behind. A launch that starts its own run takes it exclusively;
a launch that joins a run (`--join`) takes it shared, since several launches joining one coordinator may write
into one directory (openprime.train.cli checks that they join the run that directory holds; a `--join` launch
into the directory of a running `openprime run` that started its own coordinator may write beside it only if
that run is the one it joins, which the cli asks the coordinator). The lock file holds the exclusive holder's
pid, host, start time and command line, for the message that refuses the next one and for `openprime status`.

A second file, RUN_DIR/.openprime.joined.lock, is held shared by every `--join` launch (and its nodes) for its
whole life, beside the first or instead of it: a launch that joined beside a running `openprime run` cannot take
the first lock, and when that run ended the directory looked free while the joined nodes still wrote into it (a
resume started there trained beside them). A launch of its own takes the second lock exclusively before the
first, and lets it go at once: it only asks whether a joined launch is still there.
flock does not reach across machines on every network filesystem: there the lock guards the launches of one
machine only, and where the filesystem refuses locks altogether the launch says so and goes on without one.

A launch given no --run-dir makes its own with `new_run_dir`: runs/NAME-TIMESTAMP, or -2, -3, ... after it when
launches started in the same second (a sweep) took the name first.
"""

from __future__ import annotations

import datetime
import errno
import itertools
import json
import os
import pathlib
import shlex
import socket
import sys
import types

from openprime.core.errors import ConfigError

try:
    import fcntl
except ImportError:  # not on Windows: no lock, as on a filesystem that refuses them
    fcntl = None

LOCK_NAME = ".openprime.lock"
JOINED_LOCK_NAME = ".openprime.joined.lock"  # held shared by the launches joined to a coordinator (--join)
# Each try that finds its lock files removed under it (a launch that made the directory and wrote nothing removed
# it, `_remove_unused_dir`) makes them again; only a program that keeps removing the directory exhausts these.
NUM_LOCK_TRIES = 5


class RunDirInUse(ConfigError):
    """Another launch on this machine holds the run directory."""


class RunDirLock:
    """The lock of one run directory, held until `release()` (or the end of a `with` block)."""

    def __init__(self, run_dir: pathlib.Path, *, shared: bool, new: bool = False, beside: bool = False) -> None:
        """`shared`: a launch joined to a coordinator (--join). `new`: the directory must not exist yet
        (FileExistsError otherwise): a name the launch chose itself. `beside` (with `shared`): where a launch with
        its own coordinator holds the directory, hold the joined lock alone (`self.beside` is then True) instead of
        refusing; the caller checks that this launch joins that very run."""
        self.run_dir, self.shared, self.beside = run_dir, shared, False
        self._fd = self._joined_fd = None
        self._held = False  # this lock's own: the record in the file, and the directory if it made it
        for _ in range(NUM_LOCK_TRIES):
            try:
                if self._take(run_dir, new=new, beside=beside):
                    return
            except BaseException:
                self.release()  # no descriptor left open on a refusal or an error
                raise
            new = False  # the directory went away under the lock files it opened: make it again, if it must
        raise RunDirInUse(f"{run_dir} was removed {NUM_LOCK_TRIES} times while this launch took its lock: another "
                          f"program removes it; choose another --run-dir")

    def _take(self, run_dir: pathlib.Path, *, new: bool, beside: bool) -> bool:
        """Open and lock the lock files (RunDirInUse if another launch holds them); False if a launch that made the
        directory removed them meanwhile, unused (`_remove_unused_dir`): the locks taken were on files no longer
        there, and a launch joined into that directory found it gone."""
        self.created_dir = new or not run_dir.exists()
        run_dir.mkdir(parents=True, exist_ok=not new)
        self.path = run_dir / LOCK_NAME
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            self._joined_fd = os.open(run_dir / JOINED_LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # removed between the mkdir and an open
            self.release()
            return False
        if fcntl is None:
            return True
        try:
            if self.shared:
                fcntl.flock(self._joined_fd, fcntl.LOCK_SH)  # waits only while a launch of its own looks (below)
            elif not _try_flock(self._joined_fd, fcntl.LOCK_EX):
                self._refuse(run_dir)  # a joined launch (or its nodes) still writes here
            if not _try_flock(self._fd, fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX):
                if not (self.shared and beside):
                    self._refuse(run_dir)
                self.beside = True  # held by a launch with its own coordinator: the joined lock alone
            if not (_is_at(self._fd, self.path) and _is_at(self._joined_fd, run_dir / JOINED_LOCK_NAME)):
                self.release()
                self.beside = False
                return False
            if not self.shared:
                fcntl.flock(self._joined_fd, fcntl.LOCK_UN)
                os.close(self._joined_fd)
                self._joined_fd = None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            print(f"openprime: note: the filesystem of {run_dir} does not support locks ({e.strerror}): make sure no "
                  f"other launch uses this run directory", file=sys.stderr, flush=True)
            return True
        self._held = True
        if not self.shared:
            os.ftruncate(self._fd, 0)
            os.write(self._fd, (json.dumps(_holder()) + "\n").encode())
        return True

    def _refuse(self, run_dir: pathlib.Path) -> None:
        """Let go of what this lock holds and raise RunDirInUse naming the launch that holds the directory."""
        holder, elsewhere = _describe(self.path)
        self.release()
        where = "" if elsewhere else " on this machine"
        raise RunDirInUse(f"{run_dir} is in use by another openprime launch{where} ({holder}); two "
                          f"launches in one run directory would mix their records and overwrite each other's "
                          f"checkpoints. Wait for it to end (then continue its run with --resume latest), or "
                          f"choose another --run-dir")

    @property
    def fileno(self) -> int | None:
        """The descriptor of the lock file this launch holds, while it holds it (processes that get a copy hold the
        lock too): a joined launch's nodes hold the joined lock."""
        if not self._held:
            return None
        return self._joined_fd if self.shared else self._fd

    def release(self) -> None:
        """Let the next launch in. A directory this lock created that holds nothing but the lock file (the launch
        stopped before writing anything) is removed again, as if the launch had not been tried."""
        if self._fd is None:
            return
        if self._held and not self.shared:
            os.ftruncate(self._fd, 0)  # the holder's record is there only while it holds the lock
            if self.created_dir and {p.name for p in self.run_dir.iterdir()} <= {LOCK_NAME, JOINED_LOCK_NAME}:
                self._remove_unused_dir()
        for fd in (self._fd, self._joined_fd):  # closing the last descriptor of the open file releases the flock
            if fd is not None:
                os.close(fd)
        self._fd = self._joined_fd = None

    def _remove_unused_dir(self) -> None:
        """Remove the directory this launch made and wrote nothing into, unless a joined launch holds it (it joined
        beside this one): its lock file must stay the one it holds."""
        joined = os.open(self.run_dir / JOINED_LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if fcntl is None or _try_flock(joined, fcntl.LOCK_EX):
                for name in (LOCK_NAME, JOINED_LOCK_NAME):
                    (self.run_dir / name).unlink(missing_ok=True)
                # A launch that opened the lock files before they went sees it and makes them again (`_take`); one
                # that made them again already, or wrote into the directory, keeps it.
                try:
                    self.run_dir.rmdir()
                except OSError as e:
                    if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                        raise
        finally:
            os.close(joined)

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: types.TracebackType | None) -> None:
        self.release()


def _is_at(fd: int, path: pathlib.Path) -> bool:
    """Whether the open file `fd` is still the one at `path` (not removed, nor replaced by a new file)."""
    try:
        at = path.stat()
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (at.st_dev, at.st_ino)


def _try_flock(fd: int, op: int) -> bool:
    """flock(fd, op) without waiting: False if another open file holds a lock that conflicts."""
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def new_run_dir(root: pathlib.Path, name: str, *, shared: bool) -> tuple[pathlib.Path, RunDirLock]:
    """ROOT/NAME-TIMESTAMP, made by this launch and locked: with -2, -3, ... after it when another launch took that
    name in the same second (a sweep that starts its runs at once; before, they all trained into one directory)."""
    base = root.resolve() / f"{name}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    for k in itertools.count(1):
        run_dir = base if k == 1 else base.with_name(f"{base.name}-{k}")
        try:
            return run_dir, RunDirLock(run_dir, shared=shared, new=True)
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def _holder() -> dict[str, object]:
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": shlex.join(["openprime", *sys.argv[1:]])}


def _describe(path: pathlib.Path) -> tuple[str, bool]:
    """Who holds the lock that this launch could not take, and whether that is a launch of another machine."""
    holders = lock_holders(path)
    if holders is not None:
        return holders, False
    try:  # its launch is gone: its nodes, which hold the lock too until they exit (processes.nodes_hold_run_lock)
        holder = json.loads(path.read_text())
        if holder["host"] != socket.gethostname():  # a disk shared over NFS, whose locks reach across machines: this
            # machine cannot tell whether it lives, and "which ended" sent the person to wait for nodes that train on
            return (f"pid {holder['pid']} on host {holder['host']}, started {holder['started']}: "
                    f"{holder['command']}"), True
        return (f"the node processes of launch pid {holder['pid']}, which ended ({holder['command']}); they leave "
                f"within seconds of it, or once the checkpoint write under way ends (checkpoint.stop_wait_s at most)"
                ), False
    except (OSError, ValueError, KeyError, TypeError):
        return "a launch that joined a run with --join", False


def lock_holders(path: pathlib.Path) -> str | None:
    """The launches of this machine that hold the lock at `path`: the one its file names, while that process lives,
    else those that joined a run with --join, which hold it shared and write nothing; None if none does. The record
    of a launch killed with -9 stays in the file: a refusal named that dead launch, and status said none ran while
    --join launches held the directory (found 2026-12-07)."""
    try:
        holder = json.loads(path.read_text())
        if holder["host"] == socket.gethostname() and _alive(int(holder["pid"])):
            return f"pid {holder['pid']}, started {holder['started']}: {holder['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    joined = shared_holders(path.with_name(JOINED_LOCK_NAME))
    return "; ".join(f"pid {pid}, joined to a coordinator: {holder_command(pid)}" for pid in joined) or None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def shared_holders(lock: pathlib.Path) -> list[int]:
    """The pids of this machine's processes that hold `lock` shared (launches joined to a coordinator, `--join`,
    which write no record: several may), from Linux's /proc/locks; [] where it cannot tell."""
    try:
        st = lock.stat()
        table = pathlib.Path("/proc/locks").read_text()
    except OSError:
        return []
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in table.splitlines():  # e.g. "1: FLOCK  ADVISORY  READ 16265 fe:00:2146774 0 EOF"
        fields = line.split()
        if len(fields) >= 6 and "->" not in fields and fields[1] == "FLOCK" and fields[3] == "READ" \
                and fields[5] == key:
            pids.append(int(fields[4]))
    return sorted(set(pids))  # one process may hold it through several descriptors


def holder_command(pid: int) -> str:
    """A process's command line, from /proc ('?' where it cannot be read)."""
    try:
        return " ".join(pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")).strip()
    except OSError:
        return "?"


