"""How `openprime export` reads a checkpoint (checkpointing.load_model_weights): one node's parts, checksummed as
they are read, with a fall-back to another node's parts and then to the step before when they fail."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

import openprime.ckpt.manifest as manifest
from openprime.ckpt import CheckpointNotFound, write_part
from openprime.ckpt.store import step_dir
from openprime.core.config import to_dict
from openprime.train import checkpointing
from openprime.train.checkpointing import load_model_weights
from openprime.train.model import FLAVORS, Llama

DEBUG = FLAVORS["debug"]
PARTS = ("slot-0", "slot-1")


def _weights(seed: int) -> dict[str, torch.Tensor]:
    model = Llama(DEBUG)
    model.init_weights(seed=seed)
    return model.state_dict()


def _save(root, step: int, seed: int) -> None:
    """A step as two nodes save it: the same weights, and each node's own optimizer state."""
    for i, part in enumerate(PARTS):
        state = {"model": _weights(seed), "model_config": to_dict(DEBUG),
                 "optim": {"exp_avg": torch.randn(1000, generator=torch.Generator().manual_seed(i))}}
        write_part(root, step, part, state, parts=PARTS)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _flip_a_byte(part_dir) -> None:
    data_file = next(part_dir.glob("*.distcp"))
    with open(data_file, "r+b") as f:
        f.seek(data_file.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_only_the_part_read_is_checksummed(tmp_path, monkeypatch):
    # Before: the newest step was verified whole (every node's parts, optimizer states included, which at 10B on a
    # shared disk is terabytes), then the part read was verified again.
    _save(tmp_path, 20, seed=1)
    hashed = []
    digest = manifest.file_digest
    monkeypatch.setattr(manifest, "file_digest", lambda path: hashed.append(path) or digest(path))
    cfg, weights, part = load_model_weights(tmp_path)
    assert part == step_dir(tmp_path, 20) / "slot-0" and cfg == DEBUG and _same(weights, _weights(1))
    assert hashed and {p.parent.name for p in hashed} == {"slot-0"}, hashed
    assert len(hashed) == len(set(hashed)), "a file was hashed twice"


def test_a_corrupt_part_gives_way_to_another_node_s_part_of_the_same_step(tmp_path, caplog):
    _save(tmp_path, 20, seed=1)
    _save(tmp_path, 40, seed=2)
    _flip_a_byte(step_dir(tmp_path, 40) / "slot-0")
    with caplog.at_level(logging.WARNING, logger="openprime.train.checkpointing"):
        _, weights, part = load_model_weights(tmp_path)
    assert part == step_dir(tmp_path, 40) / "slot-1" and _same(weights, _weights(2))
    assert "cannot read slot-0 of checkpoint step 40" in caplog.text and "SHA-256" in caplog.text


def test_a_step_pruned_while_it_is_read_gives_way_to_the_step_before(tmp_path, monkeypatch, caplog):
    """A live run deletes its old checkpoints as it saves new ones; an export reading one must not fail for it."""
    _save(tmp_path, 20, seed=1)
    _save(tmp_path, 40, seed=2)
    read_part = checkpointing.read_part

    def pruned_first(path, **kwargs):
        if path.parent.name == "step-00000040":
            shutil.rmtree(path.parent)  # the run's prune, between choosing the step and reading it
        return read_part(path, **kwargs)

    monkeypatch.setattr(checkpointing, "read_part", pruned_first)
    with caplog.at_level(logging.WARNING, logger="openprime.train.checkpointing"):
        _, weights, part = load_model_weights(tmp_path)
    assert part == step_dir(tmp_path, 20) / "slot-0" and _same(weights, _weights(1))
    assert "cannot read slot-0 of checkpoint step 40" in caplog.text


def test_a_named_step_is_read_from_that_step_only(tmp_path):
    _save(tmp_path, 20, seed=1)
    _save(tmp_path, 40, seed=2)
    for part in PARTS:
        _flip_a_byte(step_dir(tmp_path, 40) / part)
    with pytest.raises(CheckpointNotFound, match=r"no usable checkpoint under .* at step 40: step 40 slot-0: .*"
                                                 r"SHA-256.*; step 40 slot-1: .*SHA-256"):
        load_model_weights(step_dir(tmp_path, 40))
    assert load_model_weights(tmp_path)[2] == step_dir(tmp_path, 20) / "slot-0"  # the root falls back


def test_a_step_without_a_whole_node_names_the_missing_parts_not_how_to_resume(tmp_path):
    # A node of 2 local ranks whose rank 1 never finished saving: the export's error advised "--nodes 1; more nodes
    # can join with --join and no --resume", a launch's words, about a command that launches nothing.
    parts = ("slot-0-rank-0", "slot-0-rank-1")
    model = Llama(DEBUG)
    model.init_weights(seed=1)
    write_part(tmp_path, 20, parts[0], {"model": model.state_dict(), "model_config": to_dict(DEBUG)}, parts=parts)
    with pytest.raises(CheckpointNotFound) as e:
        load_model_weights(tmp_path)
    message = str(e.value)
    assert "it holds 0 whole node(s) here (none) of the 1 that saved it (a node's parts are one per local rank; " \
           "missing here: slot-0-rank-1)" in message, message
    assert "--nodes" not in message and "--join" not in message, message
