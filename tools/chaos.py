"""Chaos harness: N nodes of a recipe on this machine, random faults for a while, and did the run survive?

    python tools/chaos.py recipes/debug.py --nodes 4 --duration 120 --seed 0 \
        [--faults kill,stop,term,join,coordinator] [--interval 5 15] [--baseline 60] [--set key=value ...]

It runs two phases of the same config, one after the other, each with its own standalone coordinator
(`openprime mesh serve`, a subprocess at fixed ports, so that it can be killed and restarted):

1. baseline: N nodes, no faults, for `--baseline` seconds (0 skips it);
2. chaos: N nodes for `--duration` seconds; after the first outer step, every `--interval MIN MAX`
   seconds (seeded RNG) one fault among those enabled and possible:
   - kill:  kill -9 of a random node; a replacement node is started 1-3 s later;
   - stop:  SIGSTOP of a random node for the eviction timeout plus 1-3 s, then SIGCONT: the node is
            evicted and must come back as a new node with the others' state;
   - term:  SIGTERM, a graceful leave (the deathrattle); a replacement is started 1-3 s later;
   - join:  one node more (at most N + 1 at a time);
   - hang:  (nodes of 2 or more local ranks) SIGSTOP of local rank 1 of a random node, for twice
            `mesh.min_straggler_s` plus 0-5 s, then SIGCONT: its local rank 0 goes on heartbeating while it
            waits for rank 1, so the coordinator must evict it as a straggler (the others go on) and it must
            come back as a new node;
   - coordinator: kill -9 of the coordinator, restarted at the same ports 0.5 s to two eviction
            timeouts later (its state is soft: it adopts the view the nodes report).
   At least `--min-alive` nodes that hold the global state stay up and unfrozen; a node still
   joining does not count, so the state can never be lost.

Each phase ends by SIGTERM to every node (they leave gracefully), then kill -9 of any node that has not
exited within 30 s. So the recipe's `train.num_steps` is set far beyond what the run can reach
(1,000,000) and the run is stopped by the clock. This keeps the chaos run as long as asked, whatever
the machine's speed. Other fast defaults, all overridable with --set: H = 5 inner steps per outer step,
a 0.5 s heartbeat (eviction after 1.5 s), stragglers evicted after 15 s at the least (5 s evicted healthy
nodes here: 10 processes on 2 cores, one of them starting, can hold one node's outer step back that long),
10 s connect and 5 s operation timeouts.

How to read the output. Lines in brackets are the harness's events, with seconds since the phase's
first inner step ("!!" marks something that went wrong). The closing table compares the two phases:
- nodes started mid-run: admitted/started: joins and replacements that received the state and took
  part in an outer step, out of those started;
- SIGSTOPs of state holders / of joiners, and rejoined after a SIGSTOP: a frozen state holder should
  find itself evicted and come back (a "rejoined" record), as should a node with a hung local rank; a
  "false evict" is a rejoin of a node the harness never froze or hung (heartbeats starved by the
  machine's load, or a member late at the barrier for longer than its straggler deadline);
- outer steps applied: outer steps whose all-reduce was committed (not skipped), in the window;
- skipped outer steps / retried all-reduces: from the nodes' metrics (the same on every node);
- HASH DISAGREEMENTS: outer steps after which two nodes' hashes of the global state differ (from the
  metrics; the coordinator's own check, in its log, is counted too). Anything but 0 is a bug;
- inner steps/s: every inner step any node computed, useful or not, per second;
- goodput: inner steps that reached the global model, per second:
  H x (sum over applied outer steps of the nodes that contributed a pseudo-gradient) / window,
  the window running from the phase's first inner step to the SIGTERM at its end. Steps of a node
  killed before its outer step, of a skipped outer step, and a joiner's zero contribution do not count;
- goodput ratio: chaos goodput / baseline goodput, both measured in this invocation (the machine is
  shared: compare ratios, not absolute rates);
- longest stall: the longest time without an applied outer step (including the start and the end);
- unexpected exits: a node that died without being killed or terminated by the harness, or exited
  with a code other than the expected one (-9 after kill, 143 after SIGTERM). See nodes.log.
A stall half as long as `--stall` gets every node process's thread stacks printed to nodes.log, one process at a
time (once per stall; `Launcher.dump_stacks`; a process the harness stopped is named, not asked), to see where
the nodes wait.

The fault schedule is drawn from `--seed`, but which faults are possible at a given moment depends on
the run (how many nodes are admitted, whether the coordinator is up), so two runs with the same seed
can differ once timings differ.

Exit code 0 when both phases had no hash disagreement and training progressed (at least one outer
step applied and no stall longer than `--stall` seconds); 1 otherwise, and with --strict also when a
node crashed. The default stall limit is one all-reduce's deadline for N + 1 nodes plus the connect
timeout plus 15 s (65 s with the defaults above), because a peer killed inside an all-reduce is
noticed only when that deadline passes. Every wait is bounded and every process (nodes, coordinator)
is stopped on exit, Ctrl-C included. Node output goes to RUN_DIR/{baseline,chaos}/nodes.log, the
coordinator's to coordinator.log, next to metrics.jsonl and config.json.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import heapq
import itertools
import os
import pathlib
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import attrs

from openprime.core.errors import ConfigError
from openprime.mesh import MeshConfig
from openprime.train.config import RunConfig
from openprime.train.data import prepare_data
from openprime.train.launcher import Launcher, write_run_files
from openprime.train.metrics import METRICS_FILE, MetricsTail, read_records
from openprime.train.processes import output_to
from openprime.train.recipe import loaded_recipe_files, recipe_config
from openprime.train.testing import free_port

FAULT_KINDS = ("kill", "stop", "term", "join", "coordinator", "hang")
FAST_DEFAULTS = ["train.num_steps=1000000", "diloco.num_inner_steps=5", "train.log_every=20",
                 "mesh.heartbeat_interval_s=0.5", "mesh.min_straggler_s=15", "timeouts.connect_s=10", "timeouts.op_s=5"]
STARTUP_TIMEOUT_S = 180.0  # spawn, import torch and reach the first inner step, on a loaded 2-core machine
SHUTDOWN_TIMEOUT_S = 30.0  # a node that has not exited this long after SIGTERM is killed and reported
TERM_TIMEOUT_S = 30.0
COORDINATOR_START_TIMEOUT_S = 60.0


def signal_pid(pid: int | None, sig: signal.Signals) -> None:
    """Send `sig` to a process that may have exited meanwhile."""
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def say(t0: float | None, line: str) -> None:
    stamp = f"[{time.time() - t0:6.1f}s]" if t0 is not None else "[   ---]"
    print(f"{stamp} {line}", flush=True)


class CoordinatorProcess:
    """`openprime mesh serve` as a subprocess at fixed ports, so it can be killed and restarted in place."""

    def __init__(self, mesh: MeshConfig, min_nodes: int, log_path: pathlib.Path) -> None:
        self.port, self.store_port = free_port(), free_port()
        self.log_path = log_path
        sets = []
        for a in attrs.fields(MeshConfig):
            value = getattr(mesh, a.name)
            if a.name != "min_nodes" and value is not None:
                sets += ["--set", f"{a.name}={value}"]
        self.args = [sys.executable, "-m", "openprime.train", "mesh", "serve", "--bind",
                     f"tcp://127.0.0.1:{self.port}", "--store-port", str(self.store_port),
                     "--min-nodes", str(min_nodes), *sets]
        self.proc: subprocess.Popen | None = None
        self.num_starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> bool:
        """Start it and wait (bounded) until it says it is listening; False if it died or never said so."""
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.num_starts += 1
        deadline = time.monotonic() + COORDINATOR_START_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            with open(self.log_path, "rb") as log:
                log.seek(offset)
                if b"coordinator at" in log.read():
                    return True
            time.sleep(0.1)
        self.stop()
        return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def reported_disagreements(self) -> int:
        if not self.log_path.exists():
            return 0
        return self.log_path.read_text(errors="replace").count("REPLICAS DISAGREE")


@dataclass
class PhaseResult:
    """What one phase did, from the harness's bookkeeping and the nodes' metrics."""

    name: str
    window_s: float = 0.0
    started: bool = False
    outer_applied: int = 0
    outer_skipped: int = 0
    retries: int = 0
    disagreements: list[tuple[int, dict[int, str]]] = field(default_factory=list)
    coordinator_disagreements: int = 0
    steps_per_s: float = 0.0
    goodput: float = 0.0
    longest_stall_s: float = 0.0
    faults: collections.Counter = field(default_factory=collections.Counter)
    replacements: int = 0
    stopped_holders: int = 0  # SIGSTOPs of nodes that held the state
    stopped_joiners: int = 0  # SIGSTOPs of nodes still starting or waiting to be admitted
    hung: int = 0  # SIGSTOPs of local rank 1 of a node (its rank 0 heartbeating on)
    rejoined: int = 0
    joiners: int = 0  # nodes started mid-run (joins and replacements)
    joiners_admitted: int = 0  # of which received the state and took part in an outer step
    unplanned_rejoins: int = 0
    unexpected_exits: list[str] = field(default_factory=list)
    alive_at_end: int = 0
    last_members: int = 0
    coordinator_restart_failures: int = 0

    def progressed(self, stall_s: float) -> bool:
        return self.started and self.outer_applied > 0 and self.longest_stall_s <= stall_s


class Phase:
    """One run of the recipe: N nodes under a fresh coordinator, with faults drawn from `faults`."""

    def __init__(self, name: str, cfg: RunConfig, run_dir: pathlib.Path, *, num_nodes: int, duration_s: float,
                 faults: tuple[str, ...], rng: random.Random, interval: tuple[float, float], min_alive: int,
                 verbose: bool, stall_s: float) -> None:
        self.name, self.cfg, self.run_dir = name, cfg, run_dir
        self.num_nodes, self.duration_s, self.faults, self.rng = num_nodes, duration_s, faults, rng
        self.interval, self.min_alive = interval, min_alive
        self.stall_s = stall_s  # a stall half this long gets the nodes' stacks printed, once per stall
        self.last_outer_at = 0.0  # when last_outer last grew (wall clock)
        self.node_log = None if verbose else run_dir / "nodes.log"
        self.max_live = max(1, min(num_nodes + 1, cfg.mesh.max_nodes - 2))
        self.eviction_s = cfg.mesh.eviction_timeout_s
        self.result = PhaseResult(name)
        self.coordinator = CoordinatorProcess(cfg.mesh, num_nodes, run_dir / "coordinator.log")
        self.launcher: Launcher | None = None
        self.tail = MetricsTail(run_dir)
        self.t0: float | None = None
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.frozen: dict[int, int] = {}  # node -> the pid of its process that is stopped
        self.stopped_at: dict[int, float] = {}
        self.num_stops: collections.Counter[int] = collections.Counter()  # node -> SIGSTOPs (stop or hang)
        self.established: set[int] = set()  # holds the global state: an outer step done since (re)start
        self.fate: dict[int, tuple[str, set[int]]] = {}  # node -> (what the harness did, expected exit codes)
        self.reported_exits: set[int] = set()
        self.started: set[int] = set()  # wrote their "start" record: past the imports, joined the mesh
        self.last_outer = 0

    # ------------------------------------------------------------------ nodes

    def live(self) -> list[int]:
        """Nodes running and not on their way out (frozen ones included)."""
        assert self.launcher is not None
        return [n for n, p in self.launcher.procs.items() if p.is_alive() and n not in self.fate]

    def start_node(self, why: str) -> int:
        assert self.launcher is not None
        with output_to(self.node_log):
            self.launcher.start_node()
        node = len(self.launcher.procs) - 1
        if self.t0 is not None:
            say(self.t0, f"{self.name}: {why}: node {node} started (pid {self.launcher.procs[node].pid}); "
                         f"{len(self.live())} live")
        return node

    def signal_node(self, node: int, sig: signal.Signals) -> None:
        """Signal the node's local rank 0 (the process that heartbeats)."""
        assert self.launcher is not None
        signal_pid(self.launcher.procs[node].pid, sig)

    # ------------------------------------------------------------------ events

    def later(self, delay_s: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (time.monotonic() + delay_s, next(self._seq), action))

    def run_due_events(self) -> None:
        while self._events and self._events[0][0] <= time.monotonic():
            heapq.heappop(self._events)[2]()

    def top_up(self) -> None:
        while len(self.live()) < self.num_nodes:
            self.start_node("replacement")
            self.result.replacements += 1

    def thaw(self, node: int) -> None:
        pid = self.frozen.pop(node, None)
        if pid is not None:
            signal_pid(pid, signal.SIGCONT)
            stopped_s = time.time() - self.stopped_at[node]
            say(self.t0, f"{self.name}: SIGCONT node {node} (pid {pid}, stopped {stopped_s:.1f}s); it should find "
                         "itself evicted and rejoin")

    def check_termed(self, node: int) -> None:
        assert self.launcher is not None
        proc = self.launcher.procs[node]
        if proc.is_alive():
            self.result.unexpected_exits.append(f"node {node} still running {TERM_TIMEOUT_S:.0f}s after SIGTERM")
            say(self.t0, f"{self.name}: !! node {node} did not exit {TERM_TIMEOUT_S:.0f}s after SIGTERM; kill -9")
            self.fate[node] = ("term, then kill", {-9})
            self.signal_node(node, signal.SIGKILL)

    def restart_coordinator(self) -> None:
        for attempt in range(3):
            if self.coordinator.start():
                say(self.t0, f"{self.name}: coordinator restarted at {self.coordinator.address}")
                return
            self.result.coordinator_restart_failures += 1
            say(self.t0, f"{self.name}: !! coordinator did not restart (try {attempt + 1}); see coordinator.log")
            time.sleep(1.0)

    # ------------------------------------------------------------------ faults

    def targets(self) -> list[int]:
        """Nodes a kill, stop or term may hit without leaving fewer than min_alive state holders."""
        candidates = [n for n in self.live() if n not in self.frozen]
        holders = [n for n in candidates if n in self.established]
        return [n for n in candidates if n not in self.established or len(holders) - 1 >= self.min_alive]

    def possible_faults(self) -> list[str]:
        possible = {"kill": bool(self.targets()), "stop": bool(self.targets()), "term": bool(self.targets()),
                    "join": len(self.live()) < self.max_live, "coordinator": self.coordinator.up,
                    "hang": self.cfg.fsdp.num_local_ranks > 1 and bool(self.targets())}
        return [kind for kind in self.faults if possible[kind]]

    def inject(self) -> None:
        possible = self.possible_faults()
        if not possible:
            say(self.t0, f"{self.name}: no fault possible now (live {self.live()}, frozen {sorted(self.frozen)})")
            return
        kind = self.rng.choice(possible)
        self.result.faults[kind] += 1
        n = sum(self.result.faults.values())
        where = f"outer step {self.last_outer}"
        if kind == "coordinator":
            self.coordinator.kill()
            down_s = self.rng.uniform(0.5, 2 * self.eviction_s)
            say(self.t0, f"{self.name}: fault #{n}: kill -9 coordinator (restart in {down_s:.1f}s); {where}")
            self.later(down_s, self.restart_coordinator)
            return
        if kind == "join":
            self.start_node(f"fault #{n}: join")
            return
        node = self.rng.choice(self.targets())
        holder = node in self.established
        pid = self.launcher.procs[node].pid if self.launcher else None
        if kind == "kill":
            self.fate[node] = ("kill", {-9})
            self.signal_node(node, signal.SIGKILL)
            self.later(self.rng.uniform(1, 3), self.top_up)
        elif kind == "term":
            self.fate[node] = ("term", {143})
            self.signal_node(node, signal.SIGTERM)
            self.later(TERM_TIMEOUT_S, lambda: self.check_termed(node))
            self.later(self.rng.uniform(1, 3), self.top_up)
        else:  # stop: the node's process that heartbeats; hang: another of its processes
            if kind == "stop":
                freeze_s = self.eviction_s + self.rng.uniform(1, 3)
                self.result.stopped_holders += holder
                self.result.stopped_joiners += not holder
            else:
                freeze_s = 2 * self.cfg.mesh.min_straggler_s + self.rng.uniform(0, 5)
                self.result.hung += 1
                pid = self.launcher.local_procs[node][1].pid
            self.frozen[node] = pid
            self.stopped_at[node] = time.time()
            self.num_stops[node] += 1
            self.established.discard(node)
            signal_pid(pid, signal.SIGSTOP)
            self.later(freeze_s, lambda: self.thaw(node))
        label = {"kill": "kill -9", "term": "SIGTERM", "stop": "SIGSTOP", "hang": "SIGSTOP of local rank 1 of"}[kind]
        extra = f" for {freeze_s:.1f}s" if kind in ("stop", "hang") else ""
        extra += "" if holder else " (not yet admitted)"
        say(self.t0, f"{self.name}: fault #{n}: {label} node {node} (pid {pid}){extra}; "
                     f"{len(self.live()) - (kind == 'stop')} live and running; {where}")

    # ------------------------------------------------------------------ watching

    def observe(self) -> None:
        for r in self.tail.poll():
            node = r["node"]
            if r["kind"] == "start":
                self.started.add(node)
            if r["kind"] in ("outer", "rejoined") and r["time"] > self.stopped_at.get(node, 0.0):
                self.established.add(node)
            if r["kind"] == "outer" and not r.get("skipped") and r["outer_step"] > self.last_outer:
                self.last_outer, self.last_outer_at = r["outer_step"], time.time()
            if r["kind"] == "step" and self.t0 is None:
                self.t0 = r["time"]
        self.check_exits()

    def check_exits(self) -> None:
        assert self.launcher is not None
        for node, proc in self.launcher.procs.items():
            if proc.is_alive() or node in self.reported_exits:
                continue
            self.reported_exits.add(node)
            what, expected = self.fate.get(node, ("nothing", set()))
            if expected and node not in self.started:
                expected = expected | {-signal.SIGTERM}  # SIGTERM while still importing: no handler yet
            if proc.exitcode not in expected:
                self.result.unexpected_exits.append(f"node {node} exited with code {proc.exitcode} (harness: {what})")
                say(self.t0, f"{self.name}: !! node {node} exited with code {proc.exitcode} after {what}; "
                             f"see {self.node_log or 'the output above'}")
                self.fate.setdefault(node, ("died", set()))
                self.later(self.rng.uniform(1, 3), self.top_up)

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.observe()
            if predicate():
                return True
            time.sleep(0.2)
        return False

    # ------------------------------------------------------------------ the phase

    def run(self) -> PhaseResult:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._run()
        finally:
            self.shutdown()
        self.analyze()
        return self.result

    def _run(self) -> None:
        say(None, f"{self.name}: starting the coordinator and {self.num_nodes} nodes; run directory {self.run_dir}")
        if not self.coordinator.start():
            raise RuntimeError(f"the coordinator did not start; see {self.coordinator.log_path}")
        self.launcher = Launcher(self.cfg, self.run_dir, num_nodes=self.num_nodes, coordinator=self.coordinator.address)
        for _ in range(self.num_nodes):
            self.start_node("start")
        if not self.wait_until(lambda: self.t0 is not None, STARTUP_TIMEOUT_S):
            say(None, f"{self.name}: !! no inner step within {STARTUP_TIMEOUT_S:.0f}s; giving up")
            return
        self.result.started = True
        say(self.t0, f"{self.name}: training started; running {self.duration_s:.0f}s"
                     + (f" with faults {','.join(self.faults)}" if self.faults else " without faults"))
        end = self.t0 + self.duration_s
        next_fault = time.time() + self.rng.uniform(*self.interval)
        next_status = time.time() + 15
        dumped = -1  # the outer step after which the stacks were last printed
        while (now := time.time()) < end:
            self.observe()
            self.run_due_events()
            if self.faults and now >= next_fault and self.last_outer > 0:
                self.inject()
                next_fault = now + self.rng.uniform(*self.interval)
            if now >= next_status:
                self.status()
                next_status = now + 15
            if self.last_outer_at and now - self.last_outer_at > self.stall_s / 2 and dumped != self.last_outer:
                dumped = self.last_outer
                stopped = f" (stopped now: pids {sorted(self.frozen.values())})" if self.frozen else ""
                say(self.t0, f"{self.name}: !! no outer step applied for {now - self.last_outer_at:.0f}s; the nodes' "
                             f"stacks go to {self.node_log or 'their output'}{stopped}")
                with output_to(self.node_log):
                    self.launcher.dump_stacks()
            time.sleep(0.2)
        self.observe()
        self.result.window_s = time.time() - self.t0
        self.result.alive_at_end = len(self.live())

    def status(self) -> None:
        live, frozen = self.live(), sorted(self.frozen)
        say(self.t0, f"{self.name}: status: {len(live)} live nodes {live}"
                     + (f" (frozen {frozen})" if frozen else "")
                     + f", outer step {self.last_outer}, coordinator {'up' if self.coordinator.up else 'DOWN'}")

    def shutdown(self) -> None:
        """SIGCONT the frozen, SIGTERM every node, kill -9 what is left after a bounded wait; stop the coordinator."""
        if self.launcher is not None:
            for node in list(self.frozen):
                signal_pid(self.frozen.pop(node), signal.SIGCONT)
            alive = [n for n, p in self.launcher.procs.items() if p.is_alive()]
            for node in alive:
                if node not in self.fate:  # a second SIGTERM could land in an exiting interpreter: no handler
                    self.fate[node] = ("final SIGTERM", {143, 0})
                    self.signal_node(node, signal.SIGTERM)
            deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
            while time.monotonic() < deadline and any(self.launcher.procs[n].is_alive() for n in alive):
                time.sleep(0.2)
            if any(self.launcher.procs[n].is_alive() for n in alive):
                with output_to(self.node_log):  # where the nodes that ignore SIGTERM wait (a C call, a collective)
                    self.launcher.dump_stacks()
            for node in alive:
                proc = self.launcher.procs[node]
                if proc.is_alive():
                    self.result.unexpected_exits.append(f"node {node} still running {SHUTDOWN_TIMEOUT_S:.0f}s "
                                                        "after the final SIGTERM (killed)")
                    say(self.t0, f"{self.name}: !! node {node} ignored the final SIGTERM; kill -9")
                    proc.kill()
                proc.join(timeout=10)
            self.check_exits()
            self.launcher.stop()
        self.coordinator.stop()

    def analyze(self) -> None:
        res = self.result
        if not res.started or not (self.run_dir / METRICS_FILE).exists():
            return
        t0, t1 = self.t0, self.t0 + res.window_s
        records = read_records(self.run_dir)
        by_step: dict[int, list[dict]] = collections.defaultdict(list)
        for r in records:
            if r["kind"] == "outer":
                by_step[r["outer_step"]].append(r)
        applied_times, contributions = [], 0
        for step, rs in sorted(by_step.items()):
            applied = [r for r in rs if not r["skipped"]]
            hashes = {r["node"]: r["state_hash"] for r in applied}
            if len(set(hashes.values())) > 1:
                res.disagreements.append((step, hashes))
            res.retries += max(r["num_tries"] for r in rs) - 1
            if not applied:
                res.outer_skipped += 1
                continue
            done_at = min(r["time"] for r in applied)
            if done_at <= t1:
                res.outer_applied += 1
                applied_times.append(done_at)
                contributions += max(r["num_contributors"] for r in applied)
                res.last_members = max(r["num_members"] for r in applied)
        steps = sum(1 for r in records if r["kind"] == "step" and t0 <= r["time"] <= t1)
        res.steps_per_s = steps / res.window_s
        res.goodput = self.cfg.diloco.num_inner_steps * contributions / res.window_s
        marks = [t0, *sorted(applied_times), t1]
        res.longest_stall_s = max(b - a for a, b in itertools.pairwise(marks))
        rejoined = [r for r in records if r["kind"] == "rejoined"]
        res.rejoined = len(rejoined)
        by_node = collections.Counter(r["node"] for r in rejoined)  # a SIGSTOP explains one rejoin, not more
        res.unplanned_rejoins = sum(max(0, k - self.num_stops[node]) for node, k in by_node.items())
        late = {r["node"] for r in records if r["kind"] == "start" and r["joining"]}
        res.joiners = len(self.launcher.procs) - self.num_nodes if self.launcher else 0
        res.joiners_admitted = len({r["node"] for r in records if r["kind"] == "outer" and r["node"] in late})
        res.coordinator_disagreements = self.coordinator.reported_disagreements()


def print_table(results: list[PhaseResult], *, stall_s: float) -> None:
    base = results[0] if results[0].name == "baseline" else None

    def row(label: str, fmt: Callable[[PhaseResult], str]) -> None:
        print(f"  {label:<38}" + "".join(f"{fmt(r):>14}" for r in results))

    print()
    print(f"  {'':<38}" + "".join(f"{r.name:>14}" for r in results))
    row("window (s)", lambda r: f"{r.window_s:.1f}")
    row("faults injected", lambda r: str(sum(r.faults.values())) if r.name != "baseline" else "-")
    for kind in FAULT_KINDS:
        if any(r.faults[kind] for r in results):
            row(f"  {kind}", lambda r, k=kind: str(r.faults[k]) if r.name != "baseline" else "-")
    row("replacement nodes started", lambda r: str(r.replacements))
    row("nodes started mid-run: admitted/started", lambda r: f"{r.joiners_admitted}/{r.joiners}")
    row("SIGSTOPs of state holders / of joiners", lambda r: f"{r.stopped_holders}/{r.stopped_joiners}")
    row("hung local ranks (SIGSTOP of rank 1)", lambda r: str(r.hung))
    row("rejoined after a SIGSTOP", lambda r: str(r.rejoined - r.unplanned_rejoins))
    row("rejoins without a SIGSTOP (false evict)", lambda r: str(r.unplanned_rejoins))
    row("coordinator restart failures", lambda r: str(r.coordinator_restart_failures))
    row("outer steps applied", lambda r: str(r.outer_applied))
    row("skipped outer steps", lambda r: str(r.outer_skipped))
    row("retried all-reduces", lambda r: str(r.retries))
    row("HASH DISAGREEMENTS (metrics)", lambda r: str(len(r.disagreements)))
    row("hash disagreements (coordinator log)", lambda r: str(r.coordinator_disagreements))
    row("inner steps/s (all nodes, raw)", lambda r: f"{r.steps_per_s:.2f}")
    row("goodput (useful inner steps/s)", lambda r: f"{r.goodput:.2f}")
    if base is not None and base.goodput > 0:
        row("goodput ratio vs baseline", lambda r: f"{r.goodput / base.goodput:.2f}")
    row("longest stall (s)", lambda r: f"{r.longest_stall_s:.1f}")
    row("nodes alive at the end", lambda r: str(r.alive_at_end))
    row("members of the last outer step", lambda r: str(r.last_members))
    row("unexpected exits", lambda r: str(len(r.unexpected_exits)))
    print()
    print("  goodput = H x (contributors summed over applied outer steps) / window; the window runs from "
          "the first inner step to the final SIGTERM.")
    print(f"  progressed = at least one outer step applied and no stall longer than {stall_s:.0f}s.")
    for r in results:
        for step, hashes in r.disagreements:
            print(f"  {r.name}: outer step {step}: hashes differ: {hashes}")
        for line in r.unexpected_exits:
            print(f"  {r.name}: unexpected exit: {line}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", type=pathlib.Path, help="recipe file, e.g. recipes/debug.py")
    p.add_argument("--nodes", type=int, default=4, help="nodes to keep running (default 4)")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of the chaos run (default 120)")
    p.add_argument("--baseline", type=float, default=60.0,
                   help="seconds of the fault-free run first (default 60; 0 skips it)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    p.add_argument("--faults", default=",".join(FAULT_KINDS),
                   help=f"comma-separated fault kinds among {','.join(FAULT_KINDS)} (default all)")
    p.add_argument("--interval", type=float, nargs=2, default=(5.0, 15.0), metavar=("MIN", "MAX"),
                   help="seconds between faults, drawn uniformly (default 5 15)")
    p.add_argument("--min-alive", type=int, default=2,
                   help="never fault a node if fewer state-holding nodes would stay running (default 2)")
    p.add_argument("--stall", type=float, default=None,
                   help="longest time without an applied outer step that still counts as progress (default: the "
                        "deadline of one all-reduce of N + 1 nodes, plus the connect timeout, plus 15 s)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config field (after the harness's fast defaults)")
    p.add_argument("--run-dir", type=pathlib.Path, default=None, help="default runs/chaos-TIMESTAMP")
    p.add_argument("--strict", action="store_true",
                   help="also fail (exit 1) when a node exited unexpectedly (crashed, or hung on SIGTERM)")
    p.add_argument("--verbose", action="store_true", help="show the nodes' output here instead of nodes.log")
    return p


def _check_args(args: argparse.Namespace) -> tuple[str, ...]:
    faults = tuple(f.strip() for f in args.faults.split(",") if f.strip())
    unknown = [f for f in faults if f not in FAULT_KINDS]
    if unknown:
        raise ConfigError(f"unknown fault kind(s) {unknown}; choose among {','.join(FAULT_KINDS)}")
    if args.nodes < 1 or args.duration <= 0 or args.baseline < 0 or args.min_alive < 1:
        raise ConfigError("--nodes and --min-alive must be >= 1, --duration > 0, --baseline >= 0")
    if not 0 < args.interval[0] <= args.interval[1]:
        raise ConfigError(f"--interval needs 0 < MIN <= MAX, got {args.interval}")
    return faults


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        faults = _check_args(args)
        overrides = [*FAST_DEFAULTS, *args.overrides]
        cfg = recipe_config(args.recipe, overrides)
    except ConfigError as e:
        print(f"chaos: error: {e}", file=sys.stderr)
        return 2
    if args.stall is None:
        # A peer lost inside an all-reduce is noticed when the collective's deadline passes (by design), so
        # one such stall is expected; a stall longer than that, a rendezvous and some slack is a hang.
        args.stall = cfg.timeouts.collective_s(args.nodes + 1) + cfg.timeouts.connect_s + 15
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = (args.run_dir or pathlib.Path("runs") / f"chaos-{stamp}").resolve()
    print(f"chaos: {args.recipe}, {args.nodes} nodes, H={cfg.diloco.num_inner_steps}, heartbeat "
          f"{cfg.mesh.heartbeat_interval_s}s (eviction after {cfg.mesh.eviction_timeout_s}s), seed {args.seed}, "
          f"faults {','.join(faults) or 'none'} every {args.interval[0]:g}-{args.interval[1]:g}s; {run_dir}",
          flush=True)
    prepare_data(cfg.data)  # once, before any node starts, so the nodes do not race to train the tokenizer
    rng = random.Random(args.seed)
    phases = [("baseline", args.baseline, ())] if args.baseline > 0 else []
    phases.append(("chaos", args.duration, faults))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup in `finally` below
    results: list[PhaseResult] = []
    current: Phase | None = None
    try:
        for name, duration, kinds in phases:
            phase_dir = run_dir / name
            write_run_files(phase_dir, cfg, recipe=args.recipe.resolve(), recipe_files=loaded_recipe_files(),
                            overrides=overrides, num_nodes=args.nodes)
            current = Phase(name, cfg, phase_dir, num_nodes=args.nodes, duration_s=duration, faults=kinds,
                            rng=rng, interval=tuple(args.interval), min_alive=args.min_alive, verbose=args.verbose,
                            stall_s=args.stall)
            results.append(current.run())
            current = None
    except KeyboardInterrupt:
        print("chaos: interrupted; stopping every node and the coordinator", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        if current is not None:
            current.shutdown()
    print_table(results, stall_s=args.stall)
    ok = all(not r.disagreements and not r.coordinator_disagreements and r.progressed(args.stall) for r in results)
    crashed = sum(len(r.unexpected_exits) for r in results)
    if args.strict and crashed:
        ok = False
    note = f" ({crashed} unexpected node exit(s): see above and nodes.log)" if crashed else ""
    print(f"\n  RESULT: {'SURVIVED' if ok else 'FAILED'}{note}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
