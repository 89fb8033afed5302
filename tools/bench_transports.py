"""Benchmark of the transports on loopback, side by side in one run: point-to-point and ring all-reduce.

What it measures (every number a median over repetitions, each timed on every rank after a barrier, the
slowest rank counting):

1. Point-to-point throughput of one large message (64 MiB and 256 MiB) from rank 0 to rank 1 over each
   transport (gloo, tcp, zmq), beside the raw-socket ceiling: plain `socket.sendall` / `recv_into` on
   one TCP connection between the same two processes. GB/s is 1e9 bytes per second. A second raw row
   stripes the message over as many plain connections as tcp and zmq use (`num_connections`, 4), since
   on loopback several connections can beat one.
2. Ring all-reduce bus bandwidth (the NCCL convention, busbw = 2(n-1)/n * bytes / time) of a 64 MiB
   fp32 tensor for 2 and 4 processes: `openprime.core.collectives.ring_all_reduce` over each transport,
   beside Gloo's own `allreduce` on a separate ProcessGroupGloo ("gloo native"). Each transport also
   has an int8 row: the same ring with `codec=Int8Codec()` (openprime.kernels, INTELLECT-1's int8
   compression), its busbw counted in fp32-equivalent bytes (those of the fp32 tensor, although it
   sends about a quarter of them) so that the rows compare, and its speed-up over the fp32 ring on the
   same transport (fp32 time / int8 time, in the same repetition).
3. The same ring all-reduces (32 MiB, fp32 and int8) with every link shaped to 1 Gbit/s
   (`LinkShaping(rate_bps=1e9)`, tcp and zmq only; gloo cannot shape). A ring of n over links of rate R
   has a busbw of about R (about 4R for int8, counted in fp32 bytes). One message over one shaped link
   ("p2p") is shown beside it, to tell the pacing's accuracy apart from the ring's own overheads.

Side by side: for each table and group size, one set of processes builds every transport (each on its
own rendezvous prefix) and each repetition runs every row back to back, in a rotating order, so the
rows share the machine's noise. A barrier on the rendezvous store (not on any transport) starts every
timed operation. The first repetition is a warm-up (connections, page faults) and is not counted.
Every all-reduce row starts from the same input, copied in before the start barrier: per-rank standard
normal values (seeded by rank), so that the int8 quantizer sees realistic data.

Run (from the repository root, with the repository's virtual environment):

    .venv/bin/python tools/bench_transports.py                 # full run, about 2 minutes on 2 cores
    .venv/bin/python tools/bench_transports.py --quick         # smoke test, smaller sizes, under a minute
    .venv/bin/python tools/bench_transports.py --reps 9 --out bench.md --transports tcp,zmq

Reading the tables: "median (min-max)" is over the counted repetitions. A ratio column is the median
over repetitions of the per-repetition ratio to the reference row measured in that same repetition
(raw socket, Gloo native, the shaped link rate, or the fp32 ring on the same transport), which cancels
most of a shared machine's drift; it is therefore close to, but not exactly, the ratio of the two
medians shown. The targets of the issue are checked at the end: tcp and zmq at >= 80% of the raw
ceiling for 64 MiB; ring all-reduce over tcp/zmq at least as fast as Gloo's native all-reduce for 2
processes; shaped busbw within 10% of the link rate; the int8 ring at least 3.5x faster than the fp32
ring under shaping, and no slower than it on unshaped loopback (the overlap must hide the
quantization). A transport that cannot be imported (zmq not installed) gets a "not installed" row, and
one that fails gets a "failed" row (openprime.kernels missing: the int8 rows say "not installed"); the
run goes on.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import torch

from openprime.core.collectives import RingBuffers, ring_all_reduce
from openprime.core.distributed import connect_store, gloo_group
from openprime.core.shaping import LinkShaping
from openprime.core.streams import StreamTransportConfig
from openprime.core.testing import GroupContext, run_group

MiB = 1 << 20
RAW = "raw socket"
RAW_STRIPED = "raw socket x{k} (striped)"
NATIVE = "gloo native"
INT8 = "|int8"  # suffix of a transport's int8 ring row
TRANSPORTS = ("gloo", "tcp", "zmq")

# ---------------------------------------------------------------- factories (picklable, built in the parent)


def transport_factories(names: tuple[str, ...], shaping: LinkShaping | None = None) -> dict[str, Any]:
    """name -> picklable TransportFactory, or a string saying why it is unavailable ("not installed")."""
    out: dict[str, Any] = {}
    for name in names:
        try:
            out[name] = _factory(name, shaping)
        except ImportError as e:
            out[name] = f"not installed ({e.name or e})"
        except Exception as e:  # a package mid-edit must not stop the other rows
            out[name] = f"failed to load ({_describe(e)})"
    return out


def _factory(name: str, shaping: LinkShaping | None):
    if name == "gloo":
        from openprime.transports.gloo import create_gloo_transport

        return create_gloo_transport
    if name == "tcp":
        from openprime.transports.tcp import create_tcp_transport

        config = StreamTransportConfig(shaping=shaping or LinkShaping())
        return functools.partial(create_tcp_transport, config=config)
    if name == "zmq":
        import openprime.transports.zmq as zmq_transport

        # The zmq package may name its config class itself; it takes the stream transports' settings.
        config_cls = getattr(zmq_transport, "ZmqTransportConfig", StreamTransportConfig)
        config = config_cls(shaping=shaping or LinkShaping())
        return functools.partial(zmq_transport.create_zmq_transport, config=config)
    raise ValueError(f"unknown transport {name!r}")


# ---------------------------------------------------------------- inside the group's processes


class StoreBarrier:
    """A barrier on the rendezvous store that also tells whether every rank's last operation succeeded."""

    def __init__(self, ctx: GroupContext, timeout_s: float) -> None:
        self.store = connect_store(ctx.rendezvous, timeout_s, suffix="/bench")
        self.world_size = ctx.world_size
        self.count = 0

    def wait(self, ok: bool = True) -> bool:
        self.count += 1
        key = f"barrier/{self.count}"
        if not ok:
            self.store.add(f"{key}/failed", 1)
        if self.store.add(f"{key}/arrived", 1) == self.world_size:
            self.store.set(f"{key}/go", b"1")
        self.store.wait([f"{key}/go"])
        return self.store.add(f"{key}/failed", 0) == 0


@attrs.frozen
class Op:
    """One timed operation of a row: `prepare` runs before the start barrier, `run` is timed."""

    run: Callable[[], None]
    prepare: Callable[[], None] = lambda: None


def _build_endpoints(ctx: GroupContext, barrier: StoreBarrier, factories: dict[str, Any],
                     extra: dict[str, Callable[[], Any]]) -> tuple[dict[str, Any], dict[str, str]]:
    """Build every row's endpoint in the same order on every rank; a row that fails anywhere is dropped."""
    built: dict[str, Any] = {}
    errors: dict[str, str] = {}
    makers: dict[str, Callable[[], Any]] = dict(extra)
    for name, factory in factories.items():
        rendezvous = attrs.evolve(ctx.rendezvous, group=f"{ctx.rendezvous.group}/{name}")
        makers[name] = functools.partial(factory, rendezvous, ctx.rank, ctx.world_size)
    for name, make in makers.items():
        try:
            built[name] = make()
            error = None
        except Exception as e:  # reported as a "failed" row; the other rows go on
            error = _describe(e)
        if not barrier.wait(ok=error is None):
            errors[name] = error or "failed on another rank"
            endpoint = built.pop(name, None)
            if endpoint is not None and hasattr(endpoint, "close"):
                endpoint.close()
    return built, errors


def _measure(barrier: StoreBarrier, ops: dict[str, Op], reps: int, errors: dict[str, str]) -> dict[str, Any]:
    """Seconds per counted repetition for each row (this rank), or the error that dropped the row."""
    times: dict[str, list[float]] = {name: [] for name in ops}
    names = list(ops)
    for rep in range(reps + 1):
        shift = rep % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            if name in errors:
                continue
            ops[name].prepare()
            barrier.wait()
            start = time.perf_counter()
            error = None
            try:
                ops[name].run()
            except Exception as e:  # the row is dropped on every rank at the next barrier
                error = _describe(e)
            elapsed = time.perf_counter() - start
            if not barrier.wait(ok=error is None):
                errors[name] = error or "failed on another rank"
            elif rep > 0:
                times[name].append(elapsed)
    return {name: errors.get(name, times.get(name)) for name in list(ops) + list(errors)}


def _describe(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:160] if lines else ''}"


class RawLink:
    """Plain TCP connections from rank 0 to rank 1 (rank 1 publishes its port in the store).

    With one connection this is the raw-socket ceiling of the table; with several, a message is cut
    into equal stripes sent in parallel, as the stream transports do with `num_connections`.
    """

    def __init__(self, ctx: GroupContext, timeout_s: float, connections: int = 1) -> None:
        store = connect_store(ctx.rendezvous, timeout_s, suffix=f"/raw{connections}")
        if ctx.rank == 1:
            with socket.create_server(("127.0.0.1", 0)) as listener:
                listener.settimeout(timeout_s)
                store.set("port", str(listener.getsockname()[1]))
                accepted = [listener.accept()[0] for _ in range(connections)]
            # Stripes are matched to connections by the index each connection sends first.
            self.socks: list[socket.socket] = [None] * connections  # type: ignore[list-item]
            for sock in accepted:
                sock.settimeout(timeout_s)
                self.socks[_recv_exact(sock, 1)[0]] = sock
        else:
            store.wait(["port"])
            self.socks = []  # type: ignore[misc]
            for i in range(connections):
                sock = socket.create_connection(("127.0.0.1", int(store.get("port"))), timeout=timeout_s)
                sock.settimeout(timeout_s)
                sock.sendall(bytes([i]))
                self.socks.append(sock)
        self.pool = ThreadPoolExecutor(connections) if connections > 1 else None

    def _striped(self, fn: Callable[[socket.socket, memoryview], None], view: memoryview) -> None:
        if self.pool is None:
            fn(self.socks[0], view)
            return
        step = -(-len(view) // len(self.socks))
        futures = [self.pool.submit(fn, sock, view[i * step:(i + 1) * step]) for i, sock in enumerate(self.socks)]
        for future in futures:
            future.result()

    def send(self, view: memoryview) -> None:
        self._striped(socket.socket.sendall, view)

    def recv(self, view: memoryview) -> None:
        self._striped(_recv_into, view)

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        if self.pool is not None:
            self.pool.shutdown()


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"raw connection closed after {got} of {len(view)} bytes")
        got += n


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def body_p2p(_transport, ctx: GroupContext, factories: dict[str, Any], sizes: list[int], reps: int,
             op_timeout_s: float, raw_connections: int) -> dict[str, Any]:
    """Rank 0 sends one message of each size to rank 1 over every row; returns {"row|size": seconds}."""
    barrier = StoreBarrier(ctx, op_timeout_s)
    raw_rows = {RAW: lambda: RawLink(ctx, op_timeout_s)} if raw_connections > 0 else {}  # 0: no raw rows
    if raw_connections > 1:
        raw_rows[RAW_STRIPED.format(k=raw_connections)] = lambda: RawLink(ctx, op_timeout_s, raw_connections)
    endpoints, errors = _build_endpoints(ctx, barrier, factories, raw_rows)
    buffers = {n: torch.ones(n, dtype=torch.uint8) if ctx.rank == 0 else torch.empty(n, dtype=torch.uint8)
               for n in sizes}
    views = {n: memoryview(buffers[n].numpy()).cast("B") for n in sizes}
    ops: dict[str, Op] = {}
    for name, endpoint in endpoints.items():
        for n in sizes:
            ops[f"{name}|{n}"] = Op(run=functools.partial(_p2p_once, endpoint, ctx.rank, buffers[n], views[n],
                                                          op_timeout_s))
    row_errors = {f"{name}|{n}": error for name, error in errors.items() for n in sizes}
    try:
        return _measure(barrier, ops, reps, row_errors)
    finally:
        for endpoint in endpoints.values():
            endpoint.close()


def _p2p_once(endpoint, rank: int, buffer: torch.Tensor, view: memoryview, timeout_s: float) -> None:
    if isinstance(endpoint, RawLink):
        (endpoint.send if rank == 0 else endpoint.recv)(view)
        return
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        endpoint.send(1, 21, [buffer], deadline=deadline)
    else:
        endpoint.recv(0, 21, [buffer], deadline=deadline)


class NativeGloo:
    """Gloo's own all-reduce on a ProcessGroupGloo of its own (the reference of the all-reduce tables)."""

    def __init__(self, ctx: GroupContext, timeout_s: float) -> None:
        store = connect_store(ctx.rendezvous, timeout_s, suffix="/native")
        self.pg = gloo_group(store, ctx.rank, ctx.world_size, timeout_s=timeout_s)

    def close(self) -> None:
        self.pg = None


def body_all_reduce(_transport, ctx: GroupContext, factories: dict[str, Any], numel: int, reps: int,
                    op_timeout_s: float, with_native: bool, with_int8: bool = True) -> dict[str, Any]:
    """Sum one fp32 tensor of `numel` over the group with every row; returns {row: seconds per rep}.

    Rows: each transport's fp32 ring (its name), its int8 ring (name + INT8) when `with_int8`, and Gloo's
    native all-reduce when `with_native`.
    """
    barrier = StoreBarrier(ctx, op_timeout_s)
    extra = {NATIVE: lambda: NativeGloo(ctx, op_timeout_s)} if with_native else {}
    endpoints, errors = _build_endpoints(ctx, barrier, factories, extra)
    int8_codec, int8_error = _int8_codec() if with_int8 else (None, None)
    # Every row of every rep starts from the same values (so repeated sums never overflow, and the
    # quantizer always sees the same realistic data): a pristine copy, copied in before the barrier.
    pristine = torch.randn(numel, generator=torch.Generator().manual_seed(ctx.rank), dtype=torch.float32)
    tensor = torch.empty_like(pristine)
    prepare = functools.partial(tensor.copy_, pristine)
    ops: dict[str, Op] = {}
    for name, endpoint in endpoints.items():
        if isinstance(endpoint, NativeGloo):
            ops[name] = Op(run=functools.partial(_native_once, endpoint, tensor), prepare=prepare)
            continue
        ops[name] = Op(run=functools.partial(_ring_once, endpoint, tensor, op_timeout_s, None, RingBuffers()),
                       prepare=prepare)
        if int8_codec is not None:
            ops[name + INT8] = Op(run=functools.partial(_ring_once, endpoint, tensor, op_timeout_s, int8_codec,
                                                        RingBuffers()), prepare=prepare)
    if with_int8:
        for name in factories:
            if name in errors or int8_error is not None:
                errors[name + INT8] = errors.get(name) or int8_error
    try:
        return _measure(barrier, ops, reps, errors)
    finally:
        for endpoint in endpoints.values():
            endpoint.close()


def _native_once(native: NativeGloo, tensor: torch.Tensor) -> None:
    native.pg.allreduce([tensor]).wait()


def _ring_once(transport, tensor: torch.Tensor, timeout_s: float, codec: Any = None,
               buffers: RingBuffers | None = None) -> None:
    # In place without a backup copy and with receive buffers kept from one call to the next, as DiLoCo
    # calls it (it recomputes its input after a failure; it keeps its RingBuffers), and as Gloo's native
    # all-reduce works. No codec: ring_all_reduce's default, fp32.
    kwargs = {} if codec is None else {"codec": codec}
    ring_all_reduce(transport, tensor, deadline=time.monotonic() + timeout_s, restore_on_failure=False,
                    buffers=buffers, **kwargs)


def _int8_codec() -> tuple[Any, str | None]:
    """(Int8Codec(), None), or (None, why the int8 rows cannot run)."""
    try:
        from openprime.kernels import Int8Codec
    except ImportError as e:
        return None, f"not installed ({e.name or e})"
    except Exception as e:  # a package mid-edit must not stop the fp32 rows
        return None, f"failed to load ({_describe(e)})"
    return Int8Codec(), None


# ---------------------------------------------------------------- in the parent: run, reduce, print


def collect(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per row: the slowest rank's seconds for each counted rep, or the row's error."""
    out: dict[str, Any] = {}
    for name in per_rank[0]:
        values = [rank_result[name] for rank_result in per_rank]
        errors = [v for v in values if isinstance(v, str)]
        out[name] = errors[0] if errors else [max(rep) for rep in zip(*values, strict=True)]
    return out


def run_measurement(label: str, num_procs: int, body: Callable, args: tuple, timeout_s: float) -> dict[str, Any]:
    progress(f"{label}: {num_procs} processes ...")
    start = time.monotonic()
    try:
        result = collect(run_group(num_procs, body, factory=None, args=args, timeout_s=timeout_s))
    except AssertionError as e:  # the whole group failed or hung: every row of it is "failed"
        progress(f"{label}: group failed: {str(e).strip().splitlines()[-1][:200]}")
        return {"*": f"group failed: {str(e).strip().splitlines()[0][:160]}"}
    progress(f"{label}: done in {time.monotonic() - start:.0f}s")
    return result


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@attrs.frozen
class Cell:
    """One measured row against its reference: rates per rep, and per-rep ratios."""

    rates: list[float]
    ratios: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.rates)

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios) if self.ratios else float("nan")

    def text(self, unit_scale: float = 1.0) -> str:
        return f"{self.median * unit_scale:.2f} ({min(self.rates) * unit_scale:.2f}-{max(self.rates) * unit_scale:.2f})"


def make_cell(seconds: Any, reference: Any, work: float, reference_rate: float | None = None) -> Cell | str:
    """Rates (`work` / seconds) and ratios to the reference row's same-rep rate (or to a fixed rate)."""
    if isinstance(seconds, str):
        return seconds
    rates = [work / s for s in seconds]
    if reference_rate is not None:
        ratios = [r / reference_rate for r in rates]
    elif isinstance(reference, list) and len(reference) == len(seconds):
        ratios = [ref_s / s for s, ref_s in zip(seconds, reference, strict=True)]
    else:
        ratios = []
    return Cell(rates, ratios)


def speedup_cell(int8_seconds: Any, fp32_seconds: Any) -> Cell | str:
    """The int8 row against the fp32 row of the same transport: ratios fp32 time / int8 time, per rep."""
    if isinstance(fp32_seconds, str) and not isinstance(int8_seconds, str):
        return f"fp32 row: {fp32_seconds}"
    return make_cell(int8_seconds, fp32_seconds, 1.0)


def lookup(results: dict[str, Any], key: str, unavailable: dict[str, Any], name: str) -> Any:
    if isinstance(unavailable.get(name), str):
        return unavailable[name]
    if "*" in results:
        return results["*"]
    return results.get(key, "not measured")


def fmt(cell: Cell | str, scale: float = 1.0) -> tuple[str, str]:
    if isinstance(cell, str):
        return (cell, "-")
    return (cell.text(scale), "-" if cell.ratio != cell.ratio else f"{cell.ratio:.2f}")


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def size_label(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes % MiB == 0 else f"{nbytes} B"


# ---------------------------------------------------------------- the three sections


def section_p2p(opts, names: tuple[str, ...], targets: list[str]) -> str:
    factories = transport_factories(names)
    available = {k: v for k, v in factories.items() if not isinstance(v, str)}
    striped = RAW_STRIPED.format(k=opts.connections)
    results = run_measurement(f"point-to-point {', '.join(size_label(n) for n in opts.p2p_sizes)}", 2, body_p2p,
                              (available, opts.p2p_sizes, opts.reps, opts.op_timeout_s, opts.connections),
                              opts.group_timeout_s)
    header = ["transport"]
    for n in opts.p2p_sizes:
        header += [f"{size_label(n)} GB/s", "x raw"]
    rows = []
    cells: dict[tuple[str, int], Cell | str] = {}
    for name in (RAW, *([striped] if opts.connections > 1 else []), *names):
        row = [name]
        for n in opts.p2p_sizes:
            raw = lookup(results, f"{RAW}|{n}", {}, RAW)
            cell = make_cell(lookup(results, f"{name}|{n}", factories, name), raw, n / 1e9)
            if name == RAW and isinstance(cell, Cell):
                cell = Cell(cell.rates, [1.0] * len(cell.rates))
            cells[name, n] = cell
            row += list(fmt(cell))
        rows.append(row)
    target_n = 64 * MiB if 64 * MiB in opts.p2p_sizes else max(opts.p2p_sizes)
    for name in ("zmq", "tcp"):
        if name in names:
            targets.append(verdict(f"point-to-point {name} >= 0.80 x raw at {size_label(target_n)}",
                                   cells[name, target_n], lambda c: c.ratio >= 0.80, "x raw"))
    return (f"### Point-to-point throughput (2 processes, one message rank 0 -> rank 1; reps {opts.reps})\n\n"
            + table(header, rows) + f"\n\n\"{RAW}\" is the reference (one connection). tcp and zmq stripe large "
            f"messages over {opts.connections} connections (StreamTransportConfig.num_connections); \"{striped}\" "
            "is plain sockets doing the same, for comparison.")


def section_all_reduce(opts, names: tuple[str, ...], targets: list[str]) -> str:
    factories = transport_factories(names)
    available = {k: v for k, v in factories.items() if not isinstance(v, str)}
    nbytes = opts.ar_numel * 4
    per_n = {}
    for n in opts.world_sizes:
        per_n[n] = run_measurement(f"ring all-reduce {size_label(nbytes)} fp32 and int8", n, body_all_reduce,
                                   (available, opts.ar_numel, opts.reps, opts.op_timeout_s, True, True),
                                   opts.group_timeout_s)
    header = ["all-reduce"]
    for n in opts.world_sizes:
        header += [f"n={n} busbw GB/s", "x gloo native", "int8 speed-up (x fp32 ring)"]
    rows = []
    cells: dict[tuple[str, int], Cell | str] = {}
    speedups: dict[tuple[str, int], Cell | str] = {}
    for name in (NATIVE, *names, *(name + INT8 for name in names)):
        transport = name.removesuffix(INT8)
        label = NATIVE if name == NATIVE else f"{'int8' if name.endswith(INT8) else 'fp32'} ring over {transport}"
        row = [label]
        for n in opts.world_sizes:
            work = 2 * (n - 1) / n * nbytes / 1e9  # fp32-equivalent bytes for the int8 rows too
            native = lookup(per_n[n], NATIVE, {}, NATIVE)
            seconds = lookup(per_n[n], name, factories, transport)
            cell = make_cell(seconds, native, work)
            cells[name, n] = cell
            row += list(fmt(cell))
            if name.endswith(INT8):
                speedups[transport, n] = speedup_cell(seconds, lookup(per_n[n], transport, factories, transport))
                row.append(fmt(speedups[transport, n])[1])
            else:
                row.append("-")
        rows.append(row)
    if 2 in opts.world_sizes:
        for name in ("tcp", "zmq"):
            if name in names:
                targets.append(verdict(f"ring over {name} >= gloo native all-reduce, n=2", cells[name, 2],
                                       lambda c: c.ratio >= 1.0, "x gloo native"))
    for name in names:
        for n in opts.world_sizes:
            targets.append(verdict(f"int8 ring over {name} on unshaped loopback no slower than the fp32 ring, n={n}",
                                   speedups[name, n], lambda c: c.ratio >= 1.0, "x fp32 ring"))
    return (f"### Ring all-reduce, {size_label(nbytes)} fp32 input, unshaped loopback (reps {opts.reps})\n\n"
            + table(header, rows) + "\n\n" + INT8_NOTE)


INT8_NOTE = (
    "int8 rows: `ring_all_reduce(..., codec=Int8Codec(), restore_on_failure=False)` on the same transport and "
    "input as the fp32 row; their busbw is in fp32-equivalent terms (the bytes of the fp32 tensor, although "
    "the int8 ring sends about a quarter of them), so the rows compare. \"int8 speed-up\": fp32 ring time / "
    "int8 ring time on the same transport, per repetition (> 1: int8 faster). Input: per-rank standard normal "
    "values, copied in before each timed operation.")


def section_shaped(opts, names: tuple[str, ...], targets: list[str]) -> str:
    shaped = tuple(n for n in names if n != "gloo")
    if not shaped or opts.rate_bps <= 0:  # gloo cannot shape; --rate-gbps 0 asks for no shaped rows
        return ""
    shaping = LinkShaping(rate_bps=opts.rate_bps)
    factories = transport_factories(shaped, shaping)
    available = {k: v for k, v in factories.items() if not isinstance(v, str)}
    nbytes = opts.shaped_numel * 4
    rate = f"{opts.rate_bps / 1e9:g} Gbit/s"
    # The link alone (one message, no ring) tells the pacing's own shortfall apart from the ring's.
    p2p = run_measurement(f"shaped point-to-point {size_label(nbytes)} at {rate}", 2, body_p2p,
                          (available, [nbytes], opts.reps, opts.op_timeout_s, 0), opts.group_timeout_s)
    per_n = {}
    for n in opts.world_sizes:
        per_n[n] = run_measurement(f"shaped ring all-reduce {size_label(nbytes)} at {rate}", n, body_all_reduce,
                                   (available, opts.shaped_numel, opts.reps, opts.op_timeout_s, False, True),
                                   opts.group_timeout_s)
    header = ["ring", "p2p Gbit/s", "x link"]
    for n in opts.world_sizes:
        header += [f"ring n={n} busbw Gbit/s", "x link", "int8 speed-up (x fp32 ring)"]
    rows = []
    link_gbps = opts.rate_bps / 1e9
    int8_targets = []
    for name in (*shaped, *(name + INT8 for name in shaped)):
        transport = name.removesuffix(INT8)
        if name.endswith(INT8):
            row = [f"int8 over {transport}", "-", "-"]  # the link alone is the fp32 row's
        else:
            cell = make_cell(lookup(p2p, f"{name}|{nbytes}", factories, name), None, nbytes * 8 / 1e9, link_gbps)
            row = [f"fp32 over {transport}", *fmt(cell)]
        for n in opts.world_sizes:
            work = 2 * (n - 1) / n * nbytes * 8 / 1e9  # fp32-equivalent bits for the int8 rows too
            seconds = lookup(per_n[n], name, factories, transport)
            cell = make_cell(seconds, None, work, link_gbps)
            row += list(fmt(cell))
            if name.endswith(INT8):
                speedup = speedup_cell(seconds, lookup(per_n[n], transport, factories, transport))
                row.append(fmt(speedup)[1])
                int8_targets.append(verdict(f"int8 ring over {transport} under {rate} shaping >= 3.5x faster than "
                                            f"the fp32 ring, n={n}", speedup, lambda c: c.ratio >= 3.5,
                                            "x fp32 ring"))
            else:
                row.append("-")
                targets.append(verdict(f"shaped ring over {name} within 10% of the link, n={n}", cell,
                                       lambda c: abs(c.ratio - 1) <= 0.10, "x link"))
        rows.append(row)
    targets.extend(int8_targets)
    return (f"### Ring all-reduce, {size_label(nbytes)} fp32 input, every link shaped to {rate} (reps {opts.reps})"
            "\n\n" + table(header, rows) + f"\n\n\"p2p\": one {size_label(nbytes)} message over one shaped link, "
            "for reference. " + INT8_NOTE)


def verdict(what: str, cell: Cell | str, ok: Callable[[Cell], bool], unit: str) -> str:
    if isinstance(cell, str):
        return f"- {what}: not measured ({cell})"
    return f"- {what}: {'met' if ok(cell) else 'NOT met'} ({cell.ratio:.2f} {unit})"


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer reps (a smoke test)")
    parser.add_argument("--reps", type=int, default=None, help="counted repetitions (default 5; 3 with --quick)")
    parser.add_argument("--out", default=None, help="also write the markdown tables to this file")
    parser.add_argument("--transports", default=",".join(TRANSPORTS),
                        help=f"comma-separated subset of {','.join(TRANSPORTS)}")
    parser.add_argument("--world-sizes", default="2,4", help="group sizes of the all-reduce tables")
    parser.add_argument("--rate-gbps", type=float, default=1.0, help="shaped link rate in Gbit/s (0: skip the shaped "
                        "section, as in tools/bench_ckpt.py)")
    parser.add_argument("--op-timeout", type=float, default=120.0, help="deadline of one timed operation (s)")
    parser.add_argument("--group-timeout", type=float, default=900.0, help="bound on one group of processes (s)")
    opts = parser.parse_args(argv)
    opts.reps = opts.reps or (3 if opts.quick else 5)
    if opts.reps < 1:
        parser.error("--reps must be at least 1")
    if opts.rate_gbps < 0:
        parser.error("--rate-gbps must be >= 0 (0 skips the shaped section)")
    names = tuple(n for n in opts.transports.split(",") if n)
    unknown = set(names) - set(TRANSPORTS)
    if unknown:
        parser.error(f"unknown transports {sorted(unknown)}; choose from {TRANSPORTS}")
    opts.names = names
    opts.world_sizes = [int(n) for n in opts.world_sizes.split(",") if n]
    opts.rate_bps = opts.rate_gbps * 1e9
    opts.op_timeout_s, opts.group_timeout_s = opts.op_timeout, opts.group_timeout
    opts.connections = StreamTransportConfig().num_connections
    opts.p2p_sizes = [16 * MiB, 64 * MiB] if opts.quick else [64 * MiB, 256 * MiB]
    opts.ar_numel = (16 if opts.quick else 64) * MiB // 4
    opts.shaped_numel = (8 if opts.quick else 32) * MiB // 4
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    torch.set_num_threads(1)
    started = time.monotonic()
    targets: list[str] = []
    sections = []
    for section in (section_p2p, section_all_reduce, section_shaped):
        try:
            sections.append(section(opts, opts.names, targets))
        except Exception:  # a bug in one section must not cost the others' numbers
            sections.append(f"### {section.__name__}: failed\n\n```\n{traceback.format_exc()}```")
    write_report("bench_transports.py", argv, started, sections, targets, opts.out, setting="loopback")
    return 0


def write_report(tool: str, argv: list[str] | None, started: float, sections: list[str], targets: list[str],
                 out: str | None, *, setting: str) -> None:
    """Print the tables after a line saying how, when and where they were measured; also write them to `out`."""
    command = f"python tools/{tool} " + " ".join(sys.argv[1:] if argv is None else argv)
    report = "\n\n".join([
        f"Command: `{command.strip()}`; {datetime.date.today().isoformat()}; {platform.node()}, "
        f"{_cpu_count()} cores, torch {torch.__version__}, {setting}; {time.monotonic() - started:.0f}s in all. "
        "Cells: median (min-max) over reps; ratios: median of per-rep ratios.",
        *(s for s in sections if s),
        "### Targets\n\n" + "\n".join(targets),
    ]) + "\n"
    print(report)
    if out:
        with open(out, "w") as f:
            f.write(report)


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


if __name__ == "__main__":
    sys.exit(main())
