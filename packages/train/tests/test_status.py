"""`openprime status RUN_DIR` (openprime.train.status): where a run stands, from its directory alone."""

import json
import os
import pathlib

import torch

from openprime.ckpt import write_part
from openprime.core.config import to_dict
from openprime.train import cli
from openprime.train.launcher import write_run_files
from openprime.train.recipe import recipe_config
from openprime.train.run_lock import RunDirLock
from openprime.train.status import run_status

ROOT = pathlib.Path(__file__).resolve().parents[3]
DEBUG = ROOT / "recipes" / "debug.py"


def _run_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """A run of 2 nodes at inner step 20 (H = 10): step 10 saved, the save of step 20 begun and not finished."""
    run_dir = tmp_path / "run"
    cfg = recipe_config(DEBUG, ["schedule.num_warmup_steps=5", "schedule.num_decay_steps=10", "train.num_steps=40",
                               "diloco.num_inner_steps=10"])
    write_run_files(run_dir, cfg, recipe=DEBUG, recipe_files=[DEBUG], overrides=[], num_nodes=2)
    records = []
    for step in range(1, 21):
        for node in (0, 1):
            records.append({"kind": "step", "node": node, "time": 1000.0 + step, "step": step,
                            "loss": 8.0 - 0.1 * step - node, "skipped": node == 1 and step == 5})
        if step % 10 == 0:
            for node in (0, 1):  # outer step 2: node 1's state differs
                state = "aa" if step == 10 or node == 0 else "bb"
                records.append({"kind": "outer", "node": node, "time": 1000.0 + step, "outer_step": step // 10,
                                "state_hash": state, "skipped": False, "bytes_sent": 0})
                records.append({"kind": "checkpoint", "node": node, "time": 1000.0 + step, "step": step})
    records.append({"kind": "eval", "node": 0, "time": 1020.5, "step": 20, "val_loss": 6.25})
    records.append({"kind": "end", "node": 1, "time": 1021.0})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_part(run_dir / "checkpoints", 10, "slot-0", {"w": torch.zeros(3)}, parts=["slot-0", "slot-1"])
    return run_dir


def test_status_of_a_run_directory(tmp_path, capsys):
    run_dir = _run_dir(tmp_path)
    s = run_status(run_dir, now=1080.0)
    assert (s.name, s.num_steps, s.outer_step, s.members, s.hashes_agree) == ("debug", 40, 2, 2, False)
    assert [(n.node, n.step, n.ended, n.num_skipped) for n in s.nodes] == [(0, 20, False, 0), (1, 20, True, 1)]
    assert s.nodes[0].seconds_ago == 1080.0 - 1020.5 and s.val_loss == (20, 6.25)
    assert (s.saved, s.unfinished, s.launch) == (10, [20], None)

    assert cli.main(["status", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"run 'debug' in {run_dir}: no launch of this machine is running in it\n")
    assert "  outer step 2: 2 node(s), global state hashes DIFFER\n" in out
    assert "  node 0: step 20/40, loss 6.0000, last record " in out
    assert "  node 1: step 20/40, loss 5.0000, ended, 1 step(s) skipped for a NaN/inf gradient\n" in out
    assert "  validation loss 6.2500 at step 20\n" in out
    assert out.endswith("  checkpoints: newest step 10; the saves of step(s) [20] did not finish\n")


def test_status_names_the_launch_running_in_the_directory(tmp_path, capsys):
    run_dir = _run_dir(tmp_path)
    with RunDirLock(run_dir, shared=False):
        assert cli.main(["status", str(run_dir)]) == 0
        assert f": running here (pid {os.getpid()}, started " in capsys.readouterr().out
    assert run_status(run_dir).launch is None  # released: no record


def test_status_of_a_directory_without_a_run(tmp_path, capsys):
    assert cli.main(["status", str(tmp_path)]) == 2
    assert f"{tmp_path} holds no run (no config.json)" in capsys.readouterr().err


def test_status_and_export_follow_the_newest_launch_s_settings(tmp_path):
    """A run resumed with `--set checkpoint.directory=ELSEWHERE --set train.num_steps=60` saves its later steps
    there: status and export read the first launch's config.json only, so status counted 'step 60/40' with the
    saves 'not finished', and the export the launch printed took the older checkpoint without a word (review of
    2026-12-07). A `--resume PATH` into a new run directory wrote no config.json at all."""
    from openprime.train.checkpointing import load_model_weights

    run_dir = _run_dir(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    cfg = recipe_config(DEBUG, ["schedule.num_warmup_steps=5", "schedule.num_decay_steps=10", "train.num_steps=60",
                               "diloco.num_inner_steps=10", f"checkpoint.directory={elsewhere}"])
    write_run_files(run_dir, cfg, recipe=DEBUG, recipe_files=[DEBUG], overrides=[], num_nodes=2,
                    resumed_from=run_dir / "checkpoints" / "step-00000010")
    assert (run_dir / "config.resumed-1.json").is_file()
    model = {"model": {"tok_embeddings.weight": torch.ones(2, 2)}, "model_config": to_dict(cfg.model)}
    for slot in ("slot-0", "slot-1"):
        write_part(elsewhere, 60, slot, model, parts=["slot-0", "slot-1"])
    s = run_status(run_dir, now=1080.0)
    assert (s.num_steps, s.saved) == (60, 60)
    _, weights, part = load_model_weights(run_dir)
    assert part.parent == elsewhere / "step-00000060"
    assert torch.equal(weights["tok_embeddings.weight"], torch.ones(2, 2))
    # A launch resuming another run's checkpoint into a new directory writes its config.json.
    fork = tmp_path / "fork"
    write_run_files(fork, cfg, recipe=DEBUG, recipe_files=[DEBUG], overrides=[], num_nodes=2,
                    resumed_from=run_dir / "checkpoints" / "step-00000010")
    assert json.loads((fork / "config.json").read_text())["resumed_from"].endswith("step-00000010")
    assert (fork / "recipe" / "debug.py").is_file() and run_status(fork).num_steps == 60


def test_status_names_the_launches_joined_to_a_coordinator_that_share_the_directory(tmp_path, capsys):
    """Every machine of a run spread over several launches with --join, which holds the run directory shared and
    writes no record: status said no launch was running while one trained there (review of 2026-12-07)."""
    run_dir = _run_dir(tmp_path)
    with RunDirLock(run_dir, shared=True):
        assert cli.main(["status", str(run_dir)]) == 0
        out = capsys.readouterr().out
        assert f": running here (pid {os.getpid()}, joined to a coordinator: " in out, out
    assert run_status(run_dir).launch is None  # released


def test_status_after_a_resume_from_an_older_step_shows_the_resumed_timeline_s_saves(tmp_path, capsys):
    """Trained to step 40 (H = 10), saving and evaluating every outer step; steps 30 and 40 moved aside, resumed from
    step 20 and stopped at step 30, saved. Status said "the saves of step(s) [40] did not finish" and showed the
    abandoned timeline's validation loss of step 40 (and the launch's end failed: test_metrics.py)."""
    run_dir = tmp_path / "run"
    cfg = recipe_config(DEBUG, ["schedule.num_warmup_steps=5", "schedule.num_decay_steps=10", "train.num_steps=40",
                               "diloco.num_inner_steps=10"])
    write_run_files(run_dir, cfg, recipe=DEBUG, recipe_files=[DEBUG], overrides=[], num_nodes=1)

    def train(steps, tag):
        for step in steps:
            yield {"kind": "step", "node": 0, "time": 1000.0 + step, "step": step, "loss": 8.0 - 0.1 * step}
            if step % 10 == 0:
                yield {"kind": "outer", "node": 0, "time": 1000.0, "step": step, "outer_step": step // 10,
                       "state_hash": tag, "skipped": False, "bytes_sent": 0}
                yield {"kind": "checkpoint", "node": 0, "time": 1000.0, "step": step}
                yield {"kind": "eval", "node": 0, "time": 1000.0, "step": step, "val_loss": 9.0 - step / 10}

    records = [*train(range(1, 41), "a"), {"kind": "start", "node": 0, "time": 1100.0, "step": 20},
               *train(range(21, 31), "b"), {"kind": "end", "node": 0, "time": 1200.0}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for step in (10, 20, 30):
        write_part(run_dir / "checkpoints", step, "slot-0", {"w": torch.zeros(3)}, parts=["slot-0"])
    s = run_status(run_dir, now=1300.0)
    assert (s.outer_step, s.saved, s.unfinished, s.val_loss) == (3, 30, [], (30, 6.0))
    assert [(n.step, n.ended) for n in s.nodes] == [(30, True)]
    assert cli.main(["status", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert out.endswith("  validation loss 6.0000 at step 30\n  checkpoints: newest step 30\n"), out


def test_a_node_that_joined_and_left_before_its_first_inner_step_shows_the_step_it_joined_at(tmp_path, capsys):
    # It read "step 0/40, loss nan": a node admitted at step 20 with the run's state, killed before its first step.
    run_dir = _run_dir(tmp_path)
    with (run_dir / "metrics.jsonl").open("a") as f:
        for r in ({"kind": "start", "node": 2, "time": 1021.0, "step": 20, "joining": True},
                  {"kind": "outer", "node": 2, "time": 1021.1, "step": 20, "outer_step": 2, "state_hash": "aa",
                   "skipped": False, "bytes_sent": 0, "received_state": True},
                  {"kind": "start", "node": 0, "time": 1022.0, "step": 10}):  # node 0 again: a resume at step 10
            f.write(json.dumps(r) + "\n")
    s = run_status(run_dir, now=1080.0)
    assert [(n.node, n.step, n.loss) for n in s.nodes] == [(0, 10, None), (1, 20, 5.0), (2, 20, None)]
    assert cli.main(["status", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "  node 2: step 20/40, no inner step yet, last record " in out, out
    assert "  node 0: step 10/40, no inner step yet, last record " in out and "nan" not in out, out
