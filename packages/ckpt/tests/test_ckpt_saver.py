"""Asynchronous saving: training blocks only for the snapshot; a kill or a full disk never loses a checkpoint."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from openprime.ckpt import Checkpointer, SaveMode, latest, read_part, step_dir


def state(value: float, numel: int = 1000) -> dict:
    return {"model": {"w": torch.full((numel,), value)}, "step": int(value)}


def test_async_save_snapshots_so_training_may_change_the_tensors(tmp_path) -> None:
    ckpt = Checkpointer(tmp_path, part="slot-0", mode=SaveMode.ASYNC, num_keep=2)
    live = state(1.0, numel=1 << 20)
    blocked = ckpt.save(20, live, parts=["slot-0"])
    live["model"]["w"].fill_(99.0)  # the next inner steps change the weights while the write runs
    result = ckpt.wait()
    assert result is not None and result.path is not None and result.step == 20
    assert blocked == result.blocking_s <= result.total_s
    assert torch.equal(read_part(result.path)["model"]["w"], torch.full((1 << 20,), 1.0))
    for step in (40, 60):  # each save first waits for the previous one; two are kept
        ckpt.save(step, state(float(step)), parts=["slot-0"])
    ckpt.close()
    assert [r.step for r in ckpt.results] == [20, 40, 60] and ckpt.num_failed == 0
    assert latest(tmp_path).step == 60 and not step_dir(tmp_path, 20).exists()


def _run(code: str, tmp_path: pathlib.Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_kill_9_during_an_async_save_leaves_the_previous_checkpoint(tmp_path) -> None:
    # The child saves step 20, then starts an async save of step 40 whose manifest never gets written
    # (the checksum pass is made to hang), so the kill lands after the tensor files are on disk.
    proc = _run("""
        import pathlib, time, torch
        import openprime.ckpt.manifest as manifest
        from openprime.ckpt import Checkpointer, SaveMode
        root = pathlib.Path("ckpt")
        ckpt = Checkpointer(root, part="slot-0", mode=SaveMode.ASYNC, num_keep=2)
        ckpt.save(20, {"w": torch.full((1000,), 20.0)}, parts=["slot-0"])
        ckpt.wait()
        def hang(path):
            pathlib.Path("writing").touch()
            time.sleep(600)
        manifest.file_digest = hang
        ckpt.save(40, {"w": torch.full((1000,), 40.0)}, parts=["slot-0"])
        time.sleep(600)
    """, tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "writing").exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the child never started writing step 40"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    root = tmp_path / "ckpt"
    leftovers = list(step_dir(root, 40).glob(".tmp-slot-0-*"))
    assert len(leftovers) == 1 and list(leftovers[0].glob("*.distcp"))  # killed mid-save
    found = latest(root)
    assert found.step == 20
    assert torch.equal(read_part(found.part("slot-0"))["w"], torch.full((1000,), 20.0))
    # The resumed run's next save cleans up after the killed one.
    ckpt = Checkpointer(root, part="slot-0", mode=SaveMode.SYNC, num_keep=2)
    ckpt.save(60, {"w": torch.zeros(3)}, parts=["slot-0"])
    assert not step_dir(root, 40).exists() and latest(root).step == 60


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs RLIMIT_FSIZE (POSIX)")
def test_a_full_disk_fails_the_save_not_the_run(tmp_path) -> None:
    # RLIMIT_FSIZE makes the kernel refuse writes past 1 MiB in the child (EFBIG), as a full disk would.
    proc = _run("""
        import logging, pathlib, resource, signal, torch
        from openprime.ckpt import Checkpointer, SaveMode, latest
        logging.basicConfig()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        root = pathlib.Path("ckpt")
        ckpt = Checkpointer(root, part="slot-0", mode=SaveMode.ASYNC, num_keep=2)
        ckpt.save(20, {"w": torch.full((1000,), 20.0)}, parts=["slot-0"])
        ckpt.save(40, {"w": torch.full((1 << 20,), 40.0)}, parts=["slot-0"])  # 4 MiB: does not fit
        ckpt.wait()
        print("results", [(r.step, r.path is not None, r.error[:40]) for r in ckpt.results])
        print("latest", latest(root).step, "training goes on")
    """, tmp_path)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "checkpoint of step 40 (slot-0) under ckpt FAILED: " in out
    assert ("(is the disk full?); 1 save(s) of this part failed in a row, its newest save is step 20; training "
            "continues, but a crash would lose the steps since") in out
    assert "results [(20, True, ''), (40, False, 'RuntimeError: " in out  # torch's zip writer hit EFBIG
    assert "latest 20 training goes on" in out
    assert not step_dir(tmp_path / "ckpt", 40).exists()  # the partial write was removed, and its empty step


def test_a_save_whose_directory_fsync_fails_after_its_rename_is_done_with_a_warning(tmp_path, monkeypatch,
                                                                                      caplog) -> None:
    """The fsync of the checkpoint root after the part's rename fails (EIO): the part is complete and in place, and a
    resume takes it, but the save was counted as failed ("FAILED ... a crash would lose the steps since"; review,
    2026-12-07). It is a save done, with a warning that a power cut might lose it; and since one might, it prunes
    no older checkpoint, until a save the disk confirms."""
    import errno
    import logging

    from openprime.ckpt import SaveNotDurable, list_steps, store, write_part

    ckpt = Checkpointer(tmp_path, part="slot-0", mode=SaveMode.SYNC, num_keep=1)
    ckpt.save(20, state(20.0), parts=["slot-0"])
    fsync = store.fsync_path

    def failing(path) -> None:
        if pathlib.Path(path) == tmp_path:
            raise OSError(errno.EIO, "Input/output error")
        fsync(path)

    monkeypatch.setattr(store, "fsync_path", failing)
    with caplog.at_level(logging.WARNING, logger="openprime.ckpt"):
        ckpt.save(40, state(40.0), parts=["slot-0"])
    result = ckpt.results[-1]
    assert (result.step, result.path, ckpt.num_failed) == (40, step_dir(tmp_path, 40) / "slot-0", 0)
    assert result.error == "" and "Input/output error" in result.warning
    assert "FAILED" not in caplog.text
    assert (f"checkpoint of step 40 saved to {result.path}, but the disk did not confirm it durable ([Errno 5] "
            f"Input/output error): it is complete and in place, but a power cut might lose it; older checkpoints "
            f"are kept until a save is confirmed") in caplog.text
    assert latest(tmp_path).step == 40 and read_part(result.path)["step"] == 40
    assert list_steps(tmp_path) == [20, 40]  # num_keep=1, but step 20 is kept
    with pytest.raises(SaveNotDurable, match="is saved, but the disk did not confirm it durable") as raised:
        write_part(tmp_path, 50, "slot-0", state(50.0), parts=["slot-0"])  # write_part itself says so
    assert raised.value.path == step_dir(tmp_path, 50) / "slot-0" and latest(tmp_path).step == 50
    monkeypatch.undo()
    ckpt.save(60, state(60.0), parts=["slot-0"])  # confirmed: the older ones are pruned
    assert list_steps(tmp_path) == [60] and ckpt.num_failed == 0
