"""Throughput of the int8 quantizer (openprime.kernels, paper section 2.2) beside a plain copy_.

For each tensor size and thread count: quantize_int8 and dequantize_add_ on the torch path, and
`y.copy_(x)` of the same fp32 tensor as the memory-bandwidth yardstick, timed in interleaved rounds so
that a noisy, shared machine slows all three alike. GB/s are of fp32 input (4 bytes an element); the
table shows medians and the ratio to copy_. On a machine with CUDA (and triton) the Triton path is timed
the same way against a CUDA copy_; without CUDA that part is skipped, and the output says so.

    python tools/bench_quant.py            # 64 and 256 MiB, one thread and all threads
    python tools/bench_quant.py --quick    # 64 MiB, fewer rounds
    python tools/bench_quant.py --native   # also the opt-in C++ path (builds it first: ~20 s once)
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from openprime.kernels import native_ops, torch_ops


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def time_rounds(fns: dict[str, Callable[[], object]], rounds: int, sync: Callable[[], None]) -> dict[str, tuple]:
    """(median wall seconds, median process CPU seconds) of each function, timed round-robin after a warm-up."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    sync()
    for _ in range(rounds):
        for name, fn in fns.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            sync()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    median = statistics.median
    return {name: (median(w for w, _ in ts), median(c for _, c in ts)) for name, ts in times.items()}


def bench_cpu(ops, numel: int, threads: int, rounds: int) -> dict[str, float]:
    """ops: torch_ops or native_ops."""
    x = torch.randn(numel)
    y = torch.empty_like(x)
    codes, codebook = ops.quantize_int8(x)
    acc = torch.zeros_like(x)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fns = {
            "copy_": lambda: y.copy_(x),
            "quantize": lambda: ops.quantize_int8(x),
            "dequantize_add_": lambda: ops.dequantize_add_(acc, codes, codebook),
        }
        return time_rounds(fns, rounds, sync=lambda: None)
    finally:
        torch.set_num_threads(previous)


def bench_triton(numel: int, rounds: int) -> dict[str, float]:
    from openprime.kernels import triton_ops

    x = torch.randn(numel, device="cuda")
    y = torch.empty_like(x)
    codes, codebook = triton_ops.quantize_int8(x)
    acc = torch.zeros_like(x)
    fns = {
        "copy_": lambda: y.copy_(x),
        "quantize": lambda: triton_ops.quantize_int8(x),
        "dequantize_add_": lambda: triton_ops.dequantize_add_(acc, codes, codebook),
    }
    return time_rounds(fns, rounds, sync=torch.cuda.synchronize)


def row(path: str, mib: int, threads: str, numel: int, medians: dict[str, tuple], cpu: bool) -> str:
    """GB/s of fp32 input by wall time, its ratio to copy_, and (CPU paths) GB/s per CPU-second used."""
    gbs = {name: 4 * numel / wall / 1e9 for name, (wall, _) in medians.items()}
    cells = [f"{gbs['copy_']:.2f}"]
    for name in ("quantize", "dequantize_add_"):
        cells.append(f"{gbs[name]:.2f} ({gbs[name] / gbs['copy_']:.2f}x)")
        cells.append(f"{4 * numel / medians[name][1] / 1e9:.2f}" if cpu else "-")
    return f"| {path} | {mib} MiB | {threads} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="64 MiB only, fewer rounds")
    parser.add_argument("--sizes-mib", type=int, nargs="+", help="tensor sizes in MiB of fp32 (default 64 256)")
    parser.add_argument("--rounds", type=int, help="timed rounds per measurement (default 7, quick 3)")
    parser.add_argument("--native", action="store_true",
                        help="also time the opt-in C++ path (openprime.kernels.native_ops; one thread a call)")
    args = parser.parse_args()
    native = None
    if args.native:
        started = time.perf_counter()
        native = native_ops.extension()
        build = f"built or loaded in {time.perf_counter() - started:.1f} s" if native else "could not be built"
        print(f"C++ path (native_ops): {build}")
    sizes = args.sizes_mib or ([64] if args.quick else [64, 256])
    rounds = args.rounds or (3 if args.quick else 7)
    all_threads = torch.get_num_threads()

    print(f"{datetime.date.today()} | {cpu_model()}, {os.cpu_count()} cores | torch {torch.__version__} | "
          f"load average {os.getloadavg()[0]:.2f} at start")
    print(f"GB/s of fp32 input, medians of {rounds} rounds; in brackets the ratio to copy_ timed alongside;")
    print("'per CPU-s': bytes per second of CPU time the process used (the per-core rate, robust to waiting)\n")
    print("| path | tensor | threads | copy_ | quantize | quantize per CPU-s | dequantize_add_ | deq.-add per CPU-s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for mib in sizes:
        numel = mib * (1 << 20) // 4
        for threads in sorted({1, all_threads}):
            label = str(threads) if threads == 1 else f"{threads} (all)"
            print(row("torch (CPU)", mib, label, numel, bench_cpu(torch_ops, numel, threads, rounds), cpu=True),
                  flush=True)
        if native is not None:
            print(row("C++ (CPU, opt-in)", mib, "1", numel, bench_cpu(native_ops, numel, 1, rounds), cpu=True),
                  flush=True)
    if torch.cuda.is_available():
        try:
            import triton  # noqa: F401

            for mib in sizes:
                numel = mib * (1 << 20) // 4
                print(row("Triton (CUDA)", mib, "-", numel, bench_triton(numel, rounds), cpu=False), flush=True)
        except ImportError:
            print("\nTriton path skipped: CUDA is present but triton is not installed.")
    else:
        print("\nTriton path skipped: no CUDA device here.")
    if native is None:
        print("\nThe opt-in C++ path (native_ops) is timed with --native; no torch.compile path is timed:")
        print("openprime.kernels has none (see kernels/README.md).")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
