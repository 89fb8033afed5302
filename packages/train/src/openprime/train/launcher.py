"""Starts the nodes of a run as separate processes on this machine and watches them.

The launcher hosts the rendezvous store (not a node: a node's death must not take the store with it),
prepares the data once (so the nodes do not race to train the tokenizer), writes the resolved config
and the recipe sources into the run directory, then starts one process per node. If any node fails,
the others are stopped and the command fails with that node's error.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import pathlib
import shutil
import sys
import time
import traceback

from openprime.core.config import to_dict
from openprime.core.distributed import host_store
from openprime.core.transport import Rendezvous
from openprime.train.config import RunConfig
from openprime.train.data import prepare_data
from openprime.train.metrics import summarize
from openprime.train.trainer import run_node


def write_run_files(run_dir: pathlib.Path, cfg: RunConfig, *, recipe: pathlib.Path, recipe_files: list[pathlib.Path],
                    overrides: list[str], num_nodes: int) -> None:
    """The resolved config and every recipe source, next to the metrics."""
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = {"recipe": str(recipe), "overrides": overrides, "num_nodes": num_nodes, "config": to_dict(cfg)}
    (run_dir / "config.json").write_text(json.dumps(resolved, indent=2) + "\n")
    sources = run_dir / "recipe"
    sources.mkdir(exist_ok=True)
    for path in recipe_files:
        shutil.copyfile(path, sources / path.name)


def _node_main(cfg: RunConfig, node_rank: int, num_nodes: int, rendezvous: Rendezvous, run_dir: pathlib.Path) -> None:
    try:
        run_node(cfg, node_rank=node_rank, num_nodes=num_nodes, rendezvous=rendezvous, run_dir=run_dir)
    except BaseException:
        print(f"[node {node_rank}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.exit(1)


def launch(cfg: RunConfig, *, num_nodes: int, run_dir: pathlib.Path) -> int:
    """Run `num_nodes` nodes to the end of the run; returns the exit code for the command."""
    prepare_data(cfg.data)
    store = host_store(timeout_s=cfg.timeouts.connect_s)
    rendezvous = Rendezvous(host="127.0.0.1", port=store.port, group=f"{cfg.name}/diloco/0")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_node_main, args=(cfg, r, num_nodes, rendezvous, run_dir), name=f"node-{r}")
             for r in range(num_nodes)]
    start = time.monotonic()
    print(f"openprime: starting {num_nodes} nodes of {cfg.name!r}; run directory {run_dir}", flush=True)
    for p in procs:
        p.start()
    failed = None
    try:
        while any(p.is_alive() for p in procs) and failed is None:
            time.sleep(0.2)
            failed = next((p for p in procs if p.exitcode not in (None, 0)), None)
    except KeyboardInterrupt:
        failed = "interrupted"
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    if failed is not None:
        who = failed if isinstance(failed, str) else f"{failed.name} exited with code {failed.exitcode}"
        print(f"openprime: run failed ({who}); the other nodes were stopped. See the log above.", file=sys.stderr)
        return 1
    _print_summary(run_dir, time.monotonic() - start)
    return 0


def _print_summary(run_dir: pathlib.Path, elapsed_s: float) -> None:
    s = summarize(run_dir)
    print(f"openprime: done in {elapsed_s:.0f}s: {s.num_nodes} nodes, {s.num_outer_steps} outer steps, "
          f"global state hashes {'identical on every node after every outer step' if s.hashes_agree else 'DIFFER'}")
    for node, losses in sorted(s.losses.items()):
        print(f"  node {node}: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps, "
              f"sent {s.bytes_sent.get(node, 0):,} bytes")
    print(f"  metrics: {run_dir / 'metrics.jsonl'}  config: {run_dir / 'config.json'}")
