"""One node's training loop: an ordinary AdamW loop with DiLoCo wrapped around it (paper section 2.1).

`run_node` is what each node process runs. It joins the run through the coordinator (openprime.mesh),
builds the model (the same seed on every node; the coordinator compares the hashes of the initial
weights at the first barrier), reads its disjoint share of the data (its slot), and trains; every
`diloco.num_inner_steps` steps `DiLoCo.step()` runs the outer step with whichever nodes are alive.
A node started mid-run first waits for the next outer step and receives the state from a live peer;
a node that finds itself evicted (it was frozen) comes back the same way, as a new node. Per-step and
per-outer-step records go to the run's metrics JSONL and progress to stdout (progress.py).

A node is `fsdp.num_local_ranks` processes (section 2.2): each runs this loop on its share of the node's
batch and holds one FSDP2 shard of the model, and its DiLoCo runs one ring with the same local rank of the
other nodes. `train.strategy=data_parallel` replaces DiLoCo by the baseline it is measured against:
gradients averaged over the nodes at every step (openprime.train.data_parallel).
"""

from __future__ import annotations

import math
import pathlib
import time
from collections.abc import Callable

import attrs
import torch
from torch.distributed.device_mesh import DeviceMesh

from openprime.ckpt import Checkpoint, Checkpointer, Fingerprint, SaveMode
from openprime.core.errors import ConfigError, OpenPrimeError
from openprime.core.transport import Rendezvous
from openprime.diloco import DiLoCo, OuterStepResult
from openprime.fsdp import (
    GradientSync,
    destroy_local_mesh,
    gradient_sync,
    init_local_mesh,
    local_all_reduce_mean,
    local_any,
    materialize,
    parallelize,
)
from openprime.mesh import ElasticDeviceMesh, Evicted, JoinRefused, MeshClient
from openprime.train.checkpointing import (
    InnerOptimizerState,
    load_node_part,
    node_checkpointer,
    node_state,
    part_name,
    parts_by_node,
    restore_node,
    saved_tokens,
    slot_of_part,
)
from openprime.train.config import RunConfig, Strategy, TensorBoard
from openprime.train.data import MixtureBatches, PreparedData, node_batches, prepare_data, validation_batches
from openprime.train.data_parallel import GradientAllReduce
from openprime.train.guard import NonFiniteSteps
from openprime.train.hardware import check_local_ranks, detect_device_type
from openprime.train.leaving import stop_deferred
from openprime.train.loss import loss_with_max_z, validation_loss
from openprime.train.metrics import (
    MetricsWriter,
    holds_outer_steps,
    say,
    tensorboard_installed,
)
from openprime.train.model import Llama
from openprime.train.optim import build_optimizer, clip_gradients
from openprime.train.progress import NodeSummary, Progress, say_outer
from openprime.train.schedule import build_lr_scheduler, follow_schedule
from openprime.train.terms import run_terms
from openprime.train.transports import codec_for, transport_factory


def build_batches(cfg: RunConfig, slot: int) -> MixtureBatches:
    """This node's disjoint share of the data mixture: slot `slot` of `mesh.max_nodes` (the coordinator's slot)."""
    prepared = prepare_data(cfg.data)
    if prepared.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"the tokenizer has {prepared.vocab_size} tokens but model.vocab_size is "
                          f"{cfg.model.vocab_size}; raise model.vocab_size")
    return node_batches(prepared, cfg.data, seq_len=cfg.train.seq_len, batch_size=cfg.train.batch_size,
                        slot=slot, num_slots=cfg.mesh.max_nodes)


def join_mesh(cfg: RunConfig, coordinator: str, *, slot: int = -1, local_rank: int = 0,
              local_mesh: DeviceMesh | None = None) -> ElasticDeviceMesh:
    """Register this node with the coordinator (a new node id each time) and wrap it as DiLoCo's membership.

    Only local rank 0 talks to the coordinator; the node's other local ranks learn the view from it.
    `slot` asks for a data slot (a node resuming a checkpoint wants the one it saved).
    """
    client = None
    if local_rank == 0:
        client = MeshClient(coordinator, cfg.mesh)
        client.join(slot=slot, terms=run_terms(cfg, prepare_data(cfg.data)))
    return ElasticDeviceMesh(client, transport_factory=transport_factory(cfg.transport, cfg.timeouts),
                             run_id=cfg.mesh.run_id, abort_poll_s=cfg.mesh.abort_poll_s,
                             connect_timeout_s=cfg.timeouts.connect_s, probe_bytes=cfg.mesh.probe_bytes,
                             probe_timeout_s=cfg.timeouts.op_s, local_rank=local_rank,
                             local_group=local_mesh.get_group() if local_mesh is not None else None)


def build_model(cfg: RunConfig, local_mesh: DeviceMesh | None, device: torch.device) -> Llama:
    """The model, built on the meta device, parallelised as `cfg.fsdp` says, then allocated (each local rank
    only its shards) and initialised from the run's seed: the same weights however many ranks share it."""
    with torch.device("meta"):
        model = Llama(cfg.model)
    parallelize(model, model.layers, local_mesh, config=cfg.fsdp)
    materialize(model, device=device, init=lambda: model.init_weights(seed=cfg.train.seed))
    return model


def catch_up(cfg: RunConfig, coordinator: str, diloco: DiLoCo, mesh: ElasticDeviceMesh, *, rejoin: bool,
             local_mesh: DeviceMesh | None, contribute: bool = False,
             started: float | None = None) -> tuple[ElasticDeviceMesh, OuterStepResult]:
    """Wait for the next outer step as a newcomer and take the global state from a live peer.

    After an eviction (`rejoin`) the node first registers again as a new node. A newcomer evicted while
    it waits (frozen, or the coordinator restarted and does not know it) registers again, up to
    `mesh.num_join_tries` times. Returns one result for the catching up: the last outer step's, with the bytes
    of every outer step the node took part in and whether it received the state in any of them.

    `contribute`: a node evicted at the end of its inner steps offers their pseudo-gradient to the first outer step
    it takes part in. It counts only where the coordinator lists the node as holding the run's state (every member
    was evicted at once, the coordinator's own link down): a node listed as new contributes zero whatever it offers
    (DiLoCo._try). Before 2026-12-07 every node offered zero there, and that outer step's inner training was lost.

    `started`: when the outer step that ended in the eviction began (time.monotonic()). The result's `total_s` is
    the whole wait from there: the failing outer step, the registration again, every outer step taken part in and
    the state's transfer. Only the outer steps' own seconds were counted, and a rejoin's minutes of timeouts read as
    training in the compute utilisation.
    """
    start = time.monotonic() if started is None else started
    for attempt in range(cfg.mesh.num_join_tries):
        if rejoin or attempt:
            slot = mesh.slot  # asked for again: its data position goes on there (a rejoin without one read from 0)
            mesh.close()
            mesh = join_mesh(cfg, coordinator, slot=slot, local_rank=mesh.local_rank, local_mesh=local_mesh)
            diloco.rejoin(mesh)
        try:
            results = [diloco.sync(contribute=contribute)]
            # The transfer broke (its donor died, or a link to one local rank): finish it at the next outer step.
            # The local ranks decide together: the mesh lists the node as new while any of them lacks the state
            # (each then takes it again), and ranks that left this loop apart would meet in other collectives.
            while local_any(not diloco.has_state, local_mesh):
                say(f"[{mesh.node_id}] the state transfer did not complete; continuing it at the next outer step")
                results.append(diloco.sync(contribute=False))
            if diloco.behind:  # non-blocking: got the state after the others moved on; join the next outer step
                results.append(diloco.sit_out())
            # One record for the catching up: the last outer step, with the bytes and the seconds of all of them
            # (the state's transfer among them: a record of the last one alone left the others' waits out of the
            # compute utilisation, which then read 0.7 where it was 0.1).
            return mesh, attrs.evolve(results[-1], bytes_sent=sum(r.bytes_sent for r in results),
                                      bytes_received=sum(r.bytes_received for r in results),
                                      total_s=max(time.monotonic() - start, sum(r.total_s for r in results)),
                                      all_reduce_s=sum(r.all_reduce_s for r in results),
                                      received_state=any(r.received_state for r in results))
        except Evicted as e:
            say(f"[{mesh.node_id}] evicted while waiting to be admitted ({e}); registering again")
    raise OpenPrimeError(f"evicted {cfg.mesh.num_join_tries} times while waiting to be admitted; giving up")


def train_step(model: Llama, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
               inputs_BL: torch.Tensor, targets_BL: torch.Tensor, cfg: RunConfig, *, local_rank: int,
               sync_gradients: Callable[[], None] | None = None) -> tuple[float, float]:
    """One inner step on this local rank's share of the node's batch: forward and backward per micro-batch
    (gradients reduce-scattered over the local ranks after the last, or after each: fsdp.gradient_sync), clip,
    AdamW, schedule. An update
    whose gradient norm is NaN or inf is skipped (openprime.train.guard); the schedule moves on regardless.

    Each rank takes rows [r * B / R, (r + 1) * B / R) of the node's B sequences. Every micro-batch loss is
    divided by the number of micro-batches and FSDP2 averages over the R ranks, so the gradient is the mean
    over the node's whole batch, as one process training on all of it would get. `sync_gradients` (data
    parallel) then averages the gradients over the nodes. Returns this rank's cross-entropy and the global
    gradient norm before clipping.
    """
    share = inputs_BL.shape[0] // cfg.fsdp.num_local_ranks
    rows = slice(local_rank * share, (local_rank + 1) * share)
    num_micro = cfg.num_micro_batches
    ce = 0.0
    for i, (micro_inputs_BL, micro_targets_BL) in enumerate(
            zip(inputs_BL[rows].chunk(num_micro), targets_BL[rows].chunk(num_micro), strict=True)):
        gradient_sync(model, i == num_micro - 1 or cfg.fsdp.gradient_sync is GradientSync.EVERY_MICRO_BATCH)
        loss = loss_with_max_z(model(micro_inputs_BL), micro_targets_BL, cfg.train.z_loss_weight)
        (loss.total / num_micro).backward()
        ce += loss.ce.item() / num_micro
    if sync_gradients is not None:
        sync_gradients()
    grad_norm = clip_gradients(model, cfg.optim.max_grad_norm)
    if math.isfinite(grad_norm):  # the same on every rank that shares weights: they skip alike
        opt.step()
        sched.step()
    else:
        follow_schedule(sched, sched.last_epoch + 1)  # without torch's warning of a scheduler stepped alone
    opt.zero_grad(set_to_none=True)
    return ce, grad_norm


def eval_batches(cfg: RunConfig, prepared: PreparedData) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The held-out batches of the validation loss: train.num_eval_batches of train.eval_batch_size sequences (the
    batch size if 0), the same on every node. ConfigError when a source's held-out tail holds no sequence: the
    launcher asks for them before its nodes start (it was said at the first evaluation, hours into a run)."""
    return list(validation_batches(prepared, cfg.data, seq_len=cfg.train.seq_len,
                                   batch_size=cfg.train.eval_batch_size or cfg.train.batch_size,
                                   num_batches=cfg.train.num_eval_batches))


class Node:
    """What one process of a node holds while it trains: model (or its shard), optimizer, schedule,
    membership, data, checkpoints. A node of R local ranks runs R of these, one per process."""

    def __init__(self, cfg: RunConfig, *, node: int, coordinator: str, run_dir: pathlib.Path,
                 resume: Checkpoint | None, local_rank: int = 0, local_rendezvous: Rendezvous | None = None,
                 first_device: int = 0, slot: int = -1) -> None:
        self.cfg, self.node, self.coordinator, self.run_dir = cfg, node, coordinator, run_dir
        self.local_rank, self.local_mesh = local_rank, None
        device_type = detect_device_type()
        check_local_ranks(cfg.fsdp, device_type=device_type,
                          local_world_size=cfg.fsdp.num_local_ranks if local_rendezvous is not None else 1)
        # One GPU per local rank, from the node's first (openprime.train.hardware.device_blocks); on a machine
        # without one, each local rank is a CPU process.
        self.device = torch.device("cuda", first_device + local_rank) if device_type == "cuda" else torch.device("cpu")
        if device_type == "cuda":
            torch.cuda.set_device(self.device)
        if cfg.fsdp.sharded:
            self.local_mesh = init_local_mesh(rank=local_rank, world_size=cfg.fsdp.num_local_ranks,
                                              rendezvous=local_rendezvous, timeout_s=cfg.local_group_timeout_s,
                                              device_type=device_type)
        self.model = build_model(cfg, self.local_mesh, self.device)
        self.opt = build_optimizer(self.model, cfg.optim)
        self.sched = build_lr_scheduler(self.opt, num_warmup_steps=cfg.schedule.num_warmup_steps,
                                        num_decay_steps=cfg.schedule.num_decay_steps,
                                        num_steps=cfg.train.num_steps, shape=cfg.schedule.decay_shape)
        # The data slot asked for (may be taken): a resumed node's saved one, else `slot` (-1: any).
        self.saved_slot = slot_of_part(parts_by_node(resume)[node][0]) if resume else slot
        self.mesh = join_mesh(cfg, coordinator, slot=self.saved_slot, local_rank=local_rank,
                              local_mesh=self.local_mesh)
        # Local rank 0 speaks for the node: its records and progress lines. Every local rank also records the
        # view it trained under ("local_outer"), which shows that a node's processes agree on it.
        tensorboard = cfg.metrics.tensorboard is TensorBoard.AUTO and tensorboard_installed() and local_rank == 0
        self.metrics = MetricsWriter(run_dir, node, tensorboard_dir=run_dir / "tensorboard" if tensorboard else None)
        self.ckpt: Checkpointer | None = None
        self.caught_up: OuterStepResult | None = None  # a joiner's catching up, in `start`
        # The run is under way: get its state at the next outer step (a resumed run restarts all its nodes).
        self.joining = self.mesh.joined_epoch > 0 and resume is None
        # A coordinator that restarted after every node of the run was gone knows no run (epoch 0), and a node
        # without a checkpoint would start it again from the initial weights: a second lineage under the same
        # outer-step numbers, in the same run directory. This machine's records know better: such a node waits
        # for the run's state as a newcomer, and is refused if no node holds it (the ranks agree on what they read).
        self.run_on_disk = (resume is None and not self.joining
                            and local_any(holds_outer_steps(run_dir), self.local_mesh))
        if self.run_on_disk:
            self.joining = True
            self.say(f"[node {node}] the coordinator at {coordinator} knows no run under way (it restarted?), but "
                     f"{run_dir} holds a run's outer steps: this node takes that run's state from a live node at the "
                     f"next outer step instead of starting the run again")
        self.diloco: DiLoCo | None = None
        self.dp: GradientAllReduce | None = None
        if cfg.train.strategy is Strategy.DILOCO:
            self.diloco = DiLoCo(self.model.parameters(), config=cfg.diloco, timeouts=cfg.timeouts,
                                 membership=self.mesh, codec=codec_for(cfg.diloco.compression), joining=self.joining,
                                 extra=InnerOptimizerState(self.model, self.opt, progress=self._progress,
                                                           adopt_progress=self._adopt_progress),
                                 lr_factor=self.sched.lr_lambdas[0])  # the schedule's factor at a step
        else:
            self.dp = GradientAllReduce(self.model.parameters(), membership=self.mesh, timeouts=cfg.timeouts,
                                        joining=self.joining)
        self.counters: DiLoCo | GradientAllReduce = self.diloco or self.dp  # inner and outer steps done
        self.batches: MixtureBatches | None = None
        # The tokens per node trained by inner step s: s * tokens_per_step + tokens_offset, the offset from a resume
        # of a run that had another batch size or sequence length (a joiner takes its donor's).
        self.tokens_per_step, self.tokens_offset = cfg.train.batch_size * cfg.train.seq_len, 0
        self._eval_batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def write(self, kind: str, **fields: object) -> None:
        if self.local_rank == 0:
            self.metrics.write(kind, **fields)

    def say(self, line: str) -> None:
        if self.local_rank == 0:
            say(line)

    def start(self, resume: Checkpoint | None) -> None:
        """Catch up with a run under way, or continue from a checkpoint; then open data and checkpoints."""
        if self.joining:
            try:
                result = self.catch_up(rejoin=False)
            except JoinRefused as e:
                if not self.run_on_disk:
                    raise
                raise JoinRefused(f"{e} (this node joined without a checkpoint because {self.run_dir} holds that "
                                  f"run's outer steps: a new run needs another --run-dir)") from e
            self.caught_up = result  # recorded by the loop's Progress, with every local rank's bytes
        else:
            self._open_slot()
        if resume is not None:
            if self.diloco is None:
                raise ConfigError("--resume continues a DiLoCo run; train.strategy=data_parallel does not checkpoint")
            # Another node took the saved slot first (one joining without a checkpoint, or a machine that shares
            # the disk): take the granted slot's part when the checkpoint holds one, else this node's own part
            # without its data position. The checkpoint's state is never dropped for a slot.
            part = self.part
            if part not in resume.parts:
                part = part_name(self.saved_slot, self.local_rank, self.cfg.fsdp.num_local_ranks)
                where = "where the node that held it left it" if self.batches.batch else "from the start"
                self.say(f"[node {self.node}] its saved data slot {self.saved_slot} went to another node: it continues "
                         f"from that slot's part on data slot {self.mesh.slot}, whose data it reads {where}")
            state = load_node_part(resume, part, self.model)
            saved_step = int(state["diloco"]["num_inner_steps_done"])
            self.tokens_offset = saved_tokens(state, self.tokens_per_step) - saved_step * self.tokens_per_step
            changed = restore_node(state, model=self.model, opt=self.opt,
                                   sched=self.sched, diloco=self.diloco,
                                   batches=self.batches if part == self.part else None,
                                   on_layout_change=self.cfg.data.on_layout_change)
            if changed:
                self.say(f"[node {self.node}] resumed with {', '.join(changed)}: the config's settings win over "
                         f"the checkpoint's")
            self.say(f"[node {self.node}] resumed from {resume.path} at inner step {self.diloco.num_inner_steps_done} "
                     f"(outer step {self.diloco.num_outer_steps_done})")
        self.write("start", node_id=self.mesh.node_id, slot=self.mesh.slot, data_batch=self.batches.batch,
                   joining=self.joining,
                   resumed_from=str(resume.path) if resume else "", step=self.counters.num_inner_steps_done,
                   state_hash=self.diloco.state.state_hash() if self.diloco else self.dp.weights_hash(),
                   host_state_numel=self.diloco.state.numel if self.diloco else 0,
                   num_local_ranks=self.cfg.fsdp.num_local_ranks, strategy=self.cfg.train.strategy.value)

    @property
    def part(self) -> str:
        """This process's checkpoint part: its node's data slot (and its local rank, when sharded)."""
        return part_name(self.mesh.slot, self.local_rank, self.cfg.fsdp.num_local_ranks)

    def catch_up(self, *, rejoin: bool, contribute: bool = False, started: float | None = None) -> OuterStepResult:
        """Take the run's state from a live peer at the next outer step (as a new node after an eviction)."""
        slot = self.mesh.slot
        self.mesh, result = catch_up(self.cfg, self.coordinator, self.diloco, self.mesh, rejoin=rejoin,
                                     local_mesh=self.local_mesh, contribute=contribute, started=started)
        follow_schedule(self.sched, self.diloco.num_inner_steps_done)
        if self.batches is None or self.mesh.slot != slot:
            # Back on its own slot (evicted and rejoined), a node goes on with its data where it was: until
            # 2026-12-07 it read the slot from its start again, its first batches in the same order.
            self._open_slot()
        self.mesh.report_slot_state(self.batches.state_dict)  # a new mesh after a rejoin
        return result

    def _open_slot(self) -> None:
        """This node's data shard and checkpoint part follow its data slot, which a rejoin may change. A slot that
        another node held goes on where that node last reported it was (at its last outer-step barrier): a
        replacement read it again from the start, batch for batch what the node before it had trained."""
        self.batches = build_batches(self.cfg, self.mesh.slot)
        inherited = self.mesh.inherited_slot_state
        if inherited is not None:
            try:
                self.batches.load_state_dict(inherited)
            except (ValueError, KeyError, TypeError) as e:
                self.say(f"[node {self.node}] reads data slot {self.mesh.slot} from its start: the position its "
                         f"previous node reported does not fit these batches ({e})")
            else:
                self.say(f"[node {self.node}] goes on with data slot {self.mesh.slot} where the node that held it "
                         f"left it ({self.batches.batch} batches read)")
        self.mesh.report_slot_state(self.batches.state_dict)
        if self.ckpt is not None:
            self.ckpt.close()
        if self.cfg.checkpoint.mode is not SaveMode.OFF:
            self.ckpt = node_checkpointer(self.cfg.checkpoint, self.run_dir, self.part)

    def evaluate(self) -> float:
        """The validation loss: mean cross-entropy over the held-out batches, the same sequences on every node.
        The batches are of train.eval_batch_size (the recipe's), each run through the model in micro-batches of
        this machine's size (its memory's: they were the batches, and nodes set up differently scored other
        sequences). Under FSDP2 every local rank runs the same forward passes: their all-gathers need each other."""
        if self._eval_batches is None:
            self._eval_batches = eval_batches(self.cfg, prepare_data(self.cfg.data))
        return validation_loss(self.model, self._eval_batches, micro_batch_size=self.cfg.forward_batch_size,
                               device=self.device)

    def tokens(self, step: int) -> int:
        """The tokens per node trained by the end of inner step `step`."""
        return step * self.tokens_per_step + self.tokens_offset

    def _progress(self) -> tuple[int, int]:
        """What a donor tells its joiner: (inner steps done, tokens per node trained by then)."""
        assert self.diloco is not None
        done = self.diloco.num_inner_steps_done
        return done, self.tokens(done)

    def _adopt_progress(self, steps: int, tokens: int) -> None:
        self.tokens_offset = tokens - steps * self.tokens_per_step

    def checkpoint_due(self, stopping: bool) -> bool:
        done = self.counters.num_inner_steps_done
        return self.ckpt is not None and (stopping or done % self.cfg.checkpoint.interval_steps == 0
                                          or done == self.cfg.train.num_steps)

    def save(self) -> None:
        """Checkpoint this process's part of the outer step just done; the parts are the members' slots (times
        the local ranks)."""
        assert self.ckpt is not None and self.batches is not None
        state = node_state(model=self.model, opt=self.opt, sched=self.sched, diloco=self.diloco,
                           batches=self.batches, model_cfg=self.cfg.model,
                           tokens=self.tokens(self.diloco.num_inner_steps_done))
        previous = self.ckpt.wait()
        view, ranks = self.mesh.view, self.cfg.fsdp.num_local_ranks
        slots = [slot for _, slot in view.slots] if view else []
        if self.mesh.slot not in slots:
            slots.append(self.mesh.slot)
        parts = [part_name(slot, r, ranks) for slot in slots for r in range(ranks)]
        step = self.diloco.num_inner_steps_done
        # The parts of one local rank hold the same shard of the global state on every node: a resume refuses a step
        # whose parts disagree (one re-saved after a resume from an older step, cut short).
        digest = self.diloco.state_hash
        fingerprint = Fingerprint(group=f"rank-{self.local_rank}", digest=digest) if digest else None
        blocking_s = self.ckpt.save(step, state, parts=parts, fingerprint=fingerprint)
        self.write("checkpoint", step=step, blocking_s=blocking_s, parts=parts,
                   previous_total_s=previous.total_s if previous else None,
                   previous_failed=bool(previous and previous.path is None))

    def report_outer(self, step: int, r: OuterStepResult, *, compute_utilisation: float | None = None) -> None:
        self.write("outer", step=step, **attrs.asdict(r), compute_utilisation=compute_utilisation)
        if self.local_rank == 0:
            say_outer(self.node, r)
        if self.cfg.fsdp.sharded and self.mesh.view is not None:
            view = self.mesh.view
            self.metrics.write("local_outer", local_rank=self.local_rank, outer_step=r.outer_step, epoch=view.epoch,
                               members=list(view.members), num_contributors=r.num_contributors, skipped=r.skipped)

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()  # the last save is on disk before the process ends
        self.metrics.close()
        self.mesh.close()
        destroy_local_mesh()


def save_if_due(n: Node, guard: NonFiniteSteps, step: int, *, stopping: bool) -> None:
    """After an outer step: save the node's checkpoint if one is due (every checkpoint.interval_steps, at the end, or
    `stopping`), unless its latest inner step had no finite gradient (it says so instead)."""
    if not n.checkpoint_due(stopping):
        return
    if guard.healthy:
        n.save()
    else:
        n.say(f"[node {n.node}] no checkpoint at step {step}: its latest inner step had no finite gradient")


def run_node(cfg: RunConfig, *, node: int, coordinator: str, run_dir: pathlib.Path, num_threads: int = 1,
             resume: Checkpoint | None = None, local_rank: int = 0,
             local_rendezvous: Rendezvous | None = None, first_device: int = 0, slot: int = -1) -> NodeSummary:
    """Train one node (this process: one of its local ranks) to the end of the run or to
    train.stop_after_outer_steps; `resume`: continue from that checkpoint's node number `node`; `slot`: the data
    slot a node without a checkpoint asks for (-1: any)."""
    torch.set_num_threads(num_threads)
    n = Node(cfg, node=node, coordinator=coordinator, run_dir=run_dir, resume=resume, local_rank=local_rank,
             local_rendezvous=local_rendezvous, first_device=first_device, slot=slot)
    try:
        n.start(resume)
        counters, stop_at = n.counters, cfg.train.stop_after_outer_steps
        # Where the run stood when this node came: its checkpoint's outer step, or for a node that joined (one
        # past a checkpoint's nodes in a resume, or a --join) the outer step before the one it caught up in.
        # A launch that came at or past the stop runs to the end; a joiner that caught up in the very outer step
        # the others stop after stops with them (it trained on alone to the end, and its saves pruned the stop's
        # checkpoint: found 2026-12-07).
        came_at = counters.num_outer_steps_done if n.caught_up is None else n.caught_up.outer_step - 1
        if stop_at and came_at >= stop_at:
            n.say(f"[node {node}] already past train.stop_after_outer_steps={stop_at}: running to the end")
            stop_at = 0
        progress = Progress(cfg, n)
        if n.caught_up is not None:
            progress.outer_done(counters.num_inner_steps_done, n.caught_up)
        guard = NonFiniteSteps(num_to_stop=cfg.num_nonfinite_steps_to_stop, lr=cfg.optim.lr, say=n.say,
                               node=node)
        if stop_at and counters.num_outer_steps_done >= stop_at:  # caught up in the stop's outer step
            save_if_due(n, guard, counters.num_inner_steps_done, stopping=True)
            n.say(f"[node {node}] stopping after outer step {stop_at} (train.stop_after_outer_steps), where it "
                  f"caught up; continue with --resume latest")
        while (step := counters.num_inner_steps_done + 1) <= cfg.train.num_steps and not (
                stop_at and counters.num_outer_steps_done >= stop_at):
            step_start = time.monotonic()
            inputs_BL, targets_BL = (t.to(n.device, non_blocking=True) for t in next(n.batches))
            lr = n.sched.get_last_lr()[0]
            outer_start = None
            try:
                ce, grad_norm = train_step(n.model, n.opt, n.sched, inputs_BL, targets_BL, cfg,
                                           local_rank=local_rank, sync_gradients=n.dp.sync if n.dp else None)
                loss = local_all_reduce_mean(ce, n.local_mesh)  # the node's loss: all its ranks' batches
                skipped = guard.update(step, grad_norm, loss)
                outer_start = time.monotonic()  # an outer step from here on, if one is due
                result = n.diloco.step(contribute=guard.healthy) if n.diloco else n.dp.step()
            except Evicted as e:  # frozen or cut off: come back as a new node with the others' state
                if n.diloco is None:
                    raise OpenPrimeError(f"{e}; a data-parallel node cannot rejoin (use train.strategy=diloco)") from e
                n.say(f"[node {node}] {e}")
                result = n.catch_up(rejoin=True, contribute=guard.healthy, started=outer_start)
                n.write("rejoined", node_id=n.mesh.node_id, slot=n.mesh.slot, step=counters.num_inner_steps_done)
            with stop_deferred():  # a stop once the outer step is done waits for its checkpoint's snapshot
                if result is not None and result.received_state:  # the run was further on than this node's state
                    follow_schedule(n.sched, counters.num_inner_steps_done)
                if result is not None and (result.received_state or (result.contributed and not skipped)):
                    guard.contributed()
                progress.step(step, loss, lr, time.monotonic() - step_start, result, grad_norm=grad_norm,
                              skipped=skipped)
                guard.stop_if_diverged(step)
                if result is not None:
                    stopping = bool(stop_at) and counters.num_outer_steps_done >= stop_at
                    save_if_due(n, guard, step, stopping=stopping)
                    if stopping:
                        n.say(f"[node {node}] stopping after outer step {stop_at} (train.stop_after_outer_steps); "
                              f"continue with --resume latest")
                        break
        summary = progress.summary()
        if n.ckpt is not None:
            n.ckpt.close()  # the last save is on disk before the node reports its end
        n.write("end", **attrs.asdict(summary), compute_utilisation=progress.clock.compute_utilisation())
        return summary
    finally:
        n.close()
