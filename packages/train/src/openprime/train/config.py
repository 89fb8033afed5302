"""The whole run's config tree: the only place (with recipes) that sees every component at once.

A recipe builds a `RunConfig` from the components' own configs; `openprime run --set key=value`
changes one field; cross-field rules are checked here, before any process starts.
"""

from __future__ import annotations

import enum

import attrs

from openprime.ckpt import CheckpointConfig, SaveMode
from openprime.core.config import (
    config,
    field,
    half_open_unit_interval,
    instance_of,
    non_negative_float,
    non_negative_int,
    one_of_enum,
    positive_float,
    positive_int,
)
from openprime.core.errors import ConfigError
from openprime.core.streams import StreamTransportConfig
from openprime.core.timeouts import Timeouts
from openprime.diloco import DiLoCoConfig
from openprime.fsdp import FSDPConfig
from openprime.mesh import MeshConfig
from openprime.train.data import DataConfig
from openprime.train.model import ModelConfig
from openprime.train.schedule import ScheduleConfig, validate_schedule


@config
class OptimizerConfig:
    """The inner optimizer: AdamW with gradient clipping (INTELLECT-1, Appendix A)."""

    lr: float = field(7.5e-5, doc="peak inner learning rate", validator=positive_float())
    beta1: float = field(0.9, doc="AdamW beta1", validator=half_open_unit_interval())
    beta2: float = field(0.95, doc="AdamW beta2", validator=half_open_unit_interval())
    eps: float = field(1e-8, doc="AdamW epsilon", validator=positive_float())
    weight_decay: float = field(0.1, doc="AdamW decoupled weight decay", validator=non_negative_float())
    max_grad_norm: float = field(1.0, doc="clip the global gradient norm to this", validator=positive_float())
    num_nonfinite_steps_to_stop: int = field(
        0, doc="inner steps with a NaN or inf gradient norm (each skipped; the node then keeps its weights out of "
               "outer steps and checkpoints) since the node last contributed to the global weights, after which it "
               "stops: training has diverged (0: 3 x diloco.num_inner_steps); above diloco.num_inner_steps",
        validator=non_negative_int())


class Strategy(enum.Enum):
    """How the nodes combine their work."""

    DILOCO = "diloco"  # H inner steps alone, then an outer step on the averaged pseudo-gradients (the paper)
    DATA_PARALLEL = "data_parallel"  # gradients averaged over the nodes at every step: the baseline, H x the bytes


class TensorBoard(enum.Enum):
    """Whether metrics are also written as TensorBoard event files."""

    AUTO = "auto"  # when the tensorboard package is installed
    OFF = "off"


@config
class MetricsConfig:
    """What a run measures beyond the loss: utilisation of the devices and of the wall time."""

    peak_flops: float = field(0.0, doc="peak FLOP/s of one device, the denominator of MFU (0: the GPU's from the "
                                       "planner's table; no MFU on CPU or a GPU not in it)",
                              validator=non_negative_float())
    tensorboard: TensorBoard = field(TensorBoard.AUTO, doc="also write TensorBoard events (auto: if installed)",
                                     validator=one_of_enum(TensorBoard))


@config
class TrainConfig:
    """The inner loop of one node."""

    num_steps: int = field(90400, doc="inner steps of the whole run", validator=positive_int())
    seq_len: int = field(8192, doc="tokens per sequence", validator=positive_int())
    batch_size: int = field(128, doc="sequences per node per inner step (split over its local ranks)",
                            validator=positive_int())
    micro_batch_size: int = field(
        0, doc="sequences per forward and backward on one local rank; gradients accumulate over the rest "
               "of the rank's share (0: the whole share at once)", validator=non_negative_int())
    z_loss_weight: float = field(2e-4, doc="weight of the max-z auxiliary loss", validator=non_negative_float())
    seed: int = field(0, doc="seed of the weight init (the same on every node)", validator=instance_of(int))
    log_every: int = field(10, doc="print progress every this many inner steps", validator=positive_int())
    eval_every: int = field(0, doc="compute the validation loss every this many inner steps and at the end "
                                   "(0: never)", validator=non_negative_int())
    num_eval_batches: int = field(4, doc="held-out batches of the validation loss (the same on every node)",
                                  validator=positive_int())
    eval_batch_size: int = field(0, doc="sequences per held-out batch (0: train.batch_size); each is run in "
                                        "micro-batches of this machine's train.micro_batch_size",
                                 validator=non_negative_int())
    strategy: Strategy = field(Strategy.DILOCO, doc="diloco, or data_parallel (gradients averaged every step)",
                               validator=one_of_enum(Strategy))
    stop_after_outer_steps: int = field(
        0, doc="end this launch after this many outer steps of the run, with a checkpoint (0: run to the end); "
               "a launch resumed at or past it runs to the end", validator=non_negative_int())
    num_threads: int = field(
        0, doc="CPU threads of each node process (0: the cores this launch may use, shared among the processes it "
               "starts; set it when several launches share one machine)", validator=non_negative_int())


class TransportKind(enum.Enum):
    """Which Transport implementation carries the DiLoCo all-reduce."""

    GLOO = "gloo"  # torch.distributed Gloo: every node reaches every other directly (datacenter, VPN)
    TCP = "tcp"  # raw sockets, parallel connections, authentication: the public internet
    ZMQ = "zmq"  # ZeroMQ, the same features over its reconnecting sockets


@config
class TransportConfig:
    """The transport between nodes; a site file (`--network site.toml`) usually sets it."""

    kind: TransportKind = field(TransportKind.GLOO, doc="transport implementation: gloo, tcp or zmq",
                                validator=one_of_enum(TransportKind))
    options: StreamTransportConfig = field(
        factory=StreamTransportConfig, doc="address, connections, shaping and authentication (gloo: address only)",
        validator=instance_of(StreamTransportConfig))

    def __attrs_post_init__(self) -> None:
        if self.kind is TransportKind.GLOO and (self.options.shaping.active or self.options.auth.secret_file):
            raise ConfigError("the gloo transport has neither WAN shaping nor authentication; "
                              "use transport.kind=tcp or zmq for them")
        if self.kind is TransportKind.GLOO and self.options.listen_host is not None:
            raise ConfigError("the gloo transport listens on transport.options.hostname itself and cannot advertise "
                              "another address (behind NAT); use transport.kind=tcp or zmq for "
                              "transport.options.listen_host")


@config
class RunConfig:
    """Everything one run needs; built by a recipe."""

    name: str = field(doc="run name (the default run directory starts with it)", validator=instance_of(str))
    model: ModelConfig = field(doc="model architecture", validator=instance_of(ModelConfig))
    data: DataConfig = field(doc="training data and tokenizer", validator=instance_of(DataConfig))
    optim: OptimizerConfig = field(factory=OptimizerConfig, doc="inner optimizer",
                                   validator=instance_of(OptimizerConfig))
    schedule: ScheduleConfig = field(factory=ScheduleConfig, doc="inner learning-rate schedule",
                                     validator=instance_of(ScheduleConfig))
    train: TrainConfig = field(factory=TrainConfig, doc="inner loop", validator=instance_of(TrainConfig))
    diloco: DiLoCoConfig = field(factory=DiLoCoConfig, doc="outer loop", validator=instance_of(DiLoCoConfig))
    transport: TransportConfig = field(factory=TransportConfig, doc="transport between nodes",
                                       validator=instance_of(TransportConfig))
    timeouts: Timeouts = field(factory=Timeouts, doc="every deadline of the run", validator=instance_of(Timeouts))
    mesh: MeshConfig = field(factory=MeshConfig, doc="membership: heartbeats, eviction, retries",
                             validator=instance_of(MeshConfig))
    checkpoint: CheckpointConfig = field(factory=CheckpointConfig, doc="when and where nodes save their state",
                                         validator=instance_of(CheckpointConfig))
    metrics: MetricsConfig = field(factory=MetricsConfig, doc="utilisation metrics and TensorBoard",
                                   validator=instance_of(MetricsConfig))
    fsdp: FSDPConfig = field(factory=FSDPConfig, doc="FSDP2 inside each node: local ranks, precision, recompute",
                             validator=instance_of(FSDPConfig))

    def __attrs_post_init__(self) -> None:
        # The default run directory is runs/NAME-TIMESTAMP: an empty name made runs/-TIMESTAMP, and a "/" in it
        # made directories below runs/ or, with "..", outside it (found 2026-12-07 by review).
        if not self.name.strip() or "/" in self.name or "\\" in self.name or "\0" in self.name:
            raise ConfigError(f"name {self.name!r} cannot start a run directory's name: give a non-empty name "
                              f"without '/' (e.g. --set name=my-run)")
        if self.data.vocab_size != self.model.vocab_size:
            raise ConfigError(
                f"data.vocab_size {self.data.vocab_size} differs from model.vocab_size {self.model.vocab_size}; "
                "set both to the tokenizer's vocabulary size"
            )
        if self.train.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"train.seq_len {self.train.seq_len} exceeds model.max_seq_len {self.model.max_seq_len}; "
                "shorten the sequences or raise max_seq_len"
            )
        if self.train.num_steps % self.diloco.num_inner_steps:
            h = self.diloco.num_inner_steps
            raise ConfigError(
                f"train.num_steps {self.train.num_steps} is not a multiple of diloco.num_inner_steps {h}; "
                f"the run must end on an outer step (e.g. train.num_steps={max(h, self.train.num_steps // h * h)})"
            )
        if self.checkpoint.mode is not SaveMode.OFF and self.checkpoint.interval_steps % self.diloco.num_inner_steps:
            h, every = self.diloco.num_inner_steps, self.checkpoint.interval_steps
            raise ConfigError(
                f"checkpoint.interval_steps {every} is not a multiple of diloco.num_inner_steps {h}: a checkpoint "
                f"is taken at an outer step, when every node holds the same global state "
                f"(e.g. checkpoint.interval_steps={max(h, every // h * h)})"
            )
        num_to_stop, h = self.optim.num_nonfinite_steps_to_stop, self.diloco.num_inner_steps
        if self.train.strategy is Strategy.DILOCO and 0 < num_to_stop <= h:
            raise ConfigError(
                f"optim.num_nonfinite_steps_to_stop {num_to_stop} is not above diloco.num_inner_steps {h}: a replica "
                f"whose training diverged alone would stop before the outer step that brings it back to the others' "
                f"weights (e.g. optim.num_nonfinite_steps_to_stop={3 * h}, or 0 for that default)")
        if self.train.stop_after_outer_steps > self.num_outer_steps:
            raise ConfigError(f"train.stop_after_outer_steps {self.train.stop_after_outer_steps} is beyond the "
                              f"run's {self.num_outer_steps} outer steps; use 0 to run to the end")
        if self.train.stop_after_outer_steps and self.checkpoint.mode is SaveMode.OFF:
            raise ConfigError(f"train.stop_after_outer_steps {self.train.stop_after_outer_steps} stops a run that "
                              f"saves no checkpoint (checkpoint.mode=off): it could not be continued. Set "
                              f"checkpoint.mode=async, or train.stop_after_outer_steps=0")
        if self.train.eval_every and self.data.val_fraction == 0:
            raise ConfigError(f"train.eval_every {self.train.eval_every} evaluates on the validation split, but "
                              f"data.val_fraction is 0 (no validation data): set data.val_fraction=0.01, or "
                              f"train.eval_every=0")
        self._check_transport_timeouts()
        self._check_batch_split()
        if self.train.strategy is Strategy.DATA_PARALLEL and self.checkpoint.mode is not SaveMode.OFF:
            raise ConfigError("train.strategy=data_parallel does not checkpoint (it is the baseline DiLoCo is "
                              "measured against); set checkpoint.mode=off")
        validate_schedule(num_warmup_steps=self.schedule.num_warmup_steps,
                          num_decay_steps=self.schedule.num_decay_steps, num_steps=self.train.num_steps)

    def _check_transport_timeouts(self) -> None:
        """The transports connect within timeouts.connect_s (openprime.train.transports): their own
        connect_timeout_s, settable, was replaced without a word."""
        options = self.transport.options
        default = attrs.fields(type(options)).connect_timeout_s.default
        if options.connect_timeout_s not in (default, self.timeouts.connect_s):
            raise ConfigError(f"transport.options.connect_timeout_s {options.connect_timeout_s} is not used: a run's "
                              f"transports connect within timeouts.connect_s ({self.timeouts.connect_s}), which the "
                              f"other deadlines derive from. Set timeouts.connect_s={options.connect_timeout_s} "
                              f"instead")

    def _check_batch_split(self) -> None:
        """batch_size = local ranks x micro-batches per rank x micro_batch_size, exactly."""
        ranks, batch, micro = self.fsdp.num_local_ranks, self.train.batch_size, self.train.micro_batch_size
        if batch % ranks:
            raise ConfigError(f"train.batch_size {batch} is not divisible by fsdp.num_local_ranks {ranks}: every "
                              f"local rank trains on an equal share of the node's batch "
                              f"(e.g. train.batch_size={max(ranks, batch // ranks * ranks)})")
        if micro and (batch // ranks) % micro:
            raise ConfigError(f"train.batch_size {batch} is not divisible by train.micro_batch_size {micro} times "
                              f"fsdp.num_local_ranks {ranks}: each local rank's share of {batch // ranks} sequences "
                              f"must be a whole number of micro-batches (e.g. train.micro_batch_size=1)")

    @property
    def forward_batch_size(self) -> int:
        """Sequences in one forward on one local rank: train.micro_batch_size, or the rank's whole share when it
        is 0."""
        return self.train.micro_batch_size or self.train.batch_size // self.fsdp.num_local_ranks

    @property
    def num_micro_batches(self) -> int:
        """Forward-backward passes per local rank per inner step (gradient accumulation)."""
        return self.train.batch_size // self.fsdp.num_local_ranks // self.forward_batch_size

    @property
    def local_group_timeout_s(self) -> float:
        """Longest wait in the node's local group: local ranks other than 0 wait in it while rank 0 waits at the
        outer-step barrier for the slowest node. (A dead local rank does not make the others wait this long:
        the launcher stops a node's other processes when one of them dies.)"""
        return self.mesh.sync_timeout_s + self.timeouts.connect_s

    @property
    def num_nonfinite_steps_to_stop(self) -> int:
        """optim.num_nonfinite_steps_to_stop, its default resolved: three outer steps' worth of inner steps (a
        replica that diverged alone is taken back to the others' weights at the next one)."""
        return self.optim.num_nonfinite_steps_to_stop or 3 * self.diloco.num_inner_steps

    @property
    def num_outer_steps(self) -> int:
        return self.train.num_steps // self.diloco.num_inner_steps


def evolve(cfg: RunConfig, **changes: object) -> RunConfig:
    """attrs.evolve for recipes deriving from a base recipe (validated again)."""
    return attrs.evolve(cfg, **changes)
