"""A run whose checkpoints cannot be written (a full disk) trains on, and its end says what is lost, non-zero; a
run whose log cannot be written trains on and ends as it would have.

Found by hand on a 60 MB tmpfs: every save failed, each with one log line, and the run ended "done", exit 0,
"checkpoints: ... (newest: step 40)", where no checkpoint had been saved at all (the failed saves left empty step
directories, and the summary named the newest of them). RLIMIT_FSIZE stands in for the full disk here: the kernel
refuses every write past 1 MiB of a file (EFBIG; Python ignores SIGXFSZ), which a checkpoint's tensor file is
well past and the run's metrics are not.
"""

import os
import pathlib
import resource
import subprocess
import sys

from openprime.ckpt import list_steps
from openprime.train.metrics import summarize
from openprime.train.testing import injecting

ROOT = pathlib.Path(__file__).resolve().parents[1]
SETTINGS = ("train.num_steps=20", "diloco.num_inner_steps=10", "checkpoint.interval_steps=10", "train.seq_len=32",
            "schedule.num_warmup_steps=2", "schedule.num_decay_steps=4", "train.num_threads=1")


def _run(run_dir: pathlib.Path, **kwargs) -> subprocess.CompletedProcess:
    sets = [arg for setting in SETTINGS for arg in ("--set", setting)]
    return subprocess.run([sys.executable, "-m", "openprime.train", "run", str(ROOT / "recipes" / "debug.py"),
                           "--nodes", "2", "--run-dir", str(run_dir), *sets],
                          capture_output=True, text=True, timeout=240, **kwargs)


def _one_mib_files() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


def test_a_run_that_saved_no_checkpoint_ends_in_an_error(tmp_path):
    run_dir = tmp_path / "run"
    proc = _run(run_dir, preexec_fn=_one_mib_files)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    summary = summarize(run_dir)
    assert {node: len(losses) for node, losses in summary.losses.items()} == {0: 20, 1: 20}  # it trained on
    assert summary.hashes_agree and summary.last_checkpoint_step == 20
    # Each node's two saves failed, the second saying so in a row.
    assert out.count("(is the disk full?); 2 save(s) of this part failed in a row, no save of it finished yet") == 2
    assert "openprime: done in" in out and "checkpoints: " not in out  # no "newest: step 20"
    assert "the run's last checkpoint, of step 20, did not finish saving" in out
    assert "None of its checkpoints finished saving: free space" in out
    assert list_steps(run_dir / "checkpoints") == []  # no step directory that would read as a checkpoint


# Every node's stdout moves to /dev/full (ENOSPC on every write) once its first outer step is done: the disk under
# `openprime run ... > run.log`, which the checkpoints share, is full from then on.
_LOG_DISK_FILLS = """
import os
from openprime.train import progress

_step = progress.Progress.step

def step(self, step, loss, lr, step_s, result, **kwargs):
    if result is not None and result.outer_step == 1:
        os.dup2(os.open("/dev/full", os.O_WRONLY), 1)
    return _step(self, step, loss, lr, step_s, result, **kwargs)

progress.Progress.step = step
"""


# ... and every node's save of the last step (20) fails as on that full disk, where the save of step 10 went through.
_LAST_SAVE_FAILS = """
import errno
from openprime.ckpt import saver

_write_part = saver.write_part

def write_part(root, step, *args, **kwargs):
    if step == 20:
        raise OSError(errno.ENOSPC, "No space left on device (injected)")
    return _write_part(root, step, *args, **kwargs)

saver.write_part = write_part
"""


def test_a_run_whose_log_and_last_checkpoint_cannot_be_written_trains_to_its_end_and_says_what_is_lost(tmp_path):
    """Every node failed on its next progress line (OSError: No space left on device), and the run ended there:
    found by hand with the log under a file-size limit, 2026-12-06. Now each node warns once and trains on. Its last
    checkpoint failing after an earlier one saved ends the run non-zero, naming the newest saved step (a hand
    mutation of the launcher's check, `saved < last`, left every test passing: the run said done, exit 0)."""
    run_dir = tmp_path / "run"
    proc = _run(run_dir, env={**os.environ, **injecting(tmp_path, _LOG_DISK_FILLS + _LAST_SAVE_FAILS)})
    out = proc.stdout + proc.stderr
    assert proc.stderr.count("its output cannot be written ([Errno 28] No space left on device); it trains on") == 2
    assert "Traceback" not in out, out[-3000:]
    summary = summarize(run_dir)
    assert {node: len(losses) for node, losses in summary.losses.items()} == {0: 20, 1: 20}
    assert summary.hashes_agree and summary.last_checkpoint_step == 20
    assert list_steps(run_dir / "checkpoints") == [10]  # the injection did what it should
    assert proc.returncode == 1, out[-3000:]
    assert "the run's last checkpoint, of step 20, did not finish saving" in out
    assert "Its newest saved one is step 10" in out
    assert "[node 0] step 20/20" not in proc.stdout  # it went to the full disk, not to this pipe
