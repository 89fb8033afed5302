"""One node's training loop: an ordinary AdamW loop with DiLoCo wrapped around it (paper section 2.1).

`run_node` is what each node process runs. It builds the model (the same seed on every node, checked
by comparing hashes before the first step), reads its disjoint share of the data, and trains; every
`diloco.num_inner_steps` steps `DiLoCo.step()` averages the pseudo-gradients over the transport.
Per-step and per-outer-step records go to the run's metrics JSONL; progress goes to stdout.
"""

from __future__ import annotations

import os
import pathlib
import time

import attrs
import torch

from openprime.core.errors import ConfigError
from openprime.core.transport import Rendezvous
from openprime.diloco import DiLoCo, OuterStepResult
from openprime.train.config import RunConfig
from openprime.train.data import PackedBatches, Split, load_tokens, prepare_data
from openprime.train.loss import loss_with_max_z
from openprime.train.metrics import MetricsWriter, human_bytes, progress_line, say
from openprime.train.model import Llama
from openprime.train.optim import build_optimizer, clip_gradients
from openprime.train.schedule import build_lr_scheduler
from openprime.train.transports import transport_factory


@attrs.frozen
class NodeSummary:
    """What a node reports when its run ends."""

    node: int
    first_loss: float
    last_loss: float
    num_outer_steps: int
    last_hash: str
    bytes_sent: int


def build_batches(cfg: RunConfig, node_rank: int, num_nodes: int) -> PackedBatches:
    prepared = prepare_data(cfg.data)
    if prepared.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"the tokenizer has {prepared.vocab_size} tokens but model.vocab_size is "
                          f"{cfg.model.vocab_size}; raise model.vocab_size")
    return PackedBatches(load_tokens(prepared, Split.TRAIN), seq_len=cfg.train.seq_len,
                         batch_size=cfg.train.batch_size, node_rank=node_rank, num_nodes=num_nodes,
                         seed=cfg.data.seed + node_rank)


def train_step(model: Llama, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
               inputs_BL: torch.Tensor, targets_BL: torch.Tensor, cfg: RunConfig) -> float:
    """Forward, backward, clip, AdamW step, schedule step; returns the cross-entropy."""
    logits_BLV = model(inputs_BL)
    loss = loss_with_max_z(logits_BLV, targets_BL, cfg.train.z_loss_weight)
    loss.total.backward()
    clip_gradients(model, cfg.optim.max_grad_norm)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return loss.ce.item()


def run_node(cfg: RunConfig, *, node_rank: int, num_nodes: int, rendezvous: Rendezvous,
             run_dir: pathlib.Path) -> NodeSummary:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_nodes))
    model = Llama(cfg.model)
    model.init_weights(seed=cfg.train.seed)
    batches = build_batches(cfg, node_rank, num_nodes)
    opt = build_optimizer(model, cfg.optim)
    sched = build_lr_scheduler(opt, num_warmup_steps=cfg.schedule.num_warmup_steps,
                               num_decay_steps=cfg.schedule.num_decay_steps, num_steps=cfg.train.num_steps,
                               shape=cfg.schedule.decay_shape)
    transport = transport_factory(cfg.transport, cfg.timeouts)(rendezvous, node_rank, num_nodes)
    metrics = MetricsWriter(run_dir, node_rank)
    try:
        diloco = DiLoCo(model.parameters(), config=cfg.diloco, transport=transport, timeouts=cfg.timeouts)
        metrics.write("start", num_nodes=num_nodes, state_hash=diloco.verify_replicas(transport))
        tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
        losses, outer, window_start = [], None, time.monotonic()
        for step in range(1, cfg.train.num_steps + 1):
            inputs_BL, targets_BL = next(batches)
            lr = sched.get_last_lr()[0]
            losses.append(train_step(model, opt, sched, inputs_BL, targets_BL, cfg))
            metrics.write("step", step=step, loss=losses[-1], lr=lr)
            result = diloco.step()
            if result is not None:
                outer = result
                _report_outer(metrics, node_rank, step, result)
            if step % cfg.train.log_every == 0 or step == cfg.train.num_steps:
                elapsed, window_start = time.monotonic() - window_start, time.monotonic()
                steps_in_window = step % cfg.train.log_every or cfg.train.log_every
                say(progress_line(node=node_rank, step=step, num_steps=cfg.train.num_steps, loss=losses[-1],
                                  tokens_per_s=tokens_per_step * steps_in_window / elapsed,
                                  outer_steps=diloco.num_outer_steps_done, bytes_sent=transport.bytes_sent, lr=lr))
        summary = NodeSummary(node=node_rank, first_loss=losses[0], last_loss=losses[-1],
                              num_outer_steps=diloco.num_outer_steps_done,
                              last_hash=outer.state_hash if outer else "", bytes_sent=transport.bytes_sent)
        metrics.write("end", **attrs.asdict(summary))
        return summary
    finally:
        metrics.close()
        transport.close()


def _report_outer(metrics: MetricsWriter, node: int, step: int, r: OuterStepResult) -> None:
    metrics.write("outer", step=step, **attrs.asdict(r))
    say(f"[node {node}] outer step {r.outer_step}: {r.num_contributors} nodes, all-reduce {r.all_reduce_s:.2f}s, "
        f"sent {human_bytes(r.bytes_sent)}, global state hash {r.state_hash[:12]}")
