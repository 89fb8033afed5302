"""Bad input to the coordinator: garbage bytes, messages that are not envelopes, another run's messages,
unknown message types, missing or mistyped fields, oversized messages, extra frames, a node claiming a
live node's id and a wrong shared secret. Each is refused and logged, the sender gets no answer (at most
an explicit refusal), and the coordinator goes on serving everyone else: the members of the current
view keep their membership, undisturbed, and a newcomer is admitted at the next outer step.

Bad messages come from raw ZeroMQ DEALER sockets (or a MeshClient with a wrong secret or a stolen id).
Whether the coordinator answered a bad message is decided without sleeping: after the bad message the
same socket sends a valid `status` request; the coordinator handles one connection's messages in order,
so any answer to the bad message would arrive before the status reply. Fast: heartbeats every 0.1 s.
"""

import logging
import time

import attrs
import msgpack
import pytest
import zmq

from openprime.core.errors import OpenPrimeError, PeerFailure
from openprime.core.testing import run_threads
from openprime.mesh import Coordinator, MeshClient, MeshConfig
from openprime.mesh.protocol import pack, unpack

RUN = "openprime"
MAX_BYTES = 4096
FAST = MeshConfig(heartbeat_interval_s=0.1, num_missed_heartbeats=10, sync_timeout_s=5, max_message_bytes=MAX_BYTES,
                  run_id=RUN)
PROBE_REQ = 987654321
LOGGER = "openprime.mesh.coordinator"
SECRET = b"0123456789abcdef0123456789abcdef"  # 32 bytes
OTHER_SECRET = b"fedcba9876543210fedcba9876543210"


class Mesh:
    """A coordinator and everything connected to it, all closed at teardown even when a test fails."""

    def __init__(self) -> None:
        self.coordinator: Coordinator | None = None
        self.config = FAST
        self._ctx = zmq.Context()
        self._sockets: list[zmq.Socket] = []
        self._clients: list[MeshClient] = []

    def start(self, **overrides) -> Coordinator:
        self.config = attrs.evolve(FAST, **overrides)
        self.coordinator = Coordinator(self.config).start()
        return self.coordinator

    def client(self, node_id: str, **overrides) -> MeshClient:
        client = MeshClient(self.coordinator.address, attrs.evolve(self.config, **overrides), node_id=node_id)
        self._clients.append(client)
        return client

    def raw(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.coordinator.address)
        self._sockets.append(sock)
        return sock

    def close(self) -> None:
        for client in self._clients:
            client.close()
        for sock in self._sockets:
            sock.close(linger=0)
        self._ctx.term()
        if self.coordinator is not None:
            self.coordinator.stop()


@pytest.fixture
def mesh(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    m = Mesh()
    yield m
    m.close()


# ---------------------------------------------------------------- messages


def envelope(body: bytes, *, run: object = RUN, mac: object = None) -> bytes:
    return msgpack.packb({"run": run, "body": body, "mac": mac})


def request(op: str, req: int = 1, **fields) -> bytes:
    """A well-formed, unsigned envelope around `fields` (which may themselves be bad)."""
    return envelope(msgpack.packb({"op": op, "req": req, **fields}))


def belief(node: str, incarnation: str, *, epoch: int = 0, members: list | None = None, step: int = 0,
           slot: int = -1) -> dict:
    return {"node": node, "incarnation": incarnation, "epoch": epoch, "members": members or [], "step": step,
            "slot": slot}


def replies_before_probe(sock: zmq.Socket, *, secret: bytes | None = None, timeout_s: float = 3.0) -> list[dict]:
    """Send a status request on `sock`; return every reply that arrived before its answer."""
    sock.send(pack({"op": "status", "req": PROBE_REQ}, run_id=RUN, secret=secret))
    earlier = []
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(left * 1000):
            break
        reply = unpack(sock.recv(), run_id=RUN, secret=secret, max_bytes=1 << 20)
        if reply.get("req") == PROBE_REQ:
            assert reply["op"] == "status"
            return earlier
        earlier.append(reply)
    raise AssertionError(f"the coordinator did not answer a valid status request in {timeout_s}s")


def status(mesh: Mesh) -> dict:
    """The coordinator's status, asked on a connection of its own (callable from any thread)."""
    sock = mesh._ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(mesh.coordinator.address)
        sock.send(pack({"op": "status", "req": PROBE_REQ}, run_id=RUN, secret=mesh.coordinator._secret))
        assert sock.poll(3000), "the coordinator did not answer a status request"
        return unpack(sock.recv(), run_id=RUN, secret=mesh.coordinator._secret, max_bytes=1 << 20)
    finally:
        sock.close(linger=0)


def assert_refused(mesh: Mesh, caplog, before: int, *reasons: str, count: int = 1) -> None:
    """`count` new refusals, the first naming every one of `reasons`, each logged at WARNING."""
    new = mesh.coordinator.refusals[before:]
    assert len(new) == count, new
    assert all(r in new[0] for r in reasons), (new, reasons)
    logged = [rec.getMessage() for rec in caplog.records if rec.name == LOGGER and rec.levelno >= logging.WARNING]
    for refusal in new:
        assert any(refusal in message for message in logged), (refusal, logged)


def assert_no_answer(sock: zmq.Socket, *, secret: bytes | None = None, refusal_may_name: str | None = None) -> None:
    """Nothing came back for the bad message (or, where allowed, only an explicit refusal)."""
    earlier = replies_before_probe(sock, secret=secret)
    if refusal_may_name is None:
        assert earlier == []
    else:
        assert all(r.get("op") == "refused" and refusal_may_name in r.get("reason", "") for r in earlier), earlier


# ---------------------------------------------------------------- good citizens


def form_view(mesh: Mesh, n: int = 2) -> tuple[list[MeshClient], object]:
    """n well-behaved nodes join and complete outer step 0 together; returns them and their view."""
    mesh.coordinator.config = attrs.evolve(mesh.coordinator.config, min_nodes=n)
    members = [mesh.client(f"good-{i}") for i in range(n)]
    for c in members:
        c.join()
    views = run_threads([lambda c=c: c.sync(0) for c in members], timeout_s=10)
    assert len(set(views)) == 1
    assert run_threads([lambda c=c: c.commit(0, 0, True) for c in members], timeout_s=10) == [True] * n
    return members, views[0]


def assert_still_served(mesh: Mesh, members: list[MeshClient], before) -> None:
    """The members go on undisturbed (same epoch, members and slots), and a newcomer is admitted."""
    views = run_threads([lambda c=c: c.sync(1) for c in members], timeout_s=10)
    assert len(set(views)) == 1
    view = views[0]
    assert (view.epoch, view.members, view.slots, view.new, view.step) == (before.epoch, before.members,
                                                                            before.slots, (), 1)
    assert run_threads([lambda c=c: c.commit(1, 0, True) for c in members], timeout_s=10) == [True] * len(members)

    newcomer = mesh.client("newcomer")
    assert newcomer.join(timeout_s=3) == len(members)

    def member_sync(c):
        deadline = time.monotonic() + 5
        while "newcomer" not in status(mesh)["waiting"]:  # the joiner waits first at the barrier
            assert time.monotonic() < deadline, "the newcomer never reached the barrier"
            time.sleep(0.01)
        return c.sync(2)

    views = run_threads([lambda c=c: member_sync(c) for c in members] + [lambda: newcomer.sync(0)], timeout_s=10)
    assert len(set(views)) == 1
    view = views[0]
    assert view.new == ("newcomer",) and view.members == (*before.members, "newcomer")
    assert view.epoch == before.epoch + 1 and view.step == 2
    assert run_threads([lambda c=c: c.commit(2, 0, True) for c in [*members, newcomer]],
                       timeout_s=10) == [True] * (len(members) + 1)


# ---------------------------------------------------------------- malformed messages

# (bytes sent in one frame, what the refusal must name)
MALFORMED = {
    "garbage bytes": (b"\xc1\xc1 this is not msgpack \x00\xff", "not a msgpack envelope"),
    "empty frame": (b"", "not a msgpack envelope"),
    "truncated envelope": (request("status")[:-3], "not a msgpack envelope"),
    "envelope with trailing bytes": (request("status") + b"\x00junk", "not a msgpack envelope"),
    "msgpack list": (msgpack.packb([1, 2, 3]), "not an openprime envelope"),
    "msgpack string": (msgpack.packb("hello coordinator"), "not an openprime envelope"),
    "map without body": (msgpack.packb({"run": RUN, "op": "status", "req": 1}), "not an openprime envelope"),
    "body is a str": (msgpack.packb({"run": RUN, "body": "op=status", "mac": None}), "not an openprime envelope"),
    "another run": (envelope(msgpack.packb({"op": "status", "req": 1}), run="other-run"), "run 'other-run'"),
    "no run id": (msgpack.packb({"body": msgpack.packb({"op": "status", "req": 1})}), "run None"),
    "body not msgpack": (envelope(b"\xc1\xc1\xc1"), "body is not msgpack"),
    "body not a map": (envelope(msgpack.packb(["status", 1])), "body is not a map"),
    "unknown op": (request("explode"), "unknown message type 'explode'"),
    "no op": (envelope(msgpack.packb({"req": 1})), "unknown message type None"),
    "reply op as request": (request("view"), "unknown message type 'view'"),
    "op not a str": (request(7), "unknown message type 7"),
    "no req id": (envelope(msgpack.packb({"op": "status"})), "no integer 'req' id"),
    "req id a str": (request("status", req="1"), "no integer 'req' id"),
    "join without incarnation": (request("join", node="x", epoch=0, members=[], step=0, slot=-1),
                                 "join: field 'incarnation' missing or not str"),
    "join node not a str": (request("join", **belief("x", "i") | {"node": 123}), "join: field 'node'"),
    "heartbeat without belief": (request("heartbeat", node="x", incarnation="i"), "heartbeat: field 'epoch'"),
    "sync without step": (request("sync", attempt=0, **{k: v for k, v in belief("x", "i").items() if k != "step"}),
                          "sync: field 'step' missing or not int"),
    "sync step a str": (request("sync", attempt=0, **belief("x", "i") | {"step": "3"}), "sync: field 'step'"),
    "sync attempt a bool": (request("sync", attempt=True, **belief("x", "i")), "sync: field 'attempt'"),
    "commit ok a str": (request("commit", attempt=0, ok="yes", **belief("x", "i")), "commit: field 'ok'"),
    "members not a list": (request("heartbeat", **belief("x", "i") | {"members": "good-0"}),
                           "heartbeat: field 'members'"),
    "members not node ids": (request("leave", **belief("x", "i") | {"members": [1, 2]}),
                             "leave: members must be node ids"),
    "bandwidths not a map": (request("sync", attempt=0, bw=[1.0], **belief("x", "i")), "sync: bw must map"),
    "negative bandwidth": (request("sync", attempt=0, bw={"good-0": -1.0}, **belief("x", "i")), "sync: bw must map"),
    "new not node ids": (request("heartbeat", **belief("x", "i") | {"new": "good-0"}),
                         "heartbeat: new must be a list of node ids"),
    "applied not a bool": (request("commit", attempt=0, ok=True, **belief("x", "i") | {"applied": 1}),
                           "commit: applied must be true or false"),
}


REQUEST_LEVEL = set(list(MALFORMED)[list(MALFORMED).index("unknown op"):])


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_message_is_refused_and_logged_and_others_are_served(mesh, caplog, name):
    data, reason = MALFORMED[name]
    coordinator = mesh.start()
    members, before = form_view(mesh)
    refused = len(coordinator.refusals)
    sock = mesh.raw()
    sock.send(data)
    # A message that is not a readable envelope of this run gets no answer; a readable request at most an
    # explicit refusal.
    assert_no_answer(sock, refusal_may_name=reason if name in REQUEST_LEVEL else None)
    assert_refused(mesh, caplog, refused, reason)
    assert_still_served(mesh, members, before)


@pytest.mark.parametrize("frames", [[request("status"), request("status", req=2)], [b"", request("status")],
                                    [b"", b"", b""]], ids=["two envelopes", "REQ-style delimiter", "empty frames"])
def test_more_than_two_frames_are_refused(mesh, caplog, frames):
    coordinator = mesh.start()
    members, before = form_view(mesh)
    refused = len(coordinator.refusals)
    sock = mesh.raw()
    sock.send_multipart(frames)
    assert_no_answer(sock)
    assert_refused(mesh, caplog, refused, f"expected 2 frames, got {len(frames) + 1}")
    assert_still_served(mesh, members, before)


def test_a_burst_of_bad_input_from_many_connections_does_not_stop_the_coordinator(mesh, caplog):
    coordinator = mesh.start()
    members, before = form_view(mesh)
    refused = len(coordinator.refusals)
    socks = [mesh.raw() for _ in range(4)]
    for _ in range(25):
        for sock, (data, _) in zip(socks, MALFORMED.values(), strict=False):
            sock.send(data)
    for sock in socks:
        replies_before_probe(sock)
    assert len(coordinator.refusals) - refused == 100
    assert_still_served(mesh, members, before)


# ---------------------------------------------------------------- oversized messages


def padded_status(size: int) -> bytes:
    """A valid status request padded to exactly `size` bytes on the wire."""
    for n in range(max(0, size - 200), size):
        data = request("status", pad="x" * n)
        if len(data) == size:
            return data
    raise AssertionError(f"cannot pad a status request to {size} bytes")


def test_a_message_of_exactly_max_message_bytes_is_served(mesh):
    mesh.start()
    sock = mesh.raw()
    sock.send(padded_status(MAX_BYTES))
    reply = unpack(sock.recv(), run_id=RUN, secret=None, max_bytes=1 << 20) if sock.poll(3000) else None
    assert reply is not None and reply["op"] == "status" and reply["req"] == 1
    assert mesh.coordinator.refusals == []


@pytest.mark.parametrize("size", [MAX_BYTES + 1, 64 * MAX_BYTES])
def test_oversized_message_does_not_stop_the_coordinator(mesh, caplog, size):
    """ZeroMQ itself (MAXMSGSIZE) drops the connection of an oversized sender; nobody else notices."""
    mesh.start()
    members, before = form_view(mesh)
    sock = mesh.raw()
    sock.send(padded_status(size))
    assert not sock.poll(300)  # no answer: the connection was dropped before the coordinator saw the message
    assert replies_before_probe(mesh.raw()) == []  # a new connection is served
    assert_still_served(mesh, members, before)
    # Today not in coordinator.refusals and not logged: see test_oversized_message_is_refused_and_logged.


def test_oversized_message_is_refused_and_logged(mesh, caplog):
    coordinator = mesh.start()
    sock = mesh.raw()
    sock.send(padded_status(MAX_BYTES + 100))
    deadline = time.monotonic() + 1
    while not coordinator.refusals and time.monotonic() < deadline:
        time.sleep(0.01)
    assert_refused(mesh, caplog, 0, f"exceeds max_message_bytes={MAX_BYTES}")


# ---------------------------------------------------------------- a node claiming another node's id


def test_join_with_a_live_nodes_id_is_refused_and_the_node_keeps_its_membership(mesh, caplog):
    coordinator = mesh.start()
    members, before = form_view(mesh)
    refused = len(coordinator.refusals)
    sock = mesh.raw()
    sock.send(request("join", **belief("good-0", "another-process")))
    assert_no_answer(sock, refusal_may_name="already in use")
    assert_refused(mesh, caplog, refused, "'good-0'", "already in use by a live node")
    assert_still_served(mesh, members, before)


def test_a_client_with_a_stolen_id_cannot_join(mesh, caplog):
    coordinator = mesh.start()
    members, before = form_view(mesh)
    thief = mesh.client("good-1")
    with pytest.raises(OpenPrimeError):  # today PeerFailure: no answer (see the next test)
        thief.join(timeout_s=0.35)
    assert thief.slot == -1
    assert all("already in use" in r for r in coordinator.refusals)
    assert_refused(mesh, caplog, 0, "'good-1'", "already in use", count=len(coordinator.refusals))
    assert_still_served(mesh, members, before)


def test_a_client_with_a_stolen_id_is_told_at_once(mesh):
    mesh.start()
    form_view(mesh)
    thief = mesh.client("good-1")
    start = time.monotonic()
    with pytest.raises(OpenPrimeError, match="already in use"):
        thief.join(timeout_s=1)
    assert time.monotonic() - start < 0.5


IMPOSTOR_OPS = {
    "heartbeat": {},
    "sync": {"attempt": 0},
    "commit": {"attempt": 0, "ok": False},  # a failed report would make every member retry
    "leave": {},  # a deathrattle would remove the real node
}


@pytest.mark.parametrize("op", list(IMPOSTOR_OPS))
def test_a_live_nodes_id_with_another_incarnation_is_refused(mesh, caplog, op):
    coordinator = mesh.start()
    members, before = form_view(mesh)
    refused = len(coordinator.refusals)
    sock = mesh.raw()
    claim = belief("good-0", "another-process", epoch=before.epoch, members=list(before.members),
                   step=1 if op == "commit" else 0, slot=7)
    sock.send(request(op, **claim, **IMPOSTOR_OPS[op]))
    assert_no_answer(sock, refusal_may_name="incarnation")
    assert_refused(mesh, caplog, refused, "'good-0'", "incarnation mismatch")
    assert_still_served(mesh, members, before)


def test_an_impostor_reporting_a_newer_view_does_not_change_the_view(mesh, caplog):
    coordinator = mesh.start()
    members, before = form_view(mesh)
    sock = mesh.raw()
    sock.send(request("heartbeat", **belief("good-0", "another-process", epoch=before.epoch + 50,
                                            members=["good-0"], step=40, slot=9)))
    assert_no_answer(sock, refusal_may_name="incarnation")
    assert_refused(mesh, caplog, 0, "'good-0'", "incarnation mismatch")
    assert (coordinator.epoch, tuple(coordinator.members)) == (before.epoch, before.members)
    assert_still_served(mesh, members, before)


# ---------------------------------------------------------------- field values out of range


def test_a_reported_slot_out_of_range_does_not_stop_the_coordinator(mesh):
    mesh.start(max_nodes=1)
    member = mesh.client("good-0")
    assert member.join() == 0
    sock = mesh.raw()
    sock.send(request("heartbeat", **belief("ghost", "g", epoch=1, members=["ghost"], slot=1)))
    replies_before_probe(sock)
    with pytest.raises(OpenPrimeError, match="full"):  # max_nodes=1: the run is full, and says so
        mesh.client("late").join(timeout_s=1)
    assert replies_before_probe(mesh.raw(), timeout_s=1) == []  # still serving


# ---------------------------------------------------------------- a wrong shared secret


@pytest.fixture
def secret_files(tmp_path):
    paths = {}
    for name, secret in (("right", SECRET), ("wrong", OTHER_SECRET)):
        paths[name] = tmp_path / f"{name}.secret"
        paths[name].write_bytes(secret)
    return {name: str(path) for name, path in paths.items()}


@pytest.mark.parametrize("client_secret", ["wrong", None], ids=["another secret", "no secret"])
def test_a_client_without_the_shared_secret_is_refused(mesh, caplog, secret_files, client_secret):
    coordinator = mesh.start(secret_file=secret_files["right"])
    members, before = form_view(mesh)  # the members hold the secret
    outsider = mesh.client("outsider", secret_file=secret_files[client_secret] if client_secret else None)
    with pytest.raises(PeerFailure, match="did not answer join"):
        outsider.join(timeout_s=0.35)
    assert outsider.slot == -1 and "outsider" not in status(mesh)["nodes"]
    assert coordinator.refusals and all("wrong or missing signature" in r for r in coordinator.refusals)
    assert_refused(mesh, caplog, 0, "wrong or missing signature", count=len(coordinator.refusals))
    assert_still_served(mesh, members, before)


def forged(kind: str) -> bytes:
    body = msgpack.packb({"op": "join", "req": 1, **belief("forger", "f")})
    good = pack({"op": "join", "req": 1, **belief("forger", "f")}, run_id=RUN, secret=SECRET)
    return {
        "another secret": pack({"op": "join", "req": 1, **belief("forger", "f")}, run_id=RUN, secret=OTHER_SECRET),
        "no mac": envelope(body),
        "mac a str": envelope(body, mac="0" * 64),
        "truncated mac": msgpack.packb({**msgpack.unpackb(good), "mac": msgpack.unpackb(good)["mac"][:16]}),
        "tampered body": msgpack.packb({**msgpack.unpackb(good), "body": msgpack.packb(
            {"op": "join", "req": 1, **belief("forger", "f"), "slot": 3})}),
    }[kind]


@pytest.mark.parametrize("kind", ["another secret", "no mac", "mac a str", "truncated mac", "tampered body"])
def test_a_message_with_a_bad_signature_is_refused(mesh, caplog, secret_files, kind):
    coordinator = mesh.start(secret_file=secret_files["right"])
    members, before = form_view(mesh)  # the members hold the secret
    refused = len(coordinator.refusals)
    sock = mesh.raw()
    sock.send(forged(kind))
    assert_no_answer(sock, secret=SECRET)
    assert_refused(mesh, caplog, refused, "wrong or missing signature")
    assert "forger" not in coordinator.nodes
    assert_still_served(mesh, members, before)


def test_clients_with_the_shared_secret_are_served(mesh, secret_files):
    coordinator = mesh.start(secret_file=secret_files["right"])
    members, before = form_view(mesh)  # the members hold the secret
    assert before.members == ("good-0", "good-1") and coordinator.refusals == []
    assert_still_served(mesh, members, before)
    assert coordinator.refusals == []
