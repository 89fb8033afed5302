"""The membership client: one per node, on the node's local rank 0 (its other ranks share its view).

It joins the run, sends a heartbeat every `heartbeat_interval_s` from a background thread, waits at the
barrier of each outer step (`sync`) for the next view, reports whether its all-reduce succeeded
(`commit`), and says goodbye (the deathrattle) on a graceful exit and, best effort, on SIGTERM or an
exception. Every message carries the node's belief (epoch, members, step, slot), which is all a
restarted coordinator needs to carry on. A request without an answer is sent again every
`request_timeout_s` (the coordinator may be restarting) until its own deadline.

A node that the coordinator evicted (it was frozen, or cut off) learns it at its next contact and
gets `Evicted`: it must rejoin as a new node. It reports the state it holds (its hash and step), and the coordinator
decides: a joiner of a run that has live members takes their state (its own may be stale), while nodes that rejoin
a run with none left (the coordinator's own link was down and it evicted every member) carry the run on with theirs.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import zmq

from openprime.core.auth import AuthConfig
from openprime.core.errors import OpenPrimeError, PeerFailure
from openprime.mesh.config import MeshConfig
from openprime.mesh.protocol import BadMessage, pack, unpack

log = logging.getLogger("openprime.mesh.client")


class Evicted(OpenPrimeError):
    """The coordinator no longer counts this node as a member: rejoin as a new node."""


class JoinRefused(OpenPrimeError):
    """The coordinator will not let this node join (another run's terms, a full run, a node id in use)."""


@attrs.frozen
class View:
    """The membership of one outer step's try, the same on every node."""

    epoch: int
    members: tuple[str, ...]  # ring order
    new: tuple[str, ...]  # admitted at this barrier
    step: int
    attempt: int
    skip: bool
    slots: tuple[tuple[str, int], ...]  # (node, data slot) in ring order
    state_hash: str | None = None  # the members' agreed hash of the global state after the previous outer step
    donor: str | None = None  # the member that sends the new nodes the state (None: the first member not new)

    def rank_of(self, node: str) -> int:
        return self.members.index(node)

    def slot_of(self, node: str) -> int:
        return dict(self.slots)[node]


def new_node_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class MeshClient:
    """A node's connection to the coordinator. Thread-safe for one caller plus its heartbeat thread."""

    def __init__(self, address: str, config: MeshConfig, *, node_id: str | None = None) -> None:
        self.address = address if "://" in address else f"tcp://{address}"
        self.config = config
        self.node = node_id or new_node_id()
        self.incarnation = uuid.uuid4().hex
        self.slot = -1
        # What this node reports of its data slot at each sync (a callable giving a small msgpack-able map: the
        # trainer's data position); the coordinator hands the last one to the next node granted the slot.
        self.slot_state: Callable[[], dict] | None = None
        self.inherited_slot_state: dict | None = None  # what the join's reply handed this node of its slot
        self.store = ""  # host:port of the rendezvous store the coordinator hosts
        self.joined_epoch = 0  # the run's epoch when this node joined: 0 means the run had not started
        self.view: View | None = None
        self._view_applied = False  # the commit of `view`'s try said to apply it
        self.terms: dict[str, str] = {}  # what this node agrees to (join); heartbeats and syncs carry it, so that a
        # restarted coordinator learns the run's terms from its members
        self.evicted = False
        self._applied_at: float | None = None  # when the last outer step this node took part in was applied
        self._compute_s: float | None = None  # how long it then computed until its next sync (commits carry it too)
        self._secret = AuthConfig(run_id=config.run_id, secret_file=config.secret_file).load_secret()
        self._ctx = zmq.Context()
        self._req_ids = itertools.count(1)
        self._lock = threading.Lock()  # the caller's socket
        self._sock = self._socket()
        self._stop = threading.Event()
        self._heartbeats: threading.Thread | None = None
        self._answered_at = time.monotonic()  # the coordinator's last reply to any request
        self._silence_lock = threading.Lock()
        self._warn_silence_s = config.coordinator_silence_warning_s  # next "silent for" warning, doubled each time

    def _socket(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        return sock

    # ------------------------------------------------------------------ requests

    def _terms(self) -> dict[str, Any]:
        return {"terms": self.terms} if self.terms else {}

    def _belief(self) -> dict[str, Any]:
        view = self.view
        # `new`, `donor` and `applied` let a restarted coordinator time the donor and the joiners of the view by their
        # transfer, at its commit (blocking recovery) or at the barrier after it (non-blocking): stragglers.py.
        return {"node": self.node, "incarnation": self.incarnation, "slot": self.slot,
                "epoch": view.epoch if view else 0, "members": list(view.members) if view else [],
                "step": view.step if view else 0, "new": list(view.new) if view else [],
                "donor": view.donor if view else None, "applied": self._view_applied}

    def _request(self, sock: zmq.Socket, op: str, deadline: float, **fields: Any) -> dict[str, Any]:
        """Send until answered or `deadline`; raise PeerFailure (coordinator) at the deadline."""
        req = next(self._req_ids)
        message = {"op": op, "req": req, **self._belief(), **fields}
        first_sent = time.monotonic()
        while True:
            message["waited_s"] = time.monotonic() - first_sent  # protocol.py: deadlines survive a restart
            # Never blocking: while the coordinator is unreachable ZeroMQ queues each copy, and at its high-water mark
            # (1000 messages: 33 minutes of resends every 2 s) a blocking send waited for ever, past this request's
            # deadline (and the heartbeats' and the deathrattle's with it). A full queue already holds copies of this
            # request, delivered when the coordinator answers again.
            with contextlib.suppress(zmq.Again):
                sock.send(pack(message, run_id=self.config.run_id, secret=self._secret), flags=zmq.NOBLOCK)
            self._warn_if_silent()  # also at join, before there are heartbeats: a wrong address, no coordinator yet
            resend_at = min(deadline, time.monotonic() + self.config.request_timeout_s)
            while (left := resend_at - time.monotonic()) > 0:
                if not sock.poll(left * 1000):
                    continue
                try:
                    reply = unpack(sock.recv(), run_id=self.config.run_id, secret=self._secret,
                                   max_bytes=self.config.max_message_bytes)
                except BadMessage as e:
                    log.warning("node %s ignored a bad reply: %s", self.node, e)
                    continue
                if reply.get("req") != req:
                    continue  # the answer to an earlier, abandoned request
                self._answered(op)
                if reply.get("op") == "evicted":
                    self.evicted = True
                    raise Evicted(f"node {self.node} was evicted by the coordinator; rejoin as a new node")
                return reply
            if time.monotonic() >= deadline:
                raise PeerFailure(-1, f"coordinator at {self.address} did not answer {op} in time")

    def join(self, timeout_s: float | None = None, *, slot: int = -1, terms: Mapping[str, str] | None = None) -> int:
        """Register with the coordinator; returns this node's data slot. Admission happens at a sync.

        `slot` asks for a data slot (a node resuming a checkpoint wants its own); the coordinator grants it
        if it is free, and otherwise gives the lowest free one that no node held (then the lowest free one).
        `terms`: what every node of the run must agree on (name -> value); the coordinator refuses a node whose
        terms differ from the run's, naming the first.
        """
        deadline = time.monotonic() + (timeout_s or self.config.sync_timeout_s)
        self.slot, self.terms = slot, dict(terms or {})
        with self._lock:
            reply = self._request(self._sock, "join", deadline, **self._terms())
        if reply.get("op") != "joined":
            raise JoinRefused(f"coordinator refused to let node {self.node} join: {reply.get('reason')}")
        self.slot, self.store, self.joined_epoch = reply["slot"], self._reachable(reply["store"]), reply["epoch"]
        self.inherited_slot_state = reply.get("slot_state") if isinstance(reply.get("slot_state"), dict) else None
        self._start_heartbeats()
        return self.slot

    def sync(self, step: int, attempt: int = 0, *, state_hash: str | None = None,
             hash_step: int | None = None, bandwidth: dict[str, float] | None = None,
             stateless: bool = False) -> View:
        """Wait at the outer-step barrier; returns the view every node of this try gets.

        `bandwidth` reports measured bytes per second from other nodes to this one (for the ring order).
        `stateless`: this node does not hold the global state (its transfer broke): the view lists it as
        new, so that a donor sends it the state again.
        """
        deadline = time.monotonic() + self.config.sync_timeout_s
        extra: dict[str, Any] = {"hash": state_hash, "hash_step": hash_step} if state_hash is not None else {}
        extra.update(self._terms())
        if attempt == 0 and self._applied_at is not None:
            # How long this node computed since its last outer step was applied: the coordinator's straggler
            # deadline, kept across a coordinator restart (its state is soft).
            self._compute_s = extra["compute_s"] = time.monotonic() - self._applied_at
        self._applied_at = None
        if stateless:
            extra["stateless"] = True
        if self.slot_state is not None:
            extra["slot_state"] = self.slot_state()
        if bandwidth:
            extra["bw"] = bandwidth
        with self._lock:
            reply = self._request(self._sock, "sync", deadline, step=step, attempt=attempt, **extra)
        if reply.get("op") == "refused":
            self.evicted = True  # no longer a node of the run: nothing to say goodbye to
            raise JoinRefused(f"coordinator refused node {self.node} at the outer-step barrier: {reply.get('reason')}")
        view = View(epoch=reply["epoch"], members=tuple(reply["members"]), new=tuple(reply["new"]),
                    step=reply["step"], attempt=reply["attempt"], skip=reply["skip"],
                    slots=tuple((n, s) for n, s in reply["slots"]), state_hash=reply.get("state_hash"),
                    donor=reply.get("donor"))
        # Cleared before the view is published: the heartbeat thread reads both, and the pair (the new view, applied)
        # would tell a restarted coordinator that the new try was applied (Commits.heard).
        self._view_applied = False
        self.view, self.store = view, self._reachable(reply["store"]) if "store" in reply else self.store
        return view

    def _reachable(self, store: str) -> str:
        """The rendezvous store's address as this node reaches it: the coordinator hosts the store, so at the host
        this node reaches the coordinator at, with the store's port. The coordinator names its own bind address,
        which for one listening on every interface (`openprime mesh serve`'s default, 0.0.0.0) is no address another
        machine can connect to: there, nodes on other machines connected to themselves and never met."""
        host = self.address.split("://", 1)[-1].rsplit(":", 1)[0]
        return f"{host}:{store.rsplit(':', 1)[1]}"

    def commit(self, step: int, attempt: int, ok: bool, *, unreachable: list[str] | None = None) -> bool:
        """Report this node's all-reduce outcome; True when every member succeeded (apply it). `unreachable`: the
        members this node could not connect to in the try (its transports' `unreachable`)."""
        deadline = time.monotonic() + self.config.sync_timeout_s
        with self._lock:
            extra: dict[str, Any] = {"compute_s": self._compute_s} if self._compute_s is not None else {}
            if unreachable:
                extra["unreachable"] = list(unreachable)
            reply = self._request(self._sock, "commit", deadline, step=step, attempt=attempt, ok=ok, **extra)
        if reply["apply"]:
            self._applied_at = time.monotonic()
            self._view_applied = True
        return bool(reply["apply"])

    def status(self) -> dict[str, Any]:
        with self._lock:
            return self._request(self._sock, "status", time.monotonic() + self.config.eviction_timeout_s)

    # ------------------------------------------------------------------ liveness

    def _start_heartbeats(self) -> None:
        if self._heartbeats is None:
            self._heartbeats = threading.Thread(target=self._heartbeat_loop, name=f"heartbeat-{self.node}",
                                                daemon=True)
            self._heartbeats.start()

    def _heartbeat_loop(self) -> None:
        sock = self._socket()
        try:
            while not self._stop.wait(self.config.heartbeat_interval_s):
                try:
                    self._request(sock, "heartbeat", time.monotonic() + self.config.heartbeat_interval_s,
                                  **self._terms())
                except Evicted:
                    log.warning("node %s: the coordinator evicted this node", self.node)
                    return
                except PeerFailure:
                    continue  # the coordinator is away (restarting?); keep trying (_request warns)
        finally:
            sock.close(linger=0)

    def _warn_if_silent(self) -> None:
        """Say so when the coordinator has not answered for a while (a node otherwise waits in silence, up to
        `sync_timeout_s`): after `coordinator_silence_warning_s`, then twice as long, and so on."""
        with self._silence_lock:
            silent_s = time.monotonic() - self._answered_at
            if silent_s < self._warn_silence_s:
                return
            self._warn_silence_s *= 2
        log.warning("node %s: the coordinator at %s has not answered for %.1fs; waiting for it (at most "
                    "mesh.sync_timeout_s = %.0fs). If none runs there, start one (`openprime mesh serve --bind %s`); "
                    "one restarted at that address continues the run from what the nodes report",
                    self.node, self.address, silent_s, self.config.sync_timeout_s, self.address)

    def _answered(self, op: str) -> None:
        with self._silence_lock:
            now = time.monotonic()
            silent_s, warned = now - self._answered_at, self._warn_silence_s > self.config.coordinator_silence_warning_s
            self._answered_at, self._warn_silence_s = now, self.config.coordinator_silence_warning_s
        if warned:
            log.warning("node %s: the coordinator at %s answers again (%s) after %.1fs of silence",
                        self.node, self.address, op, silent_s)

    def leave(self) -> None:
        """The deathrattle: tell the coordinator at once that this node is going (best effort)."""
        if self.evicted or self.slot < 0:
            return
        try:
            with self._lock:
                self._request(self._sock, "leave", time.monotonic() + self.config.request_timeout_s)
        except (PeerFailure, Evicted):
            pass

    def close(self, *, leave: bool = True) -> None:
        if self._stop.is_set():
            return
        if leave:
            self.leave()
        self._stop.set()
        if self._heartbeats is not None:
            self._heartbeats.join(timeout=self.config.heartbeat_interval_s * 2)
        self._sock.close(linger=0)
        self._ctx.term()
