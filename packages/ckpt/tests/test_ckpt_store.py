"""Checkpoints on disk: round trip, atomicity, checksums, fallback, mismatch errors and pruning."""

from __future__ import annotations

import logging
import os
import pathlib
import time

import pytest
import torch

from openprime.ckpt import (
    CheckpointMismatch,
    CheckpointNotFound,
    CorruptCheckpoint,
    Fingerprint,
    abandoned_steps,
    check_compatible,
    latest,
    list_steps,
    prune,
    read_part,
    resolve,
    step_dir,
    verify_manifest,
    write_part,
    writing_pids,
)
from openprime.ckpt.state import flatten


def make_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"layers.0.w": torch.randn(8, 4, generator=g), "norm.weight": torch.rand(4, generator=g)},
        "optim": {"state": {"layers.0.w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(8, 4, generator=g)}},
                  "param_groups": [{"lr": 1e-3 / 3, "betas": (0.9, 0.95), "fused": None, "params": ["layers.0.w"]}]},
        "counters": {"inner": 40 + seed, "outer": 2, "done": False},
        "rng": torch.randint(0, 255, (16,), dtype=torch.uint8, generator=g),
    }


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b and type(a) is type(b), (a, b)


def test_round_trip_is_exact(tmp_path: pathlib.Path) -> None:
    state = make_state(0)
    path = write_part(tmp_path, 40, "slot-0", state, parts=["slot-0"])
    assert path == step_dir(tmp_path, 40) / "slot-0"
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp")]
    loaded = read_part(path)
    state["optim"]["param_groups"][0]["betas"] = [0.9, 0.95]  # tuples come back as lists
    assert_same(state, loaded)
    assert loaded["optim"]["param_groups"][0]["lr"] == 1e-3 / 3  # floats bit-exact through JSON


def test_a_part_read_in_part_loads_only_the_tensors_asked_for(tmp_path: pathlib.Path) -> None:
    state = make_state(0)
    path = write_part(tmp_path, 40, "slot-0", state, parts=["slot-0"])
    loaded = read_part(path, only=("model", "optim/state/layers.0.w/exp_avg"))
    assert_same(loaded["model"], state["model"])
    assert loaded["counters"] == state["counters"]
    moments, saved = loaded["optim"]["state"]["layers.0.w"], state["optim"]["state"]["layers.0.w"]
    assert torch.equal(moments["exp_avg"], saved["exp_avg"])
    assert moments["step"] is None and loaded["rng"] is None  # not read


def test_flatten_refuses_what_it_cannot_store() -> None:
    with pytest.raises(TypeError, match="must be a string"):
        flatten({"state": {0: torch.zeros(1)}})
    with pytest.raises(TypeError, match="only tensors, dicts, lists"):
        flatten({"fn": object()})


def _flip_byte(path: pathlib.Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_and_truncated_files_are_detected_and_latest_falls_back(tmp_path, caplog) -> None:
    write_part(tmp_path, 20, "slot-0", make_state(1), parts=["slot-0"])
    newest = write_part(tmp_path, 40, "slot-0", make_state(2), parts=["slot-0"])
    data_file = next(newest.glob("*.distcp"))
    _flip_byte(data_file, data_file.stat().st_size // 2)
    with pytest.raises(CorruptCheckpoint, match=f"file {data_file.name} does not match its SHA-256"):
        verify_manifest(newest)
    with caplog.at_level(logging.WARNING, logger="openprime.ckpt"):
        found = latest(tmp_path)
    assert found.step == 20
    assert "skipping checkpoint step 40" in caplog.text and data_file.name in caplog.text
    assert_same(read_part(found.part("slot-0"))["model"], make_state(1)["model"])

    with open(data_file, "r+b") as f:  # truncated
        f.truncate(10)
    with pytest.raises(CorruptCheckpoint, match=r"has 10 bytes, the manifest says \d+ \(truncated"):
        read_part(newest)


def test_a_file_deleted_after_its_manifest_verified_is_a_corrupt_checkpoint(tmp_path, monkeypatch) -> None:
    """A live run prunes old checkpoints while `openprime export` may be reading one: DCP's own error for the vanished
    file is a BaseException (CheckpointException) that `except Exception` handlers let through; read_part says what
    happened instead."""
    import openprime.ckpt.store as store

    path = write_part(tmp_path, 20, "slot-0", make_state(1), parts=["slot-0"])
    verify = store.verify_manifest

    def verify_then_prune(directory, **kwargs):
        verify(directory, **kwargs)
        for data_file in directory.glob("*.distcp"):
            data_file.unlink()

    monkeypatch.setattr(store, "verify_manifest", verify_then_prune)
    with pytest.raises(CorruptCheckpoint, match=r"reading its tensors failed after its manifest verified "
                                                r"\(FileNotFoundError: .*was it deleted or changed while it was read"):
        read_part(path)


def test_a_step_missing_a_part_is_incomplete(tmp_path) -> None:
    write_part(tmp_path, 20, "slot-0", make_state(1), parts=["slot-0", "slot-1"])
    write_part(tmp_path, 20, "slot-1", make_state(2), parts=["slot-0", "slot-1"])
    write_part(tmp_path, 40, "slot-0", make_state(3), parts=["slot-0", "slot-1"])  # slot-1 never finished
    found = latest(tmp_path)
    assert (found.step, found.parts) == (20, ("slot-0", "slot-1"))
    with pytest.raises(CorruptCheckpoint, match="part slot-1 of .* is missing"):
        resolve(step_dir(tmp_path, 40))


def test_a_step_whose_parts_hold_two_saves_of_it_is_refused_and_the_previous_one_used(tmp_path) -> None:
    """A run resumed from step 20 of a run that saved 20, 40 and 60 saves step 40 again, part by part: killed after
    slot-0's save, step 40 held slot-0 of the new timeline beside slot-1 of the old. Every part verified, and the
    resumed replicas differed (ReplicaDivergence at their first outer step, at every resume). Each part now records
    the global-state hash of its save; parts of one group that disagree make the step unusable."""
    two = ["slot-0", "slot-1"]

    def save(step: int, part: str, digest: str, group: str = "rank-0") -> None:
        write_part(tmp_path, step, part, make_state(step), parts=two,
                   fingerprint=Fingerprint(group=group, digest=digest))

    for part in two:
        save(20, part, "a20")
        save(40, part, "a40")
    save(40, "slot-0", "b40")  # the resumed run's save of step 40, cut short before slot-1's
    with pytest.raises(CorruptCheckpoint, match="parts slot-0 and slot-1 hold different global states .hashes b40 "
                                                "and a40.: the step mixes two saves of it"):
        resolve(step_dir(tmp_path, 40))
    assert latest(tmp_path).step == 20
    assert latest(tmp_path, enough=lambda parts, named: None).step == 20  # a machine's own parts too
    save(40, "slot-1", "b40")  # the save finished
    assert latest(tmp_path).step == 40
    # Groups are compared within themselves (the local ranks' shards differ), and a part saved without a
    # fingerprint (before 2026-12-07) is not compared.
    write_part(tmp_path, 60, "slot-0", make_state(60), parts=two)
    save(60, "slot-1", "c60")
    assert latest(tmp_path).step == 60
    save(80, "slot-0", "r0", group="rank-0")
    save(80, "slot-1", "r1", group="rank-1")
    assert latest(tmp_path).step == 80


def test_a_failed_write_leaves_no_step_that_looks_newest(tmp_path, monkeypatch) -> None:
    # Found by hand on a full disk: every failed save left an empty step directory, and the end of the run reported
    # the newest of them ("newest: step 40") where no checkpoint had been saved at all.
    from openprime.ckpt import store

    write_part(tmp_path, 20, "slot-0", make_state(1), parts=["slot-0", "slot-1"])
    real_save = store.dcp.save

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store.dcp, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_part(tmp_path, 40, "slot-0", make_state(2), parts=["slot-0", "slot-1"])
    assert list_steps(tmp_path) == [20]  # the step that no part finished is gone
    with pytest.raises(OSError, match="No space left"):
        write_part(tmp_path, 20, "slot-1", make_state(3), parts=["slot-0", "slot-1"])
    assert list_steps(tmp_path) == [20] and (step_dir(tmp_path, 20) / "slot-0").is_dir()  # another part's step stays
    monkeypatch.setattr(store.dcp, "save", real_save)
    write_part(tmp_path, 20, "slot-1", make_state(3), parts=["slot-0", "slot-1"])
    assert latest(tmp_path).parts == ("slot-0", "slot-1")


def test_a_machine_with_its_own_parts_only_uses_what_is_enough_for_it(tmp_path, caplog) -> None:
    # Machine B of a two-machine run saved slot-1 of steps 20, 40 and 60 to its own disk (slot-0 is on machine A's);
    # its step 60 part is corrupt.
    for step in (20, 40, 60):
        write_part(tmp_path, step, "slot-1", make_state(step), parts=["slot-0", "slot-1"])
    data_file = next((step_dir(tmp_path, 60) / "slot-1").glob("*.distcp"))
    _flip_byte(data_file, data_file.stat().st_size // 2)
    with pytest.raises(CheckpointNotFound, match="part slot-0 of .* is missing"):
        latest(tmp_path)  # the default: every part of the step, here

    def one_part(parts: tuple[str, ...], named: tuple[str, ...]) -> str | None:
        assert named == ("slot-0", "slot-1") or not parts
        return None if parts else "no part of it is usable here"

    with caplog.at_level(logging.WARNING, logger="openprime.ckpt"):
        found = latest(tmp_path, enough=one_part)
    assert (found.step, found.parts, found.verified) == (40, ("slot-1",), True)
    assert "leaving part slot-1 of checkpoint step 60 out" in caplog.text and data_file.name in caplog.text
    # Every part of it here is damaged: the step is skipped as corrupt, naming the file, before `enough` is asked
    # (it said "0 whole node(s) here of the 0 that saved it", with advice for missing nodes; found by review).
    assert (f"skipping checkpoint step 60: checkpoint {step_dir(tmp_path, 60)} is corrupt: part slot-1 is corrupt: "
            f"file {data_file.name} does not match its SHA-256 checksum") in caplog.text
    assert "no part of it is usable here" not in caplog.text
    assert_same(read_part(found.part("slot-1"))["counters"], make_state(40)["counters"])
    assert resolve(step_dir(tmp_path, 20), enough=one_part).parts == ("slot-1",)
    with pytest.raises(CorruptCheckpoint, match="wants two"):
        resolve(step_dir(tmp_path, 20), enough=lambda parts, _: None if len(parts) >= 2 else "wants two")


def test_not_found_says_where_it_looked(tmp_path) -> None:
    with pytest.raises(CheckpointNotFound, match=f"no checkpoint under {tmp_path}"):
        latest(tmp_path)
    (step_dir(tmp_path, 20) / ".tmp-slot-0-1-abc").mkdir(parents=True)  # a save that was killed
    with pytest.raises(CheckpointNotFound, match="none complete, intact and enough here: .*no part finished saving"):
        latest(tmp_path)


def test_a_different_model_is_refused_with_the_first_mismatch(tmp_path) -> None:
    path = write_part(tmp_path, 20, "slot-0", make_state(0), parts=["slot-0"])
    check_compatible(path, {"model": make_state(5)["model"]})  # same shapes: fine
    wider = {"model": {"layers.0.w": torch.zeros(8, 6), "norm.weight": torch.zeros(4)}}
    with pytest.raises(CheckpointMismatch, match=r"tensor 'model/layers.0.w' is \(8, 4\) torch.float32 in the "
                                                 r"checkpoint but \(8, 6\) torch.float32 here"):
        check_compatible(path, wider)
    with pytest.raises(CheckpointMismatch, match="has no tensor 'model/extra'"):
        check_compatible(path, {"model": {**make_state(0)["model"], "extra": torch.zeros(1)}})
    with pytest.raises(CheckpointMismatch, match="has tensor 'model/norm.weight' that this model does not have"):
        check_compatible(path, {"model": {"layers.0.w": torch.zeros(8, 4)}})


def test_prune_keeps_the_newest_and_removes_leftovers(tmp_path) -> None:
    parts = ["slot-0", "slot-1"]
    for step in (20, 40, 60):
        write_part(tmp_path, step, "slot-0", make_state(step), parts=parts)
        write_part(tmp_path, step, "slot-1", make_state(step + 1), parts=parts)
    leftover = step_dir(tmp_path, 60) / ".tmp-slot-0-999-dead"
    leftover.mkdir()
    sibling_leftover = step_dir(tmp_path, 20) / ".tmp-slot-1-998-dead"
    sibling_leftover.mkdir()
    sibling_writing = step_dir(tmp_path, 60) / ".tmp-slot-1-997-live"  # in a step kept: maybe a save under way
    sibling_writing.mkdir()
    prune(tmp_path, "slot-0", num_keep=2)
    assert not leftover.exists() and sibling_writing.exists()
    # Step 20 is removed whole, slot-1's part and its leftover too: slot-1 saved 40 and 60 since, so no save of it
    # writes there, and a part that never saves again (its node gone for good) left its leftover there for ever.
    assert list_steps(tmp_path) == [40, 60] and not sibling_leftover.exists()


def test_a_directory_put_beside_the_parts_of_a_step_does_not_stop_the_pruning(tmp_path) -> None:
    """A directory that is no part (a copy someone made, here "slot-0.bak") was counted among the parts this disk
    holds of the layout: no later step held it, none was complete, and no step was ever pruned again."""
    for step in (20, 40, 60, 80):
        write_part(tmp_path, step, "slot-0", make_state(step), parts=["slot-0"])
        if step == 20:
            (step_dir(tmp_path, 20) / "slot-0.bak").mkdir()
        prune(tmp_path, "slot-0", num_keep=2, saved=step)
    assert list_steps(tmp_path) == [60, 80]


@pytest.mark.parametrize("parts", [["slot-0", "slot-1"], ["slot-0-rank-0", "slot-0-rank-1"]],
                         ids=["two nodes", "two local ranks"])
def test_prune_keeps_the_newest_complete_steps_while_a_sibling_part_is_late_failed_or_killed(tmp_path, parts) -> None:
    """Counting steps alone, a part's writer removed its part of the last complete step while its sibling (another
    node on a shared disk, or another local rank of the node) still wrote an older one, had failed on a full disk,
    or was killed before its rename: no step then held both parts, and the run could not resume."""
    first, second = parts
    for step in (100, 200):
        for part in parts:
            write_part(tmp_path, step, part, make_state(step), parts=parts)
    # `second` is slow (still writing 300), then fails 400 (full disk), then is killed writing 500.
    (step_dir(tmp_path, 500) / f".tmp-{second}-999-dead").mkdir(parents=True)
    for step in (300, 400, 500):
        write_part(tmp_path, step, first, make_state(step), parts=parts)
        prune(tmp_path, first, num_keep=1, saved=step)
        assert latest(tmp_path).step == 200
    assert [s for s in list_steps(tmp_path) if (step_dir(tmp_path, s) / first).exists()] == [200, 300, 400, 500]
    write_part(tmp_path, 300, second, make_state(300), parts=parts)  # the slow write of 300 lands
    prune(tmp_path, second, num_keep=1, saved=300)
    assert latest(tmp_path).step == 300 and not (step_dir(tmp_path, 200) / second).exists()
    write_part(tmp_path, 600, first, make_state(600), parts=parts)
    prune(tmp_path, first, num_keep=1, saved=600)
    assert list_steps(tmp_path) == [300, 400, 500, 600]  # 300 is complete; 400-600 are not (yet)
    assert latest(tmp_path).step == 300


@pytest.mark.parametrize("num_keep", [1, 2])
def test_prune_keeps_a_step_a_node_can_resume_from_when_the_layout_changed_and_some_ranks_failed(tmp_path,
                                                                                                num_keep) -> None:
    """A second node joined (a new layout of parts) and, at the new layout's first steps, local rank 1 of every
    node failed to save (a full disk, or killed before its rename) while each rank 0 saved and pruned. By presence
    those steps held every part saved so far of their layout: they counted as complete, and the last step holding a
    whole node was removed (no resume possible). With `usable` (a whole node), they do not count."""

    def whole_node(present: tuple[str, ...], named: tuple[str, ...]) -> str | None:
        slots = {name.split("-rank-")[0] for name in named}
        whole = [s for s in slots if all(n in present for n in named if n.startswith(f"{s}-rank-"))]
        return None if whole else "no whole node"

    one = ["slot-0-rank-0", "slot-0-rank-1"]
    two = [*one, "slot-1-rank-0", "slot-1-rank-1"]
    for part in one:
        write_part(tmp_path, 100, part, make_state(100), parts=one)
        prune(tmp_path, part, num_keep=num_keep, saved=100, usable=whole_node)
    for step in (200, 300)[:num_keep]:
        for part in ("slot-0-rank-0", "slot-1-rank-0"):
            write_part(tmp_path, step, part, make_state(step), parts=two)
            prune(tmp_path, part, num_keep=num_keep, saved=step, usable=whole_node)
    assert latest(tmp_path, enough=whole_node).step == 100
    assert list_steps(tmp_path)[0] == 100


def test_prune_on_a_disk_of_its_own_counts_the_parts_that_disk_holds(tmp_path) -> None:
    """A machine saving to its own disk holds only its nodes' parts of every step (here slot-1 of two): those steps
    are complete for it, and prune keeps `num_keep` of them. A step where the part never finished (only a killed
    write's leftover, or nothing) does not count."""
    parts = ["slot-0", "slot-1"]
    for step in (10, 20, 30):
        write_part(tmp_path, step, "slot-1", make_state(step), parts=parts)
    (step_dir(tmp_path, 35) / ".tmp-slot-1-999-dead").mkdir(parents=True)  # killed at a stop; resumed from 30
    write_part(tmp_path, 40, "slot-1", make_state(40), parts=parts)
    prune(tmp_path, "slot-1", num_keep=2, saved=40)
    assert list_steps(tmp_path) == [30, 40]  # 35's leftover removed and not counted: two checkpoints are kept


def test_prune_never_removes_the_step_just_saved_nor_later_ones(tmp_path) -> None:
    # The root holds steps 50 and 60 of another timeline; a run resumed from step 20 saves 30, then 40.
    for step in (20, 50, 60):
        write_part(tmp_path, step, "slot-0", make_state(step), parts=["slot-0"])
    write_part(tmp_path, 30, "slot-0", make_state(30), parts=["slot-0"])
    assert prune(tmp_path, "slot-0", num_keep=2, saved=30) == [50, 60]
    assert list_steps(tmp_path) == [20, 30, 50, 60]  # by step number alone, 20 and 30 (just saved) would go
    write_part(tmp_path, 40, "slot-0", make_state(40), parts=["slot-0"])
    assert prune(tmp_path, "slot-0", num_keep=2, saved=40) == [50, 60]
    assert list_steps(tmp_path) == [30, 40, 50, 60]


def test_writing_pids_are_those_of_the_temporary_directories_of_writes_under_way(tmp_path) -> None:
    write_part(tmp_path, 10, "slot-0", make_state(1), parts=["slot-0"])  # finished: no temporary directory left
    assert writing_pids(tmp_path) == set()
    (step_dir(tmp_path, 20) / ".tmp-slot-0-4242-0123abcd").mkdir(parents=True)
    (step_dir(tmp_path, 20) / ".tmp-slot-1-rank-1-77-89abcdef").mkdir()
    (step_dir(tmp_path, 20) / ".tmp-garbled").mkdir()
    assert writing_pids(tmp_path) == {4242, 77}
    assert writing_pids(tmp_path / "nowhere") == set()
    # A leftover of a writer killed before `since` (an earlier launch) is not a write under way now.
    os.utime(step_dir(tmp_path, 20) / ".tmp-slot-0-4242-0123abcd", (1.0e9, 1.0e9))
    assert writing_pids(tmp_path, since=time.time() - 60) == {77}


def test_snapshot_reuses_an_earlier_snapshot_memory() -> None:
    from openprime.ckpt.state import snapshot

    live = make_state(0)
    first = snapshot(live)
    assert first["model"]["layers.0.w"].data_ptr() != live["model"]["layers.0.w"].data_ptr()
    live["model"]["layers.0.w"].add_(1.0)
    second = snapshot(live, reuse=first)
    assert second["model"]["layers.0.w"].data_ptr() == first["model"]["layers.0.w"].data_ptr()  # no new memory
    assert_same(second, snapshot(live))  # and the values are the live ones
    live["model"]["norm.weight"] = torch.zeros(7)  # a shape that changed gets fresh memory
    assert snapshot(live, reuse=second)["model"]["norm.weight"].shape == (7,)


def _newest(root: pathlib.Path) -> tuple[int, int]:
    """The step a resume would take now, and the `inner` counter its part holds (which save of the step it is)."""
    found = latest(root)
    return found.step, read_part(found.part("slot-0"))["counters"]["inner"]


def test_saving_a_step_again_keeps_a_complete_part_in_place_at_every_instant(tmp_path, monkeypatch) -> None:
    """A run resumed from an older step saves the later ones again. The old part was removed before the new one was
    renamed into place: a crash (or an error) in between left the step without it (review, 2026-12-07). At every
    rename and removal of the re-save, what a resume would find is the step, whole: the old part or the new."""
    import shutil

    from openprime.ckpt import store

    write_part(tmp_path, 20, "slot-0", make_state(20), parts=["slot-0"])
    write_part(tmp_path, 40, "slot-0", make_state(40), parts=["slot-0"])
    seen: list[tuple[str, tuple[int, int]]] = []

    def probing(name, fn):
        def probe(*args, **kwargs):
            if str(args[0]).startswith(str(tmp_path)):
                seen.append((name, _newest(tmp_path)))  # what a crash here would leave
            return fn(*args, **kwargs)
        return probe

    monkeypatch.setattr(os, "rename", probing("rename", os.rename))
    monkeypatch.setattr(shutil, "rmtree", probing("rmtree", shutil.rmtree))
    monkeypatch.setattr(store, "_exchange", probing("exchange", store._exchange))
    write_part(tmp_path, 40, "slot-0", make_state(41), parts=["slot-0"])
    monkeypatch.undo()
    old, new = (40, make_state(40)["counters"]["inner"]), (40, make_state(41)["counters"]["inner"])
    assert all(found in (old, new) for _, found in seen), seen
    assert any(name == "exchange" for name, _ in seen), seen  # the filesystem here swaps (ext4, tmpfs, xfs, btrfs)
    assert _newest(tmp_path) == new
    assert [p.name for p in step_dir(tmp_path, 40).iterdir()] == ["slot-0"]  # the old part removed once swapped


def test_a_failed_save_of_a_step_again_leaves_the_old_part_in_place(tmp_path, monkeypatch) -> None:
    """The rename that puts the new part in place fails (EIO): the old part was gone already, and the new one was
    removed as a failed save's. Now the step keeps its old part, whole."""
    import errno

    from openprime.ckpt import store

    write_part(tmp_path, 40, "slot-0", make_state(40), parts=["slot-0"])

    def failing(fn):
        def rename(src, dst, *args, **kwargs):
            if pathlib.Path(dst) == step_dir(tmp_path, 40) / "slot-0":
                raise OSError(errno.EIO, "Input/output error (injected)")
            return fn(src, dst, *args, **kwargs)
        return rename

    monkeypatch.setattr(os, "rename", failing(os.rename))
    monkeypatch.setattr(store, "_exchange", failing(store._exchange))
    with pytest.raises(OSError, match="injected"):
        write_part(tmp_path, 40, "slot-0", make_state(41), parts=["slot-0"])
    monkeypatch.undo()
    assert _newest(tmp_path) == (40, make_state(40)["counters"]["inner"])
    assert [p.name for p in step_dir(tmp_path, 40).iterdir()] == ["slot-0"]  # and no temporary directory left


def test_a_filesystem_that_cannot_swap_replaces_a_part_by_renaming_the_old_one_aside(tmp_path, monkeypatch) -> None:
    """Without RENAME_EXCHANGE (NFS, not Linux) the old part is renamed aside, then the new one into place: a failure
    of the second rename puts the old part back."""
    import errno

    from openprime.ckpt import store

    monkeypatch.setattr(store, "_exchange", lambda a, b: False)
    write_part(tmp_path, 40, "slot-0", make_state(40), parts=["slot-0"])
    write_part(tmp_path, 40, "slot-0", make_state(41), parts=["slot-0"])
    assert _newest(tmp_path) == (40, make_state(41)["counters"]["inner"])
    assert [p.name for p in step_dir(tmp_path, 40).iterdir()] == ["slot-0"]
    rename, into_place = os.rename, []

    def failing(src, dst, *args, **kwargs):
        if pathlib.Path(dst).name == "slot-0":
            into_place.append(pathlib.Path(src).name)
            if len(into_place) == 1:  # the new part's rename (the old part's, back, goes through)
                raise OSError(errno.EIO, "Input/output error (injected)")
        return rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError, match="injected"):
        write_part(tmp_path, 40, "slot-0", make_state(42), parts=["slot-0"])
    monkeypatch.undo()
    assert len(into_place) == 2 and into_place[0] != into_place[1]
    assert _newest(tmp_path) == (40, make_state(41)["counters"]["inner"])
    assert [p.name for p in step_dir(tmp_path, 40).iterdir()] == ["slot-0"]


TWO = ["slot-0", "slot-1"]


def _whole_nodes(num_nodes: int):
    """A PartsCheck: at least `num_nodes` nodes (a slot's parts, one per local rank) all here, as a resume asks."""
    def enough(parts: tuple[str, ...], named: tuple[str, ...]) -> str | None:
        slots = {name.split("-rank-")[0] for name in named}
        whole = [s for s in slots if all(n in parts for n in named if n.split("-rank-")[0] == s)]
        return None if len(whole) >= num_nodes else f"{len(whole)} whole node(s) here, {num_nodes} wanted"
    return enough


def _later_steps(root: pathlib.Path) -> None:
    """Step 20 whole; the later steps as a 2-node run leaves them: 30 saved by both nodes, slot-1 damaged on disk
    since; 40 saved by slot-0 alone (slot-1's node died); 50 by the survivor alone, after the mesh dropped the dead
    node (it names only slot-0); 60 with every part damaged; 70 mixing two saves of it."""
    for part in TWO:
        for step in (20, 30, 60):
            write_part(root, step, part, make_state(step), parts=TWO)
        write_part(root, 70, part, make_state(70), parts=TWO, fingerprint=Fingerprint(group="rank-0", digest=part))
    write_part(root, 40, "slot-0", make_state(40), parts=TWO)
    write_part(root, 50, "slot-0", make_state(50), parts=["slot-0"])
    for step, part in ((30, "slot-1"), (60, "slot-0"), (60, "slot-1")):
        data_file = next((step_dir(root, step) / part).glob("*.distcp"))
        _flip_byte(data_file, data_file.stat().st_size // 2)


def test_a_later_step_with_a_damaged_part_is_not_another_timeline(tmp_path) -> None:
    """A resume of 2 nodes goes back to step 20. Step 30, one of whose two parts is damaged, was set aside as another
    timeline's ("a node died and the others saved on without it": both nodes saved it; review, 2026-12-07); only the
    steps some of the resumed nodes never saved are, 40 and 50. Nothing usable verifies in 60 and 70."""
    _later_steps(tmp_path)
    skipped: dict[int, Exception] = {}
    assert latest(tmp_path, enough=_whole_nodes(2), skipped=skipped).step == 20
    assert sorted(skipped) == [30, 40, 50, 60, 70]
    assert abandoned_steps(tmp_path, [30, 40, 50, 60, 70], enough=_whole_nodes(2), usable=_whole_nodes(1),
                           skipped=skipped) == [40, 50]
    # The same without what `latest` found (each step verified again), and for a resume of one node (nothing later
    # falls short of it but for damage).
    assert abandoned_steps(tmp_path, [30, 40, 50, 60, 70], enough=_whole_nodes(2), usable=_whole_nodes(1)) == [40, 50]
    assert abandoned_steps(tmp_path, [30, 60, 70], enough=_whole_nodes(1), usable=_whole_nodes(1)) == []


def test_a_resume_checks_the_checksums_of_the_later_steps_once(tmp_path, monkeypatch) -> None:
    """`--resume latest` checked every later step's checksums to skip it, then again to tell another timeline's
    (review, 2026-12-07): minutes more for a large model. Counted by SHA-256 passes over each file."""
    import collections

    from openprime.ckpt import manifest

    _later_steps(tmp_path)
    hashed: collections.Counter[pathlib.Path] = collections.Counter()
    digest = manifest.file_digest

    def counting(path: pathlib.Path) -> str:
        hashed[path] += 1
        return digest(path)

    monkeypatch.setattr(manifest, "file_digest", counting)
    skipped: dict[int, Exception] = {}
    found = latest(tmp_path, enough=_whole_nodes(2), skipped=skipped)  # what find_checkpoint does
    later = [s for s in list_steps(tmp_path) if s > found.step]
    assert abandoned_steps(tmp_path, later, enough=_whole_nodes(2), usable=_whole_nodes(1),
                           skipped=skipped) == [40, 50]
    files = {f for s in later for f in step_dir(tmp_path, s).rglob("*") if f.is_file() and f.name != "MANIFEST.json"}
    assert set(hashed) - files == {f for f in step_dir(tmp_path, 20).rglob("*") if f.is_file()
                                   and f.name != "MANIFEST.json"}  # and the step resumed
    assert max(hashed.values()) == 1, {str(f.relative_to(tmp_path)): n for f, n in hashed.items() if n > 1}
    whole = {f for s in (40, 50) for f in (step_dir(tmp_path, s) / "slot-0").iterdir() if f.name != "MANIFEST.json"}
    assert whole <= set(hashed)  # each file of a part that verifies was hashed, once
    hashed.clear()
    abandoned_steps(tmp_path, later, enough=_whole_nodes(2), usable=_whole_nodes(1))  # without: every one again
    assert whole <= set(hashed)
