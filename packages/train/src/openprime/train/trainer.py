"""One node's training loop: an ordinary AdamW loop with DiLoCo wrapped around it (paper section 2.1).

`run_node` is what each node process runs. It joins the run through the coordinator (openprime.mesh),
builds the model (the same seed on every node; the coordinator compares the hashes of the initial
weights at the first barrier), reads its disjoint share of the data (its slot), and trains; every
`diloco.num_inner_steps` steps `DiLoCo.step()` runs the outer step with whichever nodes are alive.
A node started mid-run first waits for the next outer step and receives the state from a live peer;
a node that finds itself evicted (it was frozen) comes back the same way, as a new node. Per-step and
per-outer-step records go to the run's metrics JSONL; progress goes to stdout.
"""

from __future__ import annotations

import pathlib
import time
import warnings

import attrs
import torch

from openprime.ckpt import Checkpoint, Checkpointer, SaveMode
from openprime.core.errors import ConfigError, OpenPrimeError
from openprime.diloco import DiLoCo, OuterStepResult
from openprime.mesh import ElasticDeviceMesh, Evicted, MeshClient
from openprime.train.checkpointing import (
    InnerOptimizerState,
    load_node_part,
    node_checkpointer,
    node_state,
    part_name,
    restore_node,
    slot_of_part,
)
from openprime.train.config import RunConfig
from openprime.train.data import PackedBatches, Split, load_tokens, prepare_data
from openprime.train.loss import loss_with_max_z
from openprime.train.metrics import MetricsWriter, human_bytes, progress_line, say
from openprime.train.model import Llama
from openprime.train.optim import build_optimizer, clip_gradients
from openprime.train.schedule import build_lr_scheduler
from openprime.train.transports import codec_for, transport_factory


@attrs.frozen
class NodeSummary:
    """What a node reports when its run ends."""

    node: int
    first_loss: float
    last_loss: float
    num_outer_steps: int
    last_hash: str
    bytes_sent: int


def build_batches(cfg: RunConfig, slot: int) -> PackedBatches:
    """This node's disjoint share of the data: shard `slot` of `mesh.max_nodes` (the coordinator's slot)."""
    prepared = prepare_data(cfg.data)
    if prepared.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"the tokenizer has {prepared.vocab_size} tokens but model.vocab_size is "
                          f"{cfg.model.vocab_size}; raise model.vocab_size")
    return PackedBatches(load_tokens(prepared, Split.TRAIN), seq_len=cfg.train.seq_len,
                         batch_size=cfg.train.batch_size, node_rank=slot, num_nodes=cfg.mesh.max_nodes,
                         seed=cfg.data.seed + slot)


def join_mesh(cfg: RunConfig, coordinator: str, *, slot: int = -1) -> ElasticDeviceMesh:
    """Register this node with the coordinator (a new node id each time) and wrap it as DiLoCo's membership.

    `slot` asks for a data slot (a node resuming a checkpoint wants the one it saved).
    """
    client = MeshClient(coordinator, cfg.mesh)
    client.join(slot=slot)
    return ElasticDeviceMesh(client, transport_factory=transport_factory(cfg.transport, cfg.timeouts),
                             run_id=cfg.mesh.run_id, probe_bytes=cfg.mesh.probe_bytes,
                             probe_timeout_s=cfg.timeouts.op_s)


def catch_up(cfg: RunConfig, coordinator: str, diloco: DiLoCo, mesh: ElasticDeviceMesh, *,
             rejoin: bool) -> tuple[ElasticDeviceMesh, OuterStepResult]:
    """Wait for the next outer step as a newcomer and take the global state from a live peer.

    After an eviction (`rejoin`) the node first registers again as a new node. A newcomer evicted while
    it waits (frozen, or the coordinator restarted and does not know it) registers again, up to
    `mesh.num_join_tries` times.
    """
    for attempt in range(cfg.mesh.num_join_tries):
        if rejoin or attempt:
            mesh.close()
            mesh = join_mesh(cfg, coordinator)
            diloco.rejoin(mesh)
        try:
            result = diloco.sync(contribute=False)
            while not diloco.has_state:  # the transfer broke (its donor died): finish it at the next outer step
                say(f"[{mesh.client.node}] the state transfer did not complete; continuing it at the next outer step")
                result = diloco.sync(contribute=False)
            if diloco.behind:  # non-blocking: got the state after the others moved on; join the next outer step
                result = diloco.sit_out()
            return mesh, result
        except Evicted as e:
            say(f"[{mesh.client.node}] evicted while waiting to be admitted ({e}); registering again")
    raise OpenPrimeError(f"evicted {cfg.mesh.num_join_tries} times while waiting to be admitted; giving up")


def follow_schedule(sched: torch.optim.lr_scheduler.LRScheduler, num_inner_steps_done: int) -> None:
    """After taking the state from a donor, move the learning-rate schedule to where the run is."""
    with warnings.catch_warnings():  # stepping a scheduler before its optimizer is the point here
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(num_inner_steps_done - sched.last_epoch):
            sched.step()


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


class Node:
    """What one node holds while it trains: model, optimizer, schedule, membership, data, checkpoints."""

    def __init__(self, cfg: RunConfig, *, node: int, coordinator: str, run_dir: pathlib.Path,
                 resume: Checkpoint | None) -> None:
        self.cfg, self.node, self.coordinator, self.run_dir = cfg, node, coordinator, run_dir
        self.model = Llama(cfg.model)
        self.model.init_weights(seed=cfg.train.seed)
        self.opt = build_optimizer(self.model, cfg.optim)
        self.sched = build_lr_scheduler(self.opt, num_warmup_steps=cfg.schedule.num_warmup_steps,
                                        num_decay_steps=cfg.schedule.num_decay_steps,
                                        num_steps=cfg.train.num_steps, shape=cfg.schedule.decay_shape)
        self.mesh = join_mesh(cfg, coordinator, slot=slot_of_part(resume.parts[node]) if resume else -1)
        self.metrics = MetricsWriter(run_dir, node)
        self.ckpt: Checkpointer | None = None
        # The run is under way: get its state at the next outer step (a resumed run restarts all its nodes).
        self.joining = self.mesh.client.joined_epoch > 0 and resume is None
        self.diloco = DiLoCo(self.model.parameters(), config=cfg.diloco, timeouts=cfg.timeouts, membership=self.mesh,
                             codec=codec_for(cfg.diloco.compression), joining=self.joining,
                             extra=InnerOptimizerState(self.model, self.opt))
        self.batches: PackedBatches | None = None

    def start(self, resume: Checkpoint | None) -> None:
        """Catch up with a run under way, or continue from a checkpoint; then open data and checkpoints."""
        if self.joining:
            result = self.catch_up(rejoin=False)
            _report_outer(self.metrics, self.node, self.diloco.num_inner_steps_done, result)
        else:
            self._open_slot()
        if resume is not None:
            restore_node(load_node_part(resume, self.mesh.client.slot, self.model), model=self.model, opt=self.opt,
                         sched=self.sched, diloco=self.diloco, batches=self.batches)
            say(f"[node {self.node}] resumed from {resume.path} at inner step {self.diloco.num_inner_steps_done} "
                f"(outer step {self.diloco.num_outer_steps_done})")
        self.metrics.write("start", node_id=self.mesh.client.node, slot=self.mesh.client.slot, joining=self.joining,
                           resumed_from=str(resume.path) if resume else "", step=self.diloco.num_inner_steps_done,
                           state_hash=self.diloco.state.state_hash())

    def catch_up(self, *, rejoin: bool) -> OuterStepResult:
        """Take the run's state from a live peer at the next outer step (as a new node after an eviction)."""
        self.mesh, result = catch_up(self.cfg, self.coordinator, self.diloco, self.mesh, rejoin=rejoin)
        follow_schedule(self.sched, self.diloco.num_inner_steps_done)
        self._open_slot()
        return result

    def _open_slot(self) -> None:
        """This node's data shard and checkpoint part follow its data slot, which a rejoin may change."""
        self.batches = build_batches(self.cfg, self.mesh.client.slot)
        if self.ckpt is not None:
            self.ckpt.close()
        if self.cfg.checkpoint.mode is not SaveMode.OFF:
            self.ckpt = node_checkpointer(self.cfg.checkpoint, self.run_dir, self.mesh.client.slot)

    def checkpoint_due(self, stopping: bool) -> bool:
        done = self.diloco.num_inner_steps_done
        return self.ckpt is not None and (stopping or done % self.cfg.checkpoint.interval_steps == 0
                                          or done == self.cfg.train.num_steps)

    def save(self) -> None:
        """Checkpoint this node's part of the outer step just done; the parts are the slots of its members."""
        assert self.ckpt is not None and self.batches is not None
        state = node_state(model=self.model, opt=self.opt, sched=self.sched, diloco=self.diloco,
                           batches=self.batches, model_cfg=self.cfg.model)
        previous = self.ckpt.wait()
        view = self.mesh.view
        parts = [part_name(slot) for _, slot in view.slots] if view else [self.ckpt.part]
        if self.ckpt.part not in parts:
            parts.append(self.ckpt.part)
        step = self.diloco.num_inner_steps_done
        blocking_s = self.ckpt.save(step, state, parts=parts)
        self.metrics.write("checkpoint", step=step, blocking_s=blocking_s, parts=parts,
                           previous_total_s=previous.total_s if previous else None,
                           previous_failed=bool(previous and previous.path is None))

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()  # the last save is on disk before the process ends
        self.metrics.close()
        self.mesh.close()


def run_node(cfg: RunConfig, *, node: int, coordinator: str, run_dir: pathlib.Path, num_threads: int = 1,
             resume: Checkpoint | None = None) -> NodeSummary:
    """Train one node to the end of the run (or to train.stop_after_outer_steps); `resume`: continue from
    that checkpoint's part number `node` (the launcher starts as many nodes as the checkpoint has parts)."""
    torch.set_num_threads(num_threads)
    n = Node(cfg, node=node, coordinator=coordinator, run_dir=run_dir, resume=resume)
    try:
        n.start(resume)
        diloco, stop_at = n.diloco, cfg.train.stop_after_outer_steps
        if stop_at and diloco.num_outer_steps_done >= stop_at:
            say(f"[node {node}] already past train.stop_after_outer_steps={stop_at}: running to the end")
            stop_at = 0
        tokens_per_step, sent = cfg.train.batch_size * cfg.train.seq_len, 0
        losses, outer, window_start = [], None, time.monotonic()
        while (step := diloco.num_inner_steps_done + 1) <= cfg.train.num_steps:
            inputs_BL, targets_BL = next(n.batches)
            lr = n.sched.get_last_lr()[0]
            losses.append(train_step(n.model, n.opt, n.sched, inputs_BL, targets_BL, cfg))
            n.metrics.write("step", step=step, loss=losses[-1], lr=lr)
            try:
                result = diloco.step()
            except Evicted as e:  # frozen or cut off: come back as a new node with the others' state
                say(f"[node {node}] {e}")
                result = n.catch_up(rejoin=True)
                n.metrics.write("rejoined", node_id=n.mesh.client.node, slot=n.mesh.client.slot,
                                step=diloco.num_inner_steps_done)
            if result is not None:
                outer, sent = result, sent + result.bytes_sent
                _report_outer(n.metrics, node, step, result)
                stopping = bool(stop_at) and diloco.num_outer_steps_done >= stop_at
                if n.checkpoint_due(stopping):
                    n.save()
                if stopping:
                    say(f"[node {node}] stopping after outer step {stop_at} (train.stop_after_outer_steps); "
                        f"continue with --resume latest")
                    break
            if step % cfg.train.log_every == 0 or step == cfg.train.num_steps:
                elapsed, window_start = time.monotonic() - window_start, time.monotonic()
                say(progress_line(node=node, step=step, num_steps=cfg.train.num_steps, loss=losses[-1],
                                  tokens_per_s=tokens_per_step * cfg.train.log_every / elapsed,
                                  outer_steps=diloco.num_outer_steps_done, bytes_sent=sent, lr=lr))
        summary = NodeSummary(node=node, first_loss=losses[0] if losses else float("nan"),
                              last_loss=losses[-1] if losses else float("nan"),
                              num_outer_steps=diloco.num_outer_steps_done,
                              last_hash=outer.state_hash if outer else "", bytes_sent=sent)
        if n.ckpt is not None:
            n.ckpt.close()  # the last save is on disk before the node reports its end
        n.metrics.write("end", **attrs.asdict(summary))
        return summary
    finally:
        n.close()


def _report_outer(metrics: MetricsWriter, node: int, step: int, r: OuterStepResult) -> None:
    metrics.write("outer", step=step, **attrs.asdict(r))
    if r.skipped:
        say(f"[node {node}] outer step {r.outer_step} SKIPPED after {r.num_tries - 1} failed tries (on every node)")
        return
    retried = f" after {r.num_tries} tries" if r.num_tries > 1 else ""
    say(f"[node {node}] outer step {r.outer_step}: {r.num_contributors} of {r.num_members} nodes{retried}, "
        f"all-reduce {r.all_reduce_s:.2f}s, sent {human_bytes(r.bytes_sent)}, global state hash {r.state_hash[:12]}")
