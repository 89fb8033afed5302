"""Benchmark of checkpointing and live recovery (issue 6): what a save blocks, and how fast a joiner gets the state.

What it measures (every number a median over repetitions; the first repetition is a warm-up, not counted):

1. Checkpoint saves (`openprime.ckpt.Checkpointer`) of what a node saves (paper, section 2.3), for the
   debug model and a 100M-parameter Llama (dim 768, 12 layers, 12 heads, 4 kv heads, vocabulary 16384,
   SwiGLU width 2048: 100,682,496 parameters): the model weights, the AdamW state after one step,
   DiLoCo's global weights and outer momentum, and the RNG state. For SaveMode.ASYNC, the seconds
   training is blocked (the host-memory snapshot) beside the whole save (snapshot, DCP write with fsync,
   SHA-256 manifest, rename, pruning), their ratio, the bytes written and the whole save's GB/s; and a
   SYNC save in the same repetition, for comparison. One process with one torch thread and nothing
   training meanwhile (on a real node, training competes with the writer thread for the cores). The
   checkpoints go to a temporary directory under /tmp, removed afterwards.
2. Live transfer (`openprime.core.state_transfer`, paper section 2.2) between two processes on loopback,
   over each transport (gloo, tcp, zmq): the donor's `send_state` of what a joiner takes in live recovery
   (DiLoCo's theta and momentum, shared; the donor's AdamW state, its own) and the joiner's
   `StateFetch.fetch`, timed together (the slower rank counting), beside the transport's point-to-point
   ceiling: one `transport.send` of a single buffer of the same total size. The donor's offer carries the
   piece digests of its state hash, as DiLoCo's does after an outer step, so it reads its theta and
   momentum only to send them; the joiner checks every chunk, and the whole state against the offer's hash
   from the same digests. The ratio (state transfer throughput / point-to-point throughput, per repetition)
   has a target of 0.80. Two more rows help to read it: the same transfer with every piece digest replaced
   by 0 on both sides ("no checksum", the benchmark patches `state_transfer._digests` in its own
   processes), which tells the checksums' cost apart from the protocol's, and the raw-socket ceiling of
   tools/bench_transports.py (plain `sendall` / `recv_into`). The joiner receives into tensors allocated in
   the warm-up, as the point-to-point row receives into a preallocated buffer (DiLoCo's joiner does so for
   theta and momentum, not for the AdamW state), so that page faults of fresh allocations are not counted.
   Each row also reports the CPU seconds the donor and the joiner spent (all threads, user and system): on
   a machine whose cores are all busy, as this 2-core one is, the rows' throughputs follow their CPU costs.

3. The same live transfer and point-to-point rows over tcp and zmq with every link shaped to --rate-gbps
   (default 1 Gbit/s, `LinkShaping`; gloo cannot shape): there the network is the bottleneck, as on the
   WAN links live recovery is for, rather than this machine's two cores that the donor, the joiner and
   the loopback copies share.

Side by side: each repetition runs every row back to back in a rotating order, after a barrier on the
rendezvous store (as in tools/bench_transports.py, whose helpers this reuses), so the rows share the
machine's noise; a ratio is the median of per-repetition ratios. The single-core rate of the checksum
(XXH3-64) on data that does not fit in the caches is printed too.

Run (from the repository root, with the repository's virtual environment):

    .venv/bin/python tools/bench_ckpt.py                      # full run, about 9 minutes on 2 cores, ~10 GB RAM
    .venv/bin/python tools/bench_ckpt.py --quick              # smoke test: the debug model only, under a minute
    .venv/bin/python tools/bench_ckpt.py --reps 7 --out ckpt.md --transports tcp,zmq
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_transports as bt  # noqa: E402

from openprime.ckpt import Checkpointer, SaveMode  # noqa: E402
from openprime.ckpt.state import flatten  # noqa: E402
from openprime.core import digest, state_transfer  # noqa: E402
from openprime.core.shaping import LinkShaping  # noqa: E402
from openprime.core.state_transfer import StateFetch, StateOffer, send_state  # noqa: E402
from openprime.core.testing import GroupContext, local_group, run_group  # noqa: E402
from openprime.core.timeouts import Timeouts  # noqa: E402
from openprime.core.transport import as_bytes  # noqa: E402
from openprime.diloco import DiLoCo, DiLoCoConfig  # noqa: E402
from openprime.train.model import FLAVORS, Llama, ModelConfig, count_parameters  # noqa: E402

HUNDRED_M = ModelConfig(dim=768, num_layers=12, num_heads=12, num_kv_heads=4, vocab_size=16384,
                        ffn_dim_multiplier=None, multiple_of=256, max_seq_len=256)
MODELS = {"debug": FLAVORS["debug"], "100M": HUNDRED_M}
P2P, STATE, NO_CHECKSUM = "p2p", "state", "state, no checksum"

# ---------------------------------------------------------------- the state of a node


def build_node(cfg: ModelConfig, seed: int = 0) -> tuple[Llama, torch.optim.Optimizer, DiLoCo]:
    """A model, its AdamW after one step (so that its state exists) and a DiLoCo over it."""
    torch.manual_seed(seed)
    model = Llama(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    diloco = DiLoCo(model.parameters(), config=DiLoCoConfig(), timeouts=Timeouts(), transport=local_group(1)[0])
    return model, opt, diloco


def saved_state(model: Llama, opt: torch.optim.Optimizer, diloco: DiLoCo) -> dict[str, Any]:
    """What `openprime.train.checkpointing.node_state` saves, less the scheduler and data position."""
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
            "diloco": diloco.state_dict(), "rng": {"torch": torch.get_rng_state()}}


def state_offer(model: Llama, opt: torch.optim.Optimizer, diloco: DiLoCo, *, checksums: bool = True) -> StateOffer:
    """What a donor offers in live recovery (as openprime.diloco.recovery builds it: with the piece digests of
    its state hash, computed at the outer step). Without `checksums`, for the "no checksum" row: every digest
    is 0 (as `_without_checksum` makes them) and so is the state hash's."""
    own, _ = flatten(get_optimizer_state_dict(model, opt))
    shared = {"theta": diloco.state.theta, "momentum": diloco.state.momentum}
    if not checksums:
        zeros = _zero_digests([as_bytes(t) for t in shared.values()], digest.PIECE_BYTES)
        return StateOffer(step=1, origin="donor", state_hash=digest.combine(zeros), shared=shared, own=own)
    state_hash = diloco.state.state_hash()
    return StateOffer(step=1, origin="donor", state_hash=state_hash, shared=shared, own=own,
                      shared_digests=diloco.state.shared_digests())


def tensor_bytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in flatten(state)[0].values())


# ---------------------------------------------------------------- saves (in this process)


def measure_saves(cfg: ModelConfig, reps: int) -> dict[str, Any]:
    """Per counted rep: async blocking and whole seconds, sync whole seconds, bytes written."""
    state = saved_state(*build_node(cfg))
    out: dict[str, Any] = {"state_bytes": tensor_bytes(state), "blocking": [], "async": [], "sync": [], "written": []}
    with tempfile.TemporaryDirectory(prefix="bench_ckpt-", dir="/tmp") as tmp:
        savers = {mode: Checkpointer(pathlib.Path(tmp) / mode.value, part="slot-0", mode=mode, num_keep=1)
                  for mode in (SaveMode.ASYNC, SaveMode.SYNC)}
        for rep in range(reps + 1):
            order = list(savers) if rep % 2 == 0 else list(savers)[::-1]
            for mode in order:
                saver = savers[mode]
                saver.save(rep, state, parts=["slot-0"])
                result = saver.wait()
                if result is None or result.path is None:
                    raise RuntimeError(f"{mode.value} save failed: {result.error if result else 'no result'}")
                if rep == 0:
                    continue
                if mode is SaveMode.ASYNC:
                    out["blocking"].append(result.blocking_s)
                    out["async"].append(result.total_s)
                    out["written"].append(sum(f.stat().st_size for f in result.path.rglob("*") if f.is_file()))
                else:
                    out["sync"].append(result.total_s)
    return out


def section_saves(opts, models: dict[str, ModelConfig]) -> str:
    rows = []
    for name, cfg in models.items():
        bt.progress(f"saves of the {name} model ...")
        r = measure_saves(cfg, opts.reps)
        written = statistics.median(r["written"])
        rows.append([
            name, f"{count_parameters(cfg):,}", f"{r['state_bytes'] / 1e6:.1f}", f"{written / 1e6:.1f}",
            spread(r["blocking"]), spread(r["async"]),
            f"{statistics.median(b / a for b, a in zip(r['blocking'], r['async'], strict=True)):.3f}",
            bt.Cell([written / 1e9 / s for s in r["async"]], []).text(), spread(r["sync"]),
            f"{statistics.median(a / s for a, s in zip(r['async'], r['sync'], strict=True)):.2f}",
        ])
        gc.collect()
    header = ["model", "parameters", "state MB", "written MB", "async blocking s", "async whole save s",
              "blocking / whole", "whole save GB/s", "sync whole save s", "async whole / sync whole"]
    return (f"### Checkpoint saves (one process, one torch thread, /tmp; reps {opts.reps})\n\n" + bt.table(header, rows)
            + "\n\nState: model weights, AdamW state after one step, DiLoCo theta and momentum, RNG state. "
            "\"blocking\": the host-memory snapshot training waits for; \"whole save\": snapshot, DCP write (fsync), "
            "SHA-256 manifest, rename and pruning, with nothing training meanwhile. GB/s: bytes written / whole save.")


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


# ---------------------------------------------------------------- live transfer (two processes)


def body_transfer(_transport, ctx: GroupContext, factories: dict[str, Any], cfg: ModelConfig, reps: int,
                  op_timeout_s: float, shaped: bool = False) -> tuple[dict[str, Any], int, dict[str, list[float]]]:
    """Rank 0 donates, rank 1 joins; returns ({row: seconds per rep}, state bytes, {row: CPU seconds per rep}).
    `shaped`: the factories' links are shaped; only the p2p and state rows (no raw socket, no checksum-less row:
    on a shaped link each repetition takes seconds)."""
    barrier = bt.StoreBarrier(ctx, op_timeout_s)
    raw = {} if shaped else {bt.RAW: lambda: bt.RawLink(ctx, op_timeout_s)}
    endpoints, errors = bt._build_endpoints(ctx, barrier, factories, raw)
    if ctx.rank == 0:
        model, opt, diloco = build_node(cfg)
        offer = state_offer(model, opt, diloco)
        offer_unchecked = state_offer(model, opt, diloco, checksums=False)
        nbytes = offer.layout.total
        barrier.store.set("state_bytes", str(nbytes))
        buffer = torch.ones(nbytes, dtype=torch.uint8)
    else:
        barrier.store.wait(["state_bytes"])
        nbytes = int(barrier.store.get("state_bytes"))
        buffer = torch.empty(nbytes, dtype=torch.uint8)
    view = memoryview(buffer.numpy()).cast("B")
    targets: dict[str, torch.Tensor] = {}  # the joiner's tensors, allocated in the warm-up and reused
    ops: dict[str, bt.Op] = {}
    for name, endpoint in endpoints.items():
        p2p = functools.partial(bt._p2p_once, endpoint, ctx.rank, buffer, view, op_timeout_s)
        ops[f"{name}|{P2P}"] = bt.Op(run=p2p)
        if name == bt.RAW:
            continue
        if ctx.rank == 0:
            transfer = functools.partial(_donate, endpoint, offer, op_timeout_s)
            unchecked = functools.partial(_donate, endpoint, offer_unchecked, op_timeout_s)
        else:
            transfer = unchecked = functools.partial(_join, endpoint, targets, op_timeout_s)
        ops[f"{name}|{STATE}"] = bt.Op(run=transfer)
        if not shaped:
            ops[f"{name}|{NO_CHECKSUM}"] = bt.Op(run=functools.partial(_without_checksum, unchecked))
    row_errors = {f"{name}|{row}": error for name, error in errors.items() for row in (P2P, STATE, NO_CHECKSUM)}
    cpu: dict[str, list[float]] = {key: [] for key in ops}
    ops = {key: bt.Op(run=functools.partial(_cpu_timed, cpu[key], op.run)) for key, op in ops.items()}
    try:
        times = bt._measure(barrier, ops, reps, row_errors)
        return times, nbytes, {key: samples[1:] for key, samples in cpu.items()}  # less the warm-up
    finally:
        for endpoint in endpoints.values():
            endpoint.close()


def _cpu_timed(samples: list[float], run) -> None:
    """Run, and note the CPU seconds this process (all its threads, user and system) spent meanwhile."""
    start = time.process_time()
    run()
    samples.append(time.process_time() - start)


def _donate(transport, offer: StateOffer, timeout_s: float) -> None:
    send_state(transport, 1, offer, deadline=time.monotonic() + timeout_s)


def _join(transport, targets: dict[str, torch.Tensor], timeout_s: float) -> None:
    fetch = StateFetch(targets=targets)
    if not fetch.fetch(transport, 0, deadline=time.monotonic() + timeout_s) or fetch.num_corrupt:
        raise RuntimeError(f"state incomplete or corrupt ({fetch.num_corrupt} chunks failed their checksum)")
    targets.update(fetch.tensors)


def _zero_digests(views, piece_bytes: int) -> np.ndarray:
    return np.zeros(-(-sum(v.numel() for v in views) // piece_bytes), dtype=np.uint64)


def _without_checksum(transfer) -> None:
    digests = state_transfer._digests
    state_transfer._digests = _zero_digests
    try:
        transfer()
    finally:
        state_transfer._digests = digests


def measure_transfer(opts, factories: dict[str, Any], cfg: ModelConfig, label: str,
                     shaped: bool = False) -> tuple[dict[str, Any], int, dict[str, float]]:
    bt.progress(f"live transfer of the {label} state{' over shaped links' if shaped else ''}: 2 processes ...")
    start = time.monotonic()
    try:
        per_rank = run_group(2, body_transfer, factory=None,
                             args=(factories, cfg, opts.reps, opts.op_timeout, shaped), timeout_s=opts.group_timeout)
    except AssertionError as e:  # the whole group failed or hung: every row of it is "failed"
        bt.progress(f"{label}: group failed: {str(e).strip().splitlines()[-1][:200]}")
        return {"*": f"group failed: {str(e).strip().splitlines()[0][:160]}"}, 0, {}
    bt.progress(f"{label}: done in {time.monotonic() - start:.0f}s")
    donor_cpu, joiner_cpu = per_rank[0][2], per_rank[1][2]
    cpu = {key: statistics.median(d + j for d, j in zip(donor_cpu[key], joiner_cpu[key], strict=False))
           for key in donor_cpu if donor_cpu[key] and joiner_cpu.get(key)}
    return bt.collect([times for times, _, _ in per_rank]), per_rank[0][1], cpu


def row_seconds(results: dict[str, Any], factories: dict[str, Any], name: str, row: str) -> Any:
    """Seconds per rep of one transport's row, or why it has none (not installed, the group failed, not measured)."""
    if isinstance(factories.get(name), str):
        return factories[name]
    return results.get("*", results.get(f"{name}|{row}", "not measured"))


def section_transfer(opts, models: dict[str, ModelConfig], targets: list[str]) -> str:
    factories = bt.transport_factories(opts.names)
    available = {k: v for k, v in factories.items() if not isinstance(v, str)}
    header = ["state", "transport", "p2p GB/s", "state transfer GB/s", "transfer / p2p", "no checksum GB/s",
              "no checksum / p2p", "p2p / raw socket", "CPU core-s: p2p / transfer / no checksum"]
    rows = []
    for label, cfg in models.items():
        results, nbytes, cpu = measure_transfer(opts, available, cfg, label)
        size = f"{label}, {nbytes / 1e6:.1f} MB" if nbytes else label

        raw = row_seconds(results, factories, bt.RAW, P2P)
        rows.append([size, bt.RAW, bt.fmt(bt.make_cell(raw, raw, nbytes / 1e9))[0], "-", "-", "-", "-", "1.00",
                     cpu_text(cpu, bt.RAW, (P2P,))])
        for name in opts.names:
            p2p = row_seconds(results, factories, name, P2P)
            cells = [bt.make_cell(row_seconds(results, factories, name, row), p2p, nbytes / 1e9)
                     for row in (STATE, NO_CHECKSUM)]
            rows.append([size, name, bt.fmt(bt.make_cell(p2p, None, nbytes / 1e9))[0], *bt.fmt(cells[0]),
                         *bt.fmt(cells[1]), bt.fmt(bt.make_cell(p2p, raw, nbytes / 1e9))[1],
                         cpu_text(cpu, name, (P2P, STATE, NO_CHECKSUM))])
            targets.append(bt.verdict(f"live transfer over {name} >= 0.80 x its p2p ceiling, {size}", cells[0],
                                      lambda c: c.ratio >= 0.80, "x p2p"))
        gc.collect()
    return (f"### Live state transfer (2 processes, donor -> joiner on loopback; reps {opts.reps})\n\n"
            + bt.table(header, rows) + "\n\nState: DiLoCo theta and momentum (shared) and the donor's AdamW state "
            f"(own), in chunks of {state_transfer.CHUNK_BYTES >> 20} MiB (a state under "
            f"{state_transfer.MIN_CHUNKS} of those in {state_transfer.MIN_CHUNKS} chunks). p2p: one "
            "`transport.send` of one buffer of the same size. Ratios: medians of per-rep ratios (\"p2p / raw "
            "socket\": the raw socket's time / the p2p time). CPU core-s: median CPU seconds of the donor and the "
            "joiner together (user and system, all threads); where every core is busy, throughput follows it. The "
            "checksum (XXH3-64) on one core, over "
            f"512 MiB: {checksum_rate():.2f} GB/s.")


def section_shaped_transfer(opts, models: dict[str, ModelConfig], targets: list[str]) -> str:
    """The live transfer over tcp and zmq links shaped to --rate-gbps: the network, not this machine's two
    cores, is then the bottleneck, as on the WAN links live recovery is for."""
    names = tuple(n for n in opts.names if n != "gloo")
    if not names or opts.rate_gbps <= 0:
        return ""
    shaping = LinkShaping(rate_bps=opts.rate_gbps * 1e9)
    factories = bt.transport_factories(names, shaping)
    available = {k: v for k, v in factories.items() if not isinstance(v, str)}
    rate = f"{opts.rate_gbps:g} Gbit/s"
    header = ["state", "transport", "link GB/s", "p2p GB/s", "state transfer GB/s", "transfer / p2p",
              "CPU core-s: p2p / transfer"]
    rows = []
    for label, cfg in models.items():
        results, nbytes, cpu = measure_transfer(opts, available, cfg, label, shaped=True)
        size = f"{label}, {nbytes / 1e6:.1f} MB" if nbytes else label
        for name in names:
            p2p, state = (row_seconds(results, factories, name, row) for row in (P2P, STATE))
            cell = bt.make_cell(state, p2p, nbytes / 1e9)
            rows.append([size, name, f"{opts.rate_gbps / 8:.3f}", bt.fmt(bt.make_cell(p2p, None, nbytes / 1e9))[0],
                         *bt.fmt(cell), cpu_text(cpu, name, (P2P, STATE))])
            targets.append(bt.verdict(f"live transfer over {name} shaped to {rate} >= 0.80 x its shaped p2p, {size}",
                                      cell, lambda c: c.ratio >= 0.80, "x p2p"))
        gc.collect()
    return (f"### Live state transfer over links shaped to {rate} (2 processes on loopback; reps {opts.reps})\n\n"
            + bt.table(header, rows) + f"\n\nThe same transfer and p2p rows as above, every link shaped to {rate} "
            "(`LinkShaping`, the transports' own pacing; gloo cannot shape): the link, not the CPU, is the "
            "bottleneck, so the checksums and the protocol's round trips overlap the wire time.")


def cpu_text(cpu: dict[str, float], name: str, rows: tuple[str, ...]) -> str:
    return " / ".join(f"{cpu[f'{name}|{row}']:.3f}" if f"{name}|{row}" in cpu else "-" for row in rows)


def checksum_rate(nbytes: int = 512 << 20, reps: int = 3) -> float:
    """GB/s of state_transfer's chunk digests (XXH3-64 of its 1 MiB pieces) on one core over a buffer far larger
    than the caches, chunk by chunk as state_transfer does."""
    data = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(0)).view(torch.uint8).numpy()
    step = state_transfer.CHUNK_BYTES
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for i in range(0, nbytes, step):
            state_transfer._digests([torch.from_numpy(data[i:i + step])], digest.PIECE_BYTES)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the debug model only, fewer reps (a smoke test)")
    parser.add_argument("--reps", type=int, default=None, help="counted repetitions (default 5; 2 with --quick)")
    parser.add_argument("--out", default=None, help="also write the markdown tables to this file")
    parser.add_argument("--transports", default=",".join(bt.TRANSPORTS),
                        help=f"comma-separated subset of {','.join(bt.TRANSPORTS)}")
    parser.add_argument("--rate-gbps", type=float, default=1.0,
                        help="link rate of the shaped live-transfer rows in Gbit/s (0: skip them)")
    parser.add_argument("--op-timeout", type=float, default=300.0, help="deadline of one timed operation (s)")
    parser.add_argument("--group-timeout", type=float, default=1200.0, help="bound on one group of processes (s)")
    opts = parser.parse_args(argv)
    opts.reps = opts.reps or (2 if opts.quick else 5)
    if opts.reps < 1:
        parser.error("--reps must be at least 1")
    opts.names = tuple(n for n in opts.transports.split(",") if n)
    if set(opts.names) - set(bt.TRANSPORTS):
        parser.error(f"unknown transports {sorted(set(opts.names) - set(bt.TRANSPORTS))}; choose from {bt.TRANSPORTS}")
    opts.models = {"debug": MODELS["debug"]} if opts.quick else MODELS
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    torch.set_num_threads(1)
    started = time.monotonic()
    load_before = os.getloadavg()
    targets: list[str] = []
    sections = [section_saves(opts, opts.models), section_transfer(opts, opts.models, targets),
                section_shaped_transfer(opts, opts.models, targets)]
    sections = [section for section in sections if section]
    load_after = os.getloadavg()
    loads = f"load average {' '.join(f'{x:.2f}' for x in load_before)} before, " \
            f"{' '.join(f'{x:.2f}' for x in load_after)} after"
    bt.write_report("bench_ckpt.py", argv, started, sections, targets, opts.out, setting=loads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
