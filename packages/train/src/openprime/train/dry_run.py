"""`openprime run RECIPE --dry-run`: the run, the model's FSDP2 sharding over a fake group of the node's local ranks
(meta device: nothing allocated), the plan and whether the model fits one GPU; with `--resume`, the checkpoint checked
as the launch would check it."""

from __future__ import annotations

import pathlib

import attrs
import torch

from openprime.train.config import RunConfig
from openprime.train.model import Llama, count_parameters

# The dry run plans for the paper's GPU and a typical public-internet link unless the site file shapes the
# link; `openprime plan` takes any other GPU and bandwidth.
DRY_RUN_GPU = "h100"
DRY_RUN_BANDWIDTH_BPS = 1e9


@attrs.frozen(kw_only=True)
class MetaShards:
    """What FSDP2 gave one local rank of a model built on the meta device (rank 0 of a fake group)."""

    num_params: int  # of the whole model (a sharded parameter's numel is its global one)
    num_local_ranks: int
    num_units: int  # FSDP2 units: one per block and the root; 0 when nothing is sharded
    shard_numel: int  # parameters one rank holds: rank 0's shards, which are the padded size every rank allocates
    shard_bytes: int
    max_padding: int  # the most dim-0 padding (elements, over all ranks) the parameters' shapes allow


def shard_on_meta(cfg: RunConfig) -> MetaShards:
    """Build the model on the meta device and apply the run's FSDP2 plan over a fake group of the node's
    local ranks (no peers, no memory); the fake group is destroyed before returning."""
    from torch.distributed.fsdp import FSDPModule

    from openprime.fsdp import destroy_local_mesh, fake_mesh, local_shard, parallelize

    ranks = cfg.fsdp.num_local_ranks
    with torch.device("meta"):
        model = Llama(cfg.model)
    mesh = fake_mesh(ranks) if cfg.fsdp.sharded else None
    try:
        parallelize(model, model.layers, mesh, config=cfg.fsdp)
        shards = [local_shard(p) for p in model.parameters()]
        assert all(s.is_meta for s in shards)
        return MetaShards(
            num_params=sum(p.numel() for p in model.parameters()), num_local_ranks=ranks,
            num_units=sum(isinstance(m, FSDPModule) for m in model.modules()),
            shard_numel=sum(s.numel() for s in shards), shard_bytes=sum(s.numel() * s.element_size() for s in shards),
            max_padding=sum((ranks - 1) * (p.numel() // p.shape[0]) for p in model.parameters()))
    finally:
        if mesh is not None:
            destroy_local_mesh()


def dry_run(cfg: RunConfig, num_nodes: int) -> None:
    """Print the run, the model's FSDP2 sharding over a fake group of the node's local ranks, and the plan;
    nothing is allocated (meta device). Raises ConfigError if the plan says one GPU is too small."""
    from openprime.train import planner

    num_params = count_parameters(cfg.model)
    embed = cfg.model.vocab_size * cfg.model.dim
    tokens_per_outer = cfg.train.batch_size * cfg.train.seq_len * cfg.diloco.num_inner_steps * num_nodes
    print(f"run {cfg.name!r}: {num_nodes} nodes, {cfg.train.num_steps:,} inner steps, "
          f"{cfg.num_outer_steps:,} outer steps of H={cfg.diloco.num_inner_steps}; "
          f"{tokens_per_outer:,} tokens per outer step across the nodes")
    shards = shard_on_meta(cfg)
    print(f"model: {shards.num_params:,} parameters ({num_params / 1e9:.2f}B; counted by hand: "
          f"{num_params:,}); {cfg.model.num_layers} layers, dim {cfg.model.dim}, "
          f"{cfg.model.num_heads} heads, {cfg.model.num_kv_heads} KV heads, FFN {cfg.model.ffn_hidden_dim}, "
          f"vocab {cfg.model.vocab_size}; embeddings + output {2 * embed:,}")
    ranks, fsdp = shards.num_local_ranks, cfg.fsdp
    train = (f"micro-batch {cfg.forward_batch_size} x "
             f"{cfg.num_micro_batches} accumulated per rank per inner step, activation checkpointing "
             f"{fsdp.activation_checkpointing.value}")
    if shards.num_units:
        print(f"FSDP2 over a fake {ranks}-rank group (meta device): {shards.num_units} units "
              f"({cfg.model.num_layers} blocks + root), {fsdp.param_dtype.value} compute, "
              f"{fsdp.reduce_dtype.value} gradient reduce-scatter; {train}")
    else:
        print(f"one local rank: no sharding, fp32 compute; {train}")
    plan = planner.plan_run(cfg, num_nodes=num_nodes, gpu=DRY_RUN_GPU,
                            bandwidth_bps=cfg.transport.options.shaping.rate_bps or DRY_RUN_BANDWIDTH_BPS,
                            latency_s=cfg.transport.options.shaping.latency_s)
    # FSDP2 pads dim 0 to a multiple of the ranks, the planner divides exactly: they may differ by that padding.
    padding = shards.shard_numel * ranks - plan.num_params
    excess_bytes = shards.shard_bytes - plan.weights_bytes
    if not (0 <= padding <= shards.max_padding and -1 <= excess_bytes <= planner.FP32 * shards.max_padding / ranks + 1):
        raise RuntimeError(f"FSDP2 gave each rank {shards.shard_bytes:,} bytes of weights, the planner "
                           f"{plan.weights_bytes:,.0f}: a bug in one of them")
    padded = f", {padding:,} parameters of dim-0 padding over the {ranks} ranks" if ranks > 1 else ""
    print(f"per local rank: {shards.shard_numel:,} parameters, {shards.shard_bytes:,} bytes of fp32 weights "
          f"({shards.shard_bytes / planner.GiB:.2f} GiB); the planner's: 4 x {num_params:,} / {ranks} = "
          f"{plan.weights_bytes:,.0f} bytes{padded}")
    print(f"plan (for other GPUs or bandwidths: openprime plan RECIPE --nodes {num_nodes} --gpu h200 "
          f"--bandwidth 500mbit)\n{planner.format_plan(plan)}")
    planner.check_fits(cfg, plan.gpu)


def dry_run_resume(spec: str, cfg: RunConfig, run_dir: pathlib.Path | None, *, num_nodes: int) -> None:
    """`--dry-run --resume spec`: the checkpoint the launch would resume from, found and checked (checksums, model,
    local ranks, later steps) as the launch checks it; the data layout is left to the launch (a dry run reads no
    data). `run_dir`: the launch's --run-dir (None: it would make a new one). Raises what the launch's check would."""
    from openprime.train.checkpointing import parts_by_node
    from openprime.train.resuming import resume_checkpoint

    found, _ = resume_checkpoint(spec, cfg, run_dir.resolve() if run_dir else None, num_nodes=num_nodes, skipped={})
    nodes = parts_by_node(found)
    print(f"resume: from {found.path} (step {found.step}, {len(nodes)} node(s) saved it"
          f"{f', {len(nodes[0])} local ranks each' if len(nodes[0]) > 1 else ''}; checksums verified, the model and "
          f"local ranks match the recipe); its data layout is checked when the run starts")
