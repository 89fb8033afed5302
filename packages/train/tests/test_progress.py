"""What a node's progress records and lines say: the tok/s and MFU of a progress line are its window's (the inner
steps trained since the previous line), the MFU's peak is known or not reported, and a run's summary counts every
byte the nodes sent. A fake clock: every inner step takes exactly one second."""

import pathlib
import types

import attrs
import pytest
import torch

from openprime.train import hardware, progress
from openprime.train.metrics import summarize_records
from openprime.train.recipe import recipe_config

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _config(*overrides: str):
    return recipe_config(str(ROOT / "recipes" / "debug.py"),
                         ["train.num_steps=100", "train.log_every=30", "schedule.num_warmup_steps=10",
                          "schedule.num_decay_steps=20", *overrides])


def _lines(monkeypatch, cfg, *, start_step: int, step_s: float = 1.0, outer_s: float = 0.0) -> list[str]:
    """The progress lines of a node that trains from `start_step` (a resume) to the run's end; every H-th inner step
    ends an outer step that takes `outer_s` more."""
    now = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    monkeypatch.setattr("openprime.train.metrics.time.monotonic", lambda: now[0])
    lines = []
    tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
    counters = types.SimpleNamespace(num_inner_steps_done=start_step, num_outer_steps_done=0)
    node = types.SimpleNamespace(
        node=0, tokens_per_step=tokens_per_step, device=torch.device("cpu"), counters=counters,
        mesh=types.SimpleNamespace(view=None), local_mesh=None, tokens=lambda s: s * tokens_per_step,
        write=lambda kind, **fields: None, say=lines.append, evaluate=lambda: 0.0,
        report_outer=lambda *a, **k: None)
    p = progress.Progress(cfg, node)
    for step in range(start_step + 1, cfg.train.num_steps + 1):
        outer = step % cfg.diloco.num_inner_steps == 0
        now[0] += step_s + (outer_s if outer else 0.0)
        counters.num_inner_steps_done = step
        p.step(step, 3.0, 1e-3, step_s + (outer_s if outer else 0.0), None, grad_norm=1.0, skipped=False)
    return lines


@pytest.mark.parametrize("start_step", [0, 40])
def test_a_progress_lines_tokens_per_second_is_its_windows(monkeypatch, start_step):
    # 100 steps of 1 s, a line every 30 steps: the last window is 10 steps (it read 3.1k tok/s for 1.0k), and a run
    # resumed at step 40 has a first window of 20 (it read 1.5k).
    cfg = _config()
    assert cfg.train.batch_size * cfg.train.seq_len == 1024  # 1.0k tok/s at 1 s a step
    lines = _lines(monkeypatch, cfg, start_step=start_step)
    assert len(lines) == (4 if start_step == 0 else 3)  # steps 30, 60, 90, 100; or 60, 90, 100
    assert all("| 1.0k tok/s |" in line for line in lines), lines


def test_a_progress_lines_mfu_is_its_windows_as_its_tokens_per_second(monkeypatch):
    # H = 10 divides log_every = 30, so each window ends on an outer step of 30 s more; its MFU was that one step's.
    cfg = _config("diloco.num_inner_steps=10", "train.log_every=30", "checkpoint.interval_steps=10")
    flops_per_token = progress.num_flops_per_token(cfg.model, cfg.train.seq_len)
    peak = 2 * 1024 * flops_per_token  # a compute step of 1 s is then 50% MFU
    cfg = attrs.evolve(cfg, metrics=attrs.evolve(cfg.metrics, peak_flops=peak))
    lines = _lines(monkeypatch, cfg, start_step=0, outer_s=30.0)
    # A window: 30 steps of 1 s and three outer steps of 30 s, 120 s for 30 x 1024 tokens: 256 tok/s, MFU 12.5%.
    assert "| 0.3k tok/s |" in lines[0] and "MFU 12.5%" in lines[0], lines[0]


def _fake_gpu(monkeypatch, name: str) -> None:
    props = types.SimpleNamespace(name=name, total_memory=80 << 30)
    monkeypatch.setattr(hardware.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(hardware.torch.cuda, "get_device_properties", lambda i: props)


@pytest.mark.parametrize(("name", "peak"), [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                            ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA L4", 0.0)])
def test_mfu_is_measured_against_the_gpus_own_peak_or_not_reported(monkeypatch, caplog, name, peak):
    # Every GPU the planner did not know was measured against an H100's 989 TFLOP/s: an L4's MFU read 0.12x.
    _fake_gpu(monkeypatch, name)
    assert hardware.mfu_peak_flops(0.0, "cuda") == peak
    assert ("metrics.peak_flops" in caplog.text) == (peak == 0.0)
    assert hardware.mfu_peak_flops(121e12, "cuda") == 121e12  # the recipe's, when set
    assert hardware.mfu_peak_flops(0.0, "cpu") == 0.0


def test_a_runs_summary_counts_the_bytes_of_a_skipped_outer_steps_tries():
    # A skipped outer step's failed tries sent bytes; the node counts them, and the summary left them out.
    records = [{"kind": "outer", "node": 0, "outer_step": 1, "bytes_sent": 2000, "state_hash": "a", "skipped": False},
               {"kind": "outer", "node": 0, "outer_step": 2, "bytes_sent": 700, "state_hash": "", "skipped": True}]
    summary = summarize_records(records)
    assert summary.bytes_sent == {0: 2700}
    assert summary.hashes == {1: {0: "a"}}


# A node's MFU is its tokens' FLOP/s over the peak of all its devices (fsdp.num_local_ranks of them): the tests above
# run one local rank, and passing 1 as the number of devices left them passing while a node of 8 GPUs reported 8x.
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_node_of_several_local_ranks_divides_its_mfu_by_them(monkeypatch, ranks):
    cfg = recipe_config(str(ROOT / "recipes" / "debug.py"),
                        ["train.num_steps=100", "train.log_every=10", "schedule.num_warmup_steps=10",
                         "schedule.num_decay_steps=20", f"fsdp.num_local_ranks={ranks}"])
    tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
    peak = 2 * tokens_per_step * progress.num_flops_per_token(cfg.model, cfg.train.seq_len)  # 1 s a step: 50%
    cfg = attrs.evolve(cfg, metrics=attrs.evolve(cfg.metrics, peak_flops=peak))
    now = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    monkeypatch.setattr("openprime.train.metrics.time.monotonic", lambda: now[0])
    lines, records = [], []
    counters = types.SimpleNamespace(num_inner_steps_done=0, num_outer_steps_done=0)
    node = types.SimpleNamespace(
        node=0, tokens_per_step=tokens_per_step, device=torch.device("cpu"), counters=counters,
        mesh=types.SimpleNamespace(view=None), local_mesh=None, tokens=lambda s: s * tokens_per_step,
        write=lambda kind, **fields: records.append(fields), say=lines.append, evaluate=lambda: 0.0,
        report_outer=lambda *a, **k: None)
    p = progress.Progress(cfg, node)
    for step in range(1, 11):
        now[0] += 1.0
        counters.num_inner_steps_done = step
        p.step(step, 3.0, 1e-3, 1.0, None, grad_norm=1.0, skipped=False)
    assert records[-1]["mfu"] == pytest.approx(0.5 / ranks)
    assert f"MFU {50 / ranks:.1f}%" in lines[0], lines[0]
