"""Aborting a doomed try (openprime.mesh.abort): the coordinator marks a try whose member it lost, or whose member
reported a failure, and each process's watch closes that try's transport, in one process (threads). Fast:
heartbeats every 0.1 s. The whole path on real node processes is in tests/test_elastic.py
(test_a_node_frozen_inside_the_all_reduce_holds_the_others_an_eviction_timeout_then_rejoins)."""

import threading
import time

import pytest

from openprime.core.distributed import store_client
from openprime.core.testing import run_threads
from openprime.mesh import Coordinator, MeshClient, MeshConfig
from openprime.mesh.abort import TryWatch, abort_key, try_group


def _client(address: str):
    """A client of the coordinator's rendezvous store at host:port."""
    host, port = address.rsplit(":", 1)
    return store_client(host, int(port), timeout_s=5)


FAST = MeshConfig(heartbeat_interval_s=0.1, num_missed_heartbeats=3, sync_timeout_s=10, min_nodes=3)
# Eviction after 0.3 s of silence, as in test_membership.py: one more run for a test whose client was starved that long.
pytestmark = pytest.mark.flaky(reruns=1)


class _Transport:
    """Stands in for a try's transport: records when it was closed."""

    def __init__(self) -> None:
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()


@pytest.fixture
def coordinator():
    c = Coordinator(FAST).start()
    yield c
    c.stop()


def _view(coordinator):
    clients = [MeshClient(coordinator.address, FAST, node_id=f"node-{i}") for i in range(3)]
    for c in clients:
        c.join()
    view = run_threads([lambda c=c: c.sync(0) for c in clients])[0]
    return clients, try_group(FAST.run_id, view.epoch, view.step, view.attempt)


def _doomed(coordinator, group: str) -> str | None:
    store = _client(coordinator.store)
    key = abort_key(group)
    return store.get(key).decode() if store.check([key]) else None


def test_a_member_lost_in_a_try_dooms_it_and_a_try_that_succeeds_is_never_doomed(coordinator):
    clients, group = _view(coordinator)
    assert run_threads([lambda c=c: c.commit(0, 0, True) for c in clients]) == [True] * 3
    assert _doomed(coordinator, group) is None  # applied: nothing marked
    view = run_threads([lambda c=c: c.sync(1) for c in clients])[0]
    group = try_group(FAST.run_id, view.epoch, 1, 0)
    clients[2]._stop.set()  # its heartbeats stop inside the try: a frozen (or cut-off) process
    clients[2]._heartbeats.join()
    start = time.monotonic()
    while _doomed(coordinator, group) is None:
        assert time.monotonic() - start < 5 * FAST.eviction_timeout_s, "the lost member's try was never doomed"
        time.sleep(0.02)
    assert "node node-2 was removed: silent for more than" in _doomed(coordinator, group)
    assert time.monotonic() - start < 3 * FAST.eviction_timeout_s
    # Doomed means not applied: the survivors retry.
    # Even survivors whose own part succeeded do not apply it: the lost member may not have the result.
    assert run_threads([lambda c=c: c.commit(1, 0, True) for c in clients[:2]]) == [False, False]
    for c in clients:
        c.close()


def test_a_member_reporting_a_failure_dooms_the_try_for_the_others(coordinator):
    clients, group = _view(coordinator)

    def member(c):  # still inside the try (waiting on its deadlines) until it learns the try is doomed
        return _wait_doomed(coordinator, group), c.commit(0, 0, True)

    outcomes = run_threads([lambda: clients[0].commit(0, 0, False)] + [lambda c=c: member(c) for c in clients[1:]])
    assert outcomes[0] is False
    for why, applied in outcomes[1:]:
        assert why == "node node-0 reported that its part failed" and applied is False
    for c in clients:
        c.close()


def _wait_doomed(coordinator, group: str) -> str:
    start = time.monotonic()
    while (why := _doomed(coordinator, group)) is None:
        assert time.monotonic() - start < 5, "never doomed"
        time.sleep(0.02)
    return why


def test_the_watch_closes_the_transport_of_a_doomed_try_only(coordinator):
    group, other = try_group("run", 1, 4, 0), try_group("run", 1, 4, 1)
    watch = TryWatch(poll_s=0.05, connect_timeout_s=5, who="test")
    other_process = TryWatch(poll_s=0.05, connect_timeout_s=5, who="another process")
    doomed, kept = _Transport(), _Transport()
    try:
        watch.watch(coordinator.store, other, kept)
        time.sleep(0.2)
        watch.watch(coordinator.store, group, doomed)  # the next try: `kept`'s is no longer watched
        time.sleep(0.2)
        start = time.monotonic()
        other_process.doom(coordinator.store, group, "lost")
        assert doomed.closed.wait(5), "the doomed try's transport was not closed"
        assert time.monotonic() - start < 1.0
        assert watch.num_aborted == 1
        # A key set for a try no longer watched closes nothing.
        watch.watch(coordinator.store, try_group("run", 1, 5, 0), kept)
        watch.unwatch()
        _client(coordinator.store).set(abort_key(try_group("run", 1, 5, 0)), "late")
        time.sleep(0.3)
        assert not kept.closed.is_set() and watch.num_aborted == 1
    finally:
        watch.close()
        other_process.close()  # left running, its thread would poll a stopped store every 50 ms through later tests


def test_the_watch_survives_a_store_it_cannot_reach():
    watch = TryWatch(poll_s=0.05, connect_timeout_s=0.2, who="test")
    transport = _Transport()
    try:
        watch.watch("127.0.0.1:9", try_group("run", 1, 0, 0), transport)  # nothing listens on the discard port
        watch.doom("127.0.0.1:9", try_group("run", 1, 0, 0), "lost")
        time.sleep(0.8)
        assert not transport.closed.is_set() and watch._thread.is_alive()
    finally:
        watch.close()
    assert not watch._thread.is_alive()
