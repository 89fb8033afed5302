"""Issue 8's experiment, shortened: does DiLoCo int8 train as well as DiLoCo fp32, on 4 x H fewer bytes than
data parallel?

`tools/experiments/convergence.py --short` trains one small Llama three ways on the same tokens (data parallel,
DiLoCo fp32, DiLoCo int8; 4 nodes, H = 10, 50 steps) in under a minute on 2 cores. The full run's other two ways are
left out: the single node (data parallel without a network) and DiLoCo int8 with a node killed and replaced (what that
shows, a node killed, replaced and given the state live, tests/test_elastic.py checks in depth; in a run this short
the replacement is often not admitted before the end anyway). It runs in a subprocess of its own
session, so that a run past the bound is killed with every node it started. The fast tests check the
script's analysis on made-up records.
"""

import importlib.util
import json
import math
import os
import pathlib
import signal
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "experiments" / "convergence.py"
BOUND_S = 540


def _load_script():
    spec = importlib.util.spec_from_file_location("convergence_experiment", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


convergence = _load_script()
# What the issue asks CI to assert (see the module docstring for the two left out).
CI_VARIANTS = (convergence.DATA_PARALLEL, convergence.DILOCO_FP32, convergence.DILOCO_INT8)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("convergence")
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--short", "--out", str(out),
                             "--only", ",".join(v.name for v in CI_VARIANTS)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the short experiment ran past {BOUND_S} s:\n{output[-6000:]}")
    assert proc.returncode == 0, output[-6000:]
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(BOUND_S + 60)
def test_int8_validation_loss_within_2_percent_of_fp32(short_run):
    _, results = short_run
    int8 = results["variants"]["diloco_int8"]["final_val_loss"]
    fp32 = results["variants"]["diloco_fp32"]["final_val_loss"]
    assert abs(int8 / fp32 - 1) <= 0.02, (int8, fp32)


@pytest.mark.slow
@pytest.mark.timeout(BOUND_S + 60)
def test_int8_sends_at_least_3_9_h_times_fewer_bytes_than_data_parallel(short_run):
    _, results = short_run
    h = results["settings"]["num_inner_steps"]
    dp = results["variants"]["data_parallel"]["bytes_sent"]
    int8 = results["variants"]["diloco_int8"]["bytes_sent"]
    fp32 = results["variants"]["diloco_fp32"]["bytes_sent"]
    assert dp / int8 >= 3.9 * h, (dp, int8, dp / int8)
    assert 3.9 <= fp32 / int8 < 4, (fp32, int8)  # 4x from int8, less the codebooks


@pytest.mark.slow
@pytest.mark.timeout(BOUND_S + 60)
def test_every_variant_trained_to_the_end(short_run):
    _, results = short_run
    s = results["settings"]
    assert set(results["variants"]) == {v.name for v in CI_VARIANTS}
    for name, r in results["variants"].items():
        assert not r["timed_out"], name
        assert r["hashes_agree"], name
        # From ~ln(vocab) = 8.3 at the start down by well over a nat on real text.
        assert r["initial_train_loss"] > math.log(4096) - 0.5, (name, r["initial_train_loss"])
        assert r["final_val_loss"] < r["initial_train_loss"] - 1.5, (name, r["final_val_loss"])
        assert [p["step"] for p in r["curve"]] == list(range(s["num_inner_steps"], s["num_steps"] + 1,
                                                             s["num_inner_steps"]))
        assert all(p["val_loss_spread"] == 0 for p in r["curve"]), name  # every node evaluated the same model


@pytest.mark.slow
@pytest.mark.timeout(BOUND_S + 60)
def test_table_and_picture_written(short_run):
    out, _ = short_run
    table = (out / "results.md").read_text()
    assert "| variant | nodes x batch | final validation loss |" in table
    for v in CI_VARIANTS:
        assert v.label in table
    assert (out / "convergence.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- the analysis, on made-up records


def _records(*, nodes: int, num_steps: int, h: int, bytes_per_sync: int, val: dict[int, float]) -> list[dict]:
    records = []
    for node in range(nodes):
        records.append({"kind": "start", "node": node, "time": 0.0, "node_id": f"n{node}", "joining": False})
        for step in range(1, num_steps + 1):
            records.append({"kind": "step", "node": node, "time": step, "step": step, "loss": 8.3 - step / 100})
            if step % h == 0:
                records.append({"kind": "outer", "node": node, "time": step, "step": step, "outer_step": step // h,
                                "bytes_sent": bytes_per_sync, "state_hash": f"h{step}", "skipped": False,
                                "received_state": False})
                records.append({"kind": "eval", "node": node, "time": step, "step": step, "val_loss": val[step],
                                "tokens": step * 64, "num_nodes": nodes})
        records.append({"kind": "end", "node": node, "time": num_steps + 1, "compute_utilisation": 0.9})
    return records


def test_analyse_counts_tokens_bytes_and_the_final_loss():
    records = _records(nodes=4, num_steps=20, h=10, bytes_per_sync=1000, val={10: 6.0, 20: 5.0})
    r = convergence.analyse(records, tokens_per_node_step=64, num_steps=20)
    assert r["final_val_loss"] == 5.0
    assert r["bytes_sent"] == 4 * 2 * 1000
    assert r["tokens"] == 4 * 20 * 64
    assert [(p["step"], p["tokens"], p["bytes"]) for p in r["curve"]] == [(10, 4 * 10 * 64, 4000),
                                                                       (20, 4 * 20 * 64, 8000)]
    assert r["hashes_agree"] and r["rejoined"] is None and r["nodes_ended"] == [0, 1, 2, 3]
    assert r["initial_train_loss"] == pytest.approx(8.29)


def test_analyse_sees_a_replacement_and_a_divergence():
    records = _records(nodes=2, num_steps=20, h=10, bytes_per_sync=500, val={10: 6.0, 20: 5.0})
    records.append({"kind": "start", "node": 2, "time": 11, "node_id": "n2", "joining": True})
    records.append({"kind": "outer", "node": 2, "time": 20, "step": 20, "outer_step": 2, "bytes_sent": 7,
                    "state_hash": "other", "skipped": False, "received_state": True})
    records.append({"kind": "end", "node": 2, "time": 21})
    r = convergence.analyse(records, tokens_per_node_step=64, num_steps=20)
    assert r["rejoined"] == {"node": 2, "admitted_at_outer_step": 2, "admitted_at_step": 20, "received_state": True,
                             "ended": True}
    assert r["bytes_sent"] == 2 * 2 * 500 + 7
    assert not r["hashes_agree"]


def test_a_run_without_its_last_evaluation_has_no_final_loss():
    records = _records(nodes=1, num_steps=20, h=10, bytes_per_sync=0, val={10: 6.0, 20: 5.0})
    records = [r for r in records if not (r["kind"] == "eval" and r["step"] == 20)]
    assert convergence.analyse(records, tokens_per_node_step=64, num_steps=20)["final_val_loss"] is None


def test_compare_and_the_table(tmp_path):
    s = convergence.SHORT
    h = s.num_inner_steps
    results = {}
    for name, loss, sent in [("data_parallel", 5.0, h * 4000), ("diloco_fp32", 5.2, 4000),
                             ("diloco_int8", 5.3, 1010), ("diloco_int8_kill", 5.35, 2000), ("single_node", 5.05, 0)]:
        results[name] = {"label": name, "final_val_loss": loss, "bytes_sent": sent, "wall_s": 10.0, "timed_out": False,
                         "hashes_agree": True, "events": {}, "rejoined": None, "curve": [
                             {"step": h, "tokens": 100, "bytes": sent // 2, "val_loss": loss + 1},
                             {"step": 2 * h, "tokens": 200, "bytes": sent, "val_loss": loss}]}
    results["diloco_int8_kill"]["events"] = {"killed_node": 3, "killed_after_step": 30,
                                             "replacement_started_s_after_kill": 2.5}
    ratios = convergence.compare(results, s)
    assert ratios["int8_over_fp32_val_loss"] == pytest.approx(5.3 / 5.2)
    assert ratios["int8_within_2pct_of_fp32"]
    assert not ratios["int8_within_5pct_of_data_parallel"]
    assert ratios["data_parallel_over_int8_bytes"] == pytest.approx(h * 4000 / 1010)  # 3.96 H
    assert ratios["bytes_ratio_met"]
    meta = {"model": "a model", "machine": "a machine", "command": "cmd", "total_s": 60.0}
    table = convergence.markdown(results, ratios, s, meta)
    assert f"| {convergence.DILOCO_INT8.label} | 4 x 8 | 5.3000 | +6.0% | 1.0 KB | {h * 4000 / 1010:.1f}x |" in table
    assert "**missed**" in table
    assert "no network" in table
    assert "node 3 killed after step 30; replacement started 2.5 s later, but not admitted" in table
    if convergence.plot(tmp_path / "c.png", results, s):
        assert (tmp_path / "c.png").stat().st_size > 1000


def test_a_runs_directory_holding_a_run_is_refused_before_training(tmp_path, capsys):
    held = tmp_path / "runs" / convergence.DILOCO_INT8.name
    held.mkdir(parents=True)
    (held / "metrics.jsonl").write_text('{"kind": "start"}\n')
    with pytest.raises(SystemExit) as exit_:
        convergence.main(["--short", "--out", str(tmp_path), "--only", "diloco_fp32,diloco_int8"])
    assert exit_.value.code == 2
    assert f"{held} already hold(s) a run" in capsys.readouterr().err
    assert not (tmp_path / "runs" / convergence.DILOCO_FP32.name).exists()  # nothing trained
