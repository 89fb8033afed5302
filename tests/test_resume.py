"""Checkpoints end to end: stop a 2-node run, resume it bit-identically, survive a corrupt file, export it.

The baseline runs 60 inner steps uninterrupted; the stopped run ends itself after outer step 3
(train.stop_after_outer_steps) with checkpoints at steps 20 and 30; `--resume latest` must then end
with exactly the baseline's global-state hashes after every outer step and exactly its losses.
"""

import contextlib
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from openprime.ckpt.store import part_info, verify_step
from openprime.train.checkpointing import load_model_weights, newest_saved
from openprime.train.launcher import LEAVE_S
from openprime.train.metrics import read_records, summarize
from openprime.train.model import Llama
from openprime.train.testing import (
    free_port,
    injecting,
    node_pids,
    process_ended,
    serve_coordinator,
    wait_for,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Sequences of 32 tokens, not 128: bit-identity does not need the compute (it made up most of these tests' time).
RUN = ("--set", "train.num_steps=60", "--set", "diloco.num_inner_steps=10", "--set", "checkpoint.interval_steps=10",
       "--set", "train.seq_len=32")
SHORT = ("--nodes", "2", *RUN)
RECIPE = ROOT / "recipes" / "debug.py"


def _continue_with(run_dir: pathlib.Path, *sets: str) -> str:
    """The command the launcher says continues the short run: the recipe with the `--set`s of its launch."""
    return f"continue with `openprime run {shlex.join([str(RECIPE), *RUN, *sets])} --nodes 2 --run-dir {run_dir}"


def _openprime(*args: str, expect: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "openprime.train", *args], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _run(run_dir: pathlib.Path, *args: str, expect: int = 0) -> subprocess.CompletedProcess:
    return _openprime("run", str(ROOT / "recipes" / "debug.py"), "--run-dir", str(run_dir), *SHORT, *args,
                      expect=expect)


def _made_once(tmp_path_factory, name: str, make) -> pathlib.Path:
    """The run directory `make(run_dir)` writes, made once per test session and shared by its pytest-xdist workers
    (each built these module fixtures for itself: 25-31 s of a worker each, twice in most runs). The tests only read
    them or copy them (`_copy`); the lock lets one worker make it while the others wait."""
    from filelock import FileLock  # torch's own dependency

    base = tmp_path_factory.getbasetemp()
    # A worker's base is SESSION/popen-gwN: the session's directory is shared by its workers and no other session.
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    run_dir, done = shared / f"shared-{name}" / "run", shared / f"shared-{name}.done"
    with FileLock(str(shared / f"shared-{name}.lock"), timeout=600):
        if not done.exists():
            shutil.rmtree(run_dir.parent, ignore_errors=True)  # a worker that failed halfway left it
            run_dir.parent.mkdir()
            make(run_dir)
            done.touch()
    return run_dir


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> pathlib.Path:
    return _made_once(tmp_path_factory, "baseline", _run)


def _stopped_run(run_dir: pathlib.Path) -> None:
    proc = _run(run_dir, "--set", "train.stop_after_outer_steps=3")
    assert "stopping after outer step 3" in proc.stdout
    assert f"{_continue_with(run_dir, '--set', 'train.stop_after_outer_steps=3')} --resume latest`" in proc.stdout


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> pathlib.Path:
    return _made_once(tmp_path_factory, "stopped", _stopped_run)


def _losses(run_dir: pathlib.Path) -> dict[int, list[float]]:
    """Per inner step, the losses of the nodes (sorted: node numbers may map to other slots per launch)."""
    losses: dict[int, list[float]] = {}
    for r in read_records(run_dir):
        if r["kind"] == "step":
            losses.setdefault(r["step"], []).append(r["loss"])
    return {step: sorted(v) for step, v in losses.items()}


def _copy(run_dir: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(run_dir, tmp_path / "run"))


def test_each_part_records_the_global_state_hash_the_replicas_agreed_on(stopped):
    from openprime.train.data import prepare_data
    from openprime.train.recipe import recipe_config

    data_cfg = recipe_config(RECIPE, []).data
    """What a resume checks to refuse a step that mixes two saves of it (openprime.ckpt.store._check_one_save)."""
    agreed = {r["step"]: r["state_hash"] for r in read_records(stopped) if r["kind"] == "outer"}
    for step in (20, 30):
        for part in ("slot-0", "slot-1"):
            info = part_info(stopped / "checkpoints" / f"step-{step:08d}" / part)
            assert (info["fingerprint"].group, info["fingerprint"].digest) == ("rank-0", agreed[step]), (step, part)
            # And the token streams its data position refers to (checked on resume: data_layout_changes).
            assert info["state"]["data"]["tokens"] == [s.tokens_sha256 for s in prepare_data(data_cfg).sources]


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


def test_a_node_that_joins_a_resume_in_the_outer_step_it_stops_after_stops_with_the_others(baseline, stopped,
                                                                                          tmp_path):
    """A third node (no part of the 2-node checkpoint) caught up in the very outer step the launch stops after. It
    took itself for "already past the stop", trained to the end alone on a third of the data, and its saves pruned
    the stop's checkpoint (found 2026-12-07)."""
    run_dir = _copy(stopped, tmp_path)
    proc = _run(run_dir, "--nodes", "3", "--resume", str(run_dir / "checkpoints" / "step-00000030"),
                "--set", "train.stop_after_outer_steps=4")
    assert proc.stdout.count("stopping after outer step 4 (train.stop_after_outer_steps)") == 3, proc.stdout[-3000:]
    assert "where it caught up" in proc.stdout and "running to the end" not in proc.stdout
    saved = run_dir / "checkpoints" / "step-00000040"
    assert sorted(p.name for p in saved.iterdir()) == ["slot-0", "slot-1", "slot-2"]
    assert newest_saved(run_dir / "checkpoints", num_nodes=3) == 40
    assert summarize(run_dir).distinct_hashes[4] == summarize(baseline).distinct_hashes[4]  # one state, the run's


def _in_process(run_dir: pathlib.Path, *args: str, monkeypatch) -> tuple[int, list[dict]]:
    """`openprime run` of the short run in this process, with the launch itself replaced: what the command checks
    and does before any node starts, without the seconds of starting them. Returns its exit code and the launches."""
    from openprime.train import cli

    launched: list[dict] = []
    monkeypatch.setattr("openprime.train.launcher.launch", lambda cfg, **kw: launched.append(kw) or 0)
    return cli.main(["run", str(RECIPE), "--run-dir", str(run_dir), *SHORT, *args]), launched


def test_resume_latest_with_more_nodes_than_saved_names_the_step_to_resume(stopped, tmp_path, capsys, monkeypatch):
    """`--nodes 3 --resume latest` of a 2-node run said "none complete and intact" of steps that were both, and not
    the command that works: --resume PATH, whose third node takes the state from the other two."""
    run_dir = _copy(stopped, tmp_path)
    code, launched = _in_process(run_dir, "--nodes", "3", "--resume", "latest", monkeypatch=monkeypatch)
    assert code == 2 and not launched
    err, step = capsys.readouterr().err, run_dir / "checkpoints" / "step-00000030"
    assert (f"no step under {run_dir / 'checkpoints'} holds the parts of 3 nodes here (--nodes 3); the newest step "
            f"holding a whole node, 30, holds 2. Resume it with --resume {step}: its 2 node(s) continue from their "
            f"parts and the other 1 take the state from them at the first outer step") in err, err


def test_resume_latest_sets_aside_the_later_steps_of_a_node_that_saved_on_alone(stopped, tmp_path, capsys,
                                                                                monkeypatch):
    """A node died after step 30 and the other saved step 40 alone; `--resume latest` of both nodes goes back to step
    30. Step 40 was left in place: status, export and a later resume of fewer nodes took it, another timeline's
    (found 2026-12-07). It is moved aside, with the command that continues it."""
    run_dir = _copy(stopped, tmp_path)
    root = run_dir / "checkpoints"
    (root / "step-00000040").mkdir()
    shutil.copytree(root / "step-00000030" / "slot-0", root / "step-00000040" / "slot-0")  # stands in for node 0's
    code, launched = _in_process(run_dir, "--resume", "latest", monkeypatch=monkeypatch)
    assert code == 0 and launched[0]["resume"].step == 30
    aside = [p for p in root.iterdir() if p.name.startswith("abandoned-after-step-00000030-")]
    assert len(aside) == 1 and [p.name for p in aside[0].iterdir()] == ["step-00000040"]
    assert (f"openprime: steps [40] under {root} hold fewer nodes than this launch (a node died and the others saved "
            f"on without it): moved to {aside[0]}, out of this run's timeline. To continue that timeline instead, stop "
            f"this launch and resume with --resume {aside[0] / 'step-00000040'}") in capsys.readouterr().out
    assert newest_saved(root) == 30  # what status and export now take


def _damage(part: pathlib.Path) -> None:
    """Flip one bit in the middle of the part's tensor file, as a bad disk or a bad copy would."""
    victim = next(part.glob("*.distcp"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))


def test_a_damaged_newest_step_is_not_set_aside_as_another_timeline_nor_named_to_resume(stopped, tmp_path, capsys,
                                                                                         monkeypatch):
    """Every part of step 30 damaged on disk: `--resume latest` goes back to step 20 and leaves step 30 where it is
    (the run saves it again). It was moved aside as another timeline's ("a node died"), with the advice to resume
    from it, and `--nodes 3` named it as the step to resume (found 2026-12-07 by review)."""
    run_dir = _copy(stopped, tmp_path)
    root = run_dir / "checkpoints"
    for part in ("slot-0", "slot-1"):
        _damage(root / "step-00000030" / part)
    code, launched = _in_process(run_dir, "--nodes", "3", "--resume", "latest", monkeypatch=monkeypatch)
    assert code == 2 and not launched
    err = capsys.readouterr().err
    assert (f"the newest step holding a whole node, 20, holds 2. Resume it with --resume {root / 'step-00000020'}"
            in err), err
    code, launched = _in_process(run_dir, "--resume", "latest", monkeypatch=monkeypatch)
    assert code == 0 and launched[0]["resume"].step == 20
    assert "moved to" not in capsys.readouterr().out
    assert sorted(p.name for p in root.iterdir()) == ["step-00000020", "step-00000030"]


@pytest.mark.slow
def test_a_corrupt_checkpoint_falls_back_to_the_previous_one(stopped, tmp_path, caplog, monkeypatch):
    """The launch resumes step 20 (in this process, with the launch replaced: a resume from any step trains on as
    test_stop_and_resume_is_bit_identical shows from step 30)."""
    run_dir = _copy(stopped, tmp_path)
    _damage(run_dir / "checkpoints" / "step-00000030" / "slot-1")
    code, launched = _in_process(run_dir, "--resume", "latest", monkeypatch=monkeypatch)
    assert code == 0 and launched[0]["resume"].step == 20
    assert sorted(launched[0]["resume"].parts) == ["slot-0", "slot-1"]
    said = caplog.text
    assert "skipping checkpoint step 30" in said and "does not match its SHA-256" in said, said
    assert "falling back to the previous one" in said


def _as_from_a_terminal() -> None:
    """The signals of a command started from a terminal, whatever this suite inherited: a shell without job control
    starts background commands with SIGINT ignored (Python then installs no KeyboardInterrupt handler), `nohup`
    with SIGHUP ignored, and the children inherit both; a suite run that way would see Ctrl-C or a hang-up
    ignored (a launch keeps an inherited SIGHUP ignored: leaving.stop_signals_handled)."""
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


def _under_nohup() -> None:
    _as_from_a_terminal()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def _signalled_after_the_first_checkpoint(run_dir: pathlib.Path, signum: int, *, group: bool,
                                         env: dict[str, str] | None = None, stdout_gone: bool = False,
                                         nohup: bool = False) -> tuple[int, str]:
    """`openprime run` of the short 2-node run, sent `signum` once its first checkpoint is written by both nodes;
    returns its exit code and output. `group`: to the launcher's whole process group, as a terminal's Ctrl-C
    (SIGINT) or hang-up (SIGHUP) and a job scheduler's or systemd's stop (SIGTERM) are; else to the launcher only
    (`kill PID`). (Waiting for one node's record raced the other's save: a stop signal there abandoned that node's
    part, and the resume then found no complete checkpoint: 1 of 4 fresh-clone CI runs on 2026-12-06.)
    `stdout_gone`: stdout is a pipe whose reader is gone right after the signal, as a `| tee` that the same Ctrl-C
    ended; the output returned is then stderr's. `nohup`: started as `nohup` starts it, with SIGHUP ignored."""
    proc = subprocess.Popen([sys.executable, "-m", "openprime.train", "run", str(ROOT / "recipes" / "debug.py"),
                             "--run-dir", str(run_dir), *SHORT], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE if stdout_gone else subprocess.STDOUT,
                            text=True, preexec_fn=_under_nohup if nohup else _as_from_a_terminal,
                            process_group=0, env={**os.environ, **(env or {})})
    try:
        wait_for(run_dir, lambda records: len({r["node"] for r in records if r["kind"] == "checkpoint"}) == 2,
                 timeout_s=120)
        if group:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        if stdout_gone:
            proc.stdout.close()
        out = "".join(o for o in proc.communicate(timeout=60) if o)
    finally:
        if proc.poll() is None:  # the test failed: leave no process of the launch behind
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    return proc.returncode, out


@pytest.mark.slow
def test_ctrl_c_stops_the_nodes_and_says_how_to_continue(baseline, tmp_path):
    """SIGINT to `openprime run` (Ctrl-C) after its first checkpoint: the nodes leave, the command exits 130 naming
    the newest checkpoint and the command that continues the run, and that command ends where the baseline does."""
    run_dir = tmp_path / "run"
    returncode, out = _signalled_after_the_first_checkpoint(run_dir, signal.SIGINT, group=True)
    assert returncode == 130, out[-3000:]
    assert "openprime: interrupted; stopping the nodes (they leave gracefully)" in out
    # The nodes got the SIGINT too: they leave when the launcher says so (they died at once before 2026-12-06,
    # their checkpoint writes under way lost: "checkpoints: none ... finished saving").
    assert out.count("removed: left (deathrattle)") == 2, out[-3000:]
    assert f"{_continue_with(run_dir)} --resume latest`" in out
    assert "Traceback" not in out, out[-3000:]
    _run(run_dir, "--resume", "latest")
    final = max(summarize(baseline).distinct_hashes)
    assert summarize(run_dir).distinct_hashes[final] == summarize(baseline).distinct_hashes[final]


@pytest.mark.slow
def test_ctrl_c_of_a_run_piped_to_tee_says_how_to_continue_on_stderr(tmp_path):
    """`openprime run ... | tee run.log` and Ctrl-C: the tee dies of the SIGINT with the launcher and the nodes
    alive. The launcher ended with a BrokenPipeError on its checkpoints line and no command to continue with
    (2026-12-06), and a node that wrote a line before its stop came failed on it. Now the launcher's lines go to
    stderr once stdout is gone, and a node drops the lines it cannot write (openprime.train.metrics.say)."""
    run_dir = tmp_path / "run"
    returncode, err = _signalled_after_the_first_checkpoint(run_dir, signal.SIGINT, group=True, stdout_gone=True)
    assert returncode == 130, err[-3000:]
    assert err.count("removed: left (deathrattle)") == 2, err[-3000:]
    assert f"{_continue_with(run_dir)} --resume latest`" in err, err[-3000:]
    assert "Traceback" not in err and "failed" not in err, err[-3000:]
    root = run_dir / "checkpoints"
    assert newest_saved(root, num_nodes=2) is not None, sorted(p.name for p in root.rglob("*"))


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "group"), [(signal.SIGTERM, False), (signal.SIGTERM, True), (signal.SIGHUP, True)],
                         ids=["SIGTERM-launcher", "SIGTERM-group", "SIGHUP-group"])
def test_sigterm_or_sighup_stops_the_nodes_as_ctrl_c_does(tmp_path, signum, group):
    """`kill` (SIGTERM to the launcher), a job scheduler or systemd (SIGTERM to every process), a closed terminal or
    ssh session (SIGHUP to every process): the launcher stops its nodes gracefully (each sends its deathrattle),
    waits for them, and says how to continue; before, it died at once and they went on. With the group signalled,
    the fork server that reports the nodes' ends used to die too, and the launcher ended before its nodes."""
    run_dir = tmp_path / "run"
    returncode, out = _signalled_after_the_first_checkpoint(run_dir, signum, group=group)
    assert returncode == 128 + signum, out[-3000:]
    assert f"openprime: got {signum.name}; stopping the nodes (they leave gracefully)" in out
    assert out.count("removed: left (deathrattle)") == 2, out[-3000:]
    assert f"{_continue_with(run_dir)} --resume latest`" in out
    assert "Traceback" not in out, out[-3000:]
    pids = node_pids(read_records(run_dir))
    assert len(pids) == 2 and all(process_ended(pid) for pid in pids), pids


@pytest.mark.slow
def test_a_launch_suspended_as_a_whole_and_continued_trains_on(tmp_path):
    """Ctrl-Z and `fg` (SIGSTOP, SIGCONT to the process group), or a machine that slept: the coordinator in the
    launcher woke to both nodes silent for longer than the eviction timeout (2 s heartbeats: 6 s) and evicted
    them, they joined again without the run's state, nobody held it, and the run failed (exit 2, 2026-12-06).
    The coordinator's clock now leaves out the time it did not run. Heartbeats of 1 s here: the pause (6 s) is
    twice the eviction timeout (3 s). Without the clock's change the run fails (exit 2; checked twice, 2026-12-06)."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "openprime.train", "run", str(ROOT / "recipes" / "debug.py"),
                             "--run-dir", str(run_dir), *SHORT, "--set", "mesh.heartbeat_interval_s=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_as_from_a_terminal, process_group=0)
    try:
        wait_for(run_dir, lambda records: len({r["node"] for r in records if r["kind"] == "checkpoint"}) == 2,
                 timeout_s=120)
        os.killpg(proc.pid, signal.SIGSTOP)
        time.sleep(6)
        os.killpg(proc.pid, signal.SIGCONT)
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == 0, out[-3000:]
    assert "the coordinator did not run for 6." in out, out[-3000:]  # 6.x s
    assert "silent for more than" not in out and "was evicted" not in out, out[-3000:]
    assert "(newest: step 60)" in out, out[-3000:]


@pytest.mark.slow
def test_a_launch_under_nohup_trains_on_through_a_hang_up(tmp_path):
    """`nohup openprime run ... &`: the shell's SIGHUP to its jobs when the ssh session drops must not stop the run.
    The launcher and its nodes put handlers in place of nohup's SIG_IGN, and the run stopped (2026-12-06)."""
    run_dir = tmp_path / "run"
    returncode, out = _signalled_after_the_first_checkpoint(run_dir, signal.SIGHUP, group=True, nohup=True)
    assert returncode == 0, out[-3000:]
    assert "got SIGHUP" not in out and "leaving the run" not in out, out[-3000:]
    assert "openprime: done in" in out and "(newest: step 60)" in out, out[-3000:]


# Node 0 runs an action (one of the two below) the moment its first outer step is done, before the step's records
# and checkpoint: the stretch where a stop used to leave the step without its part (openprime.train.leaving).
_AT_THE_FIRST_OUTER_STEP = """
import os, signal
from openprime.train import progress

_step = progress.Progress.step

def step(self, step, loss, lr, step_s, result, **kwargs):
    if result is not None and result.outer_step == 1 and self.n.node == 0:
{action}
    return _step(self, step, loss, lr, step_s, result, **kwargs)

progress.Progress.step = step
"""
_SIGTERM = "        os.kill(os.getpid(), signal.SIGTERM)"
# As a closed terminal does it: node 0's stdout is gone (a pipe nobody reads: writes fail, as a hung-up terminal's
# fail with EIO), and SIGHUP comes.
_HUNG_UP = """        read, write = os.pipe()
        os.close(read)
        os.dup2(write, 1)
        os.kill(os.getpid(), signal.SIGHUP)"""


@pytest.mark.slow
@pytest.mark.parametrize(("action", "signum"), [(_SIGTERM, signal.SIGTERM), (_HUNG_UP, signal.SIGHUP)],
                         ids=["SIGTERM", "hung-up"])
def test_a_node_stopped_as_its_outer_step_ends_saves_that_step_before_it_leaves(tmp_path, action, signum):
    env = injecting(tmp_path, _AT_THE_FIRST_OUTER_STEP.format(action=action))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "openprime.train", "run", str(ROOT / "recipes" / "debug.py"),
                           "--run-dir", str(run_dir), *SHORT,
                           "--set", "checkpoint.num_keep=10",  # node 1 goes on saving: keep its part of step 10
                           "--set", "train.stop_after_outer_steps=2"],  # node 1 goes on alone for one more
                          capture_output=True, text=True, timeout=240, env={**os.environ, **env},
                          preexec_fn=_as_from_a_terminal)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]  # node 1 went on to its stop after outer step 2
    assert f"node 0 exited with code {128 + signum}" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    # Both nodes' parts of the first outer step's checkpoint are there and verify (every part the step names).
    step = verify_step(run_dir / "checkpoints", 10)
    assert sorted(step.parts) == ["slot-0", "slot-1"], step.parts
    saved = [r["node"] for r in read_records(run_dir) if r["kind"] == "checkpoint" and r["step"] == 10]
    assert sorted(saved) == [0, 1]


# Every checkpoint write takes `write_s` longer (in its temporary directory, as a large model's write does): more
# than the launcher gives a stopped node to leave (LEAVE_S).
_SLOW_WRITES = """
import time
import torch.distributed.checkpoint as dcp

_save = dcp.save

def save(*args, **kwargs):
    time.sleep({write_s})
    return _save(*args, **kwargs)

dcp.save = save
"""


@pytest.mark.slow
def test_ctrl_c_waits_for_the_checkpoint_writes_under_way(tmp_path):
    """Ctrl-C while both nodes write a checkpoint that takes longer than the launcher's LEAVE_S: the launcher waits
    for the writes (it killed the nodes at 10 s, and the save was lost) and names that checkpoint to continue from."""
    env = injecting(tmp_path, _SLOW_WRITES.format(write_s=LEAVE_S + 4))
    run_dir = tmp_path / "run"
    returncode, out = _signalled_after_the_first_checkpoint(run_dir, signal.SIGINT, group=True, env=env)
    assert returncode == 130, out[-3000:]
    assert "openprime: waiting for node(s) [0, 1] to finish writing their checkpoint" in out, out[-3000:]
    assert out.count("removed: left (deathrattle)") == 2, out[-3000:]
    assert f"(newest: step 10); {_continue_with(run_dir)}" in out, out[-3000:]
    assert sorted(verify_step(run_dir / "checkpoints", 10).parts) == ["slot-0", "slot-1"]


def test_resume_refuses_another_model_before_starting(stopped, tmp_path, capsys, monkeypatch):
    code, launched = _in_process(_copy(stopped, tmp_path), "--resume", "latest", "--set", "model.dim=256",
                                 monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and not launched
    assert "tensor 'model/tok_embeddings.weight' is (4096, 128) torch.float32 in the checkpoint but " \
           "(4096, 256) torch.float32 here" in err, err
    # The same shapes, another function of the weights (accepted without a word before 2026-12-07).
    code, launched = _in_process(_copy(stopped, tmp_path / "rope"), "--resume", "latest", "--set",
                                 "model.rope_theta=10000", monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and not launched
    assert "was saved from another model: model.rope_theta 10000.0 (saved: 500000.0)" in err, err
    assert "Resume with --set model.rope_theta=500000.0" in err


@pytest.mark.slow
def test_resume_with_another_data_layout_is_refused_before_starting_or_restarts_the_data(stopped, tmp_path, capsys,
                                                                                         monkeypatch):
    """More data slots (mesh.max_nodes) deal the sequences to the slots anew: the saved positions would name other
    sequences. Before, each node died in the data loader with a traceback naming its internals ("saved num_slots=8
    but these batches have num_slots=4") and the launcher offered the same command again."""
    run_dir = _copy(stopped, tmp_path)
    code, launched = _in_process(run_dir, "--resume", "latest", "--set", "mesh.max_nodes=4", monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and not launched
    assert "was saved with another data layout: mesh.max_nodes 4 (saved: 8)" in err, err
    assert "Resume with --set mesh.max_nodes=8" in err and "data.on_layout_change=restart" in err
    proc = _run(run_dir, "--resume", "latest", "--set", "mesh.max_nodes=4", "--set", "data.on_layout_change=restart",
                "--set", "train.stop_after_outer_steps=4")
    said = [line for line in proc.stdout.splitlines() if "resumed with mesh.max_nodes 4 (saved: 8)" in line]
    assert len(said) == 2 and all("is read from its start (data.on_layout_change=restart)" in s for s in said), said
    hashes = summarize(run_dir).distinct_hashes
    assert max(hashes) == 4 and len(hashes[4]) == 1


@pytest.mark.slow
def test_resume_with_another_batch_size_goes_on(stopped, tmp_path):
    """The data positions count sequences, so a new batch size continues them (before: refused in every node). The
    records go on counting the tokens trained (before, step x the new batch's tokens: 30 steps of 8 sequences
    counted as 30 of 4)."""
    run_dir = _copy(stopped, tmp_path)
    num_records = len(read_records(run_dir))
    proc = _run(run_dir, "--resume", "latest", "--set", "train.batch_size=4", "--set", "train.stop_after_outer_steps=4")
    assert proc.stdout.count("resumed with train.batch_size 4 (saved: 8)") == 2, proc.stdout
    assert max(summarize(run_dir).distinct_hashes) == 4
    tokens = {r["step"]: r["tokens"] for r in read_records(run_dir)[num_records:] if r["kind"] == "step"}
    assert sorted(tokens) == list(range(31, 41))
    assert all(tokens[step] == 30 * 8 * 32 + (step - 30) * 4 * 32 for step in tokens), tokens


def test_resume_of_a_complete_run_or_past_num_steps_starts_no_node(baseline, tmp_path, capsys, monkeypatch):
    """Before, the nodes started, trained nothing and the run said "done", a mistyped train.num_steps below the
    checkpoint's step included."""
    run_dir = _copy(baseline, tmp_path)
    before = (run_dir / "metrics.jsonl").read_bytes()
    code, launched = _in_process(run_dir, "--resume", "latest", monkeypatch=monkeypatch)
    out = capsys.readouterr().out
    assert code == 0 and not launched
    assert "the run is complete: " in out and "is at train.num_steps=60" in out and "--set train.num_steps=120" in out
    code, launched = _in_process(run_dir, "--resume", "latest", "--set", "train.num_steps=50", "--set",
                                 "schedule.num_decay_steps=20", monkeypatch=monkeypatch)
    assert code == 2 and not launched
    assert "is at inner step 60, past train.num_steps=50: there is nothing to train" in capsys.readouterr().err
    assert (run_dir / "metrics.jsonl").read_bytes() == before and not list(run_dir.glob("config.resumed-*"))


def test_export_of_a_run_loads_in_transformers_with_the_same_logits(stopped, tmp_path, capsys):
    import transformers  # in requirements.txt: a missing install fails here, not skips

    from openprime.train import cli

    out = tmp_path / "hf"
    assert cli.main(["export", str(stopped), str(out)]) == 0  # in this process: the command's imports cost 3 s
    said = capsys.readouterr().out
    assert "step-00000030" in said and "and the run's tokenizer" in said, said
    model_cfg, weights, _ = load_model_weights(stopped)
    ours = Llama(model_cfg)
    ours.init_weights(seed=0)
    ours.load_state_dict(weights)
    hf = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    tokens_BL = torch.randint(0, model_cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(tokens_BL).logits - ours(tokens_BL)).abs().max().item()
    assert diff < 1e-4, diff
    # The tokenizer the run trained on (the launch copied it into the run directory) encodes as the data did.
    from openprime.train.data import load_tokenizer, prepare_data
    from openprime.train.recipe import recipe_config

    data_tokenizer = load_tokenizer(prepare_data(recipe_config(RECIPE, []).data))
    text = "In the beginning God created the heaven and the earth.\nimport os\n"
    assert transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"] == data_tokenizer.encode(text).ids
    # Exported from a checkpoint step of the run, the tokenizer is found beside the run; from a run that has none
    # (launched before 2026-12-08), the weights are exported and the output says what is missing.
    step = stopped / "checkpoints" / "step-00000030"
    assert cli.main(["export", str(step), str(tmp_path / "from-step")]) == 0
    assert (tmp_path / "from-step" / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
    capsys.readouterr()
    old = _copy(stopped, tmp_path / "old")
    (old / "tokenizer.json").unlink()
    assert cli.main(["export", str(old), str(tmp_path / "no-tokenizer")]) == 0
    assert "without a tokenizer: no tokenizer.json in the run directory" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "no-tokenizer").iterdir()) == ["config.json", "model.safetensors"]


@contextlib.contextmanager
def _coordinator(num_nodes: int):
    """A standalone coordinator (`openprime mesh serve`) for nodes launched on separate "machines"."""
    port = free_port()
    proc = serve_coordinator(port, min_nodes=num_nodes)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _started(run_dir: pathlib.Path, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Wait until the node of a launch has joined and started (its "start" record), so that the next launch joins
    after it: data slots are granted in join order."""
    def started(records: list[dict]) -> bool:
        if any(r["kind"] == "start" for r in records):
            return True
        assert proc.poll() is None, "the launch ended before its node started"
        return False

    wait_for(run_dir, started, timeout_s)


def _machines(*machines: tuple[pathlib.Path, tuple[str, ...]], first_alone: bool = False) -> list[str]:
    """One node on each "machine" (its own run directory, so its own checkpoint disk) joined to one coordinator;
    returns their outputs. `first_alone`: the others start once the first has joined. One thread each: each
    launch would otherwise take this machine's two cores for its one node."""
    with _coordinator(len(machines)) as address:
        procs = []
        try:
            for i, (run_dir, args) in enumerate(machines):
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "openprime.train", "run", str(ROOT / "recipes" / "debug.py"),
                     "--nodes", "1", "--join", address, "--run-dir", str(run_dir), *RUN,
                     "--set", "train.num_threads=1", *args],
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
                if first_alone and i == 0:
                    _started(run_dir, procs[-1])
            outputs = [proc.communicate(timeout=240)[0] for proc in procs]
        finally:
            for proc in procs:
                proc.kill()
                proc.wait(timeout=30)
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out[-3000:]
    return outputs


def _machines_of(stopped: pathlib.Path, tmp_path: pathlib.Path, name: str) -> list[pathlib.Path]:
    """The stopped run's directory as two machines that save to their own disks hold it: each its node's parts.
    (What one node saves does not depend on where the other runs: a two-machine run has the same hashes.)"""
    dirs = []
    for slot in (0, 1):
        run_dir = pathlib.Path(shutil.copytree(stopped, tmp_path / f"{name}{slot}"))
        (run_dir / "metrics.jsonl").unlink()  # the records of the part before the stop, of both nodes
        for step in (run_dir / "checkpoints").iterdir():
            shutil.rmtree(step / f"slot-{1 - slot}")
        dirs.append(run_dir)
    return dirs


RESUME = ("--resume", "latest")


@pytest.mark.slow
def test_machines_with_their_own_disks_resume_bit_identically(baseline, stopped, tmp_path):
    """Each machine holds only its own node's checkpoint parts. Resumed (`--resume latest` on each, one node each,
    joined to a standalone coordinator), the run ends exactly as the uninterrupted one."""
    a, b = _machines_of(stopped, tmp_path, "ok")
    outputs = _machines((a, RESUME), (b, RESUME))
    assert all("resumed from" in out and "step-00000030" in out for out in outputs)
    expected = summarize(baseline).distinct_hashes
    assert summarize(a).distinct_hashes == summarize(b).distinct_hashes == {s: expected[s] for s in (4, 5, 6)}
    losses_a, losses_b = _losses(a), _losses(b)
    assert {s: sorted(losses_a[s] + losses_b[s]) for s in range(31, 61)} == \
           {s: v for s, v in _losses(baseline).items() if s > 30}


@pytest.mark.slow
def test_machines_with_their_own_disks_resume_from_older_saves(stopped, tmp_path):
    """(Two tests since 2026-12-08, so that pytest-xdist's workers run them side by side: 89 s as one.) One machine
    lost its newest save (killed mid-save) and resumes an older one, and a third machine, new, joins first without a
    checkpoint and takes the other's data slot; at the first outer step the two take the state of the node that is
    furthest on, and the run goes on from where it was, with one state everywhere."""
    a, b = _machines_of(stopped, tmp_path, "crashed")
    new = tmp_path / "new"
    # Machine b was killed while saving step 30: its part of it never got its final name.
    part = b / "checkpoints" / "step-00000030" / "slot-1"
    part.rename(part.with_name(".tmp-slot-1-1234-abcd"))
    out_new, out_a, out_b = _machines((new, ()), (a, RESUME), (b, RESUME), first_alone=True)
    assert "resumed from" not in out_new
    assert "saved data slot 0 went to another node" in out_a and "step-00000030" in out_a  # new took slot 0
    assert "resumed from" in out_b and "step-00000020" in out_b
    for run_dir in (new, b):
        received = [r for r in read_records(run_dir) if r["kind"] == "outer" and r["received_state"]]
        assert [r["outer_step"] for r in received] == [4]  # at the first outer step, from a's node
    hashes = [summarize(run_dir).hashes for run_dir in (a, b, new)]
    assert all(sorted(h) == [4, 5, 6] for h in hashes)
    for step in (4, 5, 6):
        assert len({digest for h in hashes for digest in h[step].values()}) == 1, step  # one state everywhere
    lr = {m: {r["step"]: r["lr"] for r in read_records(m) if r["kind"] == "step"} for m in (a, b, new)}
    assert all(lr[b][s] == lr[a][s] == lr[new][s] for s in range(41, 61))  # schedules moved with the state
    # Each machine's disk alone can be exported (a node's parts hold the run's weights), and they agree.
    (_, weights_a, _), (_, weights_b, _) = load_model_weights(a), load_model_weights(b)
    assert weights_a.keys() == weights_b.keys() and all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


@pytest.mark.slow
def test_a_launch_whose_nodes_are_refused_exits_2_without_a_command_that_would_fail_again(tmp_path):
    """A run ends on a standalone coordinator; a second launch joins it without a checkpoint: the coordinator refuses
    its node (no node holding the run's state is left). The launch says the error names the change to make, exits 2
    (1: a failure that the same command may get past), and prints no `--resume latest` command of its own."""
    short = ("--nodes", "1", "--set", "train.num_steps=10", "--set", "checkpoint.interval_steps=10",
             "--set", "diloco.num_inner_steps=10", "--set", "train.seq_len=32", "--set", "train.num_threads=1",
             "--set", "schedule.num_warmup_steps=2", "--set", "schedule.num_decay_steps=4")
    with _coordinator(1) as address:
        _openprime("run", str(ROOT / "recipes" / "debug.py"), "--join", address, "--run-dir", str(tmp_path / "a"),
                   *short)
        late = _openprime("run", str(ROOT / "recipes" / "debug.py"), "--join", address, "--run-dir",
                          str(tmp_path / "b"), *short, expect=2)
    out = late.stdout + late.stderr
    assert "[node 0] error: coordinator refused node" in out and "no node holding the run's state is left" in out
    assert "run failed: its nodes were refused or misconfigured; the error above says what to change" in out
    assert "continue with" not in out and "Traceback" not in out, out


@pytest.mark.slow
def test_a_diverged_run_keeps_its_finite_checkpoints_stops_and_resumes_at_a_lower_lr(tmp_path):
    """At lr 30 the gradient goes NaN or inf within 20 steps. Before, the NaN went into the weights and the outer
    step; in fp32 the run ended "done" with loss nan, its NaN checkpoints having replaced the good ones, and with
    int8 the quantizer stopped every node. Now the updates are skipped, the node writes no checkpoint while its
    latest step was skipped, stops when it cannot contribute (exit 1, the way to continue in the error), and a run
    resumed with `--set optim.lr=...` trains at that lr (before, at the checkpoint's)."""
    run_dir = tmp_path / "run"
    flags = ("--nodes", "1", *RUN, "--set", "train.num_threads=1", "--set", "schedule.num_warmup_steps=20",
             "--set", "schedule.num_decay_steps=5", "--set", "optim.num_nonfinite_steps_to_stop=15")
    recipe = str(ROOT / "recipes" / "debug.py")
    proc = _openprime("run", recipe, "--run-dir", str(run_dir), *flags, "--set", "optim.lr=30", expect=1)
    assert "[node 0] error: training diverged: 15 inner steps had a NaN or inf gradient norm" in proc.stderr
    assert "--resume latest --set optim.lr=15" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    records = read_records(run_dir)
    skipped = {r["step"] for r in records if r["kind"] == "step" and r["skipped"]}
    saved = [r["step"] for r in records if r["kind"] == "checkpoint"]
    assert len(skipped) >= 15 and saved and not skipped & set(saved), (skipped, saved)
    assert any(r["num_contributors"] == 0 for r in records if r["kind"] == "outer")  # withheld: theta unchanged
    _, weights, _ = load_model_weights(run_dir)
    assert all(torch.isfinite(w).all() for w in weights.values())

    proc = _openprime("run", recipe, "--run-dir", str(run_dir), *flags, "--set", "optim.lr=0.003",
                      "--set", f"train.stop_after_outer_steps={max(saved) // 10 + 1}", "--resume", "latest")
    assert "[node 0] resumed with optim.lr 0.003 (saved: 30.0)" in proc.stdout, proc.stdout
    resumed = read_records(run_dir)[len(records):]
    lrs = [r["lr"] for r in resumed if r["kind"] == "step"]
    assert len(lrs) == 10 and 0 < max(lrs) <= 0.003, lrs
