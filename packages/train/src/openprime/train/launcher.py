"""Starts a run's nodes as separate processes on this machine, with a coordinator, and watches them.

The launcher prepares the data once (so the nodes do not race to train the tokenizer), writes the
resolved config and the recipe sources into the run directory, starts a coordinator (openprime.mesh)
on a thread of its own process unless one is given (`openprime mesh serve` runs one standalone), and
then one process per local rank of each node (processes.py: how those start, stop and show their
stacks). Nodes may die and join while the run goes on; the run succeeds when at
least one node trains to the end. `Launcher` is also what the fault-injection tests and
tools/chaos.py drive: they kill, freeze and add nodes through it.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import pathlib
import shlex
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

import attrs
import torch

from openprime.ckpt import Checkpoint, list_steps, step_dir, writing_pids
from openprime.core.config import to_dict
from openprime.core.distributed import host_store
from openprime.core.transport import Rendezvous
from openprime.mesh import Coordinator
from openprime.train.checkpointing import (
    checkpoint_root,
    newest_saved,
    num_nodes_saved,
    parts_by_node,
    slot_of_part,
)
from openprime.train.config import RunConfig
from openprime.train.data import prepare_data
from openprime.train.export import TOKENIZER_FILE
from openprime.train.hardware import detect_device_type, device_blocks, least_used_block
from openprime.train.leaving import stop_signals_handled
from openprime.train.metrics import RunSummary, summarize
from openprime.train.processes import (
    REFUSED_EXIT,
    STOP_SIGNALS,
    WATCHDOG_POLL_S,
    NodeProcess,
    dump_stacks,
    node_main,
    usable_cores,
)


def tell(line: str, *, err: bool = False) -> None:
    """One of the launcher's lines, on stdout (`err`: stderr).

    A stdout that is gone sends this line and the later ones to stderr: `openprime run ... | tee run.log` stopped by
    Ctrl-C loses its tee to the same SIGINT, and the launcher, which lives on to stop its nodes and wait for their
    saves, ended with a BrokenPipeError instead of the command that continues the run. A line that neither can take
    (the terminal is closed too) is dropped: stopping the nodes does not need it.
    """
    if not err:
        try:
            if sys.stdout is None:  # started with stdout closed (`>&-`): print() would drop the line unsaid
                raise OSError("stdout is closed")
            print(line, flush=True)
            return
        except OSError:  # EPIPE: the reader is gone; EIO: the terminal is
            _stdout_gone()
    with contextlib.suppress(OSError):
        print(line, file=sys.stderr, flush=True)


def _stdout_gone() -> None:
    """From now on stdout's lines go to stderr; what its buffer still holds goes nowhere (without this, the exit's
    flush fails again: "Exception ignored ... BrokenPipeError")."""
    with contextlib.suppress(AttributeError, OSError, ValueError):  # a stand-in without a file descriptor
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    sys.stdout = sys.stderr


def write_run_files(run_dir: pathlib.Path, cfg: RunConfig, *, recipe: pathlib.Path, recipe_files: list[pathlib.Path],
                    overrides: list[str], num_nodes: int, resumed_from: pathlib.Path | None = None,
                    joined: bool = False, tokenizer: pathlib.Path | None = None) -> None:
    """The resolved config (as the launch runs it) and every recipe source, next to the metrics.

    A resumed launch keeps the first launch's files and adds its own `config.resumed-N.json`; one that starts a
    run directory (`--resume PATH` of another run's checkpoint) writes `config.json`, which status and export read.
    A launch that `joined` the run of the launch holding the directory adds `config.joined-N.json` (it replaced the
    first launch's config.json and recipe sources with its own). Recipe files of the same name (an experiment's
    `debug.py` deriving from `recipes/debug.py`) are kept apart, `debug.py` and `debug.2.py`, and the config names
    each copy's origin (`recipe_files`): the base, copied last, replaced the recipe that ran. `tokenizer`: the data's
    tokenizer.json, copied as the run's (`openprime export` writes it beside the model).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    copies: dict[str, str] = {}
    for path in recipe_files:
        name, k = path.name, 1
        while name in copies:
            k += 1
            name = f"{path.stem}.{k}{path.suffix}"
        copies[name] = str(path)
    resolved = {"recipe": str(recipe), "overrides": overrides, "num_nodes": num_nodes, "recipe_files": copies,
                "config": to_dict(launch_config(cfg, num_nodes))}
    name = "config.json"
    if resumed_from is not None:
        resolved["resumed_from"] = str(resumed_from)
    kind = "joined" if joined else "resumed" if resumed_from is not None else ""
    if kind and (run_dir / name).exists():
        name = f"config.{kind}-{len(list(run_dir.glob(f'config.{kind}-*.json'))) + 1}.json"
    (run_dir / name).write_text(json.dumps(resolved, indent=2) + "\n")
    sources = run_dir / name.removesuffix(".json").replace("config", "recipe")
    sources.mkdir(exist_ok=True)
    for copy, path in copies.items():
        shutil.copyfile(path, sources / copy)
    if tokenizer is not None:  # written whole under another name, then renamed: a reader never sees half of it
        partial = run_dir / f".{TOKENIZER_FILE}.{os.getpid()}.tmp"
        shutil.copyfile(tokenizer, partial)
        os.replace(partial, run_dir / TOKENIZER_FILE)


def launch_config(cfg: RunConfig, num_nodes: int) -> RunConfig:
    """The config a launch of `num_nodes` nodes runs: its first view waits for all of them, and for more when the
    recipe's mesh.min_nodes asks for more (nodes that --join from other machines; it was replaced without a word)."""
    return attrs.evolve(cfg, mesh=attrs.evolve(cfg.mesh, min_nodes=max(cfg.mesh.min_nodes, num_nodes)))


# How long a stopped node process has to leave (its deathrattle, closing its mesh) before SIGKILL, when no
# checkpoint write of its own is under way (Launcher.stop).
LEAVE_S = 10.0


def data_slots(resume: Checkpoint | None, *, num_nodes: int, max_nodes: int, first_node: int = 0) -> list[int]:
    """The data slot each node of a launch asks the coordinator for, in start order (-1: any). The nodes that
    resume a checkpoint ask for their saved slots (the node itself reads it from its part); the others, for slots
    that no node of the checkpoint saved: asking for any, one could take a resumed node's slot before that node
    joined, and read that slot's data again from the start. A new run's node N asks for slot N (`first_node`: the
    launch's first node number), as a resume numbers its nodes by slot: given slots in the order they joined,
    node 0 of the first launch and node 0 of its resume were two replicas, whose records the per-node summaries
    and curves joined (found 2026-12-07)."""
    if resume is None:
        return [node if node < max_nodes else -1 for node in range(first_node, first_node + num_nodes)]
    nodes = parts_by_node(resume)
    saved = [slot_of_part(names[0]) for names in nodes]
    free = [slot for slot in range(max_nodes) if slot not in saved]
    extra = num_nodes - min(num_nodes, len(nodes))
    return saved[:num_nodes] + [free[i] if i < len(free) else -1 for i in range(extra)]


class Launcher:
    """A coordinator plus node processes on this machine: `fsdp.num_local_ranks` processes per node."""

    def __init__(self, cfg: RunConfig, run_dir: pathlib.Path, *, num_nodes: int,
                 coordinator: str | None = None, resume: Checkpoint | None = None, first_node: int = 0) -> None:
        self.cfg = launch_config(cfg, num_nodes)
        self.run_dir = run_dir
        # The number of this launch's first node in the run directory's records: past another launch's nodes when
        # two launches of a run share the directory (one disk), so that their records do not mix.
        self.first_node = first_node
        self.started_at = time.time()  # a checkpoint write of one of its nodes is newer (Launcher.stop)
        self.resume = resume  # the nodes started first continue from it; later ones join and get the state
        # The first nodes resume the checkpoint's nodes, as many as it holds (it may hold more: a shared disk).
        self._num_resumed = min(num_nodes, len(parts_by_node(resume))) if resume is not None else 0
        self._slots = data_slots(resume, num_nodes=num_nodes, max_nodes=cfg.mesh.max_nodes, first_node=first_node)
        self.num_threads = cfg.train.num_threads or max(1, usable_cores() // (num_nodes * cfg.fsdp.num_local_ranks))
        self.coordinator_server: Coordinator | None = None  # the coordinator, when it runs in this process
        if coordinator is None:
            self.coordinator_server = Coordinator(self.cfg.mesh, store_timeout_s=cfg.timeouts.connect_s).start()
            coordinator = self.coordinator_server.address
        self.coordinator = coordinator
        # The local groups of the nodes started here meet in this process's store, each on its own prefix.
        self._local_store = host_store(timeout_s=cfg.timeouts.connect_s) if cfg.fsdp.sharded else None
        self.procs: dict[int, mp.process.BaseProcess] = {}  # node -> its local rank 0 (the one that speaks for it)
        self.num_devices = torch.cuda.device_count() if detect_device_type() == "cuda" else 0
        self.device_blocks: dict[int, int] = {}  # node -> the block of GPUs it computes on (hardware.device_blocks)
        self.local_procs: dict[int, list[mp.process.BaseProcess]] = {}  # node -> all its processes, by local rank
        self.first_failures: dict[int, tuple[int, int]] = {}  # node -> (local rank, exit code) that took it down
        self._watching = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="openprime-node-watchdog", daemon=True)
        self._watchdog.start()

    def start_node(self) -> mp.process.BaseProcess:
        """Start one more node; once the run is under way, it waits for the next outer step and gets the state."""
        index = len(self.procs)
        node = self.first_node + index
        resume = self.resume if index < self._num_resumed else None
        slot = self._slots[index] if index < len(self._slots) else -1
        rendezvous = None
        if self._local_store is not None:
            rendezvous = Rendezvous(host="127.0.0.1", port=self._local_store.port,
                                    group=f"{self.cfg.mesh.run_id}/node-{node}/local")
        ranks = self.cfg.fsdp.num_local_ranks
        live = [block for other, block in self.device_blocks.items() if self.procs[other].is_alive()]
        self.device_blocks[node] = block = least_used_block(live, num_blocks=device_blocks(self.num_devices, ranks))
        procs = []
        for local_rank in range(ranks):
            name = f"node-{node}" + (f"-rank-{local_rank}" if rendezvous else "")
            proc = NodeProcess(target=node_main, name=name,
                               args=(self.cfg, node, self.coordinator, self.run_dir, self.num_threads, resume,
                                     local_rank, rendezvous, block * ranks, slot))
            proc.start()
            procs.append(proc)
        self.procs[node], self.local_procs[node] = procs[0], procs
        return procs[0]

    def _watch(self) -> None:
        """A node is all of its local ranks: when one process of a node ends with an error or a signal, stop the
        others (they would wait in the node's local group for it), so that the node leaves the run as a whole.

        They get SIGTERM first, to leave gracefully (local rank 0 sends the deathrattle), and SIGKILL if still
        there `timeouts.connect_s` later (a process blocked inside a collective cannot run its handler)."""
        grace_s = self.cfg.timeouts.connect_s
        stopping: dict[int, float] = {}  # node -> when its other processes got SIGTERM
        while not self._watching.wait(WATCHDOG_POLL_S):
            for node, procs in list(self.local_procs.items()):
                if len(procs) == 1 or not any(p.exitcode not in (None, 0) for p in procs):
                    continue
                alive = [p for p in procs if p.is_alive()]
                if node not in stopping:
                    stopping[node] = time.monotonic()
                    # The process that took the node down, for the launch's report: local rank 0's exit code is
                    # the SIGTERM this sends it, and a killed rank 1 read "node 1 left on SIGTERM".
                    rank, code = next((r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0))
                    self.first_failures.setdefault(node, (rank, code))
                    for p in alive:
                        p.terminate()
                elif time.monotonic() - stopping[node] > grace_s:
                    for p in alive:
                        p.kill()

    def wait(self, timeout_s: float | None = None) -> dict[int, int | None]:
        """Wait for every node to exit (or the timeout); returns exit codes by node (of its local rank 0).

        Processes still running at the timeout print their threads' stacks (to their stderr) before this returns:
        where a hung node waits is then on record, whatever the caller does with them next."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._alive() and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.2)
        if self._alive():
            self.dump_stacks()
        return {n: p.exitcode for n, p in self.procs.items()}

    def _alive(self) -> list[mp.process.BaseProcess]:
        return [p for procs in self.local_procs.values() for p in procs if p.is_alive()]

    def dump_stacks(self, settle_s: float = 0.5) -> list[str]:
        """Every live node process prints its threads' stacks (`dump_stacks`); returns the processes asked."""
        return dump_stacks([(p.name, p.pid) for p in self._alive()], settle_s=settle_s)

    def stop(self) -> None:
        """Stop every node: SIGTERM (it leaves gracefully), then SIGKILL to a process still there LEAVE_S later, or
        LEAVE_S after its checkpoint write under way ended (checkpoint.stop_wait_s at most, or a second Ctrl-C):
        killing a write loses that save, which for a large model is minutes of writing and an outer step of
        training."""
        self._watching.set()
        everything = [p for procs in self.local_procs.values() for p in procs]
        for p in everything:
            if p.is_alive():
                p.terminate()
        start = time.monotonic()
        root = checkpoint_root(self.cfg.checkpoint, self.run_dir)
        node_of = {p.pid: node for node, procs in self.local_procs.items() for p in procs}
        kill_at = {p.pid: start + LEAVE_S for p in everything}
        said = False
        try:
            while alive := [p for p in everything if p.is_alive()]:
                now = time.monotonic()
                pids = writing_pids(root, since=self.started_at)
                writing = [p for p in alive if p.pid in pids]
                for p in writing:  # never less than any process gets
                    kill_at[p.pid] = max(start + LEAVE_S, min(now + LEAVE_S, start + self.cfg.checkpoint.stop_wait_s))
                if writing and now > start + LEAVE_S and not said:
                    said = True
                    tell(f"openprime: waiting for node(s) {sorted({node_of[p.pid] for p in writing})} to finish "
                         f"writing their checkpoint (at most checkpoint.stop_wait_s="
                         f"{self.cfg.checkpoint.stop_wait_s:g}; Ctrl-C again kills them and loses that save)",
                         err=True)
                for p in alive:
                    if now > kill_at[p.pid]:
                        p.kill()
                        p.join()
                time.sleep(WATCHDOG_POLL_S / 2)
        except KeyboardInterrupt:
            tell("openprime: interrupted again; killing the nodes still there", err=True)
            for p in everything:
                if p.is_alive():
                    p.kill()
                    p.join()
        if self.coordinator_server is not None:
            self.coordinator_server.stop()
            self.coordinator_server = None


def launch(cfg: RunConfig, *, num_nodes: int, run_dir: pathlib.Path, coordinator: str | None = None,
           resume: Checkpoint | None = None, first_node: int = 0, recipe_args: str = "RECIPE") -> int:
    """Run `num_nodes` nodes to the end of the run; returns the exit code for the command. `first_node`: the first
    node's number in the run directory's records (after those of another launch that shares the directory);
    `recipe_args`: the recipe and the flags that changed its config (`--network`, `--transport`, `--set`), as the
    command that continues the run repeats them."""
    prepare_data(cfg.data)
    launcher = Launcher(cfg, run_dir, num_nodes=num_nodes, coordinator=coordinator, resume=resume,
                        first_node=first_node)
    start = time.monotonic()
    tell(f"openprime: starting {num_nodes} node(s) of {cfg.name!r}; coordinator {launcher.coordinator}; "
         f"run directory {run_dir}" + (f"; resuming from {resume.path}" if resume else ""))
    ranks = cfg.fsdp.num_local_ranks
    if launcher.num_devices and num_nodes > device_blocks(launcher.num_devices, ranks):
        tell(f"openprime: note: {num_nodes} nodes of {ranks} local rank(s) share this machine's "
             f"{launcher.num_devices} GPU(s): each GPU holds the replicas and memory of several")
    codes: dict[int, int] | None = None
    stopped_by = signal.SIGINT
    with _stopped_by_signals() as ignore_signals:
        try:
            for _ in range(num_nodes):
                launcher.start_node()
            codes = launcher.wait()
        except KeyboardInterrupt:
            tell("openprime: interrupted; stopping the nodes (they leave gracefully)", err=True)
        except Stopped as e:
            stopped_by = e.signum
            tell(f"openprime: got {e.signum.name}; stopping the nodes (they leave gracefully)", err=True)
        finally:
            ignore_signals()  # a second signal must not cut the stop short
            launcher.stop()
    if codes is None:
        _print_checkpoints(cfg, run_dir, num_nodes=num_nodes, joined=coordinator, recipe_args=recipe_args)
        return 128 + stopped_by
    failed = {n: c for n, c in codes.items() if c != 0}
    for node, code in failed.items():
        rank, first = launcher.first_failures.get(node, (0, code))
        how = (f"{ended_how(code)}" if rank == 0 else
               f"stopped: its local rank {rank} {ended_how(first)}, and its other processes were stopped with it")
        tell(f"openprime: node {node} {how}" + ("; the others went on without it" if len(failed) < len(codes)
                                                else ""), err=True)
    if len(failed) == len(codes):
        refused = all(c == REFUSED_EXIT for c in codes.values())
        tell("openprime: run failed: " + ("its nodes were refused or misconfigured; the error above says what to "
                                          "change before starting them again" if refused else
                                          "no node finished. See the log above."), err=True)
        _print_checkpoints(cfg, run_dir, num_nodes=num_nodes, joined=coordinator, recipe_args=recipe_args,
                           how_to_continue=not refused)
        return REFUSED_EXIT if refused else 1
    summary, saved = _print_summary(cfg, run_dir, time.monotonic() - start, num_nodes=num_nodes, joined=coordinator,
                                    recipe_args=recipe_args)
    if (diverged := divergence(summary)) is not None:  # it exited 0 with "DIFFER" in its summary line
        tell(f"openprime: error: {diverged}", err=True)
        return 1
    last = summary.last_checkpoint_step
    if last is not None and (saved is None or saved < last):  # trained, but what it trained is not on disk
        tell(f"openprime: error: the run's last checkpoint, of step {last}, did not finish saving (the errors above "
             f"say why). " + (f"Its newest saved one is step {saved}: free space and continue from it with --resume "
                              f"latest" if saved is not None else "None of its checkpoints finished saving: free "
                              "space, or give checkpoint.directory another disk, and start it again"),
             err=True)
        return 1
    return 0


def divergence(summary: RunSummary) -> str | None:
    """What to say of a run whose nodes recorded different global-state hashes after an outer step (None when they
    agree). The nodes compare their hashes at every outer step and stop (ReplicaDivergence), so this is a bug of
    openprime's or a run directory written by two runs at once; either way its weights are not to be trusted."""
    differ = sorted(step for step, hashes in summary.distinct_hashes.items() if len(hashes) > 1)
    if not differ:
        return None
    return (f"the nodes' records show different global states after outer step(s) {differ[:5]}"
            f"{f' and {len(differ) - 5} more' if len(differ) > 5 else ''}: the replicas diverged although every node "
            f"ended well. Do not trust this run's weights; resume from a checkpoint saved before outer step "
            f"{differ[0]} and report it (with metrics.jsonl)")


def ended_how(exit_code: int) -> str:
    """How a node process ended, for a person: a negative code is the signal that killed it (multiprocessing's
    convention), 128 + a stop signal is a node that left on it (openprime.train.leaving)."""
    if exit_code < 0:
        try:
            name = signal.Signals(-exit_code).name
        except ValueError:
            name = f"signal {-exit_code}"
        oom = " (out of memory? The kernel's OOM killer sends SIGKILL; `dmesg | grep -i oom` says)"
        return f"was killed by {name}" + (oom if -exit_code == signal.SIGKILL else "")
    if exit_code - 128 in STOP_SIGNALS:
        return f"exited with code {exit_code} (it left on {signal.Signals(exit_code - 128).name})"
    return f"exited with code {exit_code}"


class Stopped(Exception):
    """The launching process got one of STOP_SIGNALS: stop the launch as Ctrl-C does."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signal.Signals(signum)


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[Callable[[], None]]:
    """While a launch runs, STOP_SIGNALS raise Stopped in the main thread, as SIGINT raises KeyboardInterrupt: the
    launcher then stops its nodes gracefully and says how to continue. Without this, SIGTERM or SIGHUP ended the
    launcher at once and left its nodes running with nobody to stop them. A SIGHUP ignored when the launch began
    (`nohup`) stays ignored, by the launcher and its nodes (leaving.stop_signals_handled). Yields a function that
    ignores them from then on (while the nodes are being stopped); the previous handlers come back at the end."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread can handle signals
        yield lambda: None
        return

    def ignore() -> None:
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)

    def stop(signum: int, _frame: object) -> None:
        ignore()
        raise Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in stop_signals_handled()}  # under nohup, not SIGHUP
    try:
        yield ignore
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _print_summary(cfg: RunConfig, run_dir: pathlib.Path, elapsed_s: float, *, num_nodes: int,
                   joined: str | None, recipe_args: str) -> tuple[RunSummary, int | None]:
    """The end of a launch whose nodes finished: what they trained and where it is saved; returns the run's summary
    and its newest saved checkpoint's step."""
    s = summarize(run_dir)
    tell(f"openprime: done in {elapsed_s:.0f}s: {s.num_nodes} nodes, {s.num_outer_steps} outer steps, "
         f"global state hashes {'identical on every node after every outer step' if s.hashes_agree else 'DIFFER'}")
    for node, losses in sorted(s.losses.items()):
        skipped = s.num_skipped.get(node, 0)
        tell(f"  node {node}: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps, "
             f"sent {s.bytes_sent.get(node, 0):,} bytes"
             + (f", {skipped} step(s) skipped for a NaN/inf gradient" if skipped else ""))
    tell(f"  metrics: {run_dir / 'metrics.jsonl'}  config: {run_dir / 'config.json'}")
    return s, _print_checkpoints(cfg, run_dir, num_nodes=num_nodes, joined=joined, recipe_args=recipe_args)


def _print_checkpoints(cfg: RunConfig, run_dir: pathlib.Path, *, num_nodes: int, joined: str | None,
                       recipe_args: str = "RECIPE", how_to_continue: bool = True) -> int | None:
    """Where the run's checkpoints are and the command that continues it (after an end, a failure or Ctrl-C);
    returns the newest saved step (None: none)."""
    root = checkpoint_root(cfg.checkpoint, run_dir)
    steps = list_steps(root)
    if not steps:
        return None
    saved = newest_saved(root)  # a failed save (a full disk) can leave a step that no node finished
    if saved is None:
        tell(f"  checkpoints: none under {root} finished saving (the errors above say why)")
        return None
    # A launch joined to a standalone coordinator (one machine of several) resumes joined to it again.
    join = f" --join {shlex.quote(joined)}" if joined else ""
    quoted = shlex.quote(str(run_dir))  # the commands below are pasted into a shell: a path may hold a space
    more = ""
    if saved < cfg.train.num_steps and how_to_continue:
        # `--resume latest` takes the newest step that holds every node of the launch: a node stopped inside an
        # outer step that the others finished and saved left that step without its part.
        resumable = newest_saved(root, num_nodes=num_nodes) if num_nodes > 1 else saved
        if resumable is None:
            more = (f"no checkpoint holds the parts of all {num_nodes} nodes: continue with `openprime run "
                    f"{recipe_args} --nodes {num_nodes_saved(root, saved)}{join} --run-dir {quoted} --resume "
                    f"latest` (step {saved}; more nodes can join it with --join and take the state from a peer); ")
        else:
            older = f" (from step {resumable}, the newest that holds every node's parts)" if resumable < saved else ""
            more = (f"continue with `openprime run {recipe_args} --nodes {num_nodes}{join} --run-dir {quoted} "
                    f"--resume latest`{older}; ")
            if resumable < saved:
                # Nodes that died (or whose saves failed) left the steps the others saved after without their
                # parts: the newest holds the run's global state all the same, and the nodes it lacks take the
                # state from a peer. Named only by `--resume latest`, a run went back to the older step.
                newest = shlex.quote(str(step_dir(root, saved)))
                more += (f"or from the newest step, {saved}, which {num_nodes_saved(root, saved)} of the {num_nodes} "
                         f"nodes saved: `openprime run {recipe_args} --nodes {num_nodes}{join} --run-dir {quoted} "
                         f"--resume {newest}` (the others take the state from a peer and read their data slots from "
                         f"the start); ")
    unfinished = [step for step in steps if step > saved]
    note = f"; the saves of step(s) {unfinished} did not finish" if unfinished else ""
    tell(f"  checkpoints: {root} (newest: step {saved}{note}); {more}export the model with "
         f"`openprime export {quoted} OUT_DIR`")
    return saved
