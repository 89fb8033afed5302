"""openprime.fsdp: FSDP2 inside a node, applied torchtitan-style (`apply_*` functions on an ordinary model)."""

from openprime.fsdp.config import ActivationCheckpointing, FSDPConfig, GradientSync, Precision, ReshardPolicy
from openprime.fsdp.local import (
    destroy_local_mesh,
    fake_mesh,
    init_local_mesh,
    local_all_reduce_mean,
    local_any,
    local_sum,
)
from openprime.fsdp.parallelize import (
    apply_activation_checkpointing,
    apply_fsdp,
    gradient_sync,
    local_shard,
    materialize,
    parallelize,
)

__all__ = [
    "ActivationCheckpointing",
    "FSDPConfig",
    "Precision",
    "GradientSync",
    "ReshardPolicy",
    "apply_activation_checkpointing",
    "apply_fsdp",
    "destroy_local_mesh",
    "fake_mesh",
    "gradient_sync",
    "init_local_mesh",
    "local_all_reduce_mean",
    "local_any",
    "local_shard",
    "local_sum",
    "materialize",
    "parallelize",
]
