"""Metrics arithmetic: MFU from 6N plus attention against a peak, compute utilisation from the wall clock,
the progress line, and TensorBoard scalars mirrored from the JSONL records."""

import json
import logging
import sys
import time
import types

import pytest

from openprime.train.metrics import (
    METRICS_FILE,
    MetricsTail,
    MetricsWriter,
    WallClock,
    holds_outer_steps,
    model_flops_utilisation,
    progress_line,
    read_records,
    show_info_logs,
    summarize_records,
)
from openprime.train.model import FLAVORS, num_flops_per_token


def test_mfu_of_the_paper():
    # INTELLECT-1: 8xH100 at 43.3% MFU run 100 inner steps of 128 x 8192 tokens in about 38 minutes.
    flops_per_token = num_flops_per_token(FLAVORS["10B"], 8192)
    tokens_per_s = 128 * 8192 * 100 / (38 * 60)
    mfu = model_flops_utilisation(tokens_per_s=tokens_per_s, flops_per_token=flops_per_token, peak_flops=989e12,
                                  num_devices=8)
    assert mfu == pytest.approx(0.433, abs=0.01)
    assert model_flops_utilisation(tokens_per_s=1e3, flops_per_token=1e9, peak_flops=0, num_devices=1) is None


def test_compute_utilisation_is_the_share_of_wall_time_not_in_outer_steps():
    clock = WallClock(start=time.monotonic() - 10.0)
    clock.outer_s = 2.5
    assert clock.compute_utilisation() == pytest.approx(0.75, abs=0.01)
    clock.outer_s = 20.0  # never below 0, whatever the bookkeeping says
    assert clock.compute_utilisation() == 0.0


def test_progress_line_shows_what_is_known():
    line = progress_line(node=1, step=20, num_steps=200, loss=5.25, tokens_per_s=3456, outer_steps=1,
                         bytes_sent=7_400_000, lr=3e-3, compute_utilisation=0.929, mfu=0.4, num_nodes=4)
    assert "[node 1] step 20/200" in line and "MFU 40.0%" in line and "compute 92.9%" in line
    assert "4 nodes" in line and "3.5k tok/s" in line and "7.4 MB" in line
    assert "MFU" not in progress_line(node=0, step=1, num_steps=2, loss=1.0, tokens_per_s=1.0, outer_steps=0,
                                      bytes_sent=0, lr=1e-3)


def test_tensorboard_gets_the_numeric_fields(tmp_path, monkeypatch):
    scalars = []

    class FakeSummaryWriter:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, tag, value, step):
            scalars.append((tag, value, step))

        def close(self):
            scalars.append("closed")

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeSummaryWriter))
    writer = MetricsWriter(tmp_path, 3, tensorboard_dir=tmp_path / "tb")
    writer.write("step", step=7, loss=2.5, lr=1e-3, mfu=None, skipped=False, name="x")
    writer.close()
    assert scalars == [("step/loss", 2.5, 7), ("step/lr", 1e-3, 7), "closed"]
    assert read_records(tmp_path)[0] == {**read_records(tmp_path)[0], "kind": "step", "node": 3, "loss": 2.5}


def test_metrics_tail_returns_whole_lines_once(tmp_path):
    tail = MetricsTail(tmp_path)
    assert tail.poll() == []  # no file yet
    path = tmp_path / METRICS_FILE
    a, b = json.dumps({"kind": "step", "step": 1}), json.dumps({"kind": "step", "step": 2})
    path.write_text(a + "\n" + b[:7])  # the second record is half written
    assert tail.poll() == [{"kind": "step", "step": 1}]
    with path.open("a") as f:
        f.write(b[7:] + "\n")
    assert tail.poll() == [{"kind": "step", "step": 2}]
    assert tail.poll() == []
    assert [r["step"] for r in tail.records] == [1, 2]


def test_a_full_disk_drops_records_with_one_warning_and_training_goes_on(tmp_path, monkeypatch, caplog):
    import errno
    import os

    from openprime.train import metrics

    writer = MetricsWriter(tmp_path, node=3)
    writer.write("step", step=1, loss=2.0)
    write = os.write

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(metrics.os, "write", full)
    with caplog.at_level("WARNING", logger="openprime.train.metrics"):
        writer.write("step", step=2, loss=1.9)  # before: OSError, and the node died with it
        writer.write("step", step=3, loss=1.8)
    monkeypatch.setattr(metrics.os, "write", write)  # room again
    writer.write("step", step=4, loss=1.7)
    writer.close()
    assert writer.num_dropped == 2
    assert [r.getMessage() for r in caplog.records] == [
        "node 3: cannot write its metrics ([Errno 28] No space left on device); training goes on, its records are "
        "dropped until the disk has room (this warning is not repeated)"]
    assert [r["step"] for r in read_records(tmp_path)] == [1, 4]


def test_readers_skip_a_line_cut_short(tmp_path, caplog):
    whole = json.dumps({"kind": "step", "node": 0, "step": 1})
    (tmp_path / "metrics.jsonl").write_text(whole + '\n{"kind": "step", "no' + "\n" + whole.replace("1}", "2}") + "\n")
    with caplog.at_level("WARNING", logger="openprime.train.metrics"):
        assert [r["step"] for r in read_records(tmp_path)] == [1, 2]
        tail = MetricsTail(tmp_path)
        assert [r["step"] for r in tail.poll()] == [1, 2]
    assert "skipping a line that is not a whole record" in caplog.text


def test_a_run_directory_holds_outer_steps_once_an_outer_record_is_written(tmp_path):
    # What makes a node without a checkpoint wait for a run's state instead of starting the run again.
    assert not holds_outer_steps(tmp_path)  # no metrics file
    writer = MetricsWriter(tmp_path, node=0)
    writer.write("start", step=0)
    writer.write("step", step=1, loss=5.0)
    writer.write("local_outer", local_rank=1, outer_step=1)  # "outer" inside other names is not an outer step
    with (tmp_path / METRICS_FILE).open("a") as f:
        f.write('{"kind": "outer", "no\n')  # a record cut short by a full disk
    assert not holds_outer_steps(tmp_path)
    writer.write("outer", step=5, outer_step=1)
    assert holds_outer_steps(tmp_path)


def test_a_node_prints_live_recovery_info_as_its_lines_and_keeps_warnings_on_stderr(capsys):
    name = "openprime.test_show_info_logs"  # a logger of its own: the real ones keep no handler after the test
    logger = logging.getLogger(name)
    try:
        show_info_logs(3, loggers=(name,))
        show_info_logs(3, loggers=(name,))  # a second call adds nothing: each line printed once
        logger.debug("not shown")
        logger.info("receiving the state from rank 0: 1.0 of 2.0 MB (50%)")
        logger.warning("chunk 4 of the state from donor 0 does not match its checksum")
        out, err = capsys.readouterr()
        assert out == "[node 3] receiving the state from rank 0: 1.0 of 2.0 MB (50%)\n"
        assert err == "chunk 4 of the state from donor 0 does not match its checksum\n"
    finally:
        logger.handlers.clear()
        logger.setLevel(logging.NOTSET)


def test_steps_trained_again_after_a_resume_count_once_in_the_summary():
    # Stopped at step 6, resumed from the checkpoint of step 4: steps 5 and 6 are trained again. The summary read
    # "over 12 steps" of a 10-step run, and its last losses were in the order they were written.
    def step(node, k, loss, skipped=False):
        return {"kind": "step", "node": node, "step": k, "loss": loss, "skipped": skipped}

    first = [step(0, k, 10.0 - k, skipped=k == 6) for k in range(1, 7)]
    resumed = [step(0, k, 20.0 - k) for k in range(5, 11)]
    summary = summarize_records(first + resumed)
    assert summary.losses[0] == [9.0, 8.0, 7.0, 6.0, 15.0, 14.0, 13.0, 12.0, 11.0, 10.0]
    assert summary.num_skipped == {}  # step 6's skip was the first launch's; its second training was not skipped


def test_a_resumed_launch_that_stops_earlier_than_the_abandoned_one_ends_on_its_own_last_loss():
    # Trained to step 13 and crashed; resumed from the checkpoint of step 10 and stopped at step 12: the summary
    # read the crashed timeline's loss of step 13 and "over 13 steps".
    first = [{"kind": "step", "node": 0, "step": k, "loss": float(k)} for k in range(1, 14)]
    resumed = [{"kind": "step", "node": 0, "step": k, "loss": 100.0 + k} for k in (11, 12)]
    assert summarize_records(first + resumed).losses[0] == [*map(float, range(1, 11)), 111.0, 112.0]


def _step(node, k):
    return {"kind": "step", "node": node, "step": k, "loss": 1.0}


def _outer(node, o, state_hash):
    """Outer step `o` of a run with H = 2."""
    return {"kind": "outer", "node": node, "outer_step": o, "step": 2 * o, "state_hash": state_hash, "bytes_sent": 1}


def test_the_hashes_of_an_abandoned_timeline_go_with_it():
    # Nodes 0-2 trained outer steps 1-3 (H = 2) and node 2 died; 0 and 1 were resumed from step 2 and trained outer
    # steps 2-3 again, on other weights. Node 2's hashes of the abandoned outer steps 2 and 3 stayed beside theirs: the
    # replicas "disagreed" at steps that had agreed, and a resume that stopped at outer step 2 showed outer step 3.
    first = [r for o in (1, 2, 3) for n in range(3)
             for r in (_step(n, 2 * o - 1), _step(n, 2 * o), _outer(n, o, f"a{o}"))]
    resumed = [_step(0, 3), _step(1, 3), _step(0, 4), _step(1, 4), _outer(1, 2, "b2"), _outer(0, 2, "b2")]
    summary = summarize_records(first + resumed)
    assert summary.hashes == {1: {0: "a1", 1: "a1", 2: "a1"}, 2: {0: "b2", 1: "b2"}}
    assert summary.hashes_agree and summary.num_outer_steps == 2
    assert summary.bytes_sent == {0: 4, 1: 4, 2: 3}  # what was sent was sent, in either timeline


def test_a_node_that_joined_mid_run_and_was_resumed_keeps_the_summary_whole():
    # Node 1 joined at outer step 2 (no hash of outer step 1); both were resumed from step 2 (H = 2). Its restart
    # looked up its hash of outer step 1 (KeyError: the summary, status and the launch's end failed).
    first = [_step(0, 1), _step(0, 2), _outer(0, 1, "a1"), _step(0, 3), _step(1, 3), _step(0, 4), _step(1, 4),
             _outer(0, 2, "a2"), _outer(1, 2, "a2")]
    resumed = [_step(1, 3), _step(0, 3), _step(1, 4), _step(0, 4), _outer(0, 2, "b2"), _outer(1, 2, "b2")]
    assert summarize_records(first + resumed).hashes == {1: {0: "a1"}, 2: {0: "b2", 1: "b2"}}


def test_a_node_left_out_of_a_resume_brings_no_old_hash_back_when_it_joins_later():
    # Nodes 0-2 trained outer steps 1-4 (H = 2); 0 and 1 were resumed from step 2; node 2 joined that launch at outer
    # step 3 (elastic). Its old hashes of outer steps 2-4 stayed beside the new timeline's (found by review).
    def train(nodes, outer_steps, tag):  # in the order nodes write: every node's steps before the outer step's end
        return [r for o in outer_steps
                for r in [*(_step(n, 2 * o - 1) for n in nodes), *(_step(n, 2 * o) for n in nodes),
                          *(_outer(n, o, f"{tag}{o}") for n in nodes)]]

    first = train(range(3), range(1, 5), "a")
    # The resumed launch's node 1 started late: node 0 had finished outer step 2 before node 1's first step record.
    resumed = [_step(0, 3), _step(0, 4), _outer(0, 2, "b2"), {"kind": "start", "node": 1}, _step(1, 3), _step(1, 4),
               _outer(1, 2, "b2"), *train((0, 1), [3], "b"), *train(range(3), [4], "b")]
    summary = summarize_records(first + resumed)
    assert summary.hashes == {1: {0: "a1", 1: "a1", 2: "a1"}, 2: {0: "b2", 1: "b2"}, 3: {0: "b3", 1: "b3"},
                              4: {0: "b4", 1: "b4", 2: "b4"}}


def test_the_checkpoints_and_evaluations_of_an_abandoned_timeline_go_with_it():
    # Trained to step 6 (H = 2) with checkpoints at 2, 4, 6 and evaluations at 4 and 6; steps 4 and 6 were moved
    # aside and the run resumed from step 2, stopping at step 4 (train.stop_after_outer_steps=2), saved. The
    # abandoned step 6's "checkpoint" record counted as the run's last: the launch ended with "error: the run's
    # last checkpoint, of step 6, did not finish saving" (exit 1), and status said the same, and showed the
    # abandoned timeline's validation loss of step 6 (found by review, reproduced with `openprime run`).
    def ckpt(node, k):
        return {"kind": "checkpoint", "node": node, "step": k}

    def evaluation(node, k, val_loss):
        return {"kind": "eval", "node": node, "step": k, "val_loss": val_loss}

    first = [r for o in (1, 2, 3) for n in (0, 1)
             for r in (_step(n, 2 * o - 1), _step(n, 2 * o), _outer(n, o, f"a{o}"), ckpt(n, 2 * o),
                       *([evaluation(n, 2 * o, 10.0 + o)] if o > 1 else []))]
    resumed = [_step(0, 3), _step(1, 3), _step(0, 4), _step(1, 4), _outer(0, 2, "b2"), _outer(1, 2, "b2"),
               ckpt(0, 4), ckpt(1, 4), evaluation(0, 4, 5.0)]
    summary = summarize_records(first + resumed)
    assert summary.last_checkpoint_step == 4 and summary.checkpoint_steps == [2, 4]
    assert summary.val_loss == (4, 5.0)
    # Still resumed before it wrote its own: the checkpoint of step 2 it resumed from, no evaluation yet.
    summary = summarize_records(first + resumed[:2])
    assert summary.last_checkpoint_step == 2 and summary.val_loss is None
    # A save of this timeline that did not finish is still the last: what the launch's end reports.
    assert summarize_records(first + resumed + [ckpt(0, 6)]).last_checkpoint_step == 6


def test_a_record_that_is_valid_json_but_not_a_record_is_skipped(tmp_path, caplog):
    # A hand-edited or damaged metrics file: `null`, a number, an object without "kind". The summary (the
    # launch's end) and `openprime status` failed with a traceback (TypeError: 'NoneType' object is not subscriptable).
    whole = json.dumps({"kind": "step", "node": 0, "time": 1.0, "step": 1, "loss": 2.0})
    (tmp_path / METRICS_FILE).write_text(f'{whole}\nnull\n7\n["step"]\n{{"step": 2}}\n{whole.replace("1,", "3,")}\n')
    with caplog.at_level("WARNING", logger="openprime.train.metrics"):
        records = read_records(tmp_path)
        assert [r["step"] for r in records] == [1, 3]
        assert [r["step"] for r in MetricsTail(tmp_path).poll()] == [1, 3]
    assert summarize_records(records).losses == {0: [2.0, 2.0]}
    assert caplog.text.count("skipping a line that is not a whole record") == 2 * 4  # each reader, each line


def test_readers_skip_bytes_that_are_not_text(tmp_path):
    # A crash can leave garbage at a file's end: read_records raised UnicodeDecodeError, and status could not read
    # the run at all ("'utf-8' codec can't decode byte 0xff"), where MetricsTail skipped the line.
    whole = json.dumps({"kind": "step", "node": 0, "step": 1})
    (tmp_path / METRICS_FILE).write_bytes(whole.encode() + b"\n\xff\xfe\x00garbage\n")
    assert [r["step"] for r in read_records(tmp_path)] == [1]


def test_a_whole_record_written_after_a_short_write_is_read(tmp_path, monkeypatch):
    # A write cut short by a full disk leaves a line without its newline: the next record any node appends, whole,
    # lands on that line, and the readers skipped it with the torn one (an "end" or an outer step's hash lost).
    import os

    from openprime.train import metrics

    writer, other = MetricsWriter(tmp_path, node=0), MetricsWriter(tmp_path, node=1)
    writer.write("step", step=1, loss=2.0)
    write = os.write
    monkeypatch.setattr(metrics.os, "write", lambda fd, data: write(fd, data[:20]))  # the disk fills mid-record
    writer.write("step", step=2, loss=1.9)
    monkeypatch.setattr(metrics.os, "write", write)  # room again
    other.write("outer", step=2, outer_step=1, state_hash="aa", bytes_sent=1)
    writer.write("step", step=3, loss=1.8)
    writer.close()
    other.close()
    want = [("step", 1), ("outer", 2), ("step", 3)]
    assert [(r["kind"], r["step"]) for r in read_records(tmp_path)] == want
    assert [(r["kind"], r["step"]) for r in MetricsTail(tmp_path).poll()] == want
    assert [r["node"] for r in metrics.records_of_kind(tmp_path, "outer")] == [1]


def test_a_record_cut_short_by_a_full_disk_is_counted_dropped_and_the_next_is_read_whole(tmp_path, monkeypatch,
                                                                                        caplog):
    # A write that fills the disk returns fewer bytes than asked: the record was torn, but it was not counted or said.
    import os

    from openprime.train import metrics

    writer = MetricsWriter(tmp_path, node=1)
    write = os.write
    monkeypatch.setattr(metrics.os, "write", lambda fd, data: write(fd, data[:10]))  # 10 bytes, then the disk is full
    with caplog.at_level("WARNING", logger="openprime.train.metrics"):
        writer.write("outer", step=50, hash="ab")
    monkeypatch.setattr(metrics.os, "write", write)
    writer.write("outer", step=100, hash="cd")
    writer.close()
    assert writer.num_dropped == 1
    assert "wrote 10 of the record's" in caplog.text and "training goes on" in caplog.text
    # The torn bytes and the next record share a line; the reader takes the record from where it begins.
    assert [r["step"] for r in read_records(tmp_path)] == [100]
