"""The planner: what a run costs before it starts (INTELLECT-1, arXiv 2412.01152, sections 2.1-2.3 and 3.2).

`plan_run` takes a run's config, the nodes, their GPUs and the bandwidth between nodes, and works out by
hand: the parameters; the memory of one GPU under FSDP2 and whether it fits; the host memory DiLoCo keeps
per node; FLOPs per token and the time of an inner step at a given MFU; the bytes each node sends per
outer step (fp32 and int8) against data-parallel training; the all-reduce time and compute utilisation.

The paper's numbers it reproduces: 100 inner steps of 128 x 8192 tokens take about 38 minutes on 8xH100
at 43.3% MFU (section 3.1, Table 2); int8 pseudo-gradients every H = 100 steps send about 400x fewer bytes
than fp32 data parallel (section 3.1); compute utilisation is compute / (compute + all-reduce), which
with the median all-reduce times of Table 2 gives 95.7 / 85.6 / 83.0 %.

Memory follows the run's FSDP config (`cfg.fsdp`, applied by openprime.fsdp.parallelize as torchtitan and
PRIME do): parameters, gradients and AdamW's two moments are fp32 and sharded over the node's
`num_local_ranks` GPUs; each FSDP unit is all-gathered in `param_dtype` only while it computes, or, with
`reshard_after_forward=never`, from its forward until its backward (with one local rank nothing is sharded or
gathered, and the model computes in fp32); `activation_checkpointing` decides whether every block keeps all its
activations or only its input; `train.micro_batch_size` is the batch of one forward, and when a rank's share
takes more than one, the gradients accumulate unsharded, in `reduce_dtype`, for the whole model (the trainer
reduce-scatters only after the last micro-batch, as PRIME does; `fsdp.gradient_sync=every_micro_batch` keeps it
sharded). INTELLECT-1 10B: 8 ranks, bf16, full checkpointing, micro-batch 1 (16 accumulated: 38 GiB of fp32
gradients on every GPU). Everything here is an estimate of the steady state: allocator fragmentation, CUDA
context and NCCL buffers (a few GiB) are left out, so treat "fits" with less than ~10% to spare as "probably not".

`check_fits` turns a plan that does not fit into a ConfigError that says by how much and which change
of the config (more local ranks, activation checkpointing, a smaller micro-batch) would make it fit.
"""

from __future__ import annotations

import math
import re

import attrs

from openprime.core.collectives import SEGMENT_NUMEL
from openprime.core.errors import ConfigError
from openprime.diloco.config import Compression
from openprime.fsdp import ActivationCheckpointing, GradientSync, Precision, ReshardPolicy
from openprime.train.config import RunConfig, Strategy
from openprime.train.model import count_parameters, num_flops_per_token

GiB = 2**30
NO_COMM_MFU = 0.433  # INTELLECT-1's MFU without communication (Table 2, "Baseline")
CODEBOOK_BYTES = 256 * 4  # the int8 codec's codebook: 256 fp32 bucket means per encoded segment
BF16, FP32 = 2, 4
# The most local ranks a remedy asks for: the GPUs of one NVLink board (HGX/DGX H100, H200, B200: 8). FSDP2 inside a
# node shards over NVLink; past the board it would shard over the network DiLoCo is there to spare.
MAX_LOCAL_RANKS = 8


@attrs.frozen(kw_only=True)
class GPU:
    """What the planner needs to know of an accelerator."""

    name: str
    memory_bytes: int  # what CUDA reports (torch.cuda.get_device_properties(i).total_memory), not as marketed
    peak_flops: float  # dense bf16 tensor-core FLOP/s (no sparsity), the denominator of MFU


# Memory as CUDA reports it, the least seen in PyTorch's out-of-memory messages ("GPU 0 has a total capacity of 79.11
# GiB"): 79.1-79.3 GiB for the 80 GB parts and 139.7-139.8 GiB for H200's 141 GB, by driver. The marketed 80 and 141
# GiB said "fits, 10.5 GiB to spare" where 9.6 GiB were (before 2026-12-08). On CUDA, `openprime run` reads the
# devices' own (openprime.train.hardware).
_80GB, _141GB = int(79.1 * GiB), int(139.7 * GiB)
GPUS: dict[str, GPU] = {  # a device is the first key in its name, lower case, "-" for " ": "h100-pcie" first
    "h100-pcie": GPU(name="H100 PCIe", memory_bytes=_80GB, peak_flops=756e12),
    "h100": GPU(name="H100 SXM", memory_bytes=_80GB, peak_flops=989e12),
    "h200": GPU(name="H200 SXM", memory_bytes=_141GB, peak_flops=989e12),
    "a100": GPU(name="A100 SXM", memory_bytes=_80GB, peak_flops=312e12),
}


def device_gib(n: float) -> str:
    """A device's memory in GiB as the planner's lines say it: 79.1, 32 (one decimal, none when it is 0); table
    cells of other sizes are `_gib`'s."""
    return f"{round(n / GiB, 1):g}"


@attrs.frozen(kw_only=True)
class Plan:
    """Every number of a plan; bytes are bytes, times seconds, fractions in [0, 1]."""

    num_nodes: int
    gpus_per_node: int
    gpu: GPU
    bandwidth_bps: float  # bits per second each node gets to its ring neighbour
    num_inner_steps: int  # H
    strategy: Strategy  # DiLoCo, or data parallel (gradients all-reduced at every inner step)
    compression: Compression  # the run's pseudo-gradient encoding (DiLoCo)
    num_params: int
    # memory of one GPU, for the run's FSDP config
    compute_dtype: Precision  # of the gathered parameters and the activations (fp32 when unsharded)
    reduce_dtype: Precision  # of the gradient reduce-scatter, and of the unsharded gradients accumulated before it
    activation_checkpointing: bool
    reshard_after_forward: ReshardPolicy
    micro_batch_size: int  # sequences per forward on one GPU (the whole share when the config says 0)
    num_micro_batches: int  # forwards per GPU per inner step; over 1 (and sharded), gradients accumulate unsharded
    accumulates_unsharded: bool  # every GPU keeps the whole model's unsharded gradient between micro-batches
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    gathered_bytes: float
    activations_bytes: float
    gpu_bytes: float
    fits: bool
    # host memory of one node for the DiLoCo state (none in data parallel)
    host_bytes: float
    # compute
    flops_per_token: int
    attention_flops_per_token: int
    tokens_per_inner_step: int  # per node
    mfu: float
    inner_step_s: float
    compute_s: float  # H inner steps
    # communication per node per outer step
    fp32_bytes: float
    int8_bytes: float
    dp_bytes: float  # fp32 gradients all-reduced at each of the H inner steps
    fp32_all_reduce_s: float
    int8_all_reduce_s: float
    dp_all_reduce_s: float  # data parallel's H all-reduces of the gradients

    @property
    def shortfall_bytes(self) -> float:
        """How much more memory one GPU would need (0 when it fits)."""
        return max(0.0, self.gpu_bytes - self.gpu.memory_bytes)

    @property
    def all_reduce_s(self) -> float:
        """The run's own all-reduce time per H inner steps: its encoding's in DiLoCo, H gradient all-reduces in data
        parallel."""
        if self.strategy is Strategy.DATA_PARALLEL:
            return self.dp_all_reduce_s
        return self.int8_all_reduce_s if self.compression is Compression.INT8 else self.fp32_all_reduce_s

    def utilisation(self, all_reduce_s: float) -> float:
        """Share of the wall clock spent computing: the paper's "compute utilization" (Table 2)."""
        return self.compute_s / (self.compute_s + all_reduce_s)

    @property
    def compute_utilisation(self) -> float:
        return self.utilisation(self.all_reduce_s)

    def reduction(self, sent_bytes: float) -> float:
        """How many times fewer bytes than data parallel (nan with one node, which sends nothing)."""
        return self.dp_bytes / sent_bytes if sent_bytes else math.nan


def plan_run(cfg: RunConfig, *, num_nodes: int, bandwidth_bps: float, gpus_per_node: int | None = None,
             gpu: str | GPU = "h100", mfu: float = NO_COMM_MFU, micro_batch_size: int | None = None,
             latency_s: float = 0.0) -> Plan:
    """The plan of `cfg` on `num_nodes` nodes of `gpus_per_node` GPUs, `bandwidth_bps` between nodes.

    `gpus_per_node` and `micro_batch_size` default to the config's (`fsdp.num_local_ranks`,
    `train.micro_batch_size`); given, they replace them and the config is validated again. `gpu` names a
    row of GPUS or is a GPU of your own; `mfu` is the model FLOPs utilisation of the inner steps (default:
    the paper's 43.3% without communication); `latency_s` the one-way latency between ring neighbours,
    paid once per step of the ring.
    """
    _check(num_nodes=num_nodes, bandwidth_bps=bandwidth_bps, gpu=gpu, mfu=mfu, latency_s=latency_s)
    cfg = with_node(cfg, gpus_per_node=gpus_per_node, micro_batch_size=micro_batch_size)
    gpus_per_node = cfg.fsdp.num_local_ranks
    device = gpu_named(gpu)
    m, seq_len, h = cfg.model, cfg.train.seq_len, cfg.diloco.num_inner_steps
    p = count_parameters(m)
    memory = gpu_memory(cfg)

    # Compute. One inner step is batch_size sequences per node, spread over the node's GPUs (data
    # parallel inside the node, gradient accumulation over micro-batches); MFU is achieved FLOP/s over
    # peak, so the step takes FLOPs / (GPUs * peak * MFU).
    flops_per_token = num_flops_per_token(m, seq_len)
    tokens = cfg.train.batch_size * seq_len
    inner_step_s = tokens * flops_per_token / (gpus_per_node * device.peak_flops * mfu)

    # Communication. A ring all-reduce over n nodes makes every node send 2(n-1)/n of the payload
    # (reduce-scatter then all-gather). PRIME runs one ring per local rank, each carrying that rank's
    # FSDP shard, so a node's rings together carry the whole model over the node's link.
    ring = 2 * (num_nodes - 1) / num_nodes
    fp32_bytes = ring * FP32 * p
    int8_bytes = ring * (p + CODEBOOK_BYTES * _num_segments(p, gpus_per_node, num_nodes))
    # Data parallel all-reduces the fp32 gradients (FSDP2's reduce_dtype) at every one of the H steps.
    dp_bytes = h * ring * FP32 * p
    ring_latency_s = 2 * (num_nodes - 1) * latency_s
    return Plan(
        num_nodes=num_nodes, gpus_per_node=gpus_per_node, gpu=device, bandwidth_bps=float(bandwidth_bps),
        num_inner_steps=h, strategy=cfg.train.strategy, compression=cfg.diloco.compression, num_params=p,
        compute_dtype=compute_dtype(cfg), reduce_dtype=cfg.fsdp.reduce_dtype,
        activation_checkpointing=cfg.fsdp.activation_checkpointing is ActivationCheckpointing.FULL,
        reshard_after_forward=cfg.fsdp.reshard_after_forward, micro_batch_size=cfg.forward_batch_size,
        num_micro_batches=cfg.num_micro_batches, accumulates_unsharded=accumulates_unsharded(cfg), **memory,
        gpu_bytes=sum(memory.values()), fits=sum(memory.values()) <= device.memory_bytes,
        # DiLoCo's host state (openprime.diloco.outer.OuterState): fp32 global weights, outer momentum
        # and pseudo-gradient, 12 bytes per parameter; sharded over the local ranks, the same per node.
        # Data parallel keeps none: its gradients are all-reduced where they are.
        host_bytes=0 if cfg.train.strategy is Strategy.DATA_PARALLEL else 3 * FP32 * p,
        flops_per_token=flops_per_token, attention_flops_per_token=12 * m.num_layers * m.dim * seq_len,
        tokens_per_inner_step=tokens, mfu=mfu, inner_step_s=inner_step_s, compute_s=h * inner_step_s,
        fp32_bytes=fp32_bytes, int8_bytes=int8_bytes, dp_bytes=dp_bytes,
        fp32_all_reduce_s=8 * fp32_bytes / bandwidth_bps + ring_latency_s,
        int8_all_reduce_s=8 * int8_bytes / bandwidth_bps + ring_latency_s,
        dp_all_reduce_s=8 * dp_bytes / bandwidth_bps + h * ring_latency_s,
    )


def with_node(cfg: RunConfig, *, gpus_per_node: int | None = None, micro_batch_size: int | None = None) -> RunConfig:
    """`cfg` with another number of local ranks and micro-batch size, validated (the batch must split)."""
    if gpus_per_node is None and micro_batch_size is None:
        return cfg
    fsdp, train = cfg.fsdp, cfg.train
    if gpus_per_node is not None:
        fsdp = attrs.evolve(fsdp, num_local_ranks=gpus_per_node)
    if micro_batch_size is not None:
        train = attrs.evolve(train, micro_batch_size=micro_batch_size)
    return attrs.evolve(cfg, fsdp=fsdp, train=train)


def gpu_named(gpu: str | GPU) -> GPU:
    """The GPU a row of GPUS names, or `gpu` itself."""
    if isinstance(gpu, GPU):
        return gpu
    if gpu not in GPUS:
        raise ConfigError(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)}")
    return GPUS[gpu]


def compute_dtype(cfg: RunConfig) -> Precision:
    """The dtype forward and backward compute in: FSDP2's param_dtype, or fp32 when nothing is sharded
    (openprime.fsdp.parallelize applies FSDP2, and with it the mixed-precision policy, only over >1 rank)."""
    return cfg.fsdp.param_dtype if cfg.fsdp.sharded else Precision.FP32


def accumulates_unsharded(cfg: RunConfig) -> bool:
    """Whether every GPU holds an unsharded gradient of the whole model: FSDP2 with gradient accumulation.

    With fsdp.gradient_sync=last_micro_batch (as PRIME did) openprime.train.trainer.train_step turns FSDP2's
    gradient sync off for all micro-batches but the last, and FSDP2 then keeps each unit's unsharded gradient, cast
    to `reduce_dtype`, from one backward to the next (FSDPParam.unsharded_accumulated_grad) until the last
    micro-batch reduce-scatters it. With every_micro_batch each backward reduce-scatters into the sharded gradient.
    """
    return (cfg.fsdp.sharded and cfg.num_micro_batches > 1
            and cfg.fsdp.gradient_sync is GradientSync.LAST_MICRO_BATCH)


def gpu_memory(cfg: RunConfig) -> dict[str, float]:
    """Bytes of one GPU under the run's FSDP config (local ranks, param and reduce dtypes, resharding, activation
    checkpointing) and micro-batching, at the peak: the start of the last micro-batch's backward."""
    m, seq_len, gpus = cfg.model, cfg.train.seq_len, cfg.fsdp.num_local_ranks
    act = BF16 if compute_dtype(cfg) is Precision.BF16 else FP32
    reduce = BF16 if cfg.fsdp.reduce_dtype is Precision.BF16 else FP32
    p = count_parameters(m)
    root = 2 * m.vocab_size * m.dim + m.dim  # embedding, output layer, final norm: FSDP's root unit
    block = (p - root) // m.num_layers
    # Sharded state: fp32 parameters (the master copy AdamW updates), fp32 gradients (reduce-scattered
    # in fp32), AdamW's exp_avg and exp_avg_sq: 4 + 4 + 8 = 16 bytes per parameter, divided by the ranks.
    # With gradient accumulation the gradient is instead the unsharded one every unit keeps between micro-batches,
    # `reduce` bytes for each of the model's p parameters, divided by nothing (4 x 10,211,381,248 bytes: 38.0 GiB
    # at 10B). Its sharded fp32 form only appears, unit by unit, as the last backward reduce-scatters and frees it:
    # the two together never exceed the unsharded one, which is what is counted.
    grads = reduce * p if accumulates_unsharded(cfg) else FP32 * p / gpus
    # Gathered copies in param_dtype: the root unit stays unsharded through forward and backward (2 bytes
    # each for its 2VD parameters in bf16: 2 x 1,050,677,248 bytes, 1.96 GiB at 10B), plus the block computing
    # and the one prefetched; their unsharded gradients exist as long again, before the reduce-scatter: x2.
    # With reshard_after_forward=never every block keeps its gathered parameters from its forward to its
    # backward, so when backward starts all L blocks are gathered (the gradients still come 2 blocks at a time).
    # Unsharded, the model computes on its fp32 parameters directly and nothing is gathered.
    gathered_blocks = m.num_layers if cfg.fsdp.reshard_after_forward is ReshardPolicy.NEVER else 2
    gathered = act * (root + gathered_blocks * block) + act * (root + 2 * block) if cfg.fsdp.sharded else 0
    # Activations, per sequence of the micro-batch. A block's saved tensors per token: the norms' inputs
    # and outputs, q, k, v, the attention output (4D + D + 2*K*E) and the SwiGLU's w1, w3, silu(w1) and
    # their product (4F). Without checkpointing every block keeps them until its backward; with it each
    # block keeps only its input (L*D per layer) and backward recomputes one block at a time. The output
    # layer's fp32 logits and the log-softmax that cross-entropy keeps for backward are 2 * L * V * 4
    # bytes: 8 GiB at 8192 x 128256, more than all the checkpointed block inputs together.
    kv = m.num_kv_heads * m.head_dim
    block_activations = seq_len * act * (5 * m.dim + 2 * kv + 4 * m.ffn_hidden_dim)
    logits = 2 * seq_len * m.vocab_size * FP32
    if cfg.fsdp.activation_checkpointing is ActivationCheckpointing.FULL:
        per_sequence = m.num_layers * seq_len * m.dim * act + block_activations + logits
    else:
        per_sequence = m.num_layers * block_activations + logits
    # Not counted: the outer step's fp32 pseudo-gradient, which with int8 on a GPU (diloco.pseudo_gradient_device
    # auto) lives there during the outer step: 4 bytes per parameter share, allocated after the inner steps'
    # activations and gathered units are freed, which together with the gradients are larger.
    return {"weights_bytes": FP32 * p / gpus, "grads_bytes": grads, "optimizer_bytes": 2 * FP32 * p / gpus,
            "gathered_bytes": gathered, "activations_bytes": cfg.forward_batch_size * per_sequence}


def gpu_bytes(cfg: RunConfig) -> float:
    """The total of gpu_memory: what one GPU of a node needs for `cfg`."""
    return sum(gpu_memory(cfg).values())


def check_fits(cfg: RunConfig, gpu: str | GPU, *, max_local_ranks: int = MAX_LOCAL_RANKS) -> None:
    """Raise a ConfigError if one GPU cannot hold its share of `cfg`, saying by how many GiB and what to change;
    `max_local_ranks`: the GPUs a node has, the most local ranks a change may ask for."""
    device = gpu_named(gpu)
    memory = gpu_memory(cfg)
    need = sum(memory.values())
    if need <= device.memory_bytes:
        return
    state = memory["weights_bytes"] + memory["grads_bytes"] + memory["optimizer_bytes"]
    ranks = cfg.fsdp.num_local_ranks
    raise ConfigError(
        f"{cfg.name!r} does not fit one {device.name}: with {ranks} local rank{'s' * (ranks > 1)} per node each GPU "
        f"needs {need / GiB:.1f} GiB, {(need - device.memory_bytes) / GiB:.1f} GiB more than its "
        f"{device_gib(device.memory_bytes)} GiB (weights, gradients and AdamW state {state / GiB:.1f} GiB, gathered "
        f"units {memory['gathered_bytes'] / GiB:.1f} GiB, activations {memory['activations_bytes'] / GiB:.1f} GiB). "
        f"{_remedies(cfg, device, max_local_ranks=max(max_local_ranks, ranks))}")


def _remedies(cfg: RunConfig, device: GPU, *, max_local_ranks: int) -> str:
    """What to change in `cfg` to fit `device`: each single change that helps, with what one GPU would then need;
    when none is enough alone, all of them together (with more local ranks, up to `max_local_ranks`, if need be)."""
    changes: list[tuple[str, RunConfig, str]] = []  # (the change, the config it gives, what else it costs)
    ranks = _fitting_ranks(cfg, device, max_local_ranks)
    if ranks is not None:
        changes.append((f"more local ranks: --set fsdp.num_local_ranks={ranks}", with_node(cfg, gpus_per_node=ranks),
                        ""))
    full_ac = attrs.evolve(cfg, fsdp=attrs.evolve(cfg.fsdp, activation_checkpointing=ActivationCheckpointing.FULL))
    if cfg.fsdp.activation_checkpointing is ActivationCheckpointing.NONE:
        changes.append(("activation checkpointing: --set fsdp.activation_checkpointing=full", full_ac, ""))
    if accumulates_unsharded(cfg):
        # One reduce-scatter per micro-batch instead of per step (inside the node: NVLink's hundreds of GB/s)
        # keeps the gradient sharded: 4P x (1 - 1/R) bytes less, 33 GiB at 10B over 8 ranks.
        every = attrs.evolve(cfg, fsdp=attrs.evolve(cfg.fsdp, gradient_sync=GradientSync.EVERY_MICRO_BATCH))
        changes.append(("sharded gradients: --set fsdp.gradient_sync=every_micro_batch", every,
                        f"; {cfg.num_micro_batches} reduce-scatters a step instead of 1"))
    # A smaller micro-batch shrinks the activations, but from one forward per inner step (micro_batch_size 0, or the
    # whole share) it starts gradient accumulation, whose unsharded gradient can cost more than it saves.
    one = with_node(cfg, micro_batch_size=1)
    if cfg.forward_batch_size > 1 and gpu_bytes(one) < gpu_bytes(cfg):
        changes.append(("a smaller micro-batch: --set train.micro_batch_size=1", one, ""))
    alone = any(gpu_bytes(changed) <= device.memory_bytes for _, changed, _ in changes)
    if not alone:  # all the changes together, with more local ranks if need be
        leanest = with_node(attrs.evolve(full_ac, fsdp=attrs.evolve(full_ac.fsdp,
                                                                   gradient_sync=GradientSync.EVERY_MICRO_BATCH)),
                            micro_batch_size=1)
        together = cfg.fsdp.num_local_ranks if gpu_bytes(leanest) <= device.memory_bytes else \
            _fitting_ranks(leanest, device, max_local_ranks)
        if together is not None:
            more = f" --set fsdp.num_local_ranks={together}" if together != cfg.fsdp.num_local_ranks else ""
            changes.append((f"all together: --set fsdp.activation_checkpointing=full --set train.micro_batch_size=1 "
                            f"--set fsdp.gradient_sync=every_micro_batch{more}",
                            with_node(leanest, gpus_per_node=together), ""))
            alone = True
    listed = "; ".join(f"{change} ({gpu_bytes(changed) / GiB:.1f} GiB"
                       f"{'' if gpu_bytes(changed) <= device.memory_bytes else ', not enough alone'}{note})"
                       for change, changed, note in changes)
    if alone:
        return f"To fit, change: {listed}; or use GPUs with more memory"
    if changes:
        return (f"Nothing fits it, not even all of these together with up to {max_local_ranks} local ranks (the GPUs "
                f"of a node): {listed}. Use GPUs with more memory")
    return (f"No number of local ranks up to {max_local_ranks} (the GPUs of a node), recomputation or micro-batch "
            f"makes it fit: use GPUs with more memory")


def _fitting_ranks(cfg: RunConfig, device: GPU, max_local_ranks: int) -> int | None:
    """The fewest local ranks above the config's, up to `max_local_ranks`, that split the batch and make one GPU's
    share fit."""
    micro = cfg.train.micro_batch_size
    for ranks in range(cfg.fsdp.num_local_ranks + 1, min(cfg.train.batch_size, max_local_ranks) + 1):
        share, rest = divmod(cfg.train.batch_size, ranks)
        if rest or (micro and share % micro):
            continue
        if gpu_bytes(with_node(cfg, gpus_per_node=ranks)) <= device.memory_bytes:
            return ranks
    return None


def _num_segments(num_params: int, gpus_per_node: int, num_nodes: int) -> int:
    """Codebooks in one int8 all-reduce: one per message of at most SEGMENT_NUMEL values.

    Each local rank's shard (p / gpus) is cut into one chunk per node (openprime.core.collectives), and
    each chunk into segments that are encoded, and so carry a codebook, separately.
    """
    chunk = math.ceil(math.ceil(num_params / gpus_per_node) / num_nodes)
    return gpus_per_node * num_nodes * math.ceil(chunk / SEGMENT_NUMEL)


def _check(*, num_nodes: int, bandwidth_bps: float, gpu: str | GPU, mfu: float, latency_s: float) -> None:
    if num_nodes < 1:
        raise ConfigError(f"the number of nodes must be >= 1, got {num_nodes}")
    if not bandwidth_bps > 0:
        raise ConfigError(f"the bandwidth must be > 0 bits per second, got {bandwidth_bps!r}")
    gpu_named(gpu)
    if not 0 < mfu <= 1:
        raise ConfigError(f"MFU is a fraction in (0, 1], got {mfu!r} (43.3% is 0.433)")
    if latency_s < 0:
        raise ConfigError(f"latency must be >= 0 seconds, got {latency_s!r}")


# ---------------------------------------------------------------- bandwidth strings

_DECIMAL = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BINARY = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30}
BANDWIDTH_FORMS = ("1.6gbit, 500mbit, 4gbps, 1.6Gb/s (bits per second; k, m, g, t prefixes); "
                   "100MB/s, 1.5GB/s, 200MiB/s (bytes per second: a capital B)")


def parse_bandwidth(text: str) -> float:
    """Bits per second from a string like "1.6gbit", "500mbit", "4Gb/s", "100MB/s" or "200MiB/s".

    Prefixes are decimal (1 Gbit/s = 1e9 bit/s) except Ki, Mi, Gi. Bits are `bit`, `bps` or a small
    `b/s`; bytes a capital `B/s` (so "MB/s" is bytes and "Mb/s" bits, as usual).
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?\s*([a-zA-Z]*?)(/s|ps)?\s*", text)
    if match is None:
        raise ConfigError(f"cannot read bandwidth {text!r}; write it like {BANDWIDTH_FORMS}")
    number, exponent, unit, per_second = match.groups()
    value = float(number) * 10.0 ** int(exponent or 0)
    bits = _unit_bits(unit, per_second)
    if bits is None:
        raise ConfigError(f"unknown bandwidth unit in {text!r}; write it like {BANDWIDTH_FORMS}")
    if value <= 0:
        raise ConfigError(f"bandwidth {text!r} must be > 0")
    return value * bits


def _unit_bits(unit: str, per_second: str | None) -> float | None:
    """Bits per second of one `unit`, or None if the unit is not one of the accepted forms."""
    low = unit.lower()
    if low.endswith("bit") and low[:-3] in _DECIMAL:  # 1.6gbit, 500mbit/s
        return _DECIMAL[low[:-3]]
    if not per_second or not low.endswith("b"):
        return None  # a bare number, or an unknown word
    prefix = low[:-1]
    if unit.endswith("b"):  # a small b is bits: 4gbps, 1.6Gb/s
        return _DECIMAL.get(prefix)
    scale = _DECIMAL.get(prefix, _BINARY.get(prefix))  # 100MB/s, 200MiB/s are bytes
    return None if scale is None else 8 * scale


# ---------------------------------------------------------------- printing


def _gib(n: float) -> str:
    """Bytes in the largest binary unit under them (a debug model's megabytes read 0.0 GiB)."""
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:8.1f} {unit}"
    return f"{n:8.0f} B  "


def _gb(n: float) -> str:
    """Bytes sent, in the largest decimal unit under them."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:8.2f} {unit}"
    return f"{n:8.0f} B "


def _duration(seconds: float) -> str:
    """min, s, ms or us, whichever is the largest unit under it."""
    for unit, scale in (("min", 60.0), ("s  ", 1.0), ("ms ", 1e-3)):
        if seconds >= scale:
            return f"{seconds / scale:8.1f} {unit}"
    return f"{seconds * 1e6:8.1f} us "


def _flop(n: float, *, scale: float | None = None) -> str:
    """FLOPs in GFLOP, or MFLOP under one GFLOP (`scale`: that of another number, for its parts)."""
    scale = scale or (1e9 if n >= 1e9 else 1e6)
    return f"{n / scale:.1f} {'GFLOP' if scale == 1e9 else 'MFLOP'}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _rate(bps: float) -> str:
    return f"{bps / 1e9:.3g} Gbit/s ({bps / 8e9:.3g} GB/s)"


def _gathered(plan: Plan) -> str:
    if plan.reshard_after_forward is ReshardPolicy.NEVER:
        return "root + every block (reshard_after_forward never), gradients of root + 2 blocks"
    return "root + 2 blocks, with their gradients"


def format_plan(plan: Plan) -> str:
    """The plan as aligned lines with units, for the terminal."""
    g = plan.gpu
    fit = (f"fits, {(g.memory_bytes - plan.gpu_bytes) / GiB:.1f} GiB to spare" if plan.fits else
           f"DOES NOT FIT: {plan.shortfall_bytes / GiB:.1f} GiB more than the {device_gib(g.memory_bytes)} GiB "
           f"of one {g.name}; use more GPUs per node or larger GPUs")
    flop_scale = 1e9 if plan.flops_per_token >= 1e9 else 1e6
    sharding = f"FSDP2 over {plan.gpus_per_node} ranks" if plan.gpus_per_node > 1 else "one rank, no sharding"
    shard = ", shard" if plan.gpus_per_node > 1 else ", whole"
    lines = [
        f"{plan.num_nodes} nodes x {plan.gpus_per_node} {g.name} ({device_gib(g.memory_bytes)} GiB, "
        f"{g.peak_flops / 1e12:.0f} TFLOP/s bf16), {_rate(plan.bandwidth_bps)} per node, H = {plan.num_inner_steps}",
        f"parameters                 {plan.num_params:,} ({_count(plan.num_params)})",
        f"memory per GPU ({sharding}, {plan.compute_dtype.value} compute, micro-batch {plan.micro_batch_size}, "
        f"activation checkpointing {'full' if plan.activation_checkpointing else 'none'})",
        f"  {'weights (fp32' + shard + ')':23}  {_gib(plan.weights_bytes)}",
        f"  {'gradients (fp32' + shard + ')':23}  {_gib(plan.grads_bytes)}" if not plan.accumulates_unsharded else
        f"  {'gradients (' + plan.reduce_dtype.value + ', whole)':23}  {_gib(plan.grads_bytes)}   unsharded on "
        f"every GPU: accumulated over {plan.num_micro_batches} micro-batches, then reduce-scattered",
        f"  AdamW state (2 x fp32)   {_gib(plan.optimizer_bytes)}",
        f"  {'gathered ' + plan.compute_dtype.value + ' units':23}  {_gib(plan.gathered_bytes)}   "
        f"{_gathered(plan) if plan.gpus_per_node > 1 else 'none: nothing is sharded'}",
        f"  activations              {_gib(plan.activations_bytes)}   incl. fp32 logits",
        f"  total                    {_gib(plan.gpu_bytes)}   {fit}",
        f"host memory per node       {_gib(plan.host_bytes)}   " + (
            "none: data parallel keeps no outer state" if plan.strategy is Strategy.DATA_PARALLEL else
            "DiLoCo: fp32 weights, momentum, pseudo-gradient"),
        f"FLOPs per token            {_flop(plan.flops_per_token):>14}   6N "
        f"{_flop(plan.flops_per_token - plan.attention_flops_per_token, scale=flop_scale)} + attention "
        f"{_flop(plan.attention_flops_per_token, scale=flop_scale)} (forward and backward)",
        f"inner step                 {_duration(plan.inner_step_s)}   {plan.tokens_per_inner_step:,} tokens per "
        f"node at {100 * plan.mfu:.1f}% MFU",
        f"compute per outer step     {_duration(plan.compute_s)}   {plan.num_inner_steps} inner steps",
        f"sent per node per {plan.num_inner_steps} inner steps (ring all-reduce)",
    ]
    diloco = plan.strategy is Strategy.DILOCO
    for name, sent, seconds in (("fp32", plan.fp32_bytes, plan.fp32_all_reduce_s),
                                ("int8", plan.int8_bytes, plan.int8_all_reduce_s)):
        mark = "  <- this run" if diloco and (name == "int8") == (plan.compression is Compression.INT8) else ""
        times = plan.reduction(sent)
        less = f"{times:6.0f}x" if math.isfinite(times) else "   n/a"
        lines.append(f"  {'DiLoCo ' + name:23}  {_gb(sent)}    {less} less than data parallel, "
                     f"all-reduce {_duration(seconds).strip()}, compute utilisation "
                     f"{100 * plan.utilisation(seconds):5.1f}%{mark}")
    lines.append(f"  data parallel (fp32)     {_gb(plan.dp_bytes)}    gradients at each of the "
                 f"{plan.num_inner_steps} inner steps, all-reduce {_duration(plan.dp_all_reduce_s).strip()}, compute "
                 f"utilisation {100 * plan.utilisation(plan.dp_all_reduce_s):5.1f}%"
                 f"{'' if diloco else '  <- this run'}")
    lines.append(f"MFU with communication     {100 * plan.mfu * plan.compute_utilisation:8.1f} %")
    return "\n".join(lines)
