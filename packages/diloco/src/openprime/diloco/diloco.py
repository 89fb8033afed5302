"""DiLoCo around an ordinary training loop (INTELLECT-1 paper, section 2.1; Douillard et al., 2023).

The user's loop is unchanged: forward, backward, `inner_opt.step()`, and then `diloco.step()`, which
counts inner steps and, every `num_inner_steps`, runs the outer step. One outer step is one or more
tries, each decided by the `Membership` (openprime.core.membership; static, or the elastic mesh):

1. `begin`: wait at the barrier; get this try's group. Members without the state (admitted now, or
   whose transfer broke) get it from a donor (openprime.diloco.recovery: blocking, or non-blocking
   after the commit) and take part with a zero pseudo-gradient (non-contributing).
2. delta = theta_global - theta_local on the host (openprime.diloco.outer.OuterState), or, with a compressing
   codec (int8) on an accelerator, on the parameters' device, where the codec then runs
   (config.pseudo_gradient_device).
3. the members agree how many of them contribute; a ring all-reduce sums the pseudo-gradients.
4. `commit`: apply only if every member's all-reduce succeeded; otherwise every survivor tries again
   (the input is recomputed; nothing was applied). After the configured tries the membership skips
   the step on every node alike: a node never applies its own un-averaged delta.
   A replica whose pseudo-gradient holds NaN or inf (its inner training blew up), or whose loop says it
   is unhealthy (`step(contribute=False)`), contributes zero like a joiner: one replica's divergence
   never reaches the global weights, and the outer step brings it back to the others' average.
5. the mean divides by the contributors, the outer optimizer updates theta_global, which is copied
   back into the model, and the hashes of the global state are compared (ReplicaDivergence on a
   mismatch; PRIME could drift silently).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable

import attrs
import torch

from openprime.core.codec import Codec, Float32Codec
from openprime.core.collectives import RingBuffers, all_gather_object, ring_all_reduce
from openprime.core.errors import PeerFailure, ReplicaDivergence
from openprime.core.membership import Membership, Round, StaticMembership
from openprime.core.state_transfer import StateCorrupt
from openprime.core.timeouts import Timeouts
from openprime.core.transport import Transport
from openprime.diloco.config import DiLoCoConfig, OuterLrSchedule, PseudoGradientDevice, RecoveryMode
from openprime.diloco.outer import OuterState, outer_update_
from openprime.diloco.recovery import ExtraState, Recovery

log = logging.getLogger("openprime.diloco")


@attrs.frozen
class OuterStepResult:
    """What one outer step did, for metrics and logs."""

    outer_step: int
    num_contributors: int
    num_members: int
    num_tries: int
    skipped: bool
    received_state: bool  # this node was new: it took the global state and step counters from a donor
    contributed: bool  # this node's pseudo-gradient was in the mean (not a joiner's, withheld or non-finite one)
    state_hash: str
    bytes_sent: int
    bytes_received: int
    all_reduce_s: float
    total_s: float


class DiLoCo:
    """The DiLoCo outer loop for the parameters of one replica (one node, or one shard of it)."""

    def __init__(self, params: Iterable[torch.Tensor], *, config: DiLoCoConfig, timeouts: Timeouts,
                 transport: Transport | None = None, membership: Membership | None = None,
                 codec: Codec | None = None, joining: bool = False, extra: ExtraState | None = None,
                 lr_factor: Callable[[int], float] | None = None) -> None:
        """`lr_factor`: the inner schedule's lr over its peak at an inner step (0-based: a LambdaLR's lambda), for
        outer_lr_schedule=follow_inner. A function of the step, not of this node's scheduler: a joiner learns the
        run's step when it receives the state, in the outer step it applies with the others."""
        if (transport is None) == (membership is None):
            raise ValueError("DiLoCo takes either a transport (a static group) or a membership, not both")
        if config.outer_lr_schedule is OuterLrSchedule.FOLLOW_INNER and lr_factor is None:
            raise ValueError("diloco.outer_lr_schedule=follow_inner needs the inner schedule: pass "
                             "DiLoCo(..., lr_factor=lambda inner_step: ...), e.g. a LambdaLR's "
                             "lr_lambdas[0]")
        self._lr_factor = lr_factor if config.outer_lr_schedule is OuterLrSchedule.FOLLOW_INNER else None
        self.config = config
        self.membership = membership or StaticMembership(transport)
        self.timeouts = timeouts
        self.codec = codec or Float32Codec()
        self.state = OuterState([p for p in params if p.requires_grad])
        self._delta_device = _delta_device(config.pseudo_gradient_device, self.state.device, self.codec)
        self.num_inner_steps_done = 0
        self.num_outer_steps_done = 0
        # Reported at each barrier for the state after the previous outer step (-1: the initial weights),
        # so the coordinator compares replicas; a joiner has nothing to report until it got the state.
        self._last_hash: str | None = None if joining else self.state.state_hash()
        self._received_state = False  # in this outer step (the result's received_state)
        # Holds a donor's state and has not trained an inner step since: its pseudo-gradient is zero, not its own.
        # Kept across syncs (a try that failed after the transfer, an eviction and the rejoin's next sync).
        self._untrained_state = False
        self._awaits_later_send = False  # a non-blocking joiner whose fetch of this try asked for the state later
        self._contributed = False
        self.recovery = Recovery(self.state, config.recovery, extra)
        self._ring_buffers = RingBuffers()  # kept across outer steps: no fresh receive buffers each time
        self._donate_later: list[int] = []
        # A non-blocking joiner that received the state after a commit has not trained this outer step's
        # inner steps: it should `sit_out` the next outer step rather than make everyone wait for it.
        self.behind = False
        self._agreed_hash: str | None = None

    @property
    def outer_lr(self) -> float:
        """The outer learning rate of the outer step at `num_inner_steps_done` (every replica computes the same,
        a joiner once it holds the state and the run's counters, before it applies the step with the others).
        follow_inner: scaled by the inner lr of the last inner step that fed the pseudo-gradient. The factor of the
        step after it was 0 at the run's end (the schedule's end), and the last outer step was thrown away."""
        if self._lr_factor is None:
            return self.config.outer_lr
        return self.config.outer_lr * self._lr_factor(max(self.num_inner_steps_done - 1, 0))

    @property
    def has_state(self) -> bool:
        """False for a joiner until it received the global state from a donor."""
        return self._last_hash is not None

    @property
    def state_hash(self) -> str | None:
        """The hash of the global state (this process's shard of it) after the last outer step, which every member
        compared and agreed on; None for a joiner without the state."""
        return self._last_hash

    def state_dict(self) -> dict[str, torch.Tensor | int]:
        """The global weights, outer momentum and step counters: what a checkpoint keeps of the outer loop.

        The tensors are the live host buffers (a checkpointer snapshots them before training goes on).
        """
        return {"theta": self.state.theta, "momentum": self.state.momentum,
                "num_inner_steps_done": self.num_inner_steps_done, "num_outer_steps_done": self.num_outer_steps_done}

    def load_state_dict(self, state: dict[str, torch.Tensor | int]) -> None:
        """Continue from a checkpoint: the global state goes into the host buffers and the model."""
        for name in ("theta", "momentum"):
            if state[name].shape != getattr(self.state, name).shape:
                raise ValueError(f"DiLoCo.load_state_dict: {name} has {state[name].numel()} elements but this "
                                 f"model has {self.state.numel}; it was saved from another model")
        self.state.theta.copy_(state["theta"])
        self.state.momentum.copy_(state["momentum"])
        self.state.copy_to_params()
        self.num_inner_steps_done = int(state["num_inner_steps_done"])
        self.num_outer_steps_done = int(state["num_outer_steps_done"])
        self._last_hash = self.state.state_hash()

    def rejoin(self, membership: Membership) -> None:
        """Continue under a new membership as a newcomer (after an eviction), keeping the state and reporting it:
        the coordinator lists a joiner of a run with live members as new (it then takes their state, as a node
        resumed from an older checkpoint does), and a run whose members were all evicted at once (the coordinator's
        own link down longer than the eviction timeout) goes on with the state they rejoin with. Until 2026-12-07 the
        state was dropped here, and after such an outage every node rejoined without it and was refused: the live
        run ended although every node held the same global state."""
        self.membership = membership
        self.behind = False

    def step(self, *, contribute: bool = True) -> OuterStepResult | None:
        """Count one inner step; run the outer step when `num_inner_steps` have passed since the last.

        `contribute=False` withholds this replica's pseudo-gradient from that outer step (the loop's last
        inner steps produced no finite gradient: its weights are suspect even where they are finite).
        """
        self.num_inner_steps_done += 1
        self._untrained_state = False  # an inner step trained since the state came: its pseudo-gradient is its own
        if self.num_inner_steps_done % self.config.num_inner_steps:
            return None
        return self.sync(contribute=contribute)

    def _deadline(self, transport: Transport) -> float:
        return time.monotonic() + self.timeouts.collective_s(transport.world_size)

    def _after_transfers(self, rnd: Round, num_before: int) -> float:
        """A collective's deadline plus `num_before` state transfers (Recovery.transfer_s): a joiner's wait for
        its offer (the donor serves the new ranks in order), and every member's wait for a try's transfers."""
        return self._deadline(rnd.transport) + num_before * self.recovery.transfer_s(self.timeouts)

    def sit_out(self) -> OuterStepResult:
        """A non-blocking joiner that just got the state: count the outer step's inner steps it did not train
        and take part in that outer step with a zero pseudo-gradient (paper, section 2.2)."""
        self.num_inner_steps_done += self.config.num_inner_steps
        self.behind = False
        return self.sync(contribute=False)

    def sync(self, *, contribute: bool = True) -> OuterStepResult:
        """Run one outer step now. With `contribute=False` this node sends a zero pseudo-gradient."""
        # A non-blocking joiner's state, sent in the background since the last commit, counts in this outer step:
        # its bytes, and the wait for the send to end (network time, not compute).
        start = time.monotonic()
        sent, received = self.recovery.finish_background(), 0
        step, attempt = self.num_outer_steps_done, 0
        self._received_state = False
        self._contributed = False
        while True:
            rnd = self.membership.begin(step, attempt, state_hash=self._last_hash, hash_step=step - 1)
            step, attempt, t = rnd.step, rnd.attempt, rnd.transport  # a newcomer learns where the run is
            sent, received = sent + rnd.side_bytes_sent, received + rnd.side_bytes_received  # bandwidth probes
            if t.rank in rnd.new_ranks:
                # Listed as new: this member takes the state from the donor, even one that holds a state of its
                # own (a node whose other local ranks lost theirs, or one resumed from a checkpoint that joined
                # a run under way: the live run is the authority).
                self._last_hash = None
            sent0, received0 = t.bytes_sent, t.bytes_received
            if rnd.skip:
                log.warning("outer step %d skipped after %d failed tries", step, attempt)
                self.num_outer_steps_done = step + 1
                return self._result(step, 0, t.world_size, attempt, True, sent, received, 0.0, start)
            ok, num_contributors, all_reduce_s = self._try(rnd, contribute)
            sent += t.bytes_sent - sent0
            received += t.bytes_received - received0
            if self.membership.commit(step, attempt, ok):
                break
            attempt += 1
        if not num_contributors and self.has_state:
            log.warning("outer step %d: no member contributed a pseudo-gradient; the global weights stay as they "
                        "were and every replica goes back to them", step)
        if num_contributors and self.has_state:
            self.state.delta.div_(num_contributors)
            outer_update_(self.state.theta, self.state.momentum, self.state.delta, lr=self.outer_lr,
                          mu=self.config.outer_momentum, optimizer=self.config.outer_optimizer)
        if self.has_state:
            self.state.copy_to_params()
        self.num_outer_steps_done = step + 1
        sent0, received0 = t.bytes_sent, t.bytes_received
        self._last_hash = self._verify(t)  # the hashes' all-gather: bytes of this outer step too
        sent, received = sent + t.bytes_sent - sent0, received + t.bytes_received - received0
        received_before = self.recovery.bytes_received
        self._after_commit(rnd)  # a non-blocking joiner receives the state here
        received += self.recovery.bytes_received - received_before
        self.membership.idle()  # this outer step's traffic is counted: the membership may probe the links now
        return self._result(step, num_contributors, t.world_size, attempt + 1, False, sent, received, all_reduce_s,
                            start)

    def _try(self, rnd: Round, contribute: bool) -> tuple[bool, int, float]:
        """State to the newcomers, then the all-reduce of this try; (succeeded, contributors, seconds)."""
        t = rnd.transport
        self._donate_later = []
        self._contributed = self._awaits_later_send = False
        try:
            if rnd.new_ranks:
                self._transfer_state(rnd)
            # A node that received the state and has not trained since (in an earlier try of this outer step,
            # which failed after its transfer; or before an eviction of every member, in the sync of its rejoin)
            # holds the others' weights, not a pseudo-gradient of its own: counted, it would divide the sum by one
            # node too many (the rejoin's case found 2026-12-07 by review).
            contributing = (contribute and self.has_state and t.rank not in rnd.new_ranks
                            and not self._untrained_state)
            delta = self.state.compute_pseudo_gradient(self._delta_device)
            if contributing and not summable(delta, t.world_size):
                log.warning("outer step %d: this replica's pseudo-gradient holds NaN, inf or values past fp32's "
                            "maximum over %d members (its inner training diverged); it contributes zero and takes "
                            "the others' average", rnd.step, t.world_size)
                contributing = False
            if not contributing:
                delta.zero_()
            # Everyone waits here for the transfers of the try (blocking recovery, or a non-blocking joiner
            # finishing a background transfer that broke): each is bounded while it moves, not cut short.
            flags = all_gather_object(t, contributing, deadline=self._after_transfers(rnd, len(rnd.new_ranks)))
            self._contributed = contributing
            reduce_start = time.monotonic()
            # No backup copy of delta: a failed try recomputes it from theta and the parameters.
            ring_all_reduce(t, delta, deadline=self._deadline(t), codec=self.codec, restore_on_failure=False,
                            buffers=self._ring_buffers)
            if delta is not self.state.delta:
                self.state.delta.copy_(delta)  # the sum, to the host, where the outer step runs
            return True, sum(bool(f) for f in flags), time.monotonic() - reduce_start  # delta holds the sum
        except (PeerFailure, StateCorrupt) as e:
            log.warning("outer step all-reduce failed on rank %d: %s", t.rank, e)
            return False, 0, 0.0

    def _counters(self) -> dict[str, int]:
        return {"num_inner_steps_done": self.num_inner_steps_done, "num_outer_steps_done": self.num_outer_steps_done}

    def _transfer_state(self, rnd: Round) -> None:
        """In the try: the donor offers the state to the members without it; blocking joiners take it now."""
        t = rnd.transport
        if t.rank == rnd.donor_rank:
            self._donate_later = self.recovery.donate(t, rnd.new_ranks, timeouts=self.timeouts,
                                                      counters=self._counters(), state_hash=self._last_hash)
        elif t.rank in rnd.new_ranks and not self.has_state:
            later = self.config.recovery is RecoveryMode.NON_BLOCKING
            before = rnd.new_ranks.index(t.rank)  # the donor serves the new ranks in order
            self._install(self.recovery.receive(t, rnd.donor_rank, deadline=self._after_transfers(rnd, before),
                                                op_s=self.timeouts.op_s, later=later, expected_hash=rnd.state_hash))
            self._awaits_later_send = self.recovery.fetch.asked_later

    def _after_commit(self, rnd: Round) -> None:
        """Non-blocking recovery: the donor sends the new state in the background; the joiner receives it."""
        t = rnd.transport
        if self._donate_later:
            ranks, self._donate_later = self._donate_later, []
            self.recovery.donate_later(t, ranks, timeouts=self.timeouts, counters=self._counters(),
                                       state_hash=self._last_hash)
        elif t.rank in rnd.new_ranks and not self.has_state and self._awaits_later_send:
            # Only a joiner that asked for the state later is sent it now. One that held part of the offer asked
            # for the rest in the try; if that came incomplete (a corrupt chunk), no send follows: it waited for
            # one to its deadline (2(n - 1) x op_s) and closed the group, which cost everyone the next outer step's
            # first try (found 2026-12-07 by review). It finishes at the next barrier, listed as new again.
            try:
                before = rnd.new_ranks.index(t.rank)  # the donor sends to the new ranks in order
                self._install(self.recovery.receive(t, rnd.donor_rank, deadline=self._after_transfers(rnd, before),
                                                    op_s=self.timeouts.op_s, later=False,
                                                    expected_hash=self._agreed_hash))
                self.behind = self.has_state
            except (PeerFailure, StateCorrupt) as e:  # the next barrier finds it without state again
                log.warning("receiving the state from rank %d failed: %s; finishing it at the next outer step",
                            rnd.donor_rank, e)
                # Not on this transport: receives of the failed transfer may still be posted on it, and would take
                # (and count) the donor's next state messages. Closed, it fails the next outer step's first try at
                # once (the others still hold their end of it) and the retry builds a new group for every member.
                self.membership.abandon()

    def _install(self, meta: dict | None) -> None:
        if meta is None:
            return
        self.num_inner_steps_done = int(meta["num_inner_steps_done"])
        self.num_outer_steps_done = int(meta["num_outer_steps_done"])
        self._received_state = self._untrained_state = True
        self._last_hash = meta["state_hash"]  # checked against the received bytes by Recovery.receive

    def _verify(self, t: Transport) -> str | None:
        """Compare the hash of the global state across the members; raise ReplicaDivergence if any differs."""
        mine = self.state.state_hash() if self.has_state else None  # a joiner still without state: no vote
        try:
            hashes = all_gather_object(t, mine, deadline=self._deadline(t))
        except PeerFailure as e:
            # A member left after applying; the coordinator still compares the hashes at the next barrier. The
            # members waiting on this one in the comparison must not wait out its deadline (2(n-1) x op_s).
            log.warning("could not compare state hashes after outer step %d: %s", self.num_outer_steps_done, e)
            self.membership.abandon()
            return mine
        voted = {h for h in hashes if h is not None}
        self._agreed_hash = next(iter(voted)) if len(voted) == 1 else None  # what a non-blocking joiner checks
        if len(voted) > 1:
            listing = ", ".join(f"rank {r}: {h}" for r, h in enumerate(hashes))
            raise ReplicaDivergence(
                f"global state differs across replicas after outer step {self.num_outer_steps_done} ({listing})"
            )
        return mine

    def _result(self, step: int, num_contributors: int, num_members: int, num_tries: int, skipped: bool,
                sent: int, received: int, all_reduce_s: float, start: float) -> OuterStepResult:
        return OuterStepResult(outer_step=step + 1, num_contributors=num_contributors, num_members=num_members,
                               num_tries=num_tries, skipped=skipped, received_state=self._received_state,
                               contributed=self._contributed and not skipped,
                               state_hash=self._last_hash or "",
                               bytes_sent=sent, bytes_received=received, all_reduce_s=all_reduce_s,
                               total_s=time.monotonic() - start)


_FP32_MAX = float(torch.finfo(torch.float32).max)


def summable(x: torch.Tensor, num_members: int) -> bool:
    """Whether x can go into a sum over `num_members` replicas without overflowing fp32: every |value| at most
    fp32's maximum / num_members. Then every partial sum of the ring (k addends, each so bounded) is finite, and
    so is its int8 encoding (a bucket decodes to the mean of its values). A finite pseudo-gradient past that
    (1.2e38 at 3 members) summed to inf in fp32 and reached every replica's weights, and stopped the int8 encoder
    of the hop where it overflowed with an error (the node died, the others timed out). One reduction pass:
    max |x| propagates NaN, and no boolean copy of x is made."""
    if x.numel() == 0:
        return True
    max_abs = float(torch.linalg.vector_norm(x, float("inf")))
    return math.isfinite(max_abs) and max_abs <= _FP32_MAX / num_members


def _delta_device(where: PseudoGradientDevice, params_device: torch.device, codec: Codec) -> torch.device | None:
    """Where the outer step computes the pseudo-gradient: None for the host buffer, else a device.

    auto: on the parameters' accelerator when the codec compresses (int8: the GPU quantizes, one byte a
    parameter crosses to the host); fp32 gains nothing there, since all four bytes cross either way.
    """
    if where is PseudoGradientDevice.AUTO:
        compresses = not isinstance(codec, Float32Codec)
        where = PseudoGradientDevice.PARAMS if params_device.type != "cpu" and compresses else PseudoGradientDevice.HOST
    return params_device if where is PseudoGradientDevice.PARAMS else None
