"""Data parallel across nodes, the baseline DiLoCo is measured against (INTELLECT-1, section 2.3).

Every inner step, after backward and before AdamW, the nodes sum their gradients with the same fp32 ring
all-reduce over the same transports that DiLoCo uses, and divide by the number of nodes: each node then
takes the step that one process training on the global batch would take. Per inner step each node sends
2 (n - 1) / n x 4 bytes per parameter, i.e. H times DiLoCo fp32's traffic, and 4 H times DiLoCo int8's: the
400x of the paper at H = 100.

Every step is an outer step of the membership (openprime.mesh): a barrier at the coordinator, a group,
commit or retry without a failed node, and the hash of the weights compared across replicas. A node
cannot join a data-parallel run under way (it would need the weights and AdamW state, which only DiLoCo's
live recovery sends); such a node stops with an error that says so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import attrs
import torch
import xxhash
from torch.distributed.tensor import DTensor

from openprime.core.collectives import RingBuffers, ring_all_reduce
from openprime.core.errors import OpenPrimeError, PeerFailure
from openprime.core.membership import Membership
from openprime.core.timeouts import Timeouts
from openprime.diloco import OuterStepResult

log = logging.getLogger("openprime.train.data_parallel")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class GradientAllReduce:
    """Sums the gradients of `params` over the live nodes at every inner step."""

    def __init__(self, params: Sequence[torch.nn.Parameter], *, membership: Membership, timeouts: Timeouts,
                 joining: bool) -> None:
        if joining:
            raise OpenPrimeError("this node started while a data-parallel run (train.strategy=data_parallel) was "
                                 "under way; data parallel cannot hand a newcomer its state: start every node at "
                                 "the beginning, or use train.strategy=diloco")
        self.params = [p for p in params if p.requires_grad]
        self.membership, self.timeouts = membership, timeouts
        self.flat = torch.zeros(sum(_local(p).numel() for p in self.params), dtype=torch.float32)
        self._buffers = RingBuffers()
        self.num_inner_steps_done = 0
        self._result: OuterStepResult | None = None
        self._hash: str | None = None  # of the weights after the last step (the next sync reports it): one a step

    @property
    def num_outer_steps_done(self) -> int:
        return self.num_inner_steps_done

    def weights_hash(self) -> str:
        """XXH3-128 of this rank's weights: equal on every replica when data parallel works."""
        h = xxhash.xxh3_128()
        for p in self.params:
            h.update(_local(p.detach()).float().contiguous().cpu().numpy())
        return h.hexdigest()

    def sync(self) -> None:
        """Between backward and the optimizer step: replace every gradient by its mean over the nodes."""
        start, step, attempt = time.monotonic(), self.num_inner_steps_done, 0
        sent = received = 0
        while True:
            if self._hash is None:  # the first step of this process: the initial or restored weights
                self._hash = self.weights_hash()
            rnd = self.membership.begin(step, attempt, state_hash=self._hash, hash_step=step - 1)
            t = rnd.transport
            sent, received = sent + rnd.side_bytes_sent, received + rnd.side_bytes_received  # bandwidth probes
            sent0, received0 = t.bytes_sent, t.bytes_received
            if rnd.skip:
                raise OpenPrimeError(f"the gradient all-reduce of step {step + 1} failed {attempt} times on every "
                                     "node; data parallel cannot skip a step (the replicas would differ)")
            self._gather_gradients()
            reduce_start = time.monotonic()
            try:
                ring_all_reduce(t, self.flat, deadline=time.monotonic() + self.timeouts.collective_s(t.world_size),
                                restore_on_failure=False, buffers=self._buffers)
                ok = True
            except PeerFailure as e:
                log.warning("gradient all-reduce of step %d failed: %s", step + 1, e)
                ok = False
            all_reduce_s = time.monotonic() - reduce_start
            sent += t.bytes_sent - sent0
            received += t.bytes_received - received0
            if self.membership.commit(step, attempt, ok):
                break
            attempt += 1
        self.membership.idle()  # this step's traffic is counted: the membership may probe the links now
        self.flat.div_(t.world_size)
        self._scatter_gradients()
        self._result = OuterStepResult(outer_step=step + 1, num_contributors=t.world_size, num_members=t.world_size,
                                       num_tries=attempt + 1, skipped=False, received_state=False, contributed=True,
                                       state_hash="", bytes_sent=sent, bytes_received=received,
                                       all_reduce_s=all_reduce_s, total_s=time.monotonic() - start)

    def step(self) -> OuterStepResult:
        """After the optimizer step: count it and return what its all-reduce did, with the hash of the weights it
        made (the record of outer step s carries the state after s, as DiLoCo's does; the hash the next sync's
        barrier compares, so hashing stays once a step)."""
        assert self._result is not None, "GradientAllReduce.sync() runs between backward and the optimizer step"
        self.num_inner_steps_done += 1
        self._hash = self.weights_hash()
        result, self._result = attrs.evolve(self._result, state_hash=self._hash), None
        return result

    def _gather_gradients(self) -> None:
        offset = 0
        for p in self.params:
            n = _local(p).numel()
            if p.grad is None:
                self.flat[offset:offset + n].zero_()
            else:
                self.flat[offset:offset + n].copy_(_local(p.grad).reshape(-1))
            offset += n

    def _scatter_gradients(self) -> None:
        offset = 0
        for p in self.params:
            n = _local(p).numel()
            if p.grad is not None:
                _local(p.grad).copy_(self.flat[offset:offset + n].view_as(_local(p.grad)))
            offset += n
