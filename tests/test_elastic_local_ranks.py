"""The elastic tests of tests/test_elastic.py with 2 local ranks per node (fsdp.num_local_ranks=2).

Each node is two processes: local rank 0 talks to the coordinator and hands the view (and any eviction or
lost coordinator) to local rank 1 through the node's local group; each local rank runs its own DiLoCo ring
with the same local rank of the other nodes. Faults hit one process of a node or all of it: kill -9 of local
rank 1 or 0 (the launcher's watchdog takes the node down), SIGTERM of local rank 0 (the node leaves
with its deathrattle), SIGSTOP of both (evicted, then rejoins as a new node); or a node is
started mid-run (blocking and non-blocking recovery). Each test asserts that the survivors trained to the end,
that the global-state hashes agree, that no process of any node was left behind, and (the point of these tests)
that a node's processes never disagreed on the view: for every (node, outer step) the "local_outer" records of
local ranks 0 and 1 carry the same epoch, members and number of contributors (and every node the same view).

Two tests pin down bugs these tests found: a hung local rank 1 (its rank 0 still heartbeating) made every healthy
node give up at the barrier (the coordinator now evicts a straggler), and the launcher's watchdog SIGKILLed local
rank 0 in the middle of a graceful exit when local rank 1 had finished its own first (it now sends SIGTERM and
kills only after a grace period).
"""

import contextlib
import multiprocessing as mp
import os
import pathlib
import signal
import sys
import time
from collections import defaultdict
from collections.abc import Sequence

import pytest
import torch

from openprime.ckpt import latest, read_part
from openprime.train.launcher import Launcher
from openprime.train.metrics import summarize
from openprime.train.recipe import recipe_config
from openprime.train.testing import ELASTIC_FAST, outer_done, outer_records, run_records, wait_for

ROOT = pathlib.Path(__file__).resolve().parents[1]
RANKS = 2
# tests/test_elastic.py's settings (openprime.train.testing), two processes per node.
FAST = [*ELASTIC_FAST, f"fsdp.num_local_ranks={RANKS}"]
# Shorter runs than tests/test_elastic.py's: with 6 processes on 2 cores and the node's local all-gathers, a step
# takes about 0.3 s here against 0.06 s there, so fewer steps leave the same time for each fault to play out.
SHORT = ("schedule.num_warmup_steps=10", "schedule.num_decay_steps=10", "train.num_steps=30")
MEDIUM = ("schedule.num_warmup_steps=10", "schedule.num_decay_steps=20", "train.num_steps=40")
# A joiner started after outer step 2 was admitted about 1.5 s later (at outer step 4 when started after 3): the 9
# outer steps after it leave it some 13 s to be admitted (80 steps until 2026-12-07, 35 s of the suite).
LONG = ("schedule.num_warmup_steps=10", "schedule.num_decay_steps=40", "train.num_steps=60")

pytestmark = [pytest.mark.slow, pytest.mark.flaky(reruns=1)]


@pytest.fixture
def start(tmp_path):
    """start(num_nodes, *overrides, steps=SHORT): a Launcher with that many nodes of RANKS processes; whatever
    the test does, its processes and coordinator are stopped at the end (a failed wait leaves nothing behind)."""
    launchers: list[Launcher] = []

    def start_(num_nodes: int, *extra: str, steps: tuple[str, ...] = SHORT) -> Launcher:
        cfg = recipe_config(ROOT / "recipes" / "debug.py", [*FAST, *steps, *extra])
        launcher = Launcher(cfg, tmp_path / "run", num_nodes=num_nodes)
        launchers.append(launcher)
        launcher.run_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(num_nodes):
            launcher.start_node()
        assert all(len(procs) == RANKS for procs in launcher.local_procs.values())
        return launcher

    yield start_
    for launcher in launchers:
        launcher.stop()


def _signal(procs: Sequence[mp.Process], signum: int) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):  # one the watchdog already stopped
            os.kill(p.pid, signum)


def _finish(launcher: Launcher, expected_ok: set[int], timeout_s: float = 150) -> dict[int, list[int | None]]:
    """Wait for every process, then check the run; returns the exit codes by node and local rank."""
    try:
        launcher.wait(timeout_s)
        # Before stop(), which would terminate them: a process still alive here was left behind (hung).
        left = [p.name for procs in launcher.local_procs.values() for p in procs if p.is_alive()]
    finally:
        launcher.stop()
    codes = {node: [p.exitcode for p in procs] for node, procs in launcher.local_procs.items()}
    assert not left, f"processes left behind: {left}; exit codes {codes}"
    records = run_records(launcher.run_dir)
    ended = {r["node"] for r in records if r["kind"] == "end"}
    assert expected_ok <= ended, f"nodes {expected_ok - ended} did not train to the end; exit codes {codes}"
    assert all(codes[node] == [0] * RANKS for node in expected_ok), codes
    summary = summarize(launcher.run_dir)
    assert summary.hashes_agree, summary.hashes
    assert summary.num_outer_steps == launcher.cfg.num_outer_steps
    _check_local_views(records, ended, launcher.cfg.num_outer_steps)
    return codes


def _check_local_views(records: list[dict], ended: set[int], num_outer_steps: int) -> None:
    """A node's local ranks trained every outer step under the same view (the point of these tests), and the
    members of one outer step trained it under one view."""
    local: dict[tuple[int, int], dict[int, dict]] = defaultdict(dict)  # (node, local rank) -> outer step -> record
    for r in records:
        if r["kind"] == "local_outer":
            by_step = local[r["node"], r["local_rank"]]
            assert r["outer_step"] not in by_step, ("two local_outer records for one outer step", r)
            by_step[r["outer_step"]] = r
    nodes = {node for node, _ in local}
    assert {local_rank for _, local_rank in local} == set(range(RANKS))
    view_of_step: dict[int, tuple] = {}
    for node in sorted(nodes):
        ranks = [local[node, rank] for rank in range(RANKS)]
        common = set.intersection(*(set(by_step) for by_step in ranks))
        if node in ended:  # both trained to the end: every outer step on both ranks
            assert all(set(by_step) == set(ranks[0]) for by_step in ranks), (node, [sorted(s) for s in ranks])
            assert max(ranks[0]) == num_outer_steps, (node, sorted(ranks[0]))
        else:  # a node taken down may have lost the last record of one rank, no more
            assert all(len(set(by_step) - common) <= 1 for by_step in ranks), (node, [sorted(s) for s in ranks])
        outer = {r["outer_step"]: r for r in outer_records(records, node)}
        for step in sorted(common):
            views = [(by_step[step]["epoch"], by_step[step]["members"], by_step[step]["num_contributors"],
                      by_step[step]["skipped"]) for by_step in ranks]
            assert all(v == views[0] for v in views), f"node {node} outer step {step}: local ranks disagree: {views}"
            if step in outer:  # rank 0's usual record says the same
                assert outer[step]["num_members"] == len(views[0][1]), (outer[step], views[0])
                assert outer[step]["num_contributors"] == views[0][2], (outer[step], views[0])
            view_of_step.setdefault(step, views[0])
            assert view_of_step[step] == views[0], f"outer step {step}: node {node} {views[0]} vs {view_of_step[step]}"


def _taken_down(codes: dict[int, list[int | None]], node: int) -> None:
    """Every process of `node` ended with an error (the watchdog stopped the ones that were not hit)."""
    assert all(code not in (None, 0) for code in codes[node]), codes


def _wait_node_gone(launcher: Launcher, node: int, timeout_s: float = 20) -> None:
    """All processes of `node` exit soon after one of them died: the launcher's watchdog stops the others
    (which would otherwise wait in the node's local group for up to local_group_timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while any(p.is_alive() for p in launcher.local_procs[node]):
        assert time.monotonic() < deadline, f"node {node}: {[p.exitcode for p in launcher.local_procs[node]]}"
        time.sleep(0.1)


def _num_members(launcher: Launcher, node: int) -> list[int]:
    return [r["num_members"] for r in outer_records(run_records(launcher.run_dir), node)]


# ---------------------------------------------------------------- the tests

@pytest.mark.parametrize("local_rank", [1, 0])
def test_kill_one_local_rank_during_inner_steps_takes_the_node_down(start, local_rank):
    launcher = start(3)
    wait_for(launcher.run_dir, outer_done(2, 2))
    _signal([launcher.local_procs[2][local_rank]], signal.SIGKILL)
    _wait_node_gone(launcher, 2)
    codes = _finish(launcher, expected_ok={0, 1})
    _taken_down(codes, 2)
    assert codes[2][local_rank] == -signal.SIGKILL
    # What the launch reports: the process that took the node down (it said rank 0's SIGTERM for a killed rank 1).
    assert launcher.first_failures[2] == (local_rank, -signal.SIGKILL)
    members = _num_members(launcher, 0)
    assert members[:2] == [3, 3] and members[-1] == 2, members


def test_graceful_exit_is_removed_at_once(start, capfd):
    # SIGTERM to local rank 0 (the process that speaks for the node): the node leaves as a whole, local rank 0
    # sends its deathrattle, and the others go on without it at once. (SIGTERM to both processes, as a scheduler
    # preempting the node sends, is the watchdog test below.)
    launcher = start(3, "mesh.heartbeat_interval_s=3")  # eviction would take 9 s
    wait_for(launcher.run_dir, outer_done(2, 2))
    _signal(launcher.local_procs[2][:1], signal.SIGTERM)
    killed_at = time.time()
    _wait_node_gone(launcher, 2)

    def without_node_2(rs):
        return [r for r in outer_records(rs, 0) if r["num_members"] == 2]

    wait_for(launcher.run_dir, without_node_2)
    first_without = without_node_2(run_records(launcher.run_dir))[0]
    # Node 0 finished the step without node 2 sooner than a heartbeat timeout would have allowed.
    assert first_without["time"] - killed_at < 9, first_without["time"] - killed_at
    codes = _finish(launcher, expected_ok={0, 1})
    _taken_down(codes, 2)
    assert codes[2] == [143, 143], codes  # it left gracefully; the watchdog stopped rank 1
    # Rank 1's local collective broke when rank 0 left: one line that says so, not a traceback of a crash of its own
    # (before: "[node 2 local rank 1] failed:" and a RuntimeError from Gloo, "Connection closed by peer").
    err = capfd.readouterr().err
    assert "[node 2 local rank 1] failed" not in err, err


def _leave_gracefully_after(delay_s: float, ready) -> None:
    """A stand-in for a node process: on SIGTERM it takes `delay_s` to leave (the deathrattle, the checkpoint
    write in flight), then exits 143 as node_main does."""
    def leave(*_):
        time.sleep(delay_s)
        sys.exit(143)

    signal.signal(signal.SIGTERM, leave)
    ready.set()
    time.sleep(60)


def test_watchdog_lets_local_rank_0_finish_a_graceful_exit(tmp_path):
    # Deterministic and quick: the launcher's watchdog over two stand-in processes (forked: nothing to import),
    # SIGTERMed together; local rank 0 takes 1 s to leave, local rank 1 none.
    cfg = recipe_config(ROOT / "recipes" / "debug.py", [*FAST, *SHORT])
    launcher = Launcher(cfg, tmp_path / "run", num_nodes=1)
    ctx = mp.get_context("fork")
    ready = [ctx.Event(), ctx.Event()]
    procs = [ctx.Process(target=_leave_gracefully_after, args=(delay_s, event), name=f"node-0-rank-{rank}")
             for rank, (delay_s, event) in enumerate(zip((1.0, 0.0), ready, strict=True))]
    try:
        for p in procs:
            p.start()
        assert all(event.wait(30) for event in ready)
        launcher.procs[0], launcher.local_procs[0] = procs[0], procs
        _signal(procs, signal.SIGTERM)
        for p in procs:
            p.join(timeout=30)
        assert [p.exitcode for p in procs] == [143, 143]
    finally:
        launcher.stop()


def test_frozen_node_is_evicted_then_rejoins(start):
    # SIGSTOP of both processes (the machine froze or was cut off): rank 1 stops wherever it was, maybe inside its
    # ring's all-reduce. After SIGCONT rank 0 learns that the node was evicted and tells rank 1; the node comes
    # back as a new node. (One process of a node hung while the other goes on is the last test of this file.)
    launcher = start(3, steps=MEDIUM)
    wait_for(launcher.run_dir, outer_done(2, 2))
    stopped = launcher.local_procs[2]
    _signal(stopped, signal.SIGSTOP)
    try:
        wait_for(launcher.run_dir, lambda rs: any(r["num_members"] == 2 for r in outer_records(rs, 0)))
    finally:
        _signal(stopped, signal.SIGCONT)
    wait_for(launcher.run_dir, lambda rs: any(r["kind"] == "rejoined" and r["node"] == 2 for r in rs))
    _finish(launcher, expected_ok={0, 1, 2})
    records = run_records(launcher.run_dir)
    assert outer_records(records, 2)[-1]["outer_step"] == launcher.cfg.num_outer_steps
    rejoined = next(r for r in records if r["kind"] == "rejoined" and r["node"] == 2)
    first = next(r for r in records if r["kind"] == "start" and r["node"] == 2)
    assert rejoined["node_id"] != first["node_id"]  # a new node
    # Both local ranks of node 2 trained under a view without it, then under one with its new id.
    views = [(r["local_rank"], r["outer_step"], r["members"]) for r in records
             if r["kind"] == "local_outer" and r["node"] == 2]
    for rank in range(RANKS):
        assert any(first["node_id"] in m for lr, _, m in views if lr == rank), views
        assert any(rejoined["node_id"] in m for lr, _, m in views if lr == rank), views
    _same_final_state_on_every_node(launcher)


# Non-blocking only: the transfer to each local rank is the same code in both modes (tests/test_elastic.py runs both
# with one rank per node); non-blocking adds the background send and the sat-out step, the part with more to go wrong.
@pytest.mark.parametrize("mode", ["non_blocking"])
def test_node_started_mid_run_is_admitted_and_both_ranks_get_the_state(start, mode):
    launcher = start(2, f"diloco.recovery={mode}", steps=LONG)
    wait_for(launcher.run_dir, outer_done(0, 2))
    launcher.start_node()  # node 2
    _finish(launcher, expected_ok={0, 1, 2})
    records = run_records(launcher.run_dir)
    started = next(r for r in records if r["kind"] == "start" and r["node"] == 2)
    assert started["joining"]
    joined = outer_records(records, 2)
    assert joined and joined[0]["outer_step"] >= 3 and joined[0]["num_members"] == 3
    assert joined[0]["num_contributors"] == 2  # the joiner entered with a zero pseudo-gradient
    # Non-blocking: the state came in the outer step before, which the joiner only watched, and the step it
    # reports first is the one it sat out (DiLoCo.sit_out); its first record covers both (and their bytes).
    assert joined[0]["received_state"]
    # Its first record holds what the node received catching up, both local ranks' (it held local rank 0's): the
    # state's shards (29 MB) and two outer steps' rings (20 MB), with the new group's bandwidth probes (34 MB) when
    # they ran; rank 0's alone were at most 41 MB.
    assert joined[0]["bytes_received"] > 45e6, joined[0]
    others = {r["state_hash"] for r in records if r["kind"] == "outer" and r["outer_step"] == joined[0]["outer_step"]}
    assert others == {joined[0]["state_hash"]}  # its first outer step ends bit-identical to the others' (rank 0)
    first_local = {r["local_rank"]: r for r in records if r["kind"] == "local_outer" and r["node"] == 2
                   and r["outer_step"] == joined[0]["outer_step"]}
    assert sorted(first_local) == list(range(RANKS)) and all(r["num_contributors"] == 2 for r in first_local.values())
    admitted = [r for r in outer_records(records, 0) if r["num_members"] == 3][0]
    if mode == "blocking":  # the others waited for the transfer, then did that outer step with the joiner
        assert admitted["outer_step"] == joined[0]["outer_step"]
    else:  # the joiner took part without state, got it after the commit and entered the step after
        assert admitted["outer_step"] == joined[0]["outer_step"] - 1
    # Local rank 1 of the joiner got its shard of the state too: every node ends with the same shards.
    _same_final_state_on_every_node(launcher)


def _same_final_state_on_every_node(launcher: Launcher, num_nodes: int = 3) -> None:
    """The last checkpoint's global state (theta and outer momentum) of each local rank is the same on every
    node: what rank 0's state hashes in the metrics show for its shard, for every shard."""
    step = latest(launcher.run_dir / "checkpoints")
    assert step.step == launcher.cfg.train.num_steps
    slots = sorted({name.split("-rank-")[0] for name in step.parts})
    assert len(slots) == num_nodes, step.parts
    for rank in range(RANKS):
        states = [read_part(step.part(f"{slot}-rank-{rank}"))["diloco"] for slot in slots]
        for state in states[1:]:
            assert torch.equal(state["theta"], states[0]["theta"]), rank
            assert torch.equal(state["momentum"], states[0]["momentum"]), rank


def test_hung_local_rank_1_does_not_stop_the_run(start):
    # SIGSTOP of local rank 1 only: a process of the node hangs (a stuck kernel, a deadlock) while its local rank
    # 0, which holds the MeshClient, keeps heartbeating from its thread as it waits for rank 1 in the local group.
    # The others must go on without the node, and soon: the coordinator waits for a straggler about as long as
    # the outer steps took to compute (a second or two here; mesh.min_straggler_s=2 lowers the 60 s floor), not the
    # 57 s that mesh.sync_timeout_s=60 would allow.
    launcher = start(3, "mesh.min_straggler_s=2")
    wait_for(launcher.run_dir, outer_done(2, 2))
    hung = [launcher.local_procs[2][1]]
    _signal(hung, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        wait_for(launcher.run_dir, lambda rs: any(r["num_members"] == 2 for r in outer_records(rs, 0)), timeout_s=60,
                  unless_dead=launcher.local_procs[0])
        waited = time.monotonic() - stopped
    finally:
        _signal(hung, signal.SIGCONT)
    assert waited < 30, f"the others waited {waited:.0f}s for the hung node"
    _finish(launcher, expected_ok={0, 1})
