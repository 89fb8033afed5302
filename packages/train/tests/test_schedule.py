"""Tests of the warmup-stable-decay learning-rate schedule with INTELLECT-1's numbers."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from openprime.core.config import override
from openprime.core.errors import ConfigError
from openprime.train.schedule import (
    DecayShape,
    ScheduleConfig,
    build_lr_scheduler,
    follow_schedule,
    validate_schedule,
    wsd_lr_factor,
)

# INTELLECT-1: warmup 1000, stable until 74700, 1-sqrt cooldown to 0 at 90400.
intellect1 = functools.partial(wsd_lr_factor, num_warmup_steps=1000, num_decay_steps=15700, num_steps=90400,
                               shape=DecayShape.ONE_MINUS_SQRT)


def test_intellect1_values():
    assert intellect1(0) == pytest.approx(1 / 1000)
    assert intellect1(499) == pytest.approx(0.5)
    assert intellect1(999) == 1.0
    assert intellect1(1000) == 1.0
    assert intellect1(50_000) == 1.0
    assert intellect1(74_699) == 1.0
    assert intellect1(74_700) == 1.0  # the cooldown starts at 1
    assert intellect1(74_700 + 15_700 // 4) == pytest.approx(1 - math.sqrt(0.25))  # a quarter in: 0.5
    assert intellect1(74_700 + 15_700 * 9 // 100) == pytest.approx(1 - math.sqrt(0.09))  # 0.7
    assert intellect1(90_399) == pytest.approx(1 - math.sqrt(15_699 / 15_700))
    assert intellect1(90_400) == 0.0
    assert intellect1(100_000) == 0.0


def test_default_config_is_intellect1():
    cfg = ScheduleConfig()
    assert (cfg.num_warmup_steps, cfg.num_decay_steps, cfg.decay_shape) == (1000, 15700, DecayShape.ONE_MINUS_SQRT)
    assert override(cfg, "decay_shape", "linear").decay_shape is DecayShape.LINEAR


@pytest.mark.parametrize("shape", list(DecayShape))
def test_pieces_are_monotone_and_end_at_zero(shape):
    factors = [wsd_lr_factor(s, num_warmup_steps=10, num_decay_steps=30, num_steps=100, shape=shape)
               for s in range(101)]
    warmup, stable, cooldown = factors[:10], factors[10:70], factors[70:]
    assert all(a < b for a, b in zip(warmup, warmup[1:], strict=False))
    assert stable == [1.0] * 60
    assert all(a > b for a, b in zip(cooldown, cooldown[1:], strict=False))
    assert cooldown[0] == 1.0 and cooldown[-1] == 0.0
    assert all(0.0 <= f <= 1.0 for f in factors)


@pytest.mark.parametrize(("shape", "at_half"), [
    (DecayShape.ONE_MINUS_SQRT, 1 - math.sqrt(0.5)), (DecayShape.LINEAR, 0.5), (DecayShape.COSINE, 0.5)])
def test_cooldown_shapes_halfway(shape, at_half):
    factor = wsd_lr_factor(85, num_warmup_steps=0, num_decay_steps=30, num_steps=100, shape=shape)
    assert factor == pytest.approx(at_half)


def test_no_warmup_and_no_cooldown():
    constant = functools.partial(wsd_lr_factor, num_warmup_steps=0, num_decay_steps=0, num_steps=10,
                                 shape=DecayShape.LINEAR)
    assert [constant(s) for s in range(10)] == [1.0] * 10


@pytest.mark.parametrize(("warmup", "decay", "steps"), [(60, 50, 100), (0, 101, 100), (1, 0, 0)])
def test_schedules_that_do_not_fit_are_refused(warmup, decay, steps):
    with pytest.raises(ConfigError, match="num_steps"):
        validate_schedule(num_warmup_steps=warmup, num_decay_steps=decay, num_steps=steps)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ConfigError, match="num_steps"):
        build_lr_scheduler(optimizer, num_warmup_steps=warmup, num_decay_steps=decay, num_steps=steps,
                           shape=DecayShape.LINEAR)


def test_config_rejects_negative_counts():
    with pytest.raises(ConfigError, match="ScheduleConfig.num_warmup_steps"):
        ScheduleConfig(num_warmup_steps=-1)
    with pytest.raises(ConfigError, match="ScheduleConfig.decay_shape"):
        ScheduleConfig(decay_shape="1-sqrt")


def test_scheduler_drives_the_optimizer_and_resumes():
    def make() -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=7.5e-5)
        scheduler = build_lr_scheduler(optimizer, num_warmup_steps=4, num_decay_steps=4, num_steps=12,
                                       shape=DecayShape.ONE_MINUS_SQRT)
        return optimizer, scheduler

    optimizer, scheduler = make()
    lrs = []
    for _ in range(12):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = [7.5e-5 * wsd_lr_factor(s, num_warmup_steps=4, num_decay_steps=4, num_steps=12,
                                       shape=DecayShape.ONE_MINUS_SQRT) for s in range(12)]
    assert lrs == pytest.approx(expected)

    resumed_opt, resumed = make()
    fresh_opt, fresh = make()
    for _ in range(6):
        fresh_opt.step()
        fresh.step()
    resumed.load_state_dict(fresh.state_dict())
    resumed_opt.load_state_dict(fresh_opt.state_dict())
    assert resumed.get_last_lr() == fresh.get_last_lr() == [expected[6]]


def test_follow_schedule_moves_forward_and_back_to_the_lr_of_a_step():
    """A node takes a state from a peer or a checkpoint: its schedule goes to that state's step, behind its own one too
    (a node resumed from a newer checkpoint than the live run it joins): the lr is then exactly that of a scheduler
    that stepped to it."""
    def scheduler():
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
        return build_lr_scheduler(opt, num_warmup_steps=20, num_decay_steps=30, num_steps=100,
                                  shape=DecayShape.COSINE)

    stepped = {}
    reference = scheduler()
    for step in range(1, 101):
        reference.optimizer.step()
        reference.step()
        stepped[step] = reference.get_last_lr()[0]
    sched = scheduler()
    for step in (15, 60, 40, 85, 10, 100):
        follow_schedule(sched, step)
        assert sched.last_epoch == step
        assert sched.get_last_lr()[0] == stepped[step] == sched.optimizer.param_groups[0]["lr"], step
