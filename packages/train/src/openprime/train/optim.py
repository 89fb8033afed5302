"""The inner optimizer: AdamW with global gradient-norm clipping, as INTELLECT-1 trained each replica."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from openprime.train.config import OptimizerConfig


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW over every trainable parameter; fused/foreach kernels where torch has them."""
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )


def clip_gradients(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the global L2 norm of the gradients to `max_norm`; return the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    # Under FSDP2 the norm is a DTensor already reduced over the local ranks' shards: every rank clips alike.
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
