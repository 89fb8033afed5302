"""A node's local mesh: the process group of its local ranks, which FSDP2 shards the model over.

Inside a node the ranks talk over fast local links (NVLink with NCCL on GPUs, Gloo on CPU); this group is
separate from the transports across nodes (openprime.core), which DiLoCo builds per outer step. A dry run
uses a fake group instead: one process plans the sharding of an 8-rank node without any peer.

The local group is the process's default group (DeviceMesh, which FSDP2 takes, is built on it): a node's
local ranks are the one fixed group of a run, while every group across nodes lives and dies with an
epoch on its own store prefix (openprime.core.distributed) and never touches the default group.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from openprime.core.distributed import connect_store
from openprime.core.transport import Rendezvous


def local_backend(device_type: str) -> str:
    """The local group's backend: on GPUs NCCL for CUDA tensors (FSDP2's all-gathers and reduce-scatters) and Gloo
    for the node's small host-tensor collectives (local_sum, the mesh's view and byte broadcasts). A plain "nccl"
    group has no backend for CPU tensors: every node of several GPUs failed at its first of those."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def init_local_mesh(*, rank: int, world_size: int, rendezvous: Rendezvous, timeout_s: float,
                    device_type: str = "cpu") -> DeviceMesh:
    """Join the node's local group (its own prefix of a store the launcher hosts) and return its mesh."""
    backend = local_backend(device_type)
    dist.init_process_group(backend, store=connect_store(rendezvous, timeout_s), rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))


def fake_mesh(world_size: int, device_type: str = "cpu") -> DeviceMesh:
    """A mesh over a fake group of `world_size` ranks in this one process (collectives do nothing): for
    building the sharding plan of a node in a dry run, on meta tensors."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))


def destroy_local_mesh() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def local_sum(values: list[float], mesh: DeviceMesh | None) -> list[float]:
    """Element-wise sums of numbers over the node's local ranks (e.g. the bytes each rank's ring sent)."""
    if mesh is None or mesh.size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=mesh.get_group())
    return t.tolist()


def local_any(flag: bool, mesh: DeviceMesh | None) -> bool:
    """Whether `flag` holds on any of the node's local ranks (each passes its own; every rank gets the same answer)."""
    return local_sum([float(flag)], mesh)[0] > 0


def local_all_reduce_mean(value: float, mesh: DeviceMesh | None) -> float:
    """The mean of a number over the node's local ranks (e.g. the loss of each rank's micro-batches)."""
    size = mesh.size() if mesh is not None else 1
    return local_sum([value], mesh)[0] / size
