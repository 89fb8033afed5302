"""The offloaded outer state and the outer optimizer step (INTELLECT-1 paper, sections 2.1 and 2.4).

The global weights, the outer momentum and the pseudo-gradient are flat fp32 tensors in host memory,
so the accelerator holds no more than in ordinary training. Each parameter is a view into the flat
buffers, which lets one all-reduce carry the whole pseudo-gradient.

The outer update, with theta the global weights, m the outer momentum (zero at the start), mu the
outer momentum coefficient, eta the outer learning rate, and k the number of nodes that contributed
a pseudo-gradient delta_i = theta - theta_local_i this outer step:

    delta = (1/k) * sum_i delta_i               # mean over contributors, not over the world size
    m     = mu * m + delta                      # NESTEROV and MOMENTUM
    step  = delta + mu * m     (NESTEROV)       # Sutskever et al.'s form, as torch.optim.SGD does it
          = m                  (MOMENTUM)
          = delta              (SGD; m untouched)
    theta = theta - eta * step

With eta = 1 and SGD, theta becomes the mean of the replicas' weights; with one node it becomes the
node's own weights (plain training).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from openprime.core import digest
from openprime.core.transport import as_bytes
from openprime.diloco.config import OuterOptimizer

# Elements of the scratch buffer that holds lr x delta (and lr x mu x momentum) before theta takes them: 1 MiB that
# stays in cache, not a second copy of the weights (50M elements here: 0.06-0.09 s, as fast as the fused kernels
# within the noise; 4-16 MiB pieces fell out of cache and took 2-4x as long).
_SCRATCH_NUMEL = 1 << 18


def outer_update_(theta: torch.Tensor, momentum: torch.Tensor, delta: torch.Tensor, *, lr: float, mu: float,
                  optimizer: OuterOptimizer) -> None:
    """Apply one outer step in place to `theta` (and `momentum`), given the mean pseudo-gradient.

    Every product is rounded to fp32 before theta takes it, never fused into the subtraction: ATen's kernels with
    an `alpha` are fused multiply-adds in the AVX2 build (and wherever the compiler fuses them) and a multiply then an
    add in the default kernels of a CPU without AVX2 (ATEN_CPU_CAPABILITY=default, measured 2026-12), so
    `theta.sub_(delta, alpha=lr)` gave other bits for about 0.2% of the weights on such a node (a VM whose CPU model
    hides AVX2) and the replicas diverged at the first outer step. A product, a sum and a
    difference, each rounded once, are the same on every CPU and with any number of threads.
    """
    if optimizer is not OuterOptimizer.SGD:
        momentum.mul_(mu).add_(delta)  # alpha 1: the multiply by 1 is exact, so fused or not it rounds once
    # Flat views: the pieces below are element ranges (the host copies are flat already; a view costs nothing).
    theta, momentum, delta = theta.view(-1), momentum.view(-1), delta.view(-1)
    by = momentum if optimizer is OuterOptimizer.MOMENTUM else delta  # what theta moves by, times lr
    scratch = torch.empty(min(theta.numel(), _SCRATCH_NUMEL), dtype=theta.dtype, device=theta.device)
    for lo in range(0, theta.numel(), _SCRATCH_NUMEL):
        hi = min(lo + _SCRATCH_NUMEL, theta.numel())
        part, product = theta[lo:hi], scratch[: hi - lo]
        part.sub_(torch.mul(by[lo:hi], lr, out=product))
        if optimizer is OuterOptimizer.NESTEROV:
            part.sub_(torch.mul(momentum[lo:hi], lr * mu, out=product))


class OuterState:
    """Host fp32 copies of the global weights and outer momentum, and the pseudo-gradient buffer."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        # Under FSDP2 a parameter is a DTensor and this rank holds one shard of it: the host state covers
        # that shard only, and the all-reduce runs with the ranks of the other nodes that hold the same one.
        self.params = [_local(p) for p in params]
        self.numel = sum(p.numel() for p in self.params)
        self.theta = torch.empty(self.numel, dtype=torch.float32)
        self.momentum = torch.zeros(self.numel, dtype=torch.float32)
        self.delta = torch.empty(self.numel, dtype=torch.float32)
        self._theta_views = self._views(self.theta)
        self._delta_views = self._views(self.delta)
        self._digests: tuple[np.ndarray, tuple[int, int]] | None = None
        for view, p in zip(self._theta_views, self.params, strict=True):
            view.copy_(p.detach().reshape(-1))

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(flat, [p.numel() for p in self.params]))

    @property
    def device(self) -> torch.device:
        """The parameters' device (the host when there are none)."""
        return self.params[0].device if self.params else torch.device("cpu")

    def compute_pseudo_gradient(self, device: torch.device | None = None) -> torch.Tensor:
        """delta = theta_global - theta_local in fp32; returns the flat buffer.

        By default in the host buffer `self.delta` (the parameters are copied to the host). With `device`,
        in a new buffer there: theta is copied over and the parameters never leave their device (the
        values are the same: both subtract the parameters' exact fp32 values from theta's).
        """
        if device is None:
            for view, p in zip(self._delta_views, self.params, strict=True):
                view.copy_(p.detach().reshape(-1))
            torch.sub(self.theta, self.delta, out=self.delta)
            return self.delta
        delta = torch.empty(self.numel, dtype=torch.float32, device=device).copy_(self.theta)
        for view, p in zip(self._views(delta), self.params, strict=True):
            view.sub_(p.detach().reshape(-1))
        return delta

    def copy_to_params(self) -> None:
        """Write the global weights back into the model (cast to the parameters' dtype and device)."""
        with torch.no_grad():
            for view, p in zip(self._theta_views, self.params, strict=True):
                p.copy_(view.view_as(p))

    def _shared_views(self) -> list[torch.Tensor]:
        return [as_bytes(self.theta), as_bytes(self.momentum)]

    def state_hash(self) -> str:
        """A hash of the global weights and outer momentum: equal on every replica after an outer step.

        `digest.region_hash` of their bytes (XXH3 of 1 MiB pieces, on torch's threads): about 12 GB/s a core
        here, where BLAKE2b managed 1 GB/s, i.e. 90 s per outer step for the 80 GB of a 10B model's weights
        and momentum. It detects drift and corruption, not forgery. The piece digests are kept: a donor's
        live transfer sends them as its chunks' checksums while theta and momentum stay as they were.
        """
        digests = digest.piece_digests(self._shared_views(), num_threads=torch.get_num_threads())
        self.adopt_digests(digests)
        return digest.combine(digests)

    def adopt_digests(self, digests: np.ndarray) -> None:
        """Keep `digests` as the piece digests of theta and momentum as they are now (state_hash's, or those a
        joiner checked its received state with)."""
        self._digests = (digests, self._versions())

    def shared_digests(self) -> np.ndarray | None:
        """The piece digests kept by the last state_hash or adopt_digests, unless theta or momentum were written
        by torch since (their version counters moved); None then."""
        if self._digests is None or self._digests[1] != self._versions():
            return None
        return self._digests[0]

    def _versions(self) -> tuple[int, int]:
        return self.theta._version, self.momentum._version


def _local(p: torch.Tensor) -> torch.Tensor:
    """The part of a parameter this process holds (a view: writing it writes the parameter)."""
    return p.detach().to_local() if isinstance(p, DTensor) else p
