"""A run whose checkpoints cannot be written (a full disk) trains on, and its end says what is lost, non-zero.

Found by hand on a 60 MB tmpfs: every save failed, each with one log line, and the run ended "done", exit 0,
"checkpoints: ... (newest: step 40)", where no checkpoint had been saved at all (the failed saves left empty step
directories, and the summary named the newest of them). RLIMIT_FSIZE stands in for the full disk here: the kernel
refuses every write past 1 MiB of a file (EFBIG; Python ignores SIGXFSZ), which a checkpoint's tensor file is
well past and the run's metrics are not.
"""

import pathlib
import resource
import subprocess
import sys

from openprime.ckpt import list_steps
from openprime.train.metrics import summarize

ROOT = pathlib.Path(__file__).resolve().parents[1]
SETTINGS = ("train.num_steps=20", "diloco.num_inner_steps=10", "checkpoint.interval_steps=10", "train.seq_len=32",
            "schedule.num_warmup_steps=2", "schedule.num_decay_steps=4", "train.num_threads=1")


def _one_mib_files() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


def test_a_run_that_saved_no_checkpoint_ends_in_an_error(tmp_path):
    run_dir = tmp_path / "run"
    sets = [arg for setting in SETTINGS for arg in ("--set", setting)]
    proc = subprocess.run([sys.executable, "-m", "openprime.train.cli", "run", str(ROOT / "recipes" / "debug.py"),
                           "--nodes", "2", "--run-dir", str(run_dir), *sets],
                          capture_output=True, text=True, timeout=240, preexec_fn=_one_mib_files)
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
