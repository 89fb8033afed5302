"""Live recovery inside the outer step: a donor brings a joining node up to date (paper, section 2.2).

At a barrier, the members that report no state (new nodes, or nodes whose earlier transfer broke) are
the view's `new_ranks`; its `donor_rank` offers them the state over the try's transport with
openprime.core.state_transfer (chunked, checksummed, resumable from another donor). What travels: the
global weights and outer momentum (shared: identical on every replica), the step counters, and the
donor's own node state if the caller provides it (`ExtraState`: the inner optimizer), which the joiner
adopts as a warm start.

Two modes (DiLoCoConfig.recovery):
- BLOCKING: the transfer happens in the try, before the all-reduce; the other members wait. The joiner
  then takes part in this outer step with a zero pseudo-gradient and applies it like everyone.
- NON_BLOCKING: in the try the joiner only takes the offer and asks for the state "later"; it takes part
  in the all-reduce with a zero pseudo-gradient but applies nothing. After the commit the donor sends the
  new state from a background thread while everyone trains; the joiner receives it, sits out one outer
  step (it has not trained) and enters the next one contributing a zero pseudo-gradient. If the donor dies
  mid-transfer, the joiner reports no state at the next barrier and finishes from the next donor
  (in the try, the remaining chunks only). If the joiner dies, the donor's background send fails, is
  logged, and nothing else happens.

Deadlines (openprime.core.timeouts): the offer and the joiner's answer have a collective's; then each chunk has
IN_FLIGHT x op_s from when it is posted (state_transfer.chunk_deadline). A transfer that moves is never cut
short, however long the state takes (INTELLECT-1: 30-60 minutes; until 2026-12-04 the whole transfer had one
all-reduce's deadline, 4 minutes for 2 nodes at op_s = 120 s, so a large state never arrived and, in blocking
mode, every outer step was skipped while the joiner lived), and one that stalls fails within IN_FLIGHT x op_s.
Members that wait for a try's transfers allow `Recovery.transfer_s` for each.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from openprime.core.errors import OpenPrimeError
from openprime.core.state_transfer import SendReport, StateFetch, StateOffer, num_messages, send_state
from openprime.core.timeouts import Timeouts
from openprime.core.transport import Transport
from openprime.diloco.config import RecoveryMode
from openprime.diloco.outer import OuterState

log = logging.getLogger("openprime.diloco.recovery")


class ExtraState(ABC):
    """A node's own state beyond the global weights that a joiner takes from its donor (inner optimizer)."""

    @abstractmethod
    def own_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors by name, msgpack-able metadata) of this node now."""

    @abstractmethod
    def load_own_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Adopt a donor's `own_state`."""


class Recovery:
    """Both sides of live recovery for one DiLoCo replica."""

    def __init__(self, state: OuterState, mode: RecoveryMode, extra: ExtraState | None = None) -> None:
        self.state, self.mode, self.extra = state, mode, extra
        self.origin = uuid.uuid4().hex  # which donor the own state came from: chunks of it are not mixed
        self.fetch = self._new_fetch()
        self.num_donated = 0
        self.bytes_received = 0  # state chunk bytes received as a joiner, over the replica's life
        self._background: threading.Thread | None = None
        self._background_deadline = 0.0
        self._background_bytes = 0  # state bytes the background thread sent (read after it is joined)

    def _new_fetch(self) -> StateFetch:
        """A joiner's fetch that receives theta and momentum straight into the host buffers."""
        return StateFetch(targets={"theta": self.state.theta, "momentum": self.state.momentum})

    # ------------------------------------------------------------------ donor

    def _offer(self, counters: dict[str, int], state_hash: str, *, snapshot: bool) -> StateOffer:
        own, meta = self.extra.own_state() if self.extra is not None else ({}, {})
        if snapshot:  # sent while training changes them
            own = {k: v.detach().clone() for k, v in own.items()}
        # The origin names this donor's own state as of its inner step: a joiner keeps own chunks across offers only
        # from the same one. A non-blocking donor whose background transfer broke offers again at the next barrier,
        # at the same outer step and hash but H inner steps later: with the donor's id alone the joiner kept the
        # snapshot's optimizer chunks and took the rest from the live optimizer state. A blocking retry (no inner
        # step between the tries) keeps them.
        origin = f"{self.origin}@{counters['num_inner_steps_done']}"
        return StateOffer(step=counters["num_outer_steps_done"], origin=origin,
                          state_hash=state_hash, shared={"theta": self.state.theta, "momentum": self.state.momentum},
                          own=own, meta={**counters, "extra": meta}, shared_digests=self.state.shared_digests())

    def transfer_s(self, timeouts: Timeouts) -> float:
        """How long one transfer of this replica's state may take while it moves: `timeouts.transfer_s` of its
        messages. The own state (the inner optimizer's) is counted as large as theta and momentum together, which
        AdamW's two moments are, since a joiner that has not trained holds none yet."""
        shared = self.state.theta.nbytes + self.state.momentum.nbytes
        # + 2: the optimizer's step counters beside its moments may add a chunk to each part of the estimate.
        return timeouts.transfer_s(num_messages(shared, shared if self.extra is not None else 0) + 2)

    @staticmethod
    def _send(t: Transport, rank: int, offer: StateOffer, timeouts: Timeouts) -> SendReport:
        """`send_state` to one joiner: a collective's deadline for the offer and its answer, and each chunk
        IN_FLIGHT x `op_s` from when it is posted (state_transfer.chunk_deadline)."""
        return send_state(t, rank, offer, deadline=time.monotonic() + timeouts.collective_s(t.world_size),
                          op_s=timeouts.op_s)

    def donate(self, t: Transport, ranks: Sequence[int], *, timeouts: Timeouts, counters: dict[str, int],
               state_hash: str) -> list[int]:
        """In the try: offer the state (whose hash the caller knows) to each joiner and send what it asks for
        now; returns those that asked for it after the commit (non-blocking). Each joiner has a collective's
        deadline for the offer and its answer, and each chunk IN_FLIGHT x `timeouts.op_s` from when it is posted
        (state_transfer.chunk_deadline)."""
        offer = self._offer(counters, state_hash, snapshot=False)
        later = []
        for rank in ranks:
            report = self._send(t, rank, offer, timeouts)
            self.num_donated += report.num_chunks
            if report.later:
                later.append(rank)
            elif report.num_chunks:
                log.info("sent %d chunks (%.1f MB) of the state to rank %d in %.2fs", report.num_chunks,
                         report.num_bytes / 1e6, rank, report.seconds)
        return later

    def donate_later(self, t: Transport, ranks: Sequence[int], *, timeouts: Timeouts, counters: dict[str, int],
                     state_hash: str) -> None:
        """After the commit: send the new state to the non-blocking joiners from a background thread, with the
        deadlines of `donate`."""
        offer = self._offer(counters, state_hash, snapshot=True)

        def run() -> None:
            for rank in ranks:
                try:
                    report = self._send(t, rank, offer, timeouts)
                    self.num_donated += report.num_chunks
                    self._background_bytes += report.num_bytes
                    log.info("sent the state of outer step %d to rank %d in the background (%.1f MB, %.2fs)",
                             offer.header["step"], rank, report.num_bytes / 1e6, report.seconds)
                except OpenPrimeError as e:  # the joiner died: nothing else is affected
                    log.warning("background state transfer to rank %d failed: %s", rank, e)

        self._join_background()
        self._background_deadline = time.monotonic() + len(ranks) * (
            timeouts.collective_s(t.world_size) + self.transfer_s(timeouts))
        self._background = threading.Thread(target=run, name="diloco-donate", daemon=True)
        self._background.start()

    def finish_background(self) -> int:
        """Wait for a background send (bounded by its deadline) before the transport is used or replaced; returns
        the state bytes it sent (a non-blocking joiner's state, sent after the commit: the caller counts them in
        its next outer step)."""
        if not self._join_background():
            return 0  # still writing its count
        sent, self._background_bytes = self._background_bytes, 0
        return sent

    def _join_background(self) -> bool:
        """Wait for the background send, bounded by its deadline; False if it outlived it."""
        if self._background is not None:
            self._background.join(timeout=max(0.0, self._background_deadline - time.monotonic()) + 5.0)
            if self._background.is_alive():
                log.error("the background state transfer outlived its deadline; continuing without it")
                return False
            self._background = None
        return True

    # ------------------------------------------------------------------ joiner

    def receive(self, t: Transport, donor: int, *, deadline: float, op_s: float, later: bool,
                expected_hash: str | None = None) -> dict[str, Any] | None:
        """Take the donor's offer (by `deadline`) and the chunks still missing (each within a few `op_s`: see
        state_transfer.chunk_deadline); install the state once complete.

        Returns the offer's metadata (step counters, and the checked `state_hash`) when the state is complete
        and its hash checks out; None while it is incomplete. PeerFailure propagates (progress kept for the
        next donor).
        """
        fetch, before = self.fetch, self.fetch.num_bytes_fetched
        try:
            complete = fetch.fetch(t, donor, deadline=deadline, op_s=op_s, later=later, expected_hash=expected_hash)
        finally:
            self.bytes_received += fetch.num_bytes_fetched - before
        if not complete:
            return None
        header = self.fetch.header  # its state hash checked by the fetch against the theta and momentum received
        if any(self.fetch.tensors.get(name) is not getattr(self.state, name) for name in ("theta", "momentum")):
            shapes = {name: tuple(t.shape) for name, t in self.fetch.tensors.items() if name in ("theta", "momentum")}
            log.error("rank %d offered global weights and momentum of shapes %s where this model has %d elements: "
                      "another model; fetching again", donor, shapes, self.state.numel)
            self.fetch = self._new_fetch()
            return None
        self.state.adopt_digests(self.fetch.shared_digests())
        if self.extra is not None:
            own = {k: v for k, v in self.fetch.tensors.items() if k not in ("theta", "momentum")}
            self.extra.load_own_state(own, header["meta"]["extra"])
        self.state.copy_to_params()
        log.info("received the state of outer step %d from rank %d (%.1f MB in all, hash %s checked)", header["step"],
                 donor, fetch.num_bytes_fetched / 1e6, header["state_hash"][:12])
        meta = {**header["meta"], "state_hash": header["state_hash"]}
        self.fetch = self._new_fetch()
        return meta


__all__ = ["ExtraState", "Recovery", "RecoveryMode"]
