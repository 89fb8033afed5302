"""restore_node after an outer step that was skipped (every try failed): each replica keeps its local weights,
not theta, and its checkpoint holds both. Until 2026-12-07 restore_node put theta into the model after the saved
weights (DiLoCo.load_state_dict), so the resumed node lost its inner steps since its last applied outer step while
keeping their AdamW moments, and its run was no longer bit-identical to the one never stopped."""

from __future__ import annotations

import copy
import pathlib

import numpy as np
import torch

from openprime.core.membership import Round, StaticMembership
from openprime.core.testing import local_group
from openprime.diloco import DiLoCo
from openprime.train.checkpointing import InnerOptimizerState, node_state, restore_node
from openprime.train.data import MixtureBatches
from openprime.train.optim import build_optimizer
from openprime.train.recipe import recipe_config
from openprime.train.schedule import build_lr_scheduler
from openprime.train.trainer import build_model, train_step

ROOT = pathlib.Path(__file__).resolve().parents[3]
CFG = recipe_config(str(ROOT / "recipes" / "debug.py"),
                    ["train.num_steps=60", "train.seq_len=32", "model.num_layers=2"])
H = CFG.diloco.num_inner_steps


class SkipsTheFirstOuterStep(StaticMembership):
    """Every try of outer step 0 failed: the coordinator's view says skip."""

    def begin(self, step, attempt, *, state_hash, hash_step) -> Round:
        return Round(transport=self.transport, step=step, attempt=attempt, skip=step == 0)


def _node():
    torch.manual_seed(0)
    model = build_model(CFG, None, torch.device("cpu"))
    opt = build_optimizer(model, CFG.optim)
    sched = build_lr_scheduler(opt, num_warmup_steps=CFG.schedule.num_warmup_steps,
                               num_decay_steps=CFG.schedule.num_decay_steps, num_steps=CFG.train.num_steps,
                               shape=CFG.schedule.decay_shape)
    diloco = DiLoCo(model.parameters(), config=CFG.diloco, timeouts=CFG.timeouts,
                    membership=SkipsTheFirstOuterStep(local_group(1)[0]), extra=InnerOptimizerState(model, opt),
                    lr_factor=sched.lr_lambdas[0])
    tokens = np.random.default_rng(0).integers(0, CFG.model.vocab_size, 50_000).astype(np.uint16)
    batches = MixtureBatches([tokens], [1.0], seq_len=CFG.train.seq_len, batch_size=CFG.train.batch_size, slot=0,
                             num_slots=CFG.mesh.max_nodes, seed=0)
    return model, opt, sched, diloco, batches


def _train(node, num_steps: int) -> list:
    model, opt, sched, diloco, batches = node
    results = []
    for _ in range(num_steps):
        inputs_BL, targets_BL = next(batches)
        train_step(model, opt, sched, inputs_BL, targets_BL, CFG, local_rank=0)
        results.append(diloco.step())
    return [r for r in results if r is not None]


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_a_node_resumed_after_a_skipped_outer_step_keeps_its_local_weights():
    uninterrupted = _node()
    assert [r.skipped for r in _train(uninterrupted, H)] == [True]
    model, opt, sched, diloco, batches = uninterrupted
    assert not torch.equal(_params(model), diloco.state.theta)  # the local weights are not theta
    saved = copy.deepcopy(node_state(model=model, opt=opt, sched=sched, diloco=diloco, batches=batches,
                                     model_cfg=CFG.model))
    resumed = _node()
    restore_node(saved, model=resumed[0], opt=resumed[1], sched=resumed[2], diloco=resumed[3], batches=resumed[4])
    assert torch.equal(_params(resumed[0]), _params(model))
    assert torch.equal(resumed[3].state.theta, diloco.state.theta)
    results = [_train(node, H) for node in (uninterrupted, resumed)]
    assert [r.skipped for r in results[0]] == [r.skipped for r in results[1]] == [False]
    assert resumed[3].state.state_hash() == diloco.state.state_hash()


def test_an_export_after_a_skipped_outer_step_writes_the_global_weights(tmp_path):
    """The export takes theta, the weights the replicas agreed on, not the part's model: after a skipped outer step
    that is its replica's own local weights (until 2026-12-07 the export wrote them). It reads the model and theta
    only, not the AdamW moments and the outer momentum."""
    from openprime.ckpt import write_part
    from openprime.train.checkpointing import load_model_weights

    model, opt, sched, diloco, batches = node = _node()
    assert [r.skipped for r in _train(node, H)] == [True]
    state = node_state(model=model, opt=opt, sched=sched, diloco=diloco, batches=batches, model_cfg=CFG.model)
    write_part(tmp_path, diloco.num_inner_steps_done, "slot-0", state, parts=["slot-0"])
    _, weights, _ = load_model_weights(tmp_path)
    exported = torch.cat([weights[name].reshape(-1) for name, _ in model.named_parameters()])
    assert torch.equal(exported, diloco.state.theta) and not torch.equal(exported, _params(model))
