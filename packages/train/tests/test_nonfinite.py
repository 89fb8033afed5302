"""A gradient that goes NaN or inf: the update is skipped, the node stops contributing and checkpointing until it is
finite again, and a node that keeps diverging stops with the way to continue (openprime.train.guard); a resumed run
trains with its config's optimizer settings, not those saved in the checkpoint (the lower lr after a divergence)."""

from __future__ import annotations

import copy
import math
import pathlib

import attrs
import pytest
import torch

from openprime.core.errors import ConfigError
from openprime.core.testing import local_group
from openprime.core.timeouts import Timeouts
from openprime.diloco import DiLoCo, DiLoCoConfig
from openprime.train.checkpointing import node_state, restore_node
from openprime.train.config import OptimizerConfig, Strategy
from openprime.train.guard import Diverged, NonFiniteSteps
from openprime.train.model import Llama
from openprime.train.optim import build_optimizer
from openprime.train.recipe import load_recipe
from openprime.train.schedule import DecayShape, build_lr_scheduler, wsd_lr_factor
from openprime.train.trainer import train_step

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def debug_cfg():
    return load_recipe(ROOT / "recipes" / "debug.py").config()


def _schedule(opt: torch.optim.Optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    return build_lr_scheduler(opt, num_warmup_steps=cfg.schedule.num_warmup_steps,
                              num_decay_steps=cfg.schedule.num_decay_steps, num_steps=cfg.train.num_steps,
                              shape=cfg.schedule.decay_shape)


def test_a_step_with_a_nan_gradient_leaves_weights_and_adamw_alone(debug_cfg):
    """Before, AdamW took the step: NaN in every weight and both moments, and from there in every replica."""
    torch.manual_seed(0)
    model = Llama(debug_cfg.model)
    model.init_weights(seed=0)
    opt = build_optimizer(model, debug_cfg.optim)
    sched = _schedule(opt, debug_cfg)
    inputs_BL = torch.randint(0, debug_cfg.model.vocab_size, (2, 16))
    targets_BL = torch.randint(0, debug_cfg.model.vocab_size, (2, 16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    poison = next(iter(model.layers.values())).attention.wq.weight.register_hook(lambda g: g * float("nan"))
    ce, grad_norm = train_step(model, opt, sched, inputs_BL, targets_BL, debug_cfg, local_rank=0)
    assert math.isfinite(ce) and math.isnan(grad_norm)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not opt.state  # AdamW never stepped: no moments
    assert sched.last_epoch == 1  # the schedule moves on with the step counters
    assert all(p.grad is None for p in model.parameters())
    poison.remove()
    ce, grad_norm = train_step(model, opt, sched, inputs_BL, targets_BL, debug_cfg, local_rank=0)
    assert math.isfinite(grad_norm) and grad_norm > 0
    assert not torch.equal(before["output.weight"], model.state_dict()["output.weight"])
    assert all(torch.isfinite(s["exp_avg_sq"]).all() for s in opt.state.values())


def test_the_guard_withholds_a_diverging_node_and_stops_it_with_the_way_to_continue():
    said: list[str] = []
    guard = NonFiniteSteps(num_to_stop=5, lr=30.0, say=said.append, node=3)
    assert not guard.update(1, 0.5, 8.0) and guard.healthy and not said
    assert guard.update(2, float("nan"), float("nan")) and not guard.healthy
    assert guard.update(3, float("inf"), 1e5)
    assert len(said) == 1 and "[node 3] step 2: the gradient norm is nan" in said[0]
    assert not guard.update(4, 1.0, 9.0) and guard.healthy  # finite again: healthy, but not yet forgiven
    assert "finite again after 2 skipped step(s) (2-3)" in said[1]
    # The pattern of a run whose lr is far too high: each outer step rolls it back, one finite step, NaN again.
    for step in (5, 6):
        guard.update(step, float("nan"), 1e6)
        guard.stop_if_diverged(step)
    guard.update(7, float("nan"), 1e6)
    with pytest.raises(Diverged) as e:
        guard.stop_if_diverged(7)
    assert "5 inner steps had a NaN or inf gradient norm since this node last contributed" in str(e.value)
    assert "(steps 2-7;" in str(e.value) and "--resume latest --set optim.lr=15" in str(e.value)
    # A node that contributed again (or took the run's state from a peer) starts counting afresh.
    guard = NonFiniteSteps(num_to_stop=2, lr=1.0, say=said.append, node=0)
    guard.update(1, float("nan"), 1.0)
    guard.update(2, 1.0, 1.0)
    guard.contributed()
    assert guard.update(3, float("nan"), 1.0)
    guard.stop_if_diverged(3)


def test_a_stop_count_that_a_lone_replica_would_reach_before_its_outer_step_is_refused(debug_cfg):
    h = debug_cfg.diloco.num_inner_steps
    with pytest.raises(ConfigError, match=rf"not above diloco.num_inner_steps {h}.*num_nonfinite_steps_to_stop="
                                          rf"{3 * h}"):
        attrs.evolve(debug_cfg, optim=attrs.evolve(debug_cfg.optim, num_nonfinite_steps_to_stop=h))
    assert debug_cfg.num_nonfinite_steps_to_stop == 3 * h  # the default, 0, is three outer steps' worth
    assert attrs.evolve(debug_cfg, optim=attrs.evolve(debug_cfg.optim, num_nonfinite_steps_to_stop=h + 1)
                        ).num_nonfinite_steps_to_stop == h + 1
    dp = attrs.evolve(debug_cfg, train=attrs.evolve(debug_cfg.train, strategy=Strategy.DATA_PARALLEL),
                      checkpoint=attrs.evolve(debug_cfg.checkpoint, mode=debug_cfg.checkpoint.mode.OFF))
    attrs.evolve(dp, optim=attrs.evolve(dp.optim, num_nonfinite_steps_to_stop=1))  # no outer step to wait for


class _NoData:
    def state_dict(self) -> dict:
        return {}


def _node(optim: OptimizerConfig):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = build_optimizer(model, optim)
    sched = build_lr_scheduler(opt, num_warmup_steps=2, num_decay_steps=4, num_steps=10,
                               shape=DecayShape.ONE_MINUS_SQRT)
    diloco = DiLoCo(model.parameters(), config=DiLoCoConfig(num_inner_steps=1), transport=local_group(1)[0],
                    timeouts=Timeouts())
    return model, opt, sched, diloco


def _restore(state, nodes):
    model, opt, sched, diloco = nodes
    return restore_node(copy.deepcopy(state), model=model, opt=opt, sched=sched, diloco=diloco, batches=None)


def test_a_resumed_run_trains_with_its_configs_lr_not_the_checkpoints():
    """Before, the checkpoint's scheduler and param groups won: a run resumed after a divergence with
    `--set optim.lr=0.003` went on at lr 30 and diverged again at once."""
    model, opt, sched, diloco = _node(OptimizerConfig(lr=30.0))
    for _ in range(8):  # into the decay: the scheduled lr is below the peak
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    state = node_state(model=model, opt=opt, sched=sched, diloco=diloco, batches=_NoData(), model_cfg=_NoModel())
    factor = wsd_lr_factor(8, num_warmup_steps=2, num_decay_steps=4, num_steps=10, shape=DecayShape.ONE_MINUS_SQRT)
    assert 0 < factor < 1

    same = _node(OptimizerConfig(lr=30.0))
    assert _restore(state, same) == []  # the same config: the values the checkpoint saved, nothing to say
    assert same[1].param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 30.0 * factor
    assert same[2].get_last_lr() == sched.get_last_lr() and same[2].last_epoch == 8

    lower = _node(OptimizerConfig(lr=3e-3, beta2=0.99))
    changed = _restore(state, lower)
    assert changed == ["optim.betas (0.9, 0.99) (saved: (0.9, 0.95))", "optim.lr 0.003 (saved: 30.0)"]
    group = lower[1].param_groups[0]
    assert group["lr"] == pytest.approx(3e-3 * factor) and group["initial_lr"] == 3e-3
    assert group["betas"] == (0.9, 0.99)
    assert lower[2].get_last_lr() == [group["lr"]] and lower[2].last_epoch == 8
    for p, q in zip(model.parameters(), lower[0].parameters(), strict=True):  # the moments: the checkpoint's
        assert torch.equal(opt.state[p]["exp_avg_sq"], lower[1].state[q]["exp_avg_sq"])


@attrs.frozen
class _NoModel:
    """Stands in for the ModelConfig a checkpoint records (a Linear has none)."""
