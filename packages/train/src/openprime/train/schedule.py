"""Learning-rate schedule of the inner optimizer: warmup, stable, decay (WSD).

INTELLECT-1 (arXiv 2412.01152, section 3.1) warmed up linearly over 1000 steps, held the learning rate
(7.5e-5) constant, and cooled down over the final steps with the 1-sqrt shape of Hägele et al. 2024
("Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations", arXiv 2405.18392),
stable until step 74700 of 90400, i.e. `num_decay_steps = 15700`.

The schedule is a multiplicative factor on the optimizer's base learning rate, a function of the
inner step alone, so a resumed or joining node recomputes it from the step counter it receives:

    step < W                  factor = (step + 1) / W          linear warmup, the first step at 1/W
    W <= step < N - C         factor = 1                       stable
    N - C <= step             factor = shape((step - (N - C)) / C)   cooldown, 0 at step N

with W warmup steps, C decay (cooldown) steps, N total steps and shape(p) = 1 - sqrt(p) (1-sqrt),
1 - p (linear) or (1 + cos(pi p)) / 2 (cosine). The first warmup step is 1/W rather than 0 because a
step at learning rate 0 is wasted compute.
"""

from __future__ import annotations

import enum
import functools
import math
import warnings

import torch

from openprime.core.config import config, field, non_negative_int, one_of_enum
from openprime.core.errors import ConfigError


class DecayShape(enum.Enum):
    """Shape of the cooldown from factor 1 to 0 over the last `num_decay_steps` steps."""

    ONE_MINUS_SQRT = "1-sqrt"  # Hägele et al. 2024: matches cosine with a fraction of the decay steps
    LINEAR = "linear"
    COSINE = "cosine"


@config
class ScheduleConfig:
    """Warmup-stable-decay schedule (the total step count belongs to the run, not to the schedule)."""

    num_warmup_steps: int = field(1000, doc="steps of linear warmup from 1/num_warmup_steps to 1",
                                  validator=non_negative_int())
    num_decay_steps: int = field(15700, doc="steps of cooldown to 0 at the end of the run",
                                 validator=non_negative_int())
    decay_shape: DecayShape = field(DecayShape.ONE_MINUS_SQRT, doc="cooldown shape: 1-sqrt, linear or cosine",
                                    validator=one_of_enum(DecayShape))


def validate_schedule(*, num_warmup_steps: int, num_decay_steps: int, num_steps: int) -> None:
    """Raise ConfigError unless warmup and cooldown fit, without overlapping, into `num_steps`."""
    if num_steps < 1:
        raise ConfigError(f"schedule: num_steps must be >= 1, got {num_steps}")
    if num_warmup_steps < 0 or num_decay_steps < 0:
        raise ConfigError(f"schedule: num_warmup_steps ({num_warmup_steps}) and num_decay_steps "
                          f"({num_decay_steps}) must be >= 0")
    if num_warmup_steps + num_decay_steps > num_steps:
        raise ConfigError(f"schedule: num_warmup_steps {num_warmup_steps} + num_decay_steps "
                          f"{num_decay_steps} = {num_warmup_steps + num_decay_steps} exceeds num_steps "
                          f"{num_steps}; shorten warmup or cooldown, or raise num_steps")


def wsd_lr_factor(step: int, *, num_warmup_steps: int, num_decay_steps: int, num_steps: int,
                  shape: DecayShape) -> float:
    """The learning-rate multiplier at inner step `step` (0-based); see the module docstring."""
    if step < num_warmup_steps:
        return (step + 1) / num_warmup_steps
    decay_start = num_steps - num_decay_steps
    if step < decay_start:
        return 1.0
    if step >= num_steps:
        return 0.0  # past the planned end (e.g. an extended run): stay at 0 rather than go negative
    progress = (step - decay_start) / num_decay_steps
    if shape is DecayShape.ONE_MINUS_SQRT:
        return 1.0 - math.sqrt(progress)
    if shape is DecayShape.LINEAR:
        return 1.0 - progress
    if shape is DecayShape.COSINE:
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown decay shape {shape!r}")


def build_lr_scheduler(optimizer: torch.optim.Optimizer, *, num_warmup_steps: int, num_decay_steps: int,
                       num_steps: int, shape: DecayShape) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR applying `wsd_lr_factor` to each param group's initial lr; call `.step()` per step.

    The factor is a `functools.partial` (not a lambda) so that the scheduler's state_dict stays plain
    data that torch.distributed.checkpoint and `torch.load(weights_only=True)` accept.
    """
    validate_schedule(num_warmup_steps=num_warmup_steps, num_decay_steps=num_decay_steps, num_steps=num_steps)
    factor = functools.partial(wsd_lr_factor, num_warmup_steps=num_warmup_steps,
                               num_decay_steps=num_decay_steps, num_steps=num_steps, shape=shape)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def follow_schedule(sched: torch.optim.lr_scheduler.LRScheduler, num_inner_steps_done: int) -> None:
    """Move the learning-rate schedule forward to where the run is (after taking the state from a donor, or
    from a checkpoint): the lr is the config's peak times the factor at that step, as if it had stepped along. Also
    backwards: a node resumed from a checkpoint newer than the live run it joins takes the run's (older) state, and
    its schedule stayed ahead of the others' for the rest of the run before 2026-12-07."""
    with warnings.catch_warnings():  # stepping a scheduler before its optimizer is the point here
        warnings.simplefilter("ignore", UserWarning)
        if num_inner_steps_done < sched.last_epoch:  # LambdaLR's lr is a function of the step alone
            sched.last_epoch = num_inner_steps_done - 1
        for _ in range(num_inner_steps_done - sched.last_epoch):
            sched.step()


__all__ = ["DecayShape", "ScheduleConfig", "build_lr_scheduler", "follow_schedule", "validate_schedule",
           "wsd_lr_factor"]
