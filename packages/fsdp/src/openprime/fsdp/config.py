"""The FSDP2 config of a node: how many local ranks shard the model, in which precision, and what is recomputed."""

from __future__ import annotations

import enum

import torch

from openprime.core.config import config, field, one_of_enum, positive_int


class Precision(enum.Enum):
    """A floating-point dtype by name (configs hold enums, not torch dtypes)."""

    FP32 = "fp32"
    BF16 = "bf16"

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self is Precision.FP32 else torch.bfloat16


class ReshardPolicy(enum.Enum):
    """Whether a block frees its gathered parameters after forward (and gathers them again for backward)."""

    ALL_BUT_LAST = "all_but_last"  # torchtitan: the last block's backward starts at once, so keep it gathered
    ALWAYS = "always"  # least memory: every block gathers twice per step
    NEVER = "never"  # ZeRO-2-like: gathered parameters stay until backward; fastest, most memory


class GradientSync(enum.Enum):
    """When the gradient is reduce-scattered over the local ranks in a step of several micro-batches."""

    LAST_MICRO_BATCH = "last_micro_batch"  # PRIME: one reduce-scatter a step; every GPU holds the whole gradient
    EVERY_MICRO_BATCH = "every_micro_batch"  # torchtitan: one per micro-batch; gradients stay sharded


class ActivationCheckpointing(enum.Enum):
    """Which activations are recomputed in backward instead of kept from forward."""

    NONE = "none"
    FULL = "full"  # every transformer block keeps only its input (INTELLECT-1 10B on 8xH100)


@config
class FSDPConfig:
    """FSDP2 inside each node: the local ranks that shard parameters, gradients and optimizer state."""

    num_local_ranks: int = field(1, doc="processes per node, each holding one shard (1: no sharding)",
                                 validator=positive_int())
    param_dtype: Precision = field(Precision.FP32, doc="dtype of the gathered parameters in forward and backward "
                                   "(bf16 on GPUs; the sharded master copy stays fp32)",
                                   validator=one_of_enum(Precision))
    reduce_dtype: Precision = field(Precision.FP32, doc="dtype of the gradient reduce-scatter",
                                    validator=one_of_enum(Precision))
    reshard_after_forward: ReshardPolicy = field(ReshardPolicy.ALL_BUT_LAST,
                                                 doc="which blocks free their gathered parameters after forward",
                                                 validator=one_of_enum(ReshardPolicy))
    gradient_sync: GradientSync = field(
        GradientSync.LAST_MICRO_BATCH, doc="reduce-scatter gradients after the last micro-batch of a step (FSDP2 then "
        "keeps the whole model's unsharded gradient on every GPU until it) or after every one (sharded, more traffic)",
        validator=one_of_enum(GradientSync))
    activation_checkpointing: ActivationCheckpointing = field(
        ActivationCheckpointing.NONE, doc="recompute activations in backward: none or full (per block)",
        validator=one_of_enum(ActivationCheckpointing))

    @property
    def sharded(self) -> bool:
        return self.num_local_ranks > 1
