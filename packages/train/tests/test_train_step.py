"""trainer.train_step against what it promises: gradient accumulation over micro-batches gives the gradient of the
whole batch (each micro-batch loss divided by their number), and the update is clipped to optim.max_grad_norm.

The FSDP tests (packages/fsdp/tests/test_fsdp.py) check accumulation with a training loop of their own, not with
train_step, and no test sets train.micro_batch_size below a rank's share or looks at the clipped gradient: dropping
the division by the number of micro-batches, or the clipping, left every test passing (a hand mutation review)."""

import pathlib

import attrs
import pytest
import torch

from openprime.train.model import Llama
from openprime.train.optim import build_optimizer
from openprime.train.recipe import load_recipe
from openprime.train.schedule import build_lr_scheduler
from openprime.train.trainer import build_model, train_step

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def debug_cfg():
    return load_recipe(ROOT / "recipes" / "debug.py").config()


def _node(cfg):
    model = Llama(cfg.model)
    model.init_weights(seed=0)
    opt = build_optimizer(model, cfg.optim)
    sched = build_lr_scheduler(opt, num_warmup_steps=cfg.schedule.num_warmup_steps,
                               num_decay_steps=cfg.schedule.num_decay_steps, num_steps=cfg.train.num_steps,
                               shape=cfg.schedule.decay_shape)
    return model, opt, sched


def _batch(cfg, batch_size: int, seq_len: int = 16):
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, cfg.model.vocab_size, (batch_size, seq_len), generator=g),
            torch.randint(0, cfg.model.vocab_size, (batch_size, seq_len), generator=g))


def test_micro_batches_accumulate_to_the_whole_batch_gradient(debug_cfg):
    batch_size = 4
    whole = attrs.evolve(debug_cfg, train=attrs.evolve(debug_cfg.train, batch_size=batch_size, micro_batch_size=0))
    split = attrs.evolve(debug_cfg, train=attrs.evolve(debug_cfg.train, batch_size=batch_size, micro_batch_size=1))
    assert (whole.num_micro_batches, split.num_micro_batches) == (1, 4)
    inputs_BL, targets_BL = _batch(debug_cfg, batch_size)
    results = []
    for cfg in (whole, split):
        torch.manual_seed(0)
        model, opt, sched = _node(cfg)
        ce, grad_norm = train_step(model, opt, sched, inputs_BL, targets_BL, cfg, local_rank=0)
        results.append((ce, grad_norm, {k: v.clone() for k, v in model.state_dict().items()}))
    (ce1, norm1, weights1), (ce4, norm4, weights4) = results
    assert ce4 == pytest.approx(ce1, rel=1e-5)
    assert norm4 == pytest.approx(norm1, rel=1e-4)  # the mean gradient over the batch, however it is split
    for name, w in weights1.items():
        torch.testing.assert_close(weights4[name], w, rtol=1e-4, atol=1e-6)


def test_the_update_is_clipped_to_max_grad_norm(debug_cfg):
    """AdamW largely normalises the gradient's scale away, so the weights say little: record the gradients that reach
    the optimizer instead, and check that their global norm is max_grad_norm when the raw norm is above it."""
    max_norm = 1e-3  # far below the debug model's gradient norm at initialisation
    cfg = attrs.evolve(debug_cfg, optim=attrs.evolve(debug_cfg.optim, max_grad_norm=max_norm))
    torch.manual_seed(0)
    model, opt, sched = _node(cfg)
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()
                                              if p.grad is not None])).item()))
    inputs_BL, targets_BL = _batch(cfg, cfg.train.batch_size)
    _, grad_norm = train_step(model, opt, sched, inputs_BL, targets_BL, cfg, local_rank=0)
    assert grad_norm > 10 * max_norm  # the raw norm, reported before clipping
    assert seen == [pytest.approx(max_norm, rel=1e-3)]  # what AdamW stepped on was clipped


def _body_gradient_sync(_transport, ctx, root: str) -> dict:
    """Two local ranks (Gloo) take one inner step of train_step on a batch of 8, 4 per rank in micro-batches of 1,
    once per fsdp.gradient_sync; each returns its weights' shards and the gradient norm."""
    from openprime.fsdp import GradientSync, destroy_local_mesh, init_local_mesh, local_shard

    torch.set_num_threads(1)
    base = load_recipe(pathlib.Path(root) / "recipes" / "debug.py").config()
    mesh = init_local_mesh(rank=ctx.rank, world_size=ctx.world_size, rendezvous=ctx.rendezvous, timeout_s=60)
    try:
        inputs_BL, targets_BL = _batch(base, 8)
        initial = {k: local_shard(v).clone() for k, v in build_model(
            attrs.evolve(base, fsdp=attrs.evolve(base.fsdp, num_local_ranks=2)), mesh, torch.device("cpu")
        ).state_dict().items()}
        out, syncs = {}, []
        import openprime.train.trainer as trainer

        sync = trainer.gradient_sync
        trainer.gradient_sync = lambda model, enabled: (syncs.append(enabled), sync(model, enabled))  # watched
        for policy in GradientSync:
            cfg = attrs.evolve(base, train=attrs.evolve(base.train, batch_size=8, micro_batch_size=1),
                               fsdp=attrs.evolve(base.fsdp, num_local_ranks=2, gradient_sync=policy))
            model = build_model(cfg, mesh, torch.device("cpu"))
            opt = build_optimizer(model, cfg.optim)
            sched = build_lr_scheduler(opt, num_warmup_steps=cfg.schedule.num_warmup_steps,
                                       num_decay_steps=cfg.schedule.num_decay_steps, num_steps=cfg.train.num_steps,
                                       shape=cfg.schedule.decay_shape)
            _, grad_norm = train_step(model, opt, sched, inputs_BL, targets_BL, cfg, local_rank=ctx.rank)
            out[policy.value] = (grad_norm, {k: local_shard(v).clone() for k, v in model.state_dict().items()})
        # Numbers only: tensors through the harness's queue are shared by file descriptor and die with the child.
        (norm_last, last), (norm_every, every) = out["last_micro_batch"], out["every_micro_batch"]
        return {"norms": (norm_last, norm_every), "worst": max(float((every[k] - w).abs().max())
                                                               for k, w in last.items()),
                "moved": min(float((w - before).abs().max()) for (k, w), before in zip(
                    last.items(), initial.values(), strict=True)), "syncs": syncs}
    finally:
        destroy_local_mesh()


def test_gradients_synced_every_micro_batch_train_as_synced_on_the_last():
    # fsdp.gradient_sync=every_micro_batch reduce-scatters after each micro-batch (the gradient stays sharded: 33 GiB
    # less per H100 at 10B) instead of once a step: the same mean gradient, summed in another order.
    from openprime.core.testing import run_group

    for rank_out in run_group(2, _body_gradient_sync, factory=None, args=(str(ROOT),), timeout_s=120):
        norm_last, norm_every = rank_out["norms"]
        assert norm_every == pytest.approx(norm_last, rel=1e-5)
        assert rank_out["worst"] < 1e-6  # every weight of this rank's shards, after the step
        # The step moved every tensor of the shard (AdamW's first step: about lr each): the same step, not none.
        assert rank_out["moved"] > 1e-5
        # FSDP2's reduce-scatter was on for the last of the 4 micro-batches, then for all 4.
        assert rank_out["syncs"] == [False, False, False, True] + [True] * 4
