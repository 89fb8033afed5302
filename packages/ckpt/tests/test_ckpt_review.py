"""Review of openprime.ckpt (2026-12): pruning that removed the last usable step, and a state that can never be
saved, taken for a full disk."""

from __future__ import annotations

import errno
import logging
import os

import pytest
import torch

from openprime.ckpt import (
    Checkpointer,
    CheckpointNotFound,
    Fingerprint,
    SaveMode,
    latest,
    list_steps,
    prune,
    step_dir,
    write_part,
)

TWO = ["slot-0", "slot-1"]


def make_state(step: int) -> dict:
    return {"model": {"w": torch.full((16,), float(step))}, "counters": {"step": step}}


def test_prune_does_not_count_a_step_that_mixes_two_saves_of_it(tmp_path) -> None:
    """A run rolled back to step 20 (past a loss spike) saves step 40 again over the old timeline's, part by part.
    Right after slot-0's save, step 40 holds slot-0 of the new save beside slot-1 of the old one: every part is
    there, so prune counted it complete and, with num_keep=1, removed step 20 while slot-1 was still writing. A kill
    then (or slot-1's save failing on a full disk) left no usable step: 40 mixes two saves, and 20 was gone."""
    for part in TWO:
        for step in (20, 40):
            write_part(tmp_path, step, part, make_state(step), parts=TWO,
                       fingerprint=Fingerprint(group="rank-0", digest=f"a{step}"))
    write_part(tmp_path, 40, "slot-0", make_state(41), parts=TWO, fingerprint=Fingerprint(group="rank-0", digest="b40"))
    prune(tmp_path, "slot-0", num_keep=1, saved=40)
    assert list_steps(tmp_path) == [20, 40]
    assert latest(tmp_path).step == 20  # what a kill now would resume from
    # slot-1's save of step 40 lands: the step is one save again, and step 20 goes.
    write_part(tmp_path, 40, "slot-1", make_state(41), parts=TWO, fingerprint=Fingerprint(group="rank-0", digest="b40"))
    prune(tmp_path, "slot-1", num_keep=1, saved=40)
    assert list_steps(tmp_path) == [40] and latest(tmp_path).step == 40


class NotJson:
    """A value a user's state may hold by mistake (numpy's int64 from a data loader is one)."""


def test_a_state_that_cannot_be_saved_leaves_no_step_directory(tmp_path) -> None:
    """write_part made the step directory before splitting the state: a TypeError left it empty, and it read as the
    run's newest step (list_steps, the end-of-run report)."""
    write_part(tmp_path, 20, "slot-0", make_state(20), parts=["slot-0"])
    with pytest.raises(TypeError, match="state value at 'data/position' is a NotJson"):
        write_part(tmp_path, 40, "slot-0", {**make_state(40), "data": {"position": NotJson()}}, parts=["slot-0"])
    assert list_steps(tmp_path) == [20]


@pytest.mark.parametrize("mode", [SaveMode.SYNC, SaveMode.ASYNC])
def test_a_state_that_cannot_be_saved_is_refused_by_save_not_logged_as_a_full_disk(tmp_path, caplog, mode) -> None:
    """A state holding a value that is neither a tensor nor JSON failed in the writer thread, where every failure
    is logged as a disk's ("FAILED: TypeError ... (is the disk full?) ... training continues"): the run went on, for
    weeks, saving no checkpoint at all. No later save can succeed, so save() says what to change at once."""
    ckpt = Checkpointer(tmp_path, part="slot-0", mode=mode, num_keep=2)
    ckpt.save(20, make_state(20), parts=["slot-0"])
    with caplog.at_level(logging.ERROR, logger="openprime.ckpt"), \
            pytest.raises(TypeError, match="state value at 'data/position' is a NotJson"):
        ckpt.save(40, {**make_state(40), "data": {"position": NotJson()}}, parts=["slot-0"])
    ckpt.close()
    assert "is the disk full" not in caplog.text
    assert [r.step for r in ckpt.results] == [20] and ckpt.num_failed == 0
    assert list_steps(tmp_path) == [20] and latest(tmp_path).step == 20
    ckpt.save(60, make_state(60), parts=["slot-0"])  # the checkpointer goes on working
    ckpt.close()
    assert latest(tmp_path).step == 60


def test_nothing_found_after_the_mixed_step_would_have_been_counted(tmp_path) -> None:
    """Guard for the first test's premise: a step that mixes two saves is not usable by itself."""
    for part in TWO:
        write_part(tmp_path, 40, part, make_state(40), parts=TWO, fingerprint=Fingerprint(group="g", digest=part))
    with pytest.raises(CheckpointNotFound, match="mixes two saves"):
        latest(tmp_path)
    assert step_dir(tmp_path, 40).is_dir()


def test_num_keep_below_one_is_refused(tmp_path) -> None:
    """num_keep=0 (meant as "keep none but the newest", or "keep all") kept every step (prune's oldest kept was the
    oldest complete one: a weeks-long run filled its disk) and, with no complete step yet, raised IndexError in the
    writer thread, where the save's result was lost (wait() returned the previous save's)."""
    with pytest.raises(ValueError, match="num_keep=0: keep at least the newest checkpoint"):
        Checkpointer(tmp_path, part="slot-0", mode=SaveMode.ASYNC, num_keep=0)
    write_part(tmp_path, 20, "slot-0", make_state(20), parts=["slot-0"])
    with pytest.raises(ValueError, match="num_keep=0: keep at least the newest checkpoint"):
        prune(tmp_path, "slot-0", num_keep=0)
    assert list_steps(tmp_path) == [20]


@pytest.mark.parametrize(("error", "hint"), [
    (errno.EACCES, "(no permission to write there?)"), (errno.EROFS, "(the disk is mounted read-only)"),
    (errno.ENOSPC, "(is the disk full?)")])
def test_a_failed_save_s_line_says_what_its_error_points_to(tmp_path, monkeypatch, caplog, error, hint):
    # Every failed save was logged "(is the disk full?)", a permission error or a read-only remount too.
    import openprime.ckpt.store as store

    def refuse(*args, **kwargs):
        raise OSError(error, os.strerror(error), "x")

    monkeypatch.setattr(store, "_tmp_name", refuse)
    ckpt = Checkpointer(tmp_path, part="slot-0", mode=SaveMode.SYNC, num_keep=2)
    with caplog.at_level("ERROR", logger="openprime.ckpt"):
        ckpt.save(10, {"w": torch.zeros(3)}, parts=["slot-0"])
    kind = type(OSError(error, "")).__name__  # PermissionError for EACCES
    assert f"FAILED: {kind}: [Errno {error}] {os.strerror(error)}: 'x' {hint}; 1 save(s)" in caplog.text, caplog.text


def test_an_error_of_the_prune_after_a_save_does_not_lose_the_save_s_result(tmp_path, monkeypatch, caplog):
    # Only an OSError of the prune was caught: any other (a part's state.json half-written by another machine, a bug
    # of a `usable` check) ended the writer thread before the save, done and in place, was recorded.
    import openprime.ckpt.saver as saver

    def broken(*args, **kwargs):
        raise KeyError("fingerprint")

    monkeypatch.setattr(saver, "prune", broken)
    ckpt = Checkpointer(tmp_path, part="slot-0", mode=SaveMode.ASYNC, num_keep=2)
    with caplog.at_level("WARNING", logger="openprime.ckpt"):
        ckpt.save(10, {"w": torch.zeros(3)}, parts=["slot-0"])
        ckpt.wait()
    assert [(r.step, r.path is not None) for r in ckpt.results] == [(10, True)]
    assert "could not prune old checkpoints" in caplog.text and "KeyError" in caplog.text
