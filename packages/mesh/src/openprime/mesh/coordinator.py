"""The coordinator: who is in the run, in which ring order, and what happens at each outer step.

INTELLECT-1 kept this in a TCPStore inside rank 0, a single point of failure (DESIGN.md). Here it is a
small standalone server (a ZeroMQ ROUTER and msgpack, protocol.py) whose state is soft: every message
a node sends carries what the node believes (epoch, members, step, slot), so a coordinator that is
killed and restarted at the same address adopts the newest view the nodes report and the run goes on.

What it decides, on one thread, between messages:
- membership: joins (a free data slot each), heartbeats, eviction after `eviction_timeout_s` of
  silence, the deathrattle of a node that leaves;
- the barrier at every outer step (`sync`): once every live member of the view has arrived, the next
  view is formed: the arrived members plus the joiners waiting, in ring order, with a new epoch if the
  set changed; after `num_all_reduce_tries` failed tries the view says `skip`, to every node alike;
  a member alive by its heartbeats that stays away longer than recent outer steps took to compute
  (`straggler_deadline_s`: a process of it hung) is evicted, so that the others go on without it;
- the ring order: the current one, unless a try failed with every member alive (then the ring of the fewest
  links on such failed rings, links.py: a link broken between two members is left out) or the measured
  bandwidths give a much faster ring;
- after an outer step failed on every try with every member alive (blame.py): refusing the joiners admitted since
  the ring last worked, or evicting the node nobody could connect to, or one end of links that no ring avoids;
- the commit of each all-reduce (commit.py): apply only if every member of the view reported success, else every
  survivor retries; a try that can no longer be applied is marked doomed at once (abort.py); a member that does
  not report is evicted as late as a straggler at the barrier;
- agreement: the nodes' hashes of their global state after each outer step are compared, and any
  difference is logged loudly with the nodes involved.

What it tells a node it refuses or evicts (what happened, and what to do) is worded in reasons.py.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import attrs
import zmq

from openprime.core.auth import AuthConfig
from openprime.core.distributed import host_store
from openprime.core.errors import ConfigError
from openprime.mesh import reasons
from openprime.mesh import terms as terms_rules
from openprime.mesh.blame import Blame
from openprime.mesh.commit import Commits
from openprime.mesh.config import MeshConfig
from openprime.mesh.protocol import BadMessage, check_request, pack, unpack
from openprime.mesh.stragglers import StragglerClock, is_retry

log = logging.getLogger("openprime.mesh.coordinator")


@attrs.define
class NodeRecord:
    node: str
    incarnation: str  # "" while adopted from another node's report, until the node speaks for itself
    slot: int
    last_seen: float
    joined_at: float


class Coordinator:
    """The membership server. `start()` runs it on a background thread; `serve_forever()` in this one."""

    def __init__(self, config: MeshConfig, bind: str = "tcp://127.0.0.1:0", *, store_port: int = 0,
                 store_timeout_s: float = 60.0) -> None:
        self.config = config
        self._secret = AuthConfig(run_id=config.run_id, secret_file=config.secret_file).load_secret()
        self.bandwidth: dict[tuple[str, str], float] = {}  # (from, to) -> bytes/s, as the receivers measured
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 16 * config.max_message_bytes)  # above: dropped by ZeroMQ itself
        try:
            if bind.endswith(":0"):
                port = self._sock.bind_to_random_port(bind.rsplit(":", 1)[0])
                self.address = f"{bind.rsplit(':', 1)[0]}:{port}"
            else:
                self._sock.bind(bind)
                self.address = bind
        except zmq.ZMQError as e:
            self._sock.close(linger=0)
            self._ctx.term()
            raise ConfigError(f"the coordinator cannot listen on {bind!r}: {e.strerror}; give --bind "
                              f"tcp://HOST:PORT with an address of this machine (0.0.0.0: all of them) and a free "
                              f"port (is another coordinator running there?)") from None
        # The rendezvous store where each group of each epoch meets (openprime.core.distributed).
        host = self.address.split("://", 1)[-1].rsplit(":", 1)[0]
        try:
            if not 0 <= store_port <= 65535:
                raise ValueError(f"port {store_port} is not in 0-65535")
            self._store = host_store("127.0.0.1" if host in ("*", "0.0.0.0") else host, store_port,
                                     timeout_s=store_timeout_s)
        except (RuntimeError, OSError, ValueError) as e:  # torch's DistNetworkError is a RuntimeError
            self._sock.close(linger=0)
            self._ctx.term()
            raise ConfigError(f"the coordinator's rendezvous store cannot listen on port {store_port}: "
                              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}; give --store-port a free "
                              f"port (0: any free one)") from None
        self.store = f"{host}:{self._store.port}"
        self.nodes: dict[str, NodeRecord] = {}
        self.slots_held: set[int] = set()  # data slots granted since this coordinator started (see _grant_slot)
        # What the node holding each data slot last reported of it at a sync (opaque: the trainer's data position),
        # handed to the next node granted the slot, which goes on from there instead of reading the slot again.
        self.slot_states: dict[int, dict] = {}
        self.epoch = 0
        self.members: list[str] = []
        self.step = 0
        self._waiting: dict[str, tuple[bytes, int, dict]] = {}  # node -> (route, req, message) at the barrier
        self._periodic_errors: set[str] = set()  # errors of the periodic work already logged
        self._viewed: dict[tuple[str, str], int] = {}  # (node, incarnation) -> the last sync request answered
        self._last_view: dict[tuple[str, str], dict] = {}  # (node, incarnation) -> the view that answered it
        self._clock = StragglerClock(config)  # who is late at the barrier or in the commit (stragglers.py)
        self.hashes: dict[int, dict[str, str]] = {}
        self.disagreements: list[tuple[int, dict[str, str]]] = []
        self.terms: dict[str, str] | None = None  # what every node of the run agrees on (terms.py, _disagreement)
        self.terms_node = ""
        self.refusals: list[str] = []
        self.evictions: list[str] = []
        # What tries that failed with every member alive tell: suspect links, unproven joiners, a node nobody reaches.
        self.blame = Blame(config.num_all_reduce_tries)
        self.commits = Commits(run_id=config.run_id, store=self._store, clock=self._clock, blame=self.blame)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._frozen_s = 0.0  # time this process did not run (see _now)
        self._started = self._now()

    # ------------------------------------------------------------------ lifetime

    def start(self) -> Coordinator:
        self._thread = threading.Thread(target=self.serve_forever, name="openprime-coordinator", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        tick = min(0.1, self.config.heartbeat_interval_s / 4)
        last = time.monotonic()
        while not self._stop.is_set():
            ready = poller.poll(timeout=tick * 1000)
            last = self._count_frozen(last, tick)  # before the messages that waited are handled
            if ready:
                while self._sock.poll(0):
                    frames = self._sock.recv_multipart()
                    self._handle(frames)
            self._periodic()

    def _periodic(self) -> None:
        """The work of every pass: evictions, barriers, commits. An error in it is logged (once per distinct error)
        and the loop goes on, as for a message (`_handle`): it ended the loop's thread, and with it a launch's
        coordinator, without a word to the nodes, who then waited out their sync timeouts."""
        try:
            self._evict_silent(self._now())
            self._try_barrier()
            self._try_commit()
        except Exception as e:
            seen = f"{type(e).__name__}: {e}"
            if seen not in self._periodic_errors:
                self._periodic_errors.add(seen)
                log.exception("coordinator failed in its periodic work (evictions, barrier, commit); it goes on "
                              "serving. Please report this with the log")

    def _now(self) -> float:
        """The coordinator's clock: time.monotonic() less the time this process did not run. Every silence,
        arrival and deadline is measured on it. Suspended with its nodes (Ctrl-Z and `fg` of a launch, a machine or
        VM that slept), it woke to every node silent for the whole pause and evicted them all, and with them the
        run's state: nobody was left to give it to the nodes that joined again (2026-12-06)."""
        return time.monotonic() - self._frozen_s

    def _count_frozen(self, last: float, tick: float) -> float:
        """After a pass of the loop that should have taken a tick: a pass that took over half an eviction timeout
        means this process was stopped (or starved of CPU); that time is left out of `_now`. Returns the time now."""
        now = time.monotonic()
        if now - last > self.config.eviction_timeout_s / 2:
            self._frozen_s += now - last - tick
            log.warning("the coordinator did not run for %.1fs (suspended, or starved of CPU); its deadlines leave "
                        "that time out, so that nobody is evicted for the silence it did not hear", now - last)
        return now

    # ------------------------------------------------------------------ messages

    def _handle(self, frames: list[bytes]) -> None:
        route = frames[0]
        try:
            if len(frames) != 2:
                raise BadMessage(f"expected 2 frames, got {len(frames)}")
            message = unpack(frames[1], run_id=self.config.run_id, secret=self._secret,
                             max_bytes=self.config.max_message_bytes)
            op = check_request(message)
            reply = getattr(self, f"_on_{op}")(route, message)
        except BadMessage as e:
            self._refuse(route, str(e))
            return
        except Exception as e:
            log.exception("coordinator failed on a message from connection %s", route.hex())
            self._refuse(route, f"internal error on this message ({type(e).__name__}: {e})")
            return
        if reply is not None:
            self._reply(route, message["req"], reply)

    def _reply(self, route: bytes, req: int, reply: dict[str, Any]) -> None:
        self._sock.send_multipart([route, pack({**reply, "req": req}, run_id=self.config.run_id,
                                               secret=self._secret)])

    def _refuse(self, route: bytes, reason: str) -> None:
        self.refusals.append(reason)
        log.warning("coordinator refused a message from connection %s: %s", route.hex(), reason)

    def _known(self, message: dict) -> NodeRecord | None:
        """The sender's record (refreshing its liveness), adopting a newer view a restarted coordinator lacks."""
        node, incarnation = message["node"], message["incarnation"]
        record = self.nodes.get(node)
        if record is not None and record.incarnation and record.incarnation != incarnation:
            raise BadMessage(f"node id {node!r} belongs to another process (incarnation mismatch)")
        if message["epoch"] > self.epoch and node in message["members"] and self._may_adopt():
            self._adopt(message)
            record = self.nodes.get(node)
        if record is None:
            return None
        record.incarnation = incarnation
        record.last_seen = self._now()
        if record.slot < 0 <= message["slot"] < self.num_slots:
            # A member adopted with a placeholder slot (a restart): its own, from any message's belief. It got it
            # back only at its next sync, an outer step's compute later, and a node that joined meanwhile was
            # granted it, both then reading that slot (found 2026-12-07).
            self._reclaim_slot(node, message["slot"])
        self._settle_from(message)
        return record

    def _reclaim_slot(self, member: str, slot: int) -> None:
        """Give a member of the adopted view its own data slot (the node reads it, whatever the coordinator says); a
        node that joined this restarted coordinator before the member reported back and was granted that slot
        joins again (it was admitted to no view yet)."""
        for other, record in list(self.nodes.items()):
            if other != member and record.slot == slot and other not in self.members:
                self._remove(other, f"was granted data slot {slot}, which member {member} holds (the coordinator "
                                    f"restarted); it joins again")
        self.nodes[member].slot = slot
        self.slots_held.add(slot)

    def _settle_from(self, message: dict) -> None:
        """A member's message that shows how the open try was decided before this coordinator restarted settles
        it (Commits.heard); the members waiting for the decision get it."""
        apply = self.commits.heard(message)
        if apply is not None:
            decision = self.commits.settle(apply, self._now())
            for route, req in decision.committee.waiting.values():
                self._reply(route, req, {"op": "decision", "apply": decision.apply})

    def _may_adopt(self) -> bool:
        """Only a coordinator that just (re)started, or has no live member, takes the view the nodes report.

        Otherwise any sender could replace the live view by reporting a higher epoch that lists itself.
        """
        return self._just_started() or not any(m in self.nodes for m in self.members)

    def _just_started(self) -> bool:
        """This coordinator (re)started less than a recovery window ago: the run's nodes may still report."""
        return self._now() - self._started < self.config.recovery_window_s

    def _adopt(self, message: dict) -> None:
        """The nodes know a newer view than this coordinator: it restarted. Their report is the state."""
        log.warning("coordinator adopts epoch %d with members %s from node %s (coordinator restarted?)",
                    message["epoch"], message["members"], message["node"])
        self.epoch, self.members, self.step = message["epoch"], list(message["members"]), message["step"]
        terms = message.get("terms")
        if terms and terms != self.terms:
            # Nodes that joined this coordinator before the run reported back agreed to no terms of the run (the
            # first of them set its own): they join again, and are checked against the run's.
            for node in [n for n in self.nodes if n not in self.members]:
                self._remove(node, "joined the restarted coordinator before the run's members reported back; it "
                                   "joins again under the run's terms")
            self.terms, self.terms_node = dict(terms), message["node"]
        now = self._now()
        for i, node in enumerate(self.members):
            if node not in self.nodes:
                # Members get one eviction timeout to speak for themselves; slots come from their reports.
                self.nodes[node] = NodeRecord(node=node, incarnation="", slot=-1 - i, last_seen=now, joined_at=now)
        if 0 <= message["slot"] < self.num_slots:
            self._reclaim_slot(message["node"], message["slot"])
        # The view's donor and joiners are timed by their transfer, in its commit (blocking recovery) and at the
        # barrier after it (non-blocking): without them a restart in the middle of a transfer (INTELLECT-1's took
        # 30-60 minutes) evicted both once the first member had waited an outer step's compute.
        self._clock.view_formed(self.members, [n for n in message.get("new") or [] if n in self.members],
                                message.get("donor"))
        if message.get("applied"):
            self._clock.applied(now)

    @property
    def num_slots(self) -> int:
        """The data slots nodes may take (terms.num_slots)."""
        return terms_rules.num_slots(self.terms, self.config.max_nodes)

    def _valid_slot(self, node: str, slot: int) -> int:
        """The slot a node reports, if it is in range and free; otherwise a free one (or -1 while none is)."""
        granted = self._grant_slot(node, slot)
        return granted if granted < self.num_slots else -1

    def _grant_slot(self, node: str, wanted: Any) -> int:
        """The data slot for `node`: the one it asks for if that is free (a node resuming a checkpoint, or
        rejoining, asks for its own), else the lowest free slot that no node has held, else the lowest free one;
        num_slots when none is free. Given a slot a node that left had held (the lowest free one), a replacement
        trained again, batch for batch, what that node had trained, while slots never held stayed unread (found
        2026-12-07); given one now, it goes on from the position its node last reported (`slot_states`)."""
        used = {r.slot for n, r in self.nodes.items() if n != node}
        free = [s for s in range(self.num_slots) if s not in used]
        if isinstance(wanted, int) and wanted in free:
            slot = wanted
        else:
            slot = next((s for s in free if s not in self.slots_held), free[0] if free else self.num_slots)
            if slot in self.slots_held:
                log.warning("node %s takes data slot %d, which a node that left held: it %s (every slot of "
                            "mesh.max_nodes=%d was held; more slots give it unread data)", node, slot,
                            "goes on from where that node reported it was" if slot in self.slot_states else
                            "reads that slot's data from the start (this coordinator heard no position of it)",
                            self.num_slots)
        if slot < self.num_slots:
            self.slots_held.add(slot)
        return slot

    def _on_join(self, route: bytes, message: dict) -> dict:
        node = message["node"]
        if node in self.nodes and self.nodes[node].incarnation not in ("", message["incarnation"]):
            reason = f"node id {node!r} is already in use by a live node"
            self._refuse(route, reason)
            return {"op": "refused", "reason": reason}
        terms = message.get("terms")
        reason = terms_rules.too_few_slots(terms, self.config.max_nodes) or self._disagreement(node, terms)
        if reason is not None:
            self._refuse(route, reason)
            return {"op": "refused", "reason": reason}
        record = self.nodes.get(node)
        if record is not None and not record.incarnation:
            # A member of a view this restarted coordinator adopted that has not reported back (its placeholder,
            # slot -1 - i) and a process joining under its id (ids fixed by the caller): a new process, the member's
            # own having died. It was taken for the member, answered the placeholder slot, and every later message
            # of it was refused as out of range while it waited out its sync timeout (found 2026-12-07 by review).
            self._remove(node, "a new process joined under its id before it reported back to the restarted "
                               "coordinator; it joins as a new node")
            record = None
        if record is None:
            slot = self._grant_slot(node, message.get("slot", -1))
            if slot >= self.num_slots:
                return {"op": "refused", "reason": terms_rules.full(self.num_slots, self.config.max_nodes)}
            now = self._now()
            record = NodeRecord(node=node, incarnation=message["incarnation"], slot=slot, last_seen=now, joined_at=now)
            self.nodes[node] = record
            if node in self.members:
                # A new process under the id of a member of the last view that was removed (an id fixed by the
                # caller, e.g. a host name): a joiner like any other, not that member. Counted as it, it held the
                # run's state at the barrier with its own (initial or older) weights, in the same groups.
                self.members = [m for m in self.members if m != node]
                log.warning("node %s joined again as a new process after it was removed: it joins as a new node "
                            "and takes the run's state from a member", node)
            log.info("node %s joined (slot %d); it is admitted at the next outer step", node, slot)
        return {"op": "joined", "slot": record.slot, "epoch": self.epoch, "step": self.step, "store": self.store,
                "slot_state": self.slot_states.get(record.slot)}

    def _disagreement(self, node: str, terms: Any) -> str | None:
        """Why a joining node may not join this run's terms (None: it may). The first node to join a coordinator
        with no node sets the terms. A restarted coordinator learns the run's from the first member that reports
        (heartbeats and syncs carry them); a node that joined it before, under other terms, joins again."""
        if not isinstance(terms, dict) or not terms:
            return None  # a client that states none (the mesh's own tests)
        if self.terms is None or not self.nodes:
            self.terms, self.terms_node = dict(terms), node
            return None
        return terms_rules.disagreement(self.terms, self.terms_node, node, terms)

    def _on_heartbeat(self, route: bytes, message: dict) -> dict:
        if self._known(message) is None:
            return {"op": "evicted"}
        return {"op": "ok", "epoch": self.epoch}

    def _on_sync(self, route: bytes, message: dict) -> dict | None:
        record = self._known(message)
        if record is None:
            return {"op": "evicted"}
        key = (message["node"], message["incarnation"])
        if message["req"] <= self._viewed.get(key, 0):
            # A resend of a sync already answered with a view, crossing the answer: it would open the next barrier
            # with an arrival in the past (waited_s) and make the members still on their way look late. The view
            # goes again to the request it answered: the answer may have been lost with its connection (ZeroMQ
            # reconnects under a new route, and the node resends), and the node, never told, was evicted as hung.
            return self._last_view.get(key) if message["req"] == self._viewed[key] else None
        if record.slot < 0:
            record.slot = self._valid_slot(message["node"], message["slot"])
        if isinstance(message.get("slot_state"), dict) and 0 <= record.slot == message["slot"]:
            self.slot_states[record.slot] = message["slot_state"]
        if isinstance(message.get("hash"), str) and isinstance(message.get("hash_step"), int):
            self._record_hash(message["node"], message["hash_step"], message["hash"])
        for sender, rate in (message.get("bw") or {}).items():
            self.bandwidth[(sender, message["node"])] = float(rate)
            if float(rate) > 0:
                self.blame.probed(sender, message["node"])  # a probe's data crossed the link
        message["arrived_at"] = self._arrived_at(message)
        self._waiting[message["node"]] = (route, message["req"], message)
        return None  # answered when the barrier completes

    def _arrived_at(self, message: dict) -> float:
        """When the node reached the barrier: as this coordinator heard it the first time, when this is a resend of
        that sync (the node's `waited_s` also counts time this coordinator did not run: both suspended together);
        otherwise `_sent_at` (after a restart of this coordinator, `waited_s` is all there is)."""
        held = self._waiting.get(message["node"])
        if held is not None and all(held[2].get(k) == message.get(k) for k in ("incarnation", "step", "attempt")):
            return held[2]["arrived_at"]
        return self._sent_at(message)

    def _on_commit(self, route: bytes, message: dict) -> dict | None:
        if self._known(message) is None:
            return {"op": "evicted"}
        reply = self.commits.report(route, message, sent_at=self._sent_at(message), epoch=self.epoch,
                                    members=self.members)
        for _, _, waiting in list(self._waiting.values()):  # a committee re-formed after a restart: a member may
            self._settle_from(waiting)                        # already be at the barrier of a later try
        return reply

    def _sent_at(self, message: dict) -> float:
        """When the node first sent this request (on `_now`): it has waited `waited_s` for an answer, across a
        restart of this coordinator. At most the straggler bound ago (a clock that jumped)."""
        return self._now() - min(float(message.get("waited_s", 0.0)), self.config.straggler_timeout_s)

    def _on_leave(self, route: bytes, message: dict) -> dict:
        if self._known(message) is not None:
            self._remove(message["node"], "left (deathrattle)")
        return {"op": "ok"}

    @property
    def all_reducing(self) -> int | None:
        """The outer step whose view went out and whose members have not all reported back (they are in its
        all-reduce); None between outer steps. Read from another thread by tests that time a fault."""
        committee = self.commits.committee
        return committee.step if committee is not None else None

    def _on_status(self, route: bytes, message: dict) -> dict:
        return {"op": "status", "epoch": self.epoch, "members": self.members, "step": self.step,
                "nodes": sorted(self.nodes), "evictions": len(self.evictions), "refusals": len(self.refusals),
                "disagreements": len(self.disagreements), "waiting": sorted(self._waiting)}

    # ------------------------------------------------------------------ decisions

    def _remove(self, node: str, why: str) -> None:
        # The last view (self.members) keeps the node until the next barrier forms a view without it.
        self.nodes.pop(node, None)
        self._waiting.pop(node, None)
        for key in [k for k in self._viewed if k[0] == node]:
            del self._viewed[key]
            self._last_view.pop(key, None)
        self.blame.forget(node)
        self.evictions.append(node)
        log.warning("node %s removed: %s", node, why)
        self.commits.removed(node, why)

    def _evict_silent(self, now: float) -> None:
        for node, record in list(self.nodes.items()):
            if now - record.last_seen > self.config.eviction_timeout_s:
                self._remove(node, f"silent for more than {self.config.eviction_timeout_s:.1f}s")

    def straggler_deadline_s(self, member: str | None = None) -> float:
        """How long after the first member this barrier waits for `member` (StragglerClock.deadline_s)."""
        return self._clock.deadline_s(member)

    def _evict_stragglers(self, now: float) -> None:
        """Members that heartbeat but do not come to the barrier (a process of theirs hung) would hold everyone
        until the members' sync timeout: evict them about one outer step's compute time late (stragglers.py)."""
        if self._just_started():
            return  # the members waiting resend within a request timeout, saying how long they have waited
        arrived = {m: self._waiting[m][2] for m in self.members if m in self.nodes and m in self._waiting}
        live = [m for m in self.members if m in self.nodes]
        for m, deadline_s in self._clock.late_at_barrier(now, live, arrived):
            self._remove(m, reasons.straggler(deadline_s, retry=is_retry(arrived),
                                              known_compute=self._clock.known_compute(),
                                              straggler_factor=self.config.straggler_factor,
                                              min_straggler_s=self.config.min_straggler_s))

    def _try_barrier(self) -> None:
        self._evict_stragglers(self._now())
        live_members = [m for m in self.members if m in self.nodes]
        if not self._waiting or any(m not in self._waiting for m in live_members):
            return
        # Joiners in slot order: a run's first ring is then the same when it is resumed from a checkpoint
        # (slots are granted lowest first, so this is also join order unless a slot was freed).
        joiners = sorted((n for n in self._waiting if n not in live_members), key=lambda n: self.nodes[n].slot)
        if not live_members and len(joiners) < self.config.min_nodes:
            return  # the first view waits for min_nodes
        if not live_members and self._just_started():
            # A first view waits out the recovery window too: this coordinator may have restarted under a live run
            # whose members report back within it. Formed at once from a joiner (a node resumed from an older
            # checkpoint, or a new one), it took the epoch the members report, they were not adopted and were
            # evicted as unknown, and on rejoining took the joiner's older state: the run rolled back (found
            # 2026-12-07 by review). A new run's first barrier comes after its first inner steps, past the window.
            return
        arrivals = [self._waiting[m][2] for m in live_members] or [self._waiting[j][2] for j in joiners]
        step = max(a["step"] for a in arrivals)
        attempt = max(a["attempt"] for a in arrivals if a["step"] == step)
        if attempt >= self.config.num_all_reduce_tries and (self._refuse_unproven(live_members, step)
                                                             or self._evict_unreachable(live_members, step)):
            live_members = [m for m in live_members if m in self.nodes]
        if live_members:
            self._refuse_ahead(joiners, step)
            joiners = [j for j in joiners if j in self._waiting]
        # Members that report no state (a transfer that broke, or a node admitted earlier without it) get it
        # from a donor at this barrier, as joiners do.
        stateless = [m for m in live_members if self._waiting[m][2].get("stateless") is True]
        holders = [m for m in live_members if m not in stateless]
        new = joiners + stateless
        if not live_members:
            # The first view: every node a joiner. Nodes resumed from checkpoints of different steps (one machine
            # lost its newest save in a crash) or not resumed at all (a machine without its disk) take the state
            # of a node at the newest step, as joiners of a run under way do; the others start together.
            holders = [j for j in joiners if self._waiting[j][2]["step"] == step
                       and self._waiting[j][2].get("stateless") is not True]
            new = [j for j in joiners if j not in holders]
            if holders and new:
                log.warning("outer step %d: %s resume from older states than %s (or none); they take the state "
                            "from a node at the newest step", step, new, holders)
        if not holders:
            self._no_state_left(live_members + joiners)
            return
        members = self._ring_order(live_members, joiners)
        if live_members:
            self.blame.admitted(joiners)  # joining a ring that works; they prove themselves in an applied step
        if members != self.members:
            # A new set, or the same set in a new order: either way new groups. A first view always differs from the
            # last: a joiner is never in self.members (_on_join takes a removed member's id out of it), so a later
            # run of the same fixed ids does not meet the earlier run's decisions (keyed by epoch, step and try) nor
            # its groups' rendezvous keys.
            self.epoch += 1
        self.members, self.step = members, step
        skip = attempt >= self.config.num_all_reduce_tries
        # The hash the state holders agree their state has (after the previous outer step): the new nodes
        # check what a donor sends them against it.
        reported = {self.hashes.get(step - 1, {}).get(m) for m in holders} - {None}
        agreed = reported.pop() if len(reported) == 1 else None
        donor = self.blame.donor([m for m in members if m in holders], new)
        view = {"op": "view", "epoch": self.epoch, "members": members, "new": new, "donor": donor, "step": step,
                "state_hash": agreed,
                "attempt": attempt, "skip": skip, "slots": [[m, self.nodes[m].slot] for m in members],
                "store": self.store}
        self.commits.opened(step=step, attempt=attempt, epoch=self.epoch, members=members)
        for node, (route, req, message) in self._waiting.items():
            self._reply(route, req, view)
            self._viewed[node, message["incarnation"]] = req
            self._last_view[node, message["incarnation"]] = view
        self._waiting.clear()
        self._clock.view_formed(members, new, donor)
        log.info("outer step %d try %d: epoch %d, %d nodes%s%s", step, attempt, self.epoch, len(members),
                 f", admitted {joiners}" if joiners and live_members else "", ", SKIPPED" if skip else "")

    def _no_state_left(self, waiting: list[str]) -> None:
        """Every node at the barrier lacks the run's state (`stateless`: joined a run under way without it, or
        its transfer broke) and no member holds it: no node left does. Wait for joined nodes not yet at the barrier
        (nodes resumed from checkpoints arrive after their inner steps); with none, refuse the waiting ones, who
        would otherwise wait for a donor at every outer step forever. A coordinator that just (re)started waits out
        its recovery window first: the run's members may not have reported back yet."""
        if any(n not in self._waiting for n in self.nodes) or self._just_started():
            return
        reason = reasons.no_state_left(self.step, self.epoch, len(waiting))
        log.error("outer step %d: %s (refused: %s)", self.step, reason, waiting)
        self._refuse_at_barrier(waiting, reason)
        self._clock.barrier_reset()

    def _refuse_ahead(self, joiners: list[str], step: int) -> None:
        """Refuse the joiners that hold a state further on than the live run's: joining would replace it with an
        older one (they take the state of the run they join). The live run is then another one, begun after theirs
        lost its nodes (a restarted coordinator, nodes started without a checkpoint), or one rolled back from an
        older checkpoint; either way a person decides, not the barrier."""
        for j in joiners:
            message = self._waiting[j][2]
            if message["step"] <= step or message.get("stateless") is True:
                continue
            reason = reasons.ahead(message["step"], step)
            log.error("outer step %d: refusing %s: %s", step, j, reason)
            self._refuse_at_barrier([j], reason)

    def _refuse_at_barrier(self, nodes: list[str], reason: str) -> None:
        """Answer these nodes' waiting syncs with a refusal (JoinRefused there) and forget them."""
        for node in nodes:
            route, req, _ = self._waiting.pop(node)
            self.nodes.pop(node, None)
            self.blame.forget(node)
            self.refusals.append(reason)
            self._reply(route, req, {"op": "refused", "reason": reason})

    def _refuse_unproven(self, live_members: list[str], step: int) -> bool:
        """The outer step failed on every try with every member alive, and some members were admitted to a ring
        that worked without them and have not been in an applied all-reduce since (blame.py): refuse them (they
        would fail every outer step of the whole run, as a node whose peers cannot reach it does) and go on without
        them. Returns whether any were refused."""
        culprits = self.blame.unproven_culprits(live_members, step)
        if not culprits:
            return False
        reason = reasons.unproven(step, self.config.num_all_reduce_tries)
        log.error("outer step %d: refusing %s, admitted before every try of it failed: %s", step, culprits, reason)
        self._refuse_at_barrier(culprits, reason)
        return True

    def _evict_unreachable(self, live_members: list[str], step: int) -> bool:
        """The outer step failed on every try with every member alive, and what the members could not connect to
        singles out one node (its links broke, or its address, port or firewall changed), or one end of links that
        no ring avoids broke for outer steps in a row (blame.py): evict it, so that the others sync again. Returns
        whether one was."""
        culprit = self.blame.unreachable_culprit(step, sorted(live_members, key=lambda m: self.nodes[m].joined_at))
        if culprit is None or culprit.node not in self.nodes:
            return False
        self._remove(culprit.node, reasons.unreachable(culprit, live_members, self.config.num_all_reduce_tries))
        return True

    def _try_commit(self) -> None:
        committee = self.commits.committee
        if committee is None or not committee.reports:
            return
        # A member alive by its heartbeats that does not report on its all-reduce (a process of it hung after its
        # barrier: it never built its group) would hold the others in their commit until their sync timeout: evict
        # it as late after the first report as a straggler at the barrier (stragglers.py). A coordinator that just
        # (re)started evicts nobody here, as at the barrier: the members resend their reports first.
        if not self._just_started():
            for m, waited_s in self._clock.late_in_commit(self._now(), committee.live(self.nodes),
                                                          committee.reported_at, self.nodes):
                self._remove(m, reasons.silent_in_commit(committee.step, waited_s))
        decision = self.commits.decide(committee.live(self.nodes), self._now())
        if decision is not None:
            for route, req in decision.committee.waiting.values():
                self._reply(route, req, {"op": "decision", "apply": decision.apply})

    def _ring_order(self, live_members: list[str], joiners: list[str]) -> list[str]:
        """The current order (joiners appended), unless links of it are suspect or the measured bandwidths give
        a much faster ring (blame.py)."""
        order, why = self.blame.ring(live_members + joiners, self.bandwidth, self.config.reorder_gain)
        if why is not None:
            log.warning("ring re-ordered %s: %s", why, order)
        return order

    def _record_hash(self, node: str, step: int, digest: str) -> None:
        by_node = self.hashes.setdefault(step, {})
        by_node[node] = digest
        if len(set(by_node.values())) > 1 and not any(s == step for s, _ in self.disagreements):
            self.disagreements.append((step, dict(by_node)))
            log.error("REPLICAS DISAGREE after outer step %d: %s", step, by_node)
        for old in [s for s in self.hashes if s < step - 2]:
            del self.hashes[old]
