"""From a review of the training loop's metrics: a progress line's tok/s and MFU measure training (its inner steps
and their outer steps), not the validation loss computed in its window. A fake clock: every inner step takes exactly
one second, every evaluation ten."""

import pathlib
import types

import pytest
import torch

from openprime.train import progress
from openprime.train.recipe import recipe_config

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _lines_and_records(monkeypatch, cfg, *, eval_s: float) -> tuple[list[str], list[dict]]:
    now = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    monkeypatch.setattr("openprime.train.metrics.time.monotonic", lambda: now[0])

    def evaluate() -> float:
        now[0] += eval_s
        return 2.0

    lines, records = [], []
    tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
    counters = types.SimpleNamespace(num_inner_steps_done=0, num_outer_steps_done=0)
    node = types.SimpleNamespace(
        node=0, tokens_per_step=tokens_per_step, device=torch.device("cpu"), counters=counters,
        mesh=types.SimpleNamespace(view=None), local_mesh=None, tokens=lambda s: s * tokens_per_step,
        write=lambda kind, **fields: records.append({"kind": kind, **fields}), say=lines.append, evaluate=evaluate,
        report_outer=lambda *a, **k: None)
    p = progress.Progress(cfg, node)
    for step in range(1, cfg.train.num_steps + 1):
        now[0] += 1.0
        counters.num_inner_steps_done = step
        p.step(step, 3.0, 1e-3, 1.0, None, grad_norm=1.0, skipped=False)
    return lines, records


def test_a_progress_lines_tokens_per_second_leaves_the_evaluation_out(monkeypatch):
    # The step records said 1.0k tok/s (one second a step), and the line of the same 30 steps said 0.8k: the 10 s of
    # the validation loss computed at its last step were counted as training time (MFU read low by as much).
    cfg = recipe_config(str(ROOT / "recipes" / "debug.py"),
                        ["train.num_steps=100", "train.log_every=30", "train.eval_every=30",
                         "schedule.num_warmup_steps=10", "schedule.num_decay_steps=20"])
    assert cfg.train.batch_size * cfg.train.seq_len == 1024  # 1.0k tok/s at 1 s a step
    lines, records = _lines_and_records(monkeypatch, cfg, eval_s=10.0)
    assert [r["step"] for r in records if r["kind"] == "eval"] == [30, 60, 90, 100]
    assert all(r["tokens_per_s"] == pytest.approx(1024) for r in records if r["kind"] == "step")
    assert len(lines) == 4  # steps 30, 60, 90, 100
    assert all("| 1.0k tok/s |" in line for line in lines), lines
