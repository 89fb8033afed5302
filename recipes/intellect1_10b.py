"""INTELLECT-1: the 10B-parameter run of Prime Intellect (arXiv 2412.01152), every number written once.

Model: Llama-3 with 42 layers (Appendix A). Inner loop: AdamW lr 7.5e-5, betas (0.9, 0.95), weight
decay 0.1, gradient clip 1.0, 128 sequences of 8192 tokens per node per inner step, max-z-loss 2e-4.
Schedule: warmup 1000 steps, stable until step 74,700, then a 1-sqrt cooldown to step 90,400.
Outer loop: DiLoCo with H = 100 inner steps, Nesterov outer lr 0.7, momentum 0.9, int8 pseudo-gradients.
Inside a node: FSDP2 over 8 local ranks (8xH100), bf16 compute with fp32 gradient reduction, every block
activation-checkpointed, micro-batch 1: each rank accumulates gradients over 16 sequences of its share.
A checkpoint at every outer step.

Data: the mix of the paper's Table 1 (FineWeb-Edu 55, FineWeb 10, Stack 20, DCLM 10, OpenWebMath 5) from
local files you download (nothing is fetched at run time): .jsonl (a "text" field per line), .txt or
.parquet files under DATA_ROOT/<name>/. Point DATA_ROOT at them in a recipe of your own that derives from
this one; a missing directory is an error naming it when the run prepares its data (a dry run or
`openprime plan` needs no data). The annealing phase's mix is ANNEALING_MIX.
"""

import pathlib

from openprime.ckpt import CheckpointConfig, SaveMode
from openprime.diloco import Compression, DiLoCoConfig, OuterOptimizer
from openprime.fsdp import ActivationCheckpointing, FSDPConfig, Precision
from openprime.train.config import OptimizerConfig, RunConfig, TrainConfig
from openprime.train.data import DataConfig, WeightedSource
from openprime.train.model import FLAVORS
from openprime.train.schedule import DecayShape, ScheduleConfig

NUM_STEPS = 90_400
STABLE_UNTIL_STEP = 74_700

DATA_ROOT = pathlib.Path("~/data/intellect1").expanduser()
# Table 1: weight (%) during pre-training, and during the learning-rate annealing phase.
PRETRAINING_MIX = {"fineweb-edu": 55, "fineweb": 10, "stack-v1-popular": 20, "dclm-baseline": 10, "openwebmath": 5}
ANNEALING_MIX = {"fineweb-edu": 80, "fineweb": 10, "stack-v1-popular": 10}


def mixture(weights: dict[str, float], root: pathlib.Path = DATA_ROOT) -> tuple[WeightedSource, ...]:
    """The data mixture of `weights` by dataset name, each read from root/<name>/."""
    return tuple(WeightedSource(source=str(root / name), weight=w, name=name) for name, w in weights.items())


def config() -> RunConfig:
    return RunConfig(
        name="intellect1-10b",
        model=FLAVORS["10B"],
        data=DataConfig(mixture=mixture(PRETRAINING_MIX), vocab_size=FLAVORS["10B"].vocab_size),
        optim=OptimizerConfig(lr=7.5e-5, beta1=0.9, beta2=0.95, weight_decay=0.1, max_grad_norm=1.0),
        schedule=ScheduleConfig(num_warmup_steps=1000, num_decay_steps=NUM_STEPS - STABLE_UNTIL_STEP,
                                decay_shape=DecayShape.ONE_MINUS_SQRT),
        # 128 sequences per node per inner step: 16 per local rank, one at a time (gradient accumulation).
        train=TrainConfig(num_steps=NUM_STEPS, seq_len=8192, batch_size=128, micro_batch_size=1, z_loss_weight=2e-4),
        # int8 pseudo-gradients every 100 inner steps: 400x fewer bytes than data parallel (section 2.3).
        diloco=DiLoCoConfig(num_inner_steps=100, outer_lr=0.7, outer_momentum=0.9,
                            outer_optimizer=OuterOptimizer.NESTEROV, compression=Compression.INT8),
        # A checkpoint at every outer step, written while the next inner steps run; two kept.
        checkpoint=CheckpointConfig(mode=SaveMode.ASYNC, interval_steps=100, num_keep=2),
        # FSDP2 over the node's 8 GPUs as torchtitan and PRIME: bf16 forward and backward, fp32 gradient
        # reduce-scatter; full activation checkpointing: 69.5 GiB per H100 (`openprime plan`), 38 of it the
        # fp32 gradient every GPU keeps unsharded while 16 micro-batches accumulate.
        fsdp=FSDPConfig(num_local_ranks=8, param_dtype=Precision.BF16, reduce_dtype=Precision.FP32,
                        activation_checkpointing=ActivationCheckpointing.FULL),
    )
