"""The accelerators a run will use, checked against its config before anything is allocated.

A node runs `fsdp.num_local_ranks` processes, one per GPU (INTELLECT-1, section 2.2: FSDP2 inside each
node). Before a run starts, `check_hardware` makes sure that this machine shows that many GPUs and that
each can hold its share of the model (openprime.train.planner); on a machine without CUDA the ranks are
CPU processes and there is no device memory to check. `check_local_ranks` is also what a started process
calls with the local world size it was started with, so that a mesh of the wrong shape is a clear error
instead of a hang in the first collective. Several nodes started on one machine take blocks of its GPUs
(`device_blocks`, `least_used_block`): node k of R local ranks computes on GPUs [b * R, (b + 1) * R) of the
block b that the launcher gives it, and nodes past the machine's GPUs share blocks.
"""

from __future__ import annotations

import logging
import os

import torch

from openprime.core.errors import ConfigError
from openprime.fsdp import FSDPConfig
from openprime.train.config import RunConfig
from openprime.train.planner import GPU, GPUS, GiB, check_fits, device_gib, gpu_bytes

log = logging.getLogger("openprime.train")


def detect_device_type() -> str:
    """The device a run on this machine computes on: "cuda" when a GPU is visible, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def visible_gpu(num_devices: int = 1) -> GPU:
    """The smallest of the first `num_devices` visible CUDA devices, as the planner describes a GPU.

    Its memory is what the device reports; its peak FLOP/s is the planner's for a known model (`GPUS`: H100 SXM
    and PCIe, H200, A100) and 0 otherwise (unknown: `mfu_peak_flops` then reports no MFU, and the planner's
    memory checks do not need it).
    """
    count = min(num_devices, torch.cuda.device_count())
    if count < 1:
        raise ConfigError("no CUDA device is visible")
    props = min((torch.cuda.get_device_properties(i) for i in range(count)), key=lambda p: p.total_memory)
    name = props.name.lower().replace(" ", "-")  # "NVIDIA H100 PCIe" -> "nvidia-h100-pcie"
    known = next((gpu for key, gpu in GPUS.items() if key in name), None)
    return GPU(name=props.name, memory_bytes=props.total_memory, peak_flops=known.peak_flops if known else 0.0)


def mfu_peak_flops(configured: float, device_type: str) -> float:
    """The peak FLOP/s of one device that MFU is measured against: `metrics.peak_flops` when set, else the known
    GPU's; 0 (no MFU reported) on CPU and on a GPU the planner does not know, which says how to set it. Until
    2026-12-07 an unknown GPU was measured against an H100's 989 TFLOP/s: an L4's MFU read 0.12x its value."""
    if configured > 0 or device_type != "cuda":
        return configured
    gpu = visible_gpu()
    if gpu.peak_flops <= 0:
        log.warning("MFU is not reported: the peak FLOP/s of %s is not known here; --set metrics.peak_flops=... "
                    "(its dense bf16 FLOP/s from the data sheet) to report it", gpu.name)
    return gpu.peak_flops


def device_blocks(num_devices: int, num_local_ranks: int) -> int:
    """How many nodes of `num_local_ranks` processes this machine's `num_devices` GPUs hold side by side: block b
    is devices [b * R, (b + 1) * R). Nodes past that share blocks. 1 without a GPU (CPU processes share the cores)."""
    return max(1, num_devices // num_local_ranks)


def least_used_block(live: list[int], *, num_blocks: int) -> int:
    """The block for a node started now: the lowest of those the fewest live nodes use. Several nodes on one
    machine (`openprime run --nodes 8` on an 8-GPU machine) each get their own GPUs (before, every node computed
    on GPU 0); a replacement takes the block its dead predecessor left."""
    return min(range(num_blocks), key=lambda block: (live.count(block), block))


def check_local_ranks(fsdp: FSDPConfig, *, device_type: str, local_world_size: int | None = None) -> None:
    """Raise a ConfigError if the node's processes cannot form the mesh that `fsdp` asks for.

    On CUDA every local rank needs a GPU of its own, so `fsdp.num_local_ranks` may not exceed the visible
    devices. `local_world_size`, when given, is the number of local processes this one was started among
    (a launcher's or torchrun's LOCAL_WORLD_SIZE); it must equal `fsdp.num_local_ranks`.
    """
    ranks = fsdp.num_local_ranks
    if local_world_size is not None and local_world_size != ranks:
        raise ConfigError(f"this process was started as one of {local_world_size} local processes, but "
                          f"fsdp.num_local_ranks is {ranks}: start {ranks} processes per node, or "
                          f"--set fsdp.num_local_ranks={local_world_size}")
    if device_type == "cuda":
        visible = torch.cuda.device_count()
        if ranks > visible:
            shown = os.environ.get("CUDA_VISIBLE_DEVICES")
            which = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
            raise ConfigError(f"fsdp.num_local_ranks is {ranks}, but this machine shows {visible} CUDA "
                              f"device(s){which}, and every local rank needs one: --set "
                              f"fsdp.num_local_ranks={max(1, visible)} (if the batch still splits), or make "
                              f"more devices visible")


def check_hardware(cfg: RunConfig, *, num_nodes: int = 1, device_type: str | None = None) -> None:
    """Before a run starts: on CUDA, enough GPUs for the local ranks, and each one large enough for its share, or
    for the shares of the nodes that must share it when `num_nodes` nodes start on this machine.

    On CPU (no CUDA visible) nothing is checked: the ranks are processes and the memory is the host's.
    """
    device_type = device_type or detect_device_type()
    if device_type != "cuda":
        return
    ranks = cfg.fsdp.num_local_ranks
    check_local_ranks(cfg.fsdp, device_type=device_type)
    gpu = visible_gpu(ranks)
    check_fits(cfg, gpu, max_local_ranks=torch.cuda.device_count())
    num_devices, one = torch.cuda.device_count(), gpu_bytes(cfg)
    blocks = device_blocks(num_devices, ranks)
    per_gpu = -(-num_nodes // blocks)
    if per_gpu * one > gpu.memory_bytes:
        most = blocks * int(gpu.memory_bytes // one)
        raise ConfigError(f"{num_nodes} nodes of {ranks} local rank(s) on this machine's {num_devices} GPU(s) put "
                          f"{per_gpu} nodes' shares on each GPU: {per_gpu * one / GiB:.1f} GiB, more than its "
                          f"{device_gib(gpu.memory_bytes)} GiB. Start at most {most} node(s) here (--nodes {most}) and "
                          f"the others on other machines (--join)")
