"""Training loss: next-token cross-entropy plus the max-z-loss that INTELLECT-1 used.

INTELLECT-1 (arXiv 2412.01152, section 3.1) added a max-z-loss with weight 2e-4 to keep the logits
from drifting large in bf16, which had caused loss spikes: Baichuan 2 (Yang et al. 2023, arXiv
2309.10305, section 2.6) penalises the square of the largest logit of every token,

    z_loss = weight * mean over tokens of (max_v logits[v])^2,

a cheaper cousin of PaLM's z-loss on log-sum-exp. The max is taken on the logits as the model gives
them (float32, see `Llama.forward`); gradients flow only into the arg-max entry of each token.

Tokens whose target is `ignore_index` (padding, masked prompts) count in neither term.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F  # noqa: N812 (the universal torch spelling)

IGNORE_INDEX = -100  # torch's cross_entropy default, so that targets padded with it just work

INTELLECT1_Z_LOSS_WEIGHT = 2e-4


class LossParts(NamedTuple):
    """The total loss to backpropagate and its two parts (`total = ce + z`), each a scalar tensor."""

    total: torch.Tensor
    ce: torch.Tensor
    z: torch.Tensor  # already multiplied by the weight


def cross_entropy_loss(logits_BLV: torch.Tensor, targets_BL: torch.Tensor,
                       ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) over the tokens whose target is not `ignore_index`.

    Computed in float32 whatever the logits' dtype: log-softmax over a 128k vocabulary in bf16 loses
    the small probabilities that the loss is made of.
    """
    return F.cross_entropy(logits_BLV.flatten(0, 1).float(), targets_BL.flatten(0, 1),
                           ignore_index=ignore_index)


def max_z_loss(logits_BLV: torch.Tensor, targets_BL: torch.Tensor,
               ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Unweighted max-z term: the mean over counted tokens of the squared largest logit."""
    max_logit_BL = logits_BLV.float().amax(dim=-1)
    counted_BL = targets_BL != ignore_index
    # Mean over counted tokens; clamp so that an all-ignored batch gives 0 rather than 0/0.
    squared_sum = torch.where(counted_BL, max_logit_BL.square(), 0.0).sum()
    return squared_sum / counted_BL.sum().clamp(min=1)


def loss_with_max_z(logits_BLV: torch.Tensor, targets_BL: torch.Tensor, z_loss_weight: float,
                    ignore_index: int = IGNORE_INDEX) -> LossParts:
    """Cross-entropy plus `z_loss_weight` times the max-z term; returns (total, ce, z) with z weighted.

    With `z_loss_weight == 0` the z term is not computed and `total` is the plain cross-entropy.
    """
    if z_loss_weight < 0:
        raise ValueError(f"z_loss_weight must be >= 0, got {z_loss_weight}")
    ce = cross_entropy_loss(logits_BLV, targets_BL, ignore_index)
    if z_loss_weight == 0:
        z = torch.zeros((), dtype=ce.dtype, device=ce.device)
        return LossParts(ce, ce, z)
    z = z_loss_weight * max_z_loss(logits_BLV, targets_BL, ignore_index)
    return LossParts(ce + z, ce, z)


@torch.no_grad()
def validation_loss(model: Callable[[torch.Tensor], torch.Tensor], batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                    *, micro_batch_size: int, device: torch.device | str = "cpu") -> float:
    """Mean cross-entropy of `model` over `batches` of (inputs_BL, targets_BL), run in micro-batches of at most
    `micro_batch_size` sequences (what fits this machine): each micro-batch's mean weighted by its sequences, so the
    value does not depend on the split beyond float rounding (every sequence has L targets; ignored ones aside)."""
    total, num_sequences = 0.0, 0
    for inputs_BL, targets_BL in batches:
        for inputs_bL, targets_bL in zip(inputs_BL.split(micro_batch_size), targets_BL.split(micro_batch_size),
                                         strict=True):
            logits_bLV = model(inputs_bL.to(device))
            total += cross_entropy_loss(logits_bLV, targets_bL.to(device)).item() * len(inputs_bL)
            num_sequences += len(inputs_bL)
    return total / num_sequences


__all__ = [
    "IGNORE_INDEX",
    "INTELLECT1_Z_LOSS_WEIGHT",
    "LossParts",
    "cross_entropy_loss",
    "loss_with_max_z",
    "max_z_loss",
    "validation_loss",
]

