"""The DiLoCo config: how often nodes synchronise and how the outer optimizer steps."""

from __future__ import annotations

import enum

from openprime.core.config import config, field, one_of_enum, positive_float, positive_int, unit_interval


class OuterOptimizer(enum.Enum):
    """The outer optimizer applied to the averaged pseudo-gradient."""

    NESTEROV = "nesterov"  # INTELLECT-1 and DiLoCo
    MOMENTUM = "momentum"  # heavy-ball SGD
    SGD = "sgd"  # no momentum: with lr 1.0 this is plain averaging of the replicas


class OuterLrSchedule(enum.Enum):
    """How the outer learning rate changes over the run."""

    CONSTANT = "constant"  # outer_lr throughout (INTELLECT-1, DiLoCo)
    # outer_lr times the inner schedule's factor (lr / peak lr) at each outer step: it warms up and cools down with
    # the inner steps, so the outer momentum stops moving the weights when they do.
    FOLLOW_INNER = "follow_inner"


class Compression(enum.Enum):
    """How pseudo-gradients travel in the all-reduce."""

    NONE = "none"  # fp32
    INT8 = "int8"  # INTELLECT-1's codebook quantizer (openprime.kernels): 4x fewer bytes


class PseudoGradientDevice(enum.Enum):
    """Where the pseudo-gradient is computed, encoded and summed during the outer step."""

    AUTO = "auto"  # params when the codec compresses (int8) and the parameters are on an accelerator, else host
    HOST = "host"  # host memory, beside the offloaded outer state (paper, section 2.4); the codec runs on the CPU
    # The parameters' device: theta is copied there, the codec runs there (Triton on CUDA) and only the payload
    # (int8: one byte a parameter) crosses to the host; costs a fp32 buffer of the parameters' size there
    # during the outer step, when the activations are gone.
    PARAMS = "params"


class RecoveryMode(enum.Enum):
    """How a joining node gets the state (INTELLECT-1 had both; openprime.diloco.recovery)."""

    BLOCKING = "blocking"  # the others wait at the barrier while it transfers
    NON_BLOCKING = "non_blocking"  # the others keep training; the joiner enters the next outer step


@config
class DiLoCoConfig:
    """DiLoCo settings; the defaults are INTELLECT-1's (paper, Appendix A)."""

    num_inner_steps: int = field(100, doc="inner steps (H) between outer steps", validator=positive_int())
    outer_lr: float = field(0.7, doc="outer learning rate", validator=positive_float())
    outer_momentum: float = field(0.9, doc="outer momentum (ignored by the sgd outer optimizer)",
                                  validator=unit_interval())
    outer_optimizer: OuterOptimizer = field(OuterOptimizer.NESTEROV, doc="outer optimizer",
                                            validator=one_of_enum(OuterOptimizer))
    outer_lr_schedule: OuterLrSchedule = field(OuterLrSchedule.CONSTANT,
                                               doc="constant, or follow_inner: scaled like the inner lr",
                                               validator=one_of_enum(OuterLrSchedule))
    compression: Compression = field(Compression.NONE, doc="pseudo-gradient encoding on the wire",
                                     validator=one_of_enum(Compression))
    pseudo_gradient_device: PseudoGradientDevice = field(
        PseudoGradientDevice.AUTO, doc="where the pseudo-gradient is computed and encoded: auto, host or params",
        validator=one_of_enum(PseudoGradientDevice))
    recovery: RecoveryMode = field(RecoveryMode.BLOCKING, doc="how joiners get the state: blocking or non_blocking",
                                   validator=one_of_enum(RecoveryMode))
