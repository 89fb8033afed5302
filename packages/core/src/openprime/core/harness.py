"""Groups of real processes and of threads for tests: the harness under every multi-process test.

`run_group` starts real processes (multiprocessing "forkserver", one thread each), gives each a transport
from a picklable factory and runs a top-level function in it, bounded by a timeout; no process is left
behind. `local_group` builds transports between threads of one process (`LocalTransport`), for fast unit
tests; `run_threads` runs functions in threads, bounded. Tests import these from `openprime.core.testing`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import signal
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from openprime.core.distributed import host_store
from openprime.core.errors import FrameError, PeerFailure
from openprime.core.transport import Handle, Rendezvous, Transport, TransportFactory, as_bytes, remaining

KILLED = "killed"


@attrs.frozen
class GroupContext:
    """What a process of a test group knows about itself."""

    rank: int
    world_size: int
    rendezvous: Rendezvous


def _child_main(rank: int, world_size: int, rendezvous: Rendezvous, factory: TransportFactory | None,
                body: Callable, args: tuple, results: Any) -> None:
    torch.set_num_threads(1)
    try:
        transport = factory(rendezvous, rank, world_size) if factory is not None else None
        try:
            value = body(transport, GroupContext(rank, world_size, rendezvous), *args)
        finally:
            if transport is not None:
                transport.close()
        results.put((rank, True, value))
    except BaseException:  # report everything, including assertion errors, to the parent
        results.put((rank, False, traceback.format_exc()))


def run_group(num_procs: int, body: Callable, *, factory: TransportFactory | None, args: Sequence = (),
              timeout_s: float = 60.0, expect_killed: Sequence[int] = ()) -> list[Any]:
    """Run `body(transport, ctx, *args)` in `num_procs` processes; return their results by rank.

    Ranks in `expect_killed` must die by SIGKILL (their result is KILLED). Raises AssertionError with
    the children's tracebacks if any failed, and kills every child still running at the timeout.
    """
    store = host_store(timeout_s=timeout_s)
    rendezvous = Rendezvous(host="127.0.0.1", port=store.port, group=f"test/{uuid.uuid4().hex[:8]}")
    # Fresh interpreters, as "spawn" gives, but forked from a server that imported torch once: importing it
    # costs each child about 1.6 CPU-s here, which with spawn was half the time of the transport suites
    # (transports, core, fsdp, the int8 ring and kernels: 189 s with spawn, 91 s with this). Nothing in the
    # server has started threads or touched CUDA, so forking it is safe. Children take the server's
    # environment, which it got at the first start below (OMP_NUM_THREADS=1), and its stdout and stderr (under
    # pytest, those of the test that started it): a child reports through `results`, never by printing.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "openprime.core.testing"])
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_child_main, args=(r, num_procs, rendezvous, factory, body, tuple(args), results),
                    daemon=True)
        for r in range(num_procs)
    ]
    env_before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # taken by the fork server (and so its children) before torch loads
    try:
        for p in procs:
            p.start()
    finally:
        if env_before is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = env_before
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        # Drain the queue while waiting: a child blocks on exit until its result has been read.
        while time.monotonic() < deadline and (
            any(p.is_alive() for p in procs) or len(outcomes) < num_procs - len(expect_killed)
        ):
            try:
                rank, ok, value = results.get(timeout=0.1)
                outcomes[rank] = (ok, value)
            except queue_mod.Empty:
                if not any(p.is_alive() for p in procs) and results.empty():
                    break
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
        results.close()
    problems = []
    if hung:
        problems.append(f"ranks {hung} still running after {timeout_s:.0f}s (killed)")
    values: list[Any] = []
    for r, p in enumerate(procs):
        if r in expect_killed:
            if p.exitcode != -signal.SIGKILL:
                problems.append(f"rank {r} was expected to be killed, exit code {p.exitcode}")
            values.append(KILLED)
        elif r not in outcomes:
            problems.append(f"rank {r} reported nothing (exit code {p.exitcode})")
            values.append(None)
        elif not outcomes[r][0]:
            problems.append(f"rank {r} failed:\n{outcomes[r][1]}")
            values.append(None)
        else:
            values.append(outcomes[r][1])
    if problems:
        raise AssertionError("\n".join(problems))
    return values


# ---------------------------------------------------------------- in-process groups (threads)


class _Done(Handle):
    def wait(self) -> None:
        return None


class _Hub:
    """The queues of a local group, one per (sender, receiver, tag), created under a lock.

    A `defaultdict(queue.Queue)` is not enough: its factory runs Python code, so a sender and a receiver
    that touch a new key at the same moment can each create a queue, one overwriting the other, and the
    receiver then waits on a queue nobody puts into until its deadline (seen once as a rare
    "deadline passed" in the DiLoCo tests).
    """

    def __init__(self) -> None:
        self._queues: dict[tuple[int, int, int], queue_mod.Queue] = {}
        self._lock = threading.Lock()

    def __getitem__(self, key: tuple[int, int, int]) -> queue_mod.Queue:
        with self._lock:
            if key not in self._queues:
                self._queues[key] = queue_mod.Queue()
            return self._queues[key]


class _LocalRecv(Handle):
    def __init__(self, transport: LocalTransport, peer: int, tag: int, buffers: Sequence[torch.Tensor],
                 deadline: float) -> None:
        self._t, self._peer, self._tag, self._buffers, self._deadline = transport, peer, tag, buffers, deadline
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        try:
            message = self._t._hub[(self._peer, self._t.rank, self._tag)].get(timeout=remaining(self._deadline))
        except queue_mod.Empty:
            raise PeerFailure(self._peer, "deadline passed") from None
        sizes = [as_bytes(b).numel() for b in self._buffers]
        if [m.numel() for m in message] != sizes:
            raise FrameError(self._peer, f"expected sizes {sizes}, got {[m.numel() for m in message]}")
        for buf, m in zip(self._buffers, message, strict=True):
            as_bytes(buf).copy_(m)
        self._t._count(received=self._t.frame_bytes(self._tag, sizes))
        self._done = True


class LocalTransport(Transport):
    """A Transport between threads of one process: a test double for fast, deterministic unit tests."""

    def __init__(self, hub: _Hub, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self._hub = hub
        self._closed = False

    def isend(self, peer: int, tag: int, buffers: Sequence[torch.Tensor], *, deadline: float) -> Handle:
        self._check_peer(peer)
        if self._closed:
            raise PeerFailure(peer, "transport is closed")
        message = [as_bytes(b).clone() for b in buffers]
        self._hub[(self.rank, peer, tag)].put(message)
        self._count(sent=self.frame_bytes(tag, [m.numel() for m in message]))
        return _Done()

    def irecv(self, peer: int, tag: int, buffers: Sequence[torch.Tensor], *, deadline: float) -> Handle:
        self._check_peer(peer)
        if self._closed:
            raise PeerFailure(peer, "transport is closed")
        return _LocalRecv(self, peer, tag, buffers, deadline)

    def close(self) -> None:
        self._closed = True


class ForwardingTransport(Transport):
    """Passes every call to `inner`: a test subclasses it and overrides one call to inject a fault there."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner.rank, inner.world_size)
        self.inner = inner

    def isend(self, peer: int, tag: int, buffers: Sequence[torch.Tensor], *, deadline: float) -> Handle:
        return self.inner.isend(peer, tag, buffers, deadline=deadline)

    def irecv(self, peer: int, tag: int, buffers: Sequence[torch.Tensor], *, deadline: float) -> Handle:
        return self.inner.irecv(peer, tag, buffers, deadline=deadline)

    @property
    def unreachable(self) -> frozenset[int]:
        return self.inner.unreachable

    def close(self) -> None:
        self.inner.close()


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (nothing listens there: a connect to it is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def await_stopped(pid: int, what: str, timeout_s: float = 10.0) -> None:
    """Wait until process `pid` is stopped (state T in /proc): SIGSTOP takes effect once the process is scheduled,
    and until then (a loaded machine) it still answers."""
    deadline = time.monotonic() + timeout_s
    while (state := _process_state(pid)) != "T":
        assert time.monotonic() < deadline, f"{what} did not stop ({state})"
        time.sleep(0.005)


def _process_state(pid: int) -> str:
    """The process's state letter in /proc, after "(comm)", which may hold spaces."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def local_group(world_size: int) -> list[LocalTransport]:
    """`world_size` LocalTransports that talk to each other through in-memory queues."""
    hub = _Hub()
    return [LocalTransport(hub, r, world_size) for r in range(world_size)]


def run_threads(fns: Sequence[Callable[[], Any]], *, timeout_s: float = 60.0) -> list[Any]:
    """Run each function in its own thread; return their results, re-raising the first failure."""
    results: list[Any] = [None] * len(fns)
    errors: list[BaseException | None] = [None] * len(fns)

    def runner(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as e:  # surfaced to the caller below
            errors[i] = e

    threads = [threading.Thread(target=runner, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(timeout=remaining(deadline))
    if any(t.is_alive() for t in threads):
        raise AssertionError(f"threads still running after {timeout_s}s")
    for e in errors:
        if e is not None:
            raise e
    return results
