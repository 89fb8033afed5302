"""Helpers shared by tests across packages: a process harness and the transport and codec conformance suites.

`run_group` starts real processes (multiprocessing "forkserver", one thread each), gives each a transport
from a picklable factory and runs a top-level function in it, bounded by a timeout; no process is
left behind. `TransportConformance` is the suite every Transport implementation runs: subclass it in
a test module as `class TestMyTransport(TransportConformance)` with `factory = functools.partial(...)`.
`CodecConformance` (openprime.core.codec_conformance) is the suite every Codec runs.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import pytest
import torch

from openprime.core.auth import AuthConfig
from openprime.core.codec_conformance import CodecConformance  # noqa: F401  (re-exported: the suites live here)
from openprime.core.collectives import all_gather_object, ring_all_reduce
from openprime.core.distributed import connect_store, gloo_group, host_store
from openprime.core.errors import FrameError, PeerFailure
from openprime.core.shaping import LinkShaping
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


# ---------------------------------------------------------------- deterministic payloads


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    """`nbytes` pseudo-random bytes that both ends of a test can regenerate."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64)


def dtype_message(seed: int) -> list[torch.Tensor]:
    """One tensor of every dtype, of assorted shapes (0-d, empty, 2-d)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, dtype in enumerate(DTYPES):
        shape = [(), (0,), (3, 5), (1000,)][i % 4]
        raw = torch.randn(shape, generator=g, dtype=torch.float64) * 100
        out.append(raw.to(dtype) if not dtype.is_complex else torch.complex(raw, -raw).to(dtype))
    return out


# ---------------------------------------------------------------- bodies run inside the group

TAG_A, TAG_B = 11, 12


def _body_sizes(transport, ctx: GroupContext, sizes: Sequence[int]) -> dict:
    deadline = time.monotonic() + 120
    framed = sum(transport.frame_bytes(TAG_A, [n]) for n in sizes)
    intact = []
    for i, n in enumerate(sizes):
        if ctx.rank == 0:
            transport.send(1, TAG_A, [pattern(n, seed=i)], deadline=deadline)
        else:
            buf = torch.empty(n, dtype=torch.uint8)
            transport.recv(0, TAG_A, [buf], deadline=deadline)
            intact.append(torch.equal(buf, pattern(n, seed=i)))
    return {"intact": intact, "sent": transport.bytes_sent, "received": transport.bytes_received,
            "framed": framed}


def _body_dtypes(transport, ctx: GroupContext) -> bool:
    deadline = time.monotonic() + 60
    expected = dtype_message(seed=7)
    if ctx.rank == 0:
        transport.send(1, TAG_A, expected, deadline=deadline)
        return True
    got = [torch.empty_like(t) for t in expected]
    transport.recv(0, TAG_A, got, deadline=deadline)
    return all(g.dtype == e.dtype and torch.equal(g, e) for g, e in zip(got, expected, strict=True))


def _body_order(transport, ctx: GroupContext, num_messages: int) -> list[list[int]]:
    deadline = time.monotonic() + 60
    if ctx.rank == 0:
        handles = [transport.isend(1, (TAG_A, TAG_B)[k % 2], [torch.tensor([k])], deadline=deadline)
                   for k in range(num_messages)]
        for h in handles:
            h.wait()
        return []
    received = []
    for tag in (TAG_B, TAG_A):  # the reverse of the order they were sent in
        seq = []
        for _ in range(num_messages // 2):
            buf = torch.empty(1, dtype=torch.int64)
            transport.recv(0, tag, [buf], deadline=deadline)
            seq.append(int(buf.item()))
        received.append(seq)
    return received


def _body_add(transport, ctx: GroupContext, numels: Sequence[int]) -> list[bool]:
    """irecv_add of messages of each size, each twice: posted before the message arrives (the receiver says
    when it is ready), and posted after (the sender says when it sent; the receiver waits a little longer)."""
    deadline = time.monotonic() + 60
    go = torch.zeros(1)
    exact = []
    for i, numel in enumerate(numels):
        message = torch.randn(numel, generator=torch.Generator().manual_seed(i))
        for posted_first in (True, False):
            if ctx.rank == 0:
                if posted_first:
                    transport.recv(1, TAG_B, [go], deadline=deadline)
                sending = transport.isend(1, TAG_A, [message], deadline=deadline)
                if not posted_first:  # (Gloo completes a send only once the receive is posted)
                    transport.send(1, TAG_B, [go], deadline=deadline)
                sending.wait()
                continue
            acc = torch.randn(numel, generator=torch.Generator().manual_seed(100 + i))
            expected = acc + message
            scratch = torch.full((numel,), float("nan"))  # what the transport leaves in it does not matter
            if not posted_first:
                transport.recv(0, TAG_B, [go], deadline=deadline)
                time.sleep(0.2)
            adding = transport.irecv_add(0, TAG_A, acc, scratch=scratch, deadline=deadline)
            if posted_first:
                transport.send(0, TAG_B, [go], deadline=deadline)
            adding.wait()
            exact.append(torch.equal(acc, expected))
    return exact


def _body_hang(transport, ctx: GroupContext, deadline_s: float) -> float | None:
    if ctx.rank == 1:
        time.sleep(deadline_s + 3)  # alive but silent: a frozen peer
        return None
    start = time.monotonic()
    try:
        transport.recv(1, TAG_A, [torch.empty(16, dtype=torch.uint8)], deadline=start + deadline_s)
    except PeerFailure as e:
        assert e.peers == (1,), e.peers
        return time.monotonic() - start
    raise AssertionError("recv from a silent peer returned")


def _body_killed(transport, ctx: GroupContext, nbytes: int) -> float | None:
    if ctx.rank == 1:
        # Die by SIGKILL while a large message is on its way: no clean-up, no goodbye.
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGKILL)).start()
        data = pattern(nbytes, seed=1)
        while True:
            transport.send(0, TAG_A, [data], deadline=time.monotonic() + 60)
    start = time.monotonic()
    buf = torch.empty(nbytes, dtype=torch.uint8)
    try:
        while True:
            transport.recv(1, TAG_A, [buf], deadline=time.monotonic() + 60)
    except PeerFailure as e:
        assert e.peers == (1,), e.peers
        return time.monotonic() - start


def _body_close(transport, ctx: GroupContext) -> bool:
    transport.close()
    transport.close()
    try:
        transport.send(1 - ctx.rank, TAG_A, [torch.zeros(1)], deadline=time.monotonic() + 5)
    except PeerFailure:
        return True
    return False


def _all_reduce_input(rank: int, numel: int, integer_valued: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    if integer_valued:  # sums of small integers are exact in fp32 in any order
        return torch.randint(-1000, 1000, (numel,), generator=g).float()
    return torch.randn(numel, generator=g)


def _body_all_reduce(transport, ctx: GroupContext, numels: Sequence[int],
                     segment_numel: int) -> list[tuple[bool, float]]:
    deadline = time.monotonic() + 120
    native = gloo_group(connect_store(ctx.rendezvous, 60, suffix="/native"), ctx.rank, ctx.world_size,
                        timeout_s=60)
    out = []
    for numel in numels:
        for integer_valued in (True, False):
            mine = _all_reduce_input(ctx.rank, numel, integer_valued)
            reference = mine.clone()
            native.allreduce([reference]).wait()
            ring_all_reduce(transport, mine, deadline=deadline, segment_numel=segment_numel)
            exact = torch.equal(mine, reference)
            out.append((exact if integer_valued else True, float((mine - reference).abs().max()) if numel else 0.0))
    return out


def _body_all_gather(transport, ctx: GroupContext) -> list:
    return all_gather_object(transport, {"rank": ctx.rank, "blob": b"x" * ctx.rank * 1000},
                             deadline=time.monotonic() + 60)


def _body_shaped(transport, ctx: GroupContext, sizes: Sequence[int], reps: int = 3) -> list[float]:
    """Rank 1 asks for each message with a tiny request and times its arrival; returns seconds per size.

    The round trip of a tiny request and reply, measured first on the same link, is subtracted: it is
    the fixed cost of asking (thread wake-ups, a few headers), not time the link spent on the payload.
    Each size is timed `reps` times and the fastest kept: a busy machine only ever adds time.
    """
    deadline = time.monotonic() + 120
    go = torch.zeros(1, dtype=torch.uint8)
    overhead = min(_body_ping(transport, ctx, 5) or [0.0])
    elapsed = []
    for i, n in enumerate(sizes):
        data = pattern(n, seed=i) if ctx.rank == 0 else torch.empty(n, dtype=torch.uint8)
        best = float("inf")
        for _ in range(reps):
            if ctx.rank == 0:
                transport.recv(1, TAG_B, [go], deadline=deadline)
                transport.send(1, TAG_A, [data], deadline=deadline)
                continue
            receiving = transport.irecv(0, TAG_A, [data], deadline=deadline)
            start = time.monotonic()
            transport.send(0, TAG_B, [go], deadline=deadline)
            receiving.wait()
            best = min(best, time.monotonic() - start - overhead)
            assert torch.equal(data, pattern(n, seed=i))
        elapsed.append(best)
    return elapsed


def _body_ping(transport, ctx: GroupContext, num_pings: int) -> list[float]:
    """Round trips of a tiny message, timed on the side that asks (rank 1)."""
    deadline = time.monotonic() + 60
    buf = torch.zeros(8, dtype=torch.uint8)
    rtts = []
    for _ in range(num_pings):
        if ctx.rank == 1:
            start = time.monotonic()
            transport.send(0, TAG_A, [buf], deadline=deadline)
            transport.recv(0, TAG_B, [buf], deadline=deadline)
            rtts.append(time.monotonic() - start)
        else:
            transport.recv(1, TAG_A, [buf], deadline=deadline)
            transport.send(1, TAG_B, [buf], deadline=deadline)
    return rtts


def _body_refused(transport, ctx: GroupContext) -> dict:
    """Peers that must not trust each other: every operation fails; the refusals are logged."""
    outcome = {}
    try:
        transport.send(1 - ctx.rank, TAG_A, [torch.zeros(4)], deadline=time.monotonic() + 5)
        outcome["send"] = "delivered"
    except PeerFailure as e:
        outcome["send"] = e.reason
    time.sleep(1.0)  # let the other side's handshake attempts reach this side and be refused
    outcome["refusals"] = [reason for _addr, reason in getattr(transport, "refusals", [])]
    return outcome


def _body_restart(transport, ctx: GroupContext, factory: TransportFactory) -> list[int]:
    """Rank 1 closes its transport and comes back as a new one; rank 0 goes on sending to it."""
    deadline = time.monotonic() + 60
    if ctx.rank == 0:
        transport.send(1, TAG_A, [torch.tensor([1])], deadline=deadline)
        ready = torch.zeros(1, dtype=torch.int64)
        while True:  # receives fail while rank 1 is gone; the first one after it is back succeeds
            try:
                transport.recv(1, TAG_B, [ready], deadline=deadline)  # from rank 1's new incarnation
                break
            except PeerFailure:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        transport.send(1, TAG_A, [torch.tensor([2])], deadline=deadline)
        return [int(ready.item())]
    got = []
    buf = torch.zeros(1, dtype=torch.int64)
    transport.recv(0, TAG_A, [buf], deadline=deadline)
    got.append(int(buf.item()))
    transport.close()
    reborn = factory(ctx.rendezvous, 1, 2)
    try:
        reborn.send(0, TAG_B, [torch.tensor([7])], deadline=deadline)
        reborn.recv(0, TAG_A, [buf], deadline=deadline)
        got.append(int(buf.item()))
    finally:
        reborn.close()
    return got


def per_rank_factory(rendezvous: Rendezvous, rank: int, world_size: int, *,
                     factories: Sequence[TransportFactory]) -> Transport:
    """A factory that builds each rank's transport with its own factory (e.g. different secrets)."""
    return factories[rank](rendezvous, rank, world_size)


# ---------------------------------------------------------------- the suite


class TransportConformance:
    """The conformance suite. Subclass with `factory = functools.partial(top_level_fn, ...)`.

    Transports that shape links, authenticate, or survive a peer's restart also set
    `shaped_factory(LinkShaping) -> factory`, `secured_factory(AuthConfig) -> factory` and
    `supports_restart = True`; the tests of a capability a transport lacks are skipped, not passed.
    """

    factory: TransportFactory
    shaped_factory: Callable[[LinkShaping], TransportFactory] | None = None
    secured_factory: Callable[[AuthConfig], TransportFactory] | None = None
    supports_restart: bool = False
    sizes: tuple[int, ...] = (0, 1, 7, 4096, (1 << 20) + 3, 64 << 20, 256 << 20)
    hang_deadline_s: float = 2.0
    hang_slack_s: float = 1.5

    def test_messages_of_every_size_arrive_intact(self):
        sender, receiver = run_group(2, _body_sizes, factory=self.factory, args=(self.sizes,), timeout_s=180)
        assert receiver["intact"] == [True] * len(self.sizes)
        # Counters equal the bytes framed, on both ends.
        assert sender["sent"] == sender["framed"] == receiver["received"]
        assert sender["sent"] >= sum(self.sizes)

    def test_every_dtype_arrives_intact(self):
        assert run_group(2, _body_dtypes, factory=self.factory) == [True, True]

    def test_messages_are_ordered_per_tag(self):
        _, received = run_group(2, _body_order, factory=self.factory, args=(16,))
        assert received == [list(range(1, 16, 2)), list(range(0, 16, 2))]

    def test_irecv_add_adds_the_message_into_the_accumulator(self):
        # Bit-identical to acc + message whether the message arrives before or after the receive is posted; 3 MiB
        # and more travel as several chunks (over several connections where the transport stripes).
        numels = (0, 1, 10_007, (3 << 18) + 5)
        _, exact = run_group(2, _body_add, factory=self.factory, args=(numels,), timeout_s=90)
        assert exact == [True] * 2 * len(numels), exact

    def test_silent_peer_raises_within_deadline(self):
        elapsed, _ = run_group(2, _body_hang, factory=self.factory, args=(self.hang_deadline_s,), timeout_s=60)
        assert self.hang_deadline_s - 0.05 <= elapsed <= self.hang_deadline_s + self.hang_slack_s, elapsed

    def test_peer_killed_mid_transfer_raises(self):
        elapsed, killed = run_group(2, _body_killed, factory=self.factory, args=(64 << 20,),
                                    expect_killed=(1,), timeout_s=90)
        assert killed == KILLED
        assert elapsed < 30, f"PeerFailure came only after {elapsed:.1f}s"

    def test_close_is_idempotent(self):
        assert run_group(2, _body_close, factory=self.factory) == [True, True]

    def test_ring_all_reduce_equals_gloo_all_reduce(self):
        numels = (1, 5, 10_007, (1 << 18) + 3)
        for world_size in (2, 3, 4):
            # Segments of 4099 elements: the larger tensors travel as many pipelined messages per chunk.
            per_rank = run_group(world_size, _body_all_reduce, factory=self.factory, args=(numels, 4099),
                                 timeout_s=120)
            for result in per_rank:
                assert all(exact for exact, _ in result), (world_size, result)
                assert max(diff for _, diff in result) < 1e-4, (world_size, result)

    def test_all_gather_object(self):
        per_rank = run_group(3, _body_all_gather, factory=self.factory)
        expected = [{"rank": r, "blob": b"x" * r * 1000} for r in range(3)]
        assert per_rank == [expected] * 3

    def test_shaped_rate_is_accurate(self):
        if self.shaped_factory is None:
            pytest.skip("this transport has no WAN shaping")
        rate_bps = 100e6  # 100 Mbit/s: 1 MiB takes 84 ms
        sizes = (1 << 20, 4 << 20, 16 << 20)
        factory = self.shaped_factory(LinkShaping(rate_bps=rate_bps))
        _, elapsed = run_group(2, _body_shaped, factory=factory, args=(sizes,), timeout_s=120)
        for n, seconds in zip(sizes, elapsed, strict=True):
            ideal = n * 8 / rate_bps
            assert abs(seconds - ideal) <= 0.10 * ideal, f"{n} bytes took {seconds:.3f}s, shaped ideal {ideal:.3f}s"

    def test_shaped_latency_is_added_each_way(self):
        if self.shaped_factory is None:
            pytest.skip("this transport has no WAN shaping")
        factory = self.shaped_factory(LinkShaping(latency_s=0.05))
        _, rtts = run_group(2, _body_ping, factory=factory, args=(5,), timeout_s=60)
        assert 0.1 <= sorted(rtts)[2] <= 0.12, rtts  # median round trip: 2 x 50 ms one way

    def test_wrong_secret_and_other_run_are_refused(self, tmp_path):
        if self.secured_factory is None:
            pytest.skip("this transport has no authentication")
        secret_a, secret_b = tmp_path / "a.secret", tmp_path / "b.secret"
        secret_a.write_text("a" * 32)
        secret_b.write_text("b" * 32)
        cases = {
            "wrong secret": (AuthConfig(secret_file=str(secret_a)), AuthConfig(secret_file=str(secret_b))),
            "no secret": (AuthConfig(secret_file=str(secret_a)), AuthConfig()),
            "other run": (AuthConfig(run_id="run-1"), AuthConfig(run_id="run-2")),
        }
        for case, (first, second) in cases.items():
            factory = functools.partial(per_rank_factory, factories=(self.secured_factory(first),
                                                                     self.secured_factory(second)))
            outcomes = run_group(2, _body_refused, factory=factory, timeout_s=60)
            assert all(o["send"] != "delivered" for o in outcomes), (case, outcomes)
            assert any(o["refusals"] for o in outcomes), (case, outcomes)

    def test_same_secret_is_accepted(self, tmp_path):
        if self.secured_factory is None:
            pytest.skip("this transport has no authentication")
        secret = tmp_path / "run.secret"
        secret.write_text("s" * 32)
        factory = self.secured_factory(AuthConfig(run_id="r", secret_file=str(secret)))
        assert run_group(2, _body_dtypes, factory=factory) == [True, True]

    def test_peer_restart_reconnects(self):
        if not self.supports_restart:
            pytest.skip("this transport's groups are rebuilt, not reconnected, when a peer restarts")
        first, second = run_group(2, _body_restart, factory=self.factory, args=(self.factory,), timeout_s=60)
        assert first == [7] and second == [1, 2]
