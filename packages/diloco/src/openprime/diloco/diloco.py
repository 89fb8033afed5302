"""DiLoCo around an ordinary training loop (INTELLECT-1 paper, section 2.1; Douillard et al., 2023).

The user's loop is unchanged: forward, backward, `inner_opt.step()`, and then `diloco.step()`, which
counts inner steps and, every `num_inner_steps`, runs the outer step:

1. delta = theta_global - theta_local on the host (openprime.diloco.outer.OuterState);
2. the nodes agree how many of them contribute (a joiner may send a zero pseudo-gradient);
3. a ring all-reduce sums the pseudo-gradients over the transport; the mean divides by the
   contributors, never by a stale world size;
4. the outer optimizer updates theta_global, which is copied back into the model;
5. every node hashes its global weights and outer momentum and the hashes are compared: a mismatch
   raises ReplicaDivergence (PRIME could drift silently).

If the all-reduce fails, PeerFailure propagates and nothing was applied: the global weights, the
momentum and the model are as they were, and the node never applies its own un-averaged delta.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import attrs
import torch

from openprime.core.codec import Codec, Float32Codec
from openprime.core.collectives import all_gather_object, ring_all_reduce
from openprime.core.errors import ReplicaDivergence
from openprime.core.timeouts import Timeouts
from openprime.core.transport import Transport
from openprime.diloco.config import DiLoCoConfig
from openprime.diloco.outer import OuterState, outer_update_


@attrs.frozen
class OuterStepResult:
    """What one outer step did, for metrics and logs."""

    outer_step: int
    num_contributors: int
    state_hash: str
    bytes_sent: int
    bytes_received: int
    all_reduce_s: float
    total_s: float


class DiLoCo:
    """The DiLoCo outer loop for the parameters of one replica (one node, or one shard of it)."""

    def __init__(self, params: Iterable[torch.Tensor], *, config: DiLoCoConfig, transport: Transport,
                 timeouts: Timeouts, codec: Codec | None = None) -> None:
        self.config = config
        self.transport = transport
        self.timeouts = timeouts
        self.codec = codec or Float32Codec()
        self.state = OuterState([p for p in params if p.requires_grad])
        self.num_inner_steps_done = 0
        self.num_outer_steps_done = 0

    def step(self) -> OuterStepResult | None:
        """Count one inner step; run the outer step when `num_inner_steps` have passed since the last."""
        self.num_inner_steps_done += 1
        if self.num_inner_steps_done % self.config.num_inner_steps:
            return None
        return self.sync()

    def _deadline(self) -> float:
        return time.monotonic() + self.timeouts.collective_s(self.transport.world_size)

    def sync(self, *, contribute: bool = True) -> OuterStepResult:
        """Run one outer step now. With `contribute=False` this node sends a zero pseudo-gradient."""
        start = time.monotonic()
        sent0, received0 = self.transport.bytes_sent, self.transport.bytes_received
        delta = self.state.compute_pseudo_gradient()
        if not contribute:
            delta.zero_()
        flags = all_gather_object(self.transport, contribute, deadline=self._deadline())
        num_contributors = sum(bool(f) for f in flags)
        reduce_start = time.monotonic()
        ring_all_reduce(self.transport, delta, deadline=self._deadline(), codec=self.codec)
        all_reduce_s = time.monotonic() - reduce_start
        if num_contributors:
            delta.div_(num_contributors)
            outer_update_(self.state.theta, self.state.momentum, delta, lr=self.config.outer_lr,
                          mu=self.config.outer_momentum, optimizer=self.config.outer_optimizer)
        self.state.copy_to_params()
        self.num_outer_steps_done += 1
        state_hash = self.verify_replicas()
        return OuterStepResult(
            outer_step=self.num_outer_steps_done,
            num_contributors=num_contributors,
            state_hash=state_hash,
            bytes_sent=self.transport.bytes_sent - sent0,
            bytes_received=self.transport.bytes_received - received0,
            all_reduce_s=all_reduce_s,
            total_s=time.monotonic() - start,
        )

    def verify_replicas(self) -> str:
        """Compare the hash of the global state across nodes; raise ReplicaDivergence if any differs."""
        mine = self.state.state_hash()
        hashes = all_gather_object(self.transport, mine, deadline=self._deadline())
        if len(set(hashes)) != 1:
            listing = ", ".join(f"rank {r}: {h}" for r, h in enumerate(hashes))
            raise ReplicaDivergence(
                f"global state differs across replicas after outer step {self.num_outer_steps_done} ({listing})"
            )
        return mine
