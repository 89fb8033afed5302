"""What a node checkpoints, how it comes back from a checkpoint, and where checkpoints live (issue 6).

A node saves at outer-step boundaries, when every node holds the same global weights, one part per
data slot (`slot-S`) under `RUN_DIR/checkpoints/step-N/`: the model and AdamW state (DCP), the DiLoCo
host copies of the global weights and outer momentum, the scheduler, the step counters, the data
position and the RNG state; with these a run stopped after outer step k and resumed continues exactly
as if it had not stopped. The model config goes in too, so that a checkpoint alone can be exported.
"""

from __future__ import annotations

import enum
import json
import pathlib
import typing
from typing import Any

import attrs
import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from openprime.ckpt import (
    Checkpoint,
    CheckpointConfig,
    Checkpointer,
    CheckpointNotFound,
    check_compatible,
    latest,
    read_part,
    resolve,
)
from openprime.ckpt.state import flatten, unflatten
from openprime.core.config import to_dict
from openprime.core.errors import ConfigError
from openprime.diloco import DiLoCo, ExtraState
from openprime.train.data import MixtureBatches
from openprime.train.model import ModelConfig


def part_name(slot: int, local_rank: int = 0, num_local_ranks: int = 1) -> str:
    """`slot-S` for a node in one process; `slot-S-rank-R` for local rank R of a node sharded by FSDP2."""
    return f"slot-{slot}" if num_local_ranks == 1 else f"slot-{slot}-rank-{local_rank}"


def slot_of_part(name: str) -> int:
    return int(name.removeprefix("slot-").split("-rank-")[0])


def rank_of_part(name: str) -> int:
    return int(name.split("-rank-")[1]) if "-rank-" in name else 0


def parts_by_node(checkpoint: Checkpoint) -> list[list[str]]:
    """The checkpoint's parts grouped by node (data slot), in slot order; within a node in local-rank order."""
    slots: dict[int, list[str]] = {}
    for name in checkpoint.parts:
        slots.setdefault(slot_of_part(name), []).append(name)
    return [sorted(names, key=rank_of_part) for _, names in sorted(slots.items())]


def local_state(tree: Any) -> Any:
    """A state dict with every DTensor (an FSDP2 shard) replaced by the tensor this rank holds: what a rank
    saves and sends. Plain tensors and values pass through."""
    if isinstance(tree, DTensor):
        return tree.to_local()
    if isinstance(tree, dict):
        return {k: local_state(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [local_state(v) for v in tree]
    return tree


def sharded_like(tree: Any, like: Any) -> Any:
    """The inverse of `local_state`: local tensors become DTensors laid out as the matching ones in `like`."""
    if isinstance(like, DTensor):
        return DTensor.from_local(tree, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                                  stride=like.stride())
    if isinstance(like, dict) and isinstance(tree, dict):
        return {k: sharded_like(v, like[k]) if k in like else v for k, v in tree.items()}
    if isinstance(like, list) and isinstance(tree, list):
        return [sharded_like(v, w) for v, w in zip(tree, like, strict=True)]
    return tree


def checkpoint_root(cfg: CheckpointConfig, run_dir: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(cfg.directory) if cfg.directory else run_dir / "checkpoints"


def node_checkpointer(cfg: CheckpointConfig, run_dir: pathlib.Path, part: str) -> Checkpointer:
    return Checkpointer(checkpoint_root(cfg, run_dir), part=part, mode=cfg.mode, num_keep=cfg.num_keep)


def node_state(*, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
               diloco: DiLoCo, batches: MixtureBatches, model_cfg: ModelConfig) -> dict[str, Any]:
    """Everything this node needs to continue exactly (live tensors: the checkpointer snapshots them)."""
    return {
        "model": local_state(get_model_state_dict(model)),
        "optim": local_state(get_optimizer_state_dict(model, opt)),
        "scheduler": sched.state_dict(),
        "diloco": diloco.state_dict(),
        "data": batches.state_dict(),
        "rng": {"torch": torch.get_rng_state()},
        "model_config": to_dict(model_cfg),
    }


def restore_node(state: dict[str, Any], *, model: torch.nn.Module, opt: torch.optim.Optimizer,
                 sched: torch.optim.lr_scheduler.LRScheduler, diloco: DiLoCo, batches: MixtureBatches) -> None:
    """Put a node back where `node_state` found it."""
    set_model_state_dict(model, sharded_like(state["model"], get_model_state_dict(model)))
    set_optimizer_state_dict(model, opt, sharded_like(state["optim"], get_optimizer_state_dict(model, opt)))
    sched.load_state_dict(state["scheduler"])
    diloco.load_state_dict(state["diloco"])
    batches.load_state_dict(state["data"])
    torch.set_rng_state(state["rng"]["torch"])


class InnerOptimizerState(ExtraState):
    """The AdamW state a joining node takes from its donor in live recovery (paper, section 2.2)."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def own_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors, skeleton = flatten(local_state(get_optimizer_state_dict(self.model, self.opt)))
        return tensors, {"optim": skeleton}

    def load_own_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        like = get_optimizer_state_dict(self.model, self.opt)
        set_optimizer_state_dict(self.model, self.opt, sharded_like(unflatten(meta["optim"], tensors), like))


def find_checkpoint(spec: str, cfg: CheckpointConfig, run_dir: pathlib.Path) -> Checkpoint:
    """`--resume latest` (the run directory's newest complete, verified step) or `--resume PATH`."""
    if spec == "latest":
        return latest(checkpoint_root(cfg, run_dir))
    return resolve(pathlib.Path(spec))


def load_node_part(checkpoint: Checkpoint, name: str, model: torch.nn.Module) -> dict[str, Any]:
    """This process's part of a checkpoint, after checking it was saved from the same model and sharding."""
    if name not in checkpoint.parts:
        saved_ranks = len(parts_by_node(checkpoint)[0])
        raise ConfigError(f"this process saves as {name}, but checkpoint {checkpoint.path} holds "
                          f"{list(checkpoint.parts)}: resume with as many nodes as it has "
                          f"(--nodes {len(parts_by_node(checkpoint))}) and as many local ranks "
                          f"(fsdp.num_local_ranks={saved_ranks}); add nodes with --join afterwards")
    part = checkpoint.part(name)
    check_compatible(part, {"model": local_state(model.state_dict())})
    # `--resume` found the checkpoint with its checksums checked (find_checkpoint): hashing it again in every
    # node would read every byte twice.
    return read_part(part, verify=not checkpoint.verified)


def model_config_from_dict(values: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from `to_dict`'s JSON (enums by value)."""
    hints = typing.get_type_hints(ModelConfig)
    kwargs = {}
    for f in attrs.fields(ModelConfig):
        value, tp = values[f.name], hints[f.name]
        kwargs[f.name] = tp(value) if isinstance(tp, type) and issubclass(tp, enum.Enum) else value
    return ModelConfig(**kwargs)


def load_model_weights(source: pathlib.Path) -> tuple[ModelConfig, dict[str, torch.Tensor], pathlib.Path]:
    """The model config and weights of a run directory (its newest checkpoint), a checkpoint root, a step
    directory or one part; returns (config, state dict, the part read)."""
    if (source / "state.json").is_file():
        part = source
    else:
        if (source / "config.json").is_file() and (source / "checkpoints").is_dir():
            run_cfg = json.loads((source / "config.json").read_text())["config"]
            root = pathlib.Path(run_cfg["checkpoint"]["directory"] or source / "checkpoints")
            found = latest(root)
        elif source.is_dir():
            found = resolve(source)
        else:
            raise CheckpointNotFound(f"{source} is neither a run directory nor a checkpoint")
        part = found.part(found.parts[0])
    state = read_part(part)
    model = state["model"]
    if "-rank-" in part.name:
        # Saved by FSDP2 local ranks: rank r holds rows [r * ceil(n / R), ...) of every parameter (dim 0), so
        # the node's full weights are its ranks' shards concatenated in rank order.
        step = resolve(part.parent)
        (names,) = [names for names in parts_by_node(step) if part.name in names]
        shards = [model if name == part.name else read_part(step.part(name))["model"] for name in names]
        model = {key: torch.cat([shard[key] for shard in shards]) for key in model}
    return model_config_from_dict(state["model_config"]), model, part
