"""The data-parallel baseline end to end: gradients averaged over the nodes at every step keep the replicas
identical (the hash of the weights is compared at every step), each step sends the ring's 2 (n - 1) / n x 4
bytes per parameter, and validation records agree across nodes."""

import pathlib
import subprocess
import sys

import pytest

from openprime.train.metrics import read_records, summarize
from openprime.train.model import FLAVORS, count_parameters

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(run_dir: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "openprime.train", "run", str(ROOT / "recipes" / "debug.py"),
                           "--run-dir", str(run_dir), "--nodes", "2", "--set", "schedule.num_warmup_steps=5",
                           "--set", "schedule.num_decay_steps=5", "--set", "train.num_steps=20",
                           "--set", "train.eval_every=10", *args], capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_data_parallel_keeps_replicas_identical_and_sends_every_step(tmp_path):
    proc = _run(tmp_path / "dp", "--set", "checkpoint.mode=off", "--set", "train.strategy=data_parallel")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_records(tmp_path / "dp")
    outer = [r for r in records if r["kind"] == "outer"]
    assert sorted(r["outer_step"] for r in outer) == sorted(list(range(1, 21)) * 2)  # every step, both nodes
    # Each record carries the hash of the weights its step made (the last step's too); the coordinator compared
    # them at the next step's barrier.
    assert summarize(tmp_path / "dp").hashes_agree
    assert len({r["state_hash"] for r in outer if r["outer_step"] == 20}) == 1
    # A 2-node fp32 ring sends each parameter's 4 bytes once per step (plus frame headers).
    per_step = 4 * count_parameters(FLAVORS["debug"])
    for r in outer:
        assert per_step <= r["bytes_sent"] <= 1.01 * per_step
    evals = [r for r in records if r["kind"] == "eval"]
    assert sorted(r["step"] for r in evals) == [10, 10, 20, 20]
    for step in (10, 20):
        assert len({r["val_loss"] for r in evals if r["step"] == step}) == 1  # the same weights on both nodes
    assert all(0 < r["compute_utilisation"] <= 1 for r in outer)
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["tokens"] for r in steps if r["node"] == 0] == [i * 8 * 128 for i in range(1, 21)]


def test_data_parallel_refuses_checkpoints(tmp_path, capsys):
    from openprime.train.cli import main  # in this process: a refusal at config time starts nothing

    assert main(["run", str(ROOT / "recipes" / "debug.py"), "--run-dir", str(tmp_path / "dp"), "--nodes", "2",
                 "--set", "train.strategy=data_parallel"]) == 2
    assert "set checkpoint.mode=off" in capsys.readouterr().err
    assert not (tmp_path / "dp").exists()
