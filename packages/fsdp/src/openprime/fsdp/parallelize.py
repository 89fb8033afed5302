"""Applying FSDP2 and activation checkpointing to a model, torchtitan-style (INTELLECT-1 paper, section 2.2).

Inside a node, FSDP2 (`torch.distributed.fsdp.fully_shard`) splits every parameter along dim 0 over the
node's local ranks: rank r holds rows [r * ceil(n / R), (r + 1) * ceil(n / R)) of an n-row weight, plus
the matching gradient and AdamW moments. Forward all-gathers one block's parameters at a time (in
`param_dtype`), backward reduce-scatters its gradients (in `reduce_dtype`), so a 10B model's 40 GB of
fp32 weights and 80 GB of AdamW state cost each of 8 GPUs 1/8 of that.

Each transformer block is one FSDP unit and the root (embeddings, final norm, output) another, which
lets the all-gather of block i+1 overlap the compute of block i. A block frees its gathered parameters
after forward except the last one, whose backward starts at once (torchtitan's policy).

The functions take the model and its list of blocks explicitly (a `ModuleDict`, so that wrapping
keeps the parameter names), not a run config: any decoder with a `layers` dict fits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from openprime.fsdp.config import ActivationCheckpointing, FSDPConfig, ReshardPolicy


def apply_activation_checkpointing(blocks: nn.ModuleDict) -> None:
    """Wrap every block so that backward recomputes its activations: memory per block drops from all its
    intermediate tensors (about 34 * B * L * D bytes in bf16 for a Llama block) to its input (2 * B * L * D).

    The wrapper's state-dict hooks strip its prefix, so checkpoints keep the unwrapped names.
    """
    for name, block in list(blocks.items()):
        blocks[name] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_fsdp(model: nn.Module, blocks: nn.ModuleDict, mesh: DeviceMesh, *, config: FSDPConfig) -> None:
    """`fully_shard` each block, then the root, over `mesh` (the node's local ranks).

    The blocks' inputs are not cast: the activations come in param_dtype already (from the embedding), and the
    other floating-point inputs, a Llama's RoPE tables, must stay float32 (cast to bf16, neighbouring positions
    share a cos/sin in the slow channel pairs at long context: errors of 2e-3, found 2026-12-07). The root casts
    its own inputs (token ids: none are floating-point)."""
    policy = MixedPrecisionPolicy(param_dtype=config.param_dtype.dtype, reduce_dtype=config.reduce_dtype.dtype)
    block_policy = MixedPrecisionPolicy(param_dtype=config.param_dtype.dtype, reduce_dtype=config.reduce_dtype.dtype,
                                        cast_forward_inputs=False)
    names = list(blocks.keys())
    for i, name in enumerate(names):
        if config.reshard_after_forward is ReshardPolicy.ALL_BUT_LAST:
            reshard = i < len(names) - 1
        else:
            reshard = config.reshard_after_forward is ReshardPolicy.ALWAYS
        fully_shard(blocks[name], mesh=mesh, mp_policy=block_policy, reshard_after_forward=reshard)
    # The root's own parameters (embeddings, final norm, output) are gathered at the start of forward and
    # used at its end and in the first backward step: freeing them after forward gains nothing.
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)


def parallelize(model: nn.Module, blocks: nn.ModuleDict, mesh: DeviceMesh | None, *, config: FSDPConfig) -> None:
    """Everything the config asks for, in the order that composes: activation checkpointing, then FSDP2."""
    if config.activation_checkpointing is ActivationCheckpointing.FULL:
        apply_activation_checkpointing(blocks)
    if config.sharded:
        if mesh is None:
            raise ValueError(f"FSDPConfig.num_local_ranks={config.num_local_ranks} needs the node's local mesh "
                             "(openprime.fsdp.init_local_mesh)")
        if mesh.size() != config.num_local_ranks:
            raise ValueError(f"the local mesh has {mesh.size()} ranks but FSDPConfig.num_local_ranks is "
                             f"{config.num_local_ranks}; start one process per local rank")
        apply_fsdp(model, blocks, mesh, config=config)


def materialize(model: nn.Module, *, device: torch.device | str, init: Callable[[], None]) -> None:
    """Allocate a model built on the meta device (each rank only its shards) and run `init` to fill it.

    `init` must write every parameter in place; for DTensor parameters it fills the local shard (see
    openprime.train.model: it draws each full parameter and keeps the rows this rank holds, so the weights
    do not depend on the number of local ranks).
    """
    model.to_empty(device=device)
    with torch.no_grad():
        init()


def gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn FSDP2's gradient reduce-scatter off for the micro-batches before the last of an accumulation."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly sharded) parameter this rank holds; writes to it change the parameter."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
