"""Settings that passed the config checks and failed later (a traceback in every node, a run that could not be
continued, a setting replaced without a word): each is refused when the recipe's config is made, with the `--set`
that fixes it (from a review of the configuration, 2026-12-07)."""

import json
import pathlib

import pytest

from openprime.core.errors import ConfigError
from openprime.train.launcher import launch_config
from openprime.train.recipe import recipe_config
from openprime.train.terms import run_terms

ROOT = pathlib.Path(__file__).resolve().parents[3]
DEBUG = ROOT / "recipes" / "debug.py"


@pytest.mark.parametrize(("overrides", "expected"), [
    (["timeouts.connect_s=inf"], "Timeouts.connect_s must be finite, got inf"),
    (["optim.lr=inf"], "OptimizerConfig.lr must be finite"),
    (["optim.beta1=1"], "OptimizerConfig.beta1 must be < 1.0, got 1.0"),
    (["optim.beta2=1.0"], "OptimizerConfig.beta2 must be < 1.0"),
    (["train.stop_after_outer_steps=2", "checkpoint.mode=off"],
     "stops a run that saves no checkpoint (checkpoint.mode=off): it could not be continued"),
    (["data.val_fraction=0", "train.eval_every=20"],
     "data.val_fraction is 0 (no validation data): set data.val_fraction=0.01"),
    (["transport.kind=tcp", "transport.options.connect_timeout_s=300"],
     "transport.options.connect_timeout_s 300.0 is not used: a run's transports connect within timeouts.connect_s"),
    (["mesh.min_nodes=9"], "mesh.min_nodes 9 is more than mesh.max_nodes 8"),
    (["mesh.sync_timeout_s=2", "mesh.heartbeat_interval_s=0.5", "mesh.num_missed_heartbeats=6"],
     "mesh.sync_timeout_s 2 is under three eviction timeouts"),
    # A checkpoint is taken only at an outer step: an interval of 30 with H = 20 saved at 60, 120, ...
    (["diloco.num_inner_steps=20", "checkpoint.interval_steps=30"],
     "checkpoint.interval_steps 30 is not a multiple of diloco.num_inner_steps 20: a checkpoint is taken at an "
     "outer step, when every node holds the same global state (e.g. checkpoint.interval_steps=20)"),
    # The trainer gives each local rank batch_size // num_local_ranks sequences: a remainder would be dropped.
    (["train.batch_size=10", "fsdp.num_local_ranks=4"],
     "train.batch_size 10 is not divisible by fsdp.num_local_ranks 4: every local rank trains on an equal share "
     "of the node's batch (e.g. train.batch_size=8)"),
    (["train.batch_size=8", "fsdp.num_local_ranks=2", "train.micro_batch_size=8"],
     "train.batch_size 8 is not divisible by train.micro_batch_size 8 times fsdp.num_local_ranks 2: each local "
     "rank's share of 4 sequences must be a whole number of micro-batches"),
])
def test_a_setting_that_would_fail_later_is_refused_with_the_fix(overrides, expected):
    with pytest.raises(ConfigError) as e:
        recipe_config(DEBUG, overrides)
    assert expected in str(e.value), str(e.value)


def test_the_same_settings_that_would_work_pass():
    cfg = recipe_config(DEBUG, ["transport.kind=tcp", "timeouts.connect_s=30", "transport.options.connect_timeout_s=30",
                                "data.val_fraction=0", "train.eval_every=0", "optim.beta2=0.999"])
    assert cfg.timeouts.connect_s == 30 and cfg.optim.beta2 == 0.999


def test_a_typo_in_one_value_is_named_not_another_keys_rule():
    # checkpoint.interval_steps=4O (a letter O) with H = 40: the error was the interval rule, with the fix
    # "checkpoint.interval_steps=40", the value the user had typed.
    with pytest.raises(ConfigError, match=r"checkpoint.interval_steps: expected int, got '4O'"):
        recipe_config(DEBUG, ["diloco.num_inner_steps=40", "checkpoint.interval_steps=4O"])


def test_terms_of_equal_configs_are_equal():
    # max_grad_norm=1 and 1.0, and weights 0.5/0.5 and 1/1 (relative): the same run, refused as disagreeing.
    from openprime.train.data import prepare_data

    one, other = recipe_config(DEBUG, ["optim.max_grad_norm=1"]), recipe_config(DEBUG, ["optim.max_grad_norm=1.0"])
    prepared = prepare_data(one.data)
    assert run_terms(one, prepared) == run_terms(other, prepared)
    import attrs
    halves = attrs.evolve(one, data=attrs.evolve(one.data, mixture=tuple(
        attrs.evolve(entry, weight=entry.weight / 2) for entry in one.data.mixture)))
    assert run_terms(halves, prepared) == run_terms(one, prepared)
    assert json.loads(run_terms(one, prepared)["optim.max_grad_norm"]) == 1


def test_a_launch_waits_for_the_recipes_min_nodes_when_more_than_its_own():
    cfg = recipe_config(DEBUG, ["mesh.min_nodes=4"])
    assert launch_config(cfg, 2).mesh.min_nodes == 4 and launch_config(cfg, 6).mesh.min_nodes == 6


def test_a_home_relative_checkpoint_directory_is_under_home(monkeypatch, tmp_path):
    from openprime.train.checkpointing import checkpoint_root

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = recipe_config(DEBUG, ["checkpoint.directory=~/ckpts"])
    assert checkpoint_root(cfg.checkpoint, tmp_path / "run") == tmp_path / "ckpts"
