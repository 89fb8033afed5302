"""ElasticDeviceMesh: a node's local ranks and the global group across nodes, as one object.

INTELLECT-1 paper, section 2.2. Each process of a node has a local rank (its place in the node, where
FSDP2 shards the model) and, at every outer step, a global rank (its node's place in the view's ring
order). Only the node's local rank 0 talks to the coordinator; it hands the view to its other local
ranks, so the processes of one node never disagree about who is alive. Each local rank gets its own
transport per try, joining the same local rank of every other node: one ring per local rank, which
also gives several parallel connections between each pair of nodes.

It implements the `Membership` interface of openprime.core, which DiLoCo drives: a new transport is
built whenever the epoch changes or a try is retried (a failed group is never reused), and a group
that cannot be built makes that try fail, so the nodes retry without the missing member.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import msgpack
import torch

from openprime.core.errors import OpenPrimeError, PeerFailure
from openprime.core.membership import Membership, Round
from openprime.core.transport import Handle, Rendezvous, Transport, TransportFactory
from openprime.mesh.abort import TryWatch, try_group
from openprime.mesh.bandwidth import ProbeBytes, probe_bandwidth
from openprime.mesh.client import Evicted, JoinRefused, MeshClient, View

log = logging.getLogger("openprime.mesh.elastic")


class _BrokenTransport(Transport):
    """Stands in for a group that could not be built: every operation fails at once."""

    def __init__(self, rank: int, world_size: int, reason: str) -> None:
        super().__init__(rank, world_size)
        self.reason = reason

    def isend(self, peer: int, tag: int, buffers: Sequence[torch.Tensor], *, deadline: float) -> Handle:
        raise PeerFailure(peer, self.reason)

    def irecv(self, peer: int, tag: int, buffers: Sequence[torch.Tensor], *, deadline: float) -> Handle:
        raise PeerFailure(peer, self.reason)

    def close(self) -> None:
        pass


class ElasticDeviceMesh(Membership):
    """The elastic membership of one process (one local rank of one node)."""

    def __init__(self, client: MeshClient | None, *, transport_factory: TransportFactory, run_id: str,
                 abort_poll_s: float, connect_timeout_s: float, local_rank: int = 0,
                 local_group: torch.distributed.ProcessGroup | None = None,
                 probe_bytes: int = 0, probe_timeout_s: float = 30.0) -> None:
        """`abort_poll_s` (MeshConfig.abort_poll_s): how often this process reads whether its try is doomed
        (openprime.mesh.abort); `connect_timeout_s`: the bound on reaching the coordinator's store for it."""
        if (client is None) != (local_rank != 0):
            raise ValueError("local rank 0, and only it, holds the node's MeshClient")
        self.client = client
        self.local_rank = local_rank
        self.local_group = local_group
        self._factory = transport_factory
        self._run_id = run_id
        self._transport: Transport | None = None
        self._epoch = -1
        self.view: View | None = None
        self._probe_bytes, self._probe_timeout_s = probe_bytes, probe_timeout_s
        self._probed_epoch = -1
        self._probed = ProbeBytes()  # what the probes since the last round moved (counted in the next round)
        self._probe: threading.Thread | None = None
        self._probe_due = False  # the last commit applied a try of a group not yet measured: probe at idle()
        self._measured: dict[str, float] = {}  # node -> bytes/s from it to this node, reported at the next sync
        # Who this node is, the same on every local rank (only local rank 0 holds the client).
        identity = self._share([client.node, client.slot, client.joined_epoch, client.inherited_slot_state]
                               if client is not None else None)
        # inherited_slot_state: what the node that held this data slot before reported of it (MeshClient.join).
        self.node_id, self.slot, self.joined_epoch, self.inherited_slot_state = identity
        self._store = ""  # the coordinator's rendezvous store, as the last view named it
        self._try = ""  # the group name of the current try (abort.try_group)
        self._watch = TryWatch(poll_s=abort_poll_s, connect_timeout_s=connect_timeout_s,
                               who=f"node {self.node_id} local rank {local_rank}")

    def report_slot_state(self, state: Callable[[], dict]) -> None:
        """What this node reports of its data slot at each sync (local rank 0 reports for the node)."""
        if self.client is not None:
            self.client.slot_state = state

    # ------------------------------------------------------------------ the node's local ranks

    def _share(self, value: object) -> object:
        """Local rank 0's value, on every local rank of the node (msgpack through the local group)."""
        if self.local_group is None:
            return value
        return msgpack.unpackb(_broadcast_bytes(msgpack.packb(value), self.local_rank, self.local_group), raw=False)

    def _on_rank0(self, call: Callable[[], object]) -> object:
        """Run `call` (a request to the coordinator) on local rank 0 and give every local rank its result, or
        raise its error on every local rank: an eviction or a lost coordinator stops the whole node alike."""
        reply: object = None
        if self.client is not None:
            try:
                reply = {"ok": call()}
            except (Evicted, PeerFailure, OpenPrimeError) as e:
                if self.local_group is None:
                    raise
                reply = {"error": type(e).__name__, "message": e.reason if isinstance(e, PeerFailure) else str(e)}
        shared = self._share(reply)
        if "error" in shared:
            errors = {"Evicted": Evicted, "JoinRefused": JoinRefused, "PeerFailure": None}
            error = errors.get(shared["error"], OpenPrimeError)
            raise PeerFailure(-1, shared["message"]) if error is None else error(shared["message"])
        return shared["ok"]

    def _gather_hashes(self, state_hash: str | None) -> str | None:
        """The node's hash: its local ranks' shard hashes joined by ';' in rank order (None if any rank has
        no state, so that the coordinator lists the node as new and every rank takes the state again)."""
        if self.local_group is None:
            return state_hash
        hashes = [msgpack.unpackb(b, raw=False) for b in _all_gather_bytes(msgpack.packb(state_hash), self.local_group)]
        return None if any(h is None for h in hashes) else ";".join(hashes)

    def _own_hash(self, agreed: str | None) -> str | None:
        """This local rank's part of the node hash the members agreed on."""
        if agreed is None or self.local_group is None:
            return agreed
        return agreed.split(";")[self.local_rank]

    def _all_local(self, ok: bool) -> bool:
        """True when every local rank of the node succeeded."""
        if self.local_group is None:
            return ok
        flag = torch.tensor([1 if ok else 0])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=self.local_group)
        return bool(flag.item())

    # ------------------------------------------------------------------ Membership

    def begin(self, step: int, attempt: int, *, state_hash: str | None, hash_step: int) -> Round:
        self._probe_due = False
        bandwidth = self._probe_results()
        probed, self._probed = self._probed, ProbeBytes()
        node_hash = self._gather_hashes(state_hash)

        def sync() -> dict:
            view = self.client.sync(step, attempt, state_hash=node_hash, hash_step=hash_step, bandwidth=bandwidth,
                                    stateless=node_hash is None)
            return {"view": [view.epoch, list(view.members), list(view.new), view.step, view.attempt, view.skip,
                             [list(s) for s in view.slots], view.state_hash, view.donor], "node": self.client.node,
                    "store": self.client.store}

        shared = self._on_rank0(sync)
        epoch, members, new, v_step, v_attempt, skip, slots, agreed, donor = shared["view"]
        view = View(epoch=epoch, members=tuple(members), new=tuple(new), step=v_step, attempt=v_attempt, skip=skip,
                    slots=tuple((n, s) for n, s in slots), state_hash=agreed, donor=donor)
        self.view = view
        rank = view.rank_of(shared["node"])
        if self._transport is None or epoch != self._epoch or attempt > 0:
            self._rebuild(view, rank, shared["store"])
        self._store, self._try = shared["store"], try_group(self._run_id, epoch, v_step, v_attempt)
        if not skip:  # closed at once if the try is doomed (a member lost): see openprime.mesh.abort
            self._watch.watch(self._store, self._try, self._transport)
        old = [r for r, n in enumerate(view.members) if n not in view.new]
        new_ranks = tuple(r for r, n in enumerate(view.members) if n in view.new) if old else ()
        return Round(transport=self._transport, step=v_step, attempt=v_attempt, skip=skip, new_ranks=new_ranks,
                     donor_rank=_donor_rank(view, old), state_hash=self._own_hash(agreed),
                     side_bytes_sent=probed.sent, side_bytes_received=probed.received)

    def _rebuild(self, view: View, rank: int, store: str) -> None:
        if self._transport is not None:
            self._transport.close()
        host, port = store.rsplit(":", 1)
        group = f"{try_group(self._run_id, view.epoch, view.step, view.attempt)}/l{self.local_rank}"
        try:
            self._transport = self._factory(Rendezvous(host=host, port=int(port), group=group), rank,
                                            len(view.members))
        except (PeerFailure, RuntimeError, OSError) as e:
            # RuntimeError, OSError: the rendezvous store cannot be reached (torch's DistNetworkError), e.g. the
            # coordinator that holds it restarted after sending the view. The try fails; the node lives (it died
            # here before 2026-12-07 with the tcp and zmq transports, which reach the store in their constructor).
            log.warning("could not build the group of epoch %d: %s", view.epoch, e)
            first_line = str(e).partition("\n")[0]  # torch's store errors run over many lines
            reason = e.reason if isinstance(e, PeerFailure) else f"{type(e).__name__}: {first_line}"
            self._transport = _BrokenTransport(rank, len(view.members), f"group not built: {reason}")
        self._epoch = view.epoch

    def commit(self, step: int, attempt: int, ok: bool) -> bool:
        if not ok and self._transport is not None:
            # The try cannot be applied: every process of every member stops waiting on it now (abort.py), and
            # closing this try's group fails the neighbours waiting on this node at once (the next try builds a
            # new group anyway).
            self._watch.doom(self._store, self._try, f"node {self.node_id} local rank {self.local_rank} failed "
                                                     f"its part of outer step {step} try {attempt}")
            self._transport.close()
        ok = self._all_local(ok)
        unreachable = [] if ok else self._unreachable_nodes()
        try:
            applied = bool(self._on_rank0(lambda: self.client.commit(step, attempt, ok, unreachable=unreachable)))
        finally:
            self._watch.unwatch()
        # Probed once the caller is done with the group (idle): the caller still counts this outer step's traffic
        # after the commit (DiLoCo's hash comparison, a state sent in the background), and a probe started here
        # was counted there and again, through `_probed`, in the next round.
        self._probe_due = (applied and self._probe_bytes > 0 and self._probed_epoch != self._epoch
                           and len(self.view.members) > 2)
        return applied

    def idle(self) -> None:
        if self._probe_due:
            self._probe_due = False
            self._start_probe()

    def _unreachable_nodes(self) -> list[str]:
        """The members this node's transports of the try could not connect to (any local rank's), by node id: what
        the coordinator needs to find a node that nobody reaches (openprime.mesh.links)."""
        ranks = sorted(self._transport.unreachable) if self._transport is not None else []
        if self.local_group is not None:
            gathered = _all_gather_bytes(msgpack.packb(ranks), self.local_group)
            ranks = sorted({r for b in gathered for r in msgpack.unpackb(b, raw=False)})
        return [self.view.members[r] for r in ranks if r < len(self.view.members)]

    def abandon(self) -> None:
        # The same group serves the next outer step if the view does not change (the same epoch, a first try);
        # closed, it fails that try at once and the second try builds a new one.
        self._probe_due = False  # not over a closed group
        if self._transport is not None:
            self._transport.close()

    # ------------------------------------------------------------------ bandwidth for the ring order

    def _start_probe(self) -> None:
        """Measure the group's links once per epoch, in the background, until the next outer step."""
        self._probed_epoch = self._epoch
        transport, members = self._transport, self.view.members
        deadline = time.monotonic() + self._probe_timeout_s

        def run() -> None:
            try:
                rates = probe_bandwidth(transport, self._probe_bytes, deadline=deadline, moved=self._probed)
                self._measured = {members[rank]: rate for rank, rate in rates.items()}
            except PeerFailure as e:
                log.info("bandwidth probe of epoch %d stopped: %s", self._epoch, e)

        self._probe = threading.Thread(target=run, name="openprime-probe", daemon=True)
        self._probe.start()

    def _probe_results(self) -> dict[str, float] | None:
        if self._probe is not None:
            self._probe.join(timeout=self._probe_timeout_s)
            self._probe = None
        measured, self._measured = self._measured, {}
        return measured or None

    def close(self) -> None:
        self._watch.close()
        self._probe_results()
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self.client is not None:
            self.client.close()


# ---------------------------------------------------------------- bytes through the node's local group
# Messages between a node's local ranks are msgpack bytes carried in uint8 tensors (no pickle, as on the
# wire between nodes): first each length, then the bytes, padded to the longest for the all-gather.


def _donor_rank(view: View, old: list[int]) -> int:
    """The rank that sends the new nodes the state: the view's donor (the coordinator picks one that reached them,
    blame.py), else the first member that holds the state."""
    if view.donor in view.members and view.donor not in view.new:
        return view.rank_of(view.donor)
    return old[0] if old else 0


def _broadcast_bytes(data: bytes, local_rank: int, group) -> bytes:
    """Local rank 0's `data` on every local rank (the others' `data` is ignored)."""
    length = torch.tensor([len(data) if local_rank == 0 else 0], dtype=torch.int64)
    torch.distributed.broadcast(length, group_src=0, group=group)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if local_rank == 0
           else torch.empty(int(length), dtype=torch.uint8))
    torch.distributed.broadcast(buf, group_src=0, group=group)
    return buf.numpy().tobytes()


def _all_gather_bytes(data: bytes, group) -> list[bytes]:
    """Every local rank's `data`, in local-rank order, on every local rank."""
    size = torch.distributed.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    torch.distributed.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64), group=group)
    longest = max(int(n) for n in lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
    torch.distributed.all_gather(bufs, mine, group=group)
    return [buf[:int(n)].numpy().tobytes() for buf, n in zip(bufs, lengths, strict=True)]
