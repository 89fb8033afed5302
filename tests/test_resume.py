"""Checkpoints end to end: stop a 2-node run, resume it bit-identically, survive a corrupt file, export it.

The baseline runs 60 inner steps uninterrupted; the stopped run ends itself after outer step 3
(train.stop_after_outer_steps) with checkpoints at steps 20 and 30; `--resume latest` must then end
with exactly the baseline's global-state hashes after every outer step and exactly its losses.
"""

import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

from openprime.train.checkpointing import load_model_weights
from openprime.train.metrics import read_records, summarize
from openprime.train.model import Llama

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Sequences of 32 tokens, not 128: bit-identity does not need the compute (it made up most of these tests' time).
SHORT = ("--nodes", "2", "--set", "train.num_steps=60", "--set", "diloco.num_inner_steps=10",
         "--set", "checkpoint.interval_steps=10", "--set", "train.seq_len=32")


def _openprime(*args: str, expect: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "openprime.train.cli", *args], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _run(run_dir: pathlib.Path, *args: str, expect: int = 0) -> subprocess.CompletedProcess:
    return _openprime("run", str(ROOT / "recipes" / "debug.py"), "--run-dir", str(run_dir), *SHORT, *args,
                      expect=expect)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> pathlib.Path:
    run_dir = tmp_path_factory.mktemp("baseline") / "run"
    _run(run_dir)
    return run_dir


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> pathlib.Path:
    run_dir = tmp_path_factory.mktemp("stopped") / "run"
    proc = _run(run_dir, "--set", "train.stop_after_outer_steps=3")
    assert "stopping after outer step 3" in proc.stdout
    assert f"continue with `openprime run RECIPE --run-dir {run_dir} --resume latest`" in proc.stdout
    return run_dir


def _losses(run_dir: pathlib.Path) -> dict[int, list[float]]:
    """Per inner step, the losses of the nodes (sorted: node numbers may map to other slots per launch)."""
    losses: dict[int, list[float]] = {}
    for r in read_records(run_dir):
        if r["kind"] == "step":
            losses.setdefault(r["step"], []).append(r["loss"])
    return {step: sorted(v) for step, v in losses.items()}


def _copy(run_dir: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(run_dir, tmp_path / "run"))


@pytest.mark.slow
def test_stop_and_resume_is_bit_identical(baseline, stopped, tmp_path):
    assert sorted(p.name for p in (stopped / "checkpoints").iterdir()) == ["step-00000020", "step-00000030"]
    assert max(_losses(stopped)) == 30
    run_dir = _copy(stopped, tmp_path)
    proc = _run(run_dir, "--resume", "latest", "--set", "train.stop_after_outer_steps=3")
    assert "resuming from" in proc.stdout and "step-00000030" in proc.stdout
    assert "already past train.stop_after_outer_steps=3: running to the end" in proc.stdout
    expected = summarize(baseline).distinct_hashes
    assert len(expected) == 6 and all(len(h) == 1 for h in expected.values())
    assert summarize(run_dir).distinct_hashes == expected  # every outer step, before and after the stop
    assert _losses(run_dir) == _losses(baseline)  # the same data order, optimizer state and schedule
    assert (run_dir / "config.resumed-1.json").is_file()


@pytest.mark.slow
def test_a_corrupt_checkpoint_falls_back_to_the_previous_one(baseline, stopped, tmp_path):
    run_dir = _copy(stopped, tmp_path)
    victim = next((run_dir / "checkpoints" / "step-00000030" / "slot-1").glob("*.distcp"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    proc = _run(run_dir, "--resume", "latest")
    assert "skipping checkpoint step 30" in proc.stderr and "does not match its SHA-256" in proc.stderr
    assert "falling back to the previous one" in proc.stderr
    assert "step-00000020" in proc.stdout
    assert summarize(run_dir).distinct_hashes[6] == summarize(baseline).distinct_hashes[6]  # from 20 to the same end


def test_resume_refuses_another_model_before_starting(stopped, tmp_path):
    proc = _run(_copy(stopped, tmp_path), "--resume", "latest", "--set", "model.dim=256", expect=2)
    assert "tensor 'model/tok_embeddings.weight' is (4096, 128) torch.float32 in the checkpoint but " \
           "(4096, 256) torch.float32 here" in proc.stderr


def test_export_of_a_run_loads_in_transformers_with_the_same_logits(stopped, tmp_path):
    import transformers  # in requirements.txt: a missing install fails here, not skips
    out = tmp_path / "hf"
    proc = _openprime("export", str(stopped), str(out))
    assert "step-00000030" in proc.stdout
    model_cfg, weights, _ = load_model_weights(stopped)
    ours = Llama(model_cfg)
    ours.init_weights(seed=0)
    ours.load_state_dict(weights)
    hf = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    tokens_BL = torch.randint(0, model_cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(tokens_BL).logits - ours(tokens_BL)).abs().max().item()
    assert diff < 1e-4, diff
