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
import logging
import pathlib
import typing
from collections.abc import Callable, Sequence
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
    PartsCheck,
    check_compatible,
    latest,
    read_part,
    resolve,
)
from openprime.ckpt.state import flatten, unflatten
from openprime.ckpt.store import STEP_RE, CorruptCheckpoint, list_steps, part_info, step_dir, verify_step
from openprime.core.config import to_dict
from openprime.core.errors import ConfigError
from openprime.diloco import DiLoCo, ExtraState
from openprime.train.data import LayoutChange, MixtureBatches, layout_changes
from openprime.train.model import ModelConfig
from openprime.train.schedule import follow_schedule

log = logging.getLogger("openprime.train.checkpointing")


def part_name(slot: int, local_rank: int = 0, num_local_ranks: int = 1) -> str:
    """`slot-S` for a node in one process; `slot-S-rank-R` for local rank R of a node sharded by FSDP2."""
    return f"slot-{slot}" if num_local_ranks == 1 else f"slot-{slot}-rank-{local_rank}"


def slot_of_part(name: str) -> int:
    return int(name.removeprefix("slot-").split("-rank-")[0])


def rank_of_part(name: str) -> int:
    return int(name.split("-rank-")[1]) if "-rank-" in name else 0


def _by_node(parts: Sequence[str]) -> list[list[str]]:
    slots: dict[int, list[str]] = {}
    for name in parts:
        slots.setdefault(slot_of_part(name), []).append(name)
    return [sorted(names, key=rank_of_part) for _, names in sorted(slots.items())]


def parts_by_node(checkpoint: Checkpoint) -> list[list[str]]:
    """The checkpoint's parts grouped by node (data slot), in slot order; within a node in local-rank order."""
    return _by_node(checkpoint.parts)


def whole_nodes(parts: Sequence[str], named: Sequence[str]) -> list[list[str]]:
    """The nodes of a step whose parts (one per local rank) are all among `parts`; `named`: every part of the step."""
    have = set(parts)
    return [names for names in _by_node(named) if all(name in have for name in names)]


def nodes_here(num_nodes: int, *, resuming: bool = True) -> PartsCheck:
    """A step is usable on this machine when it holds the whole parts of at least `num_nodes` nodes of it.

    A run whose machines checkpoint to their own disks holds only its own nodes' parts on each machine, so
    this is what a machine can resume from (a shared disk holds every node's). `resuming`: the refusal says how a
    launch goes on without those nodes' parts; otherwise (an export: one node's parts hold the weights) it names the
    parts that are missing."""
    def enough(parts: tuple[str, ...], named: tuple[str, ...]) -> str | None:
        found = whole_nodes(parts, named)
        if len(found) >= num_nodes:
            return None
        held = ", ".join(f"slot {slot_of_part(names[0])}" for names in found) or "none"
        saved = f"it holds {len(found)} whole node(s) here ({held}) of the {len(_by_node(named))} that saved it"
        if resuming:
            return (f"{saved}, and {num_nodes} are to resume from it (--nodes {num_nodes}; more nodes can join with "
                    f"--join and no --resume: they take the state from a peer)")
        missing = sorted(set(named) - set(parts))
        return (f"{saved} (a node's parts are one per local rank; missing here: {', '.join(missing[:4])}"
                f"{f' and {len(missing) - 4} more' if len(missing) > 4 else ''})")
    return enough


def newest_saved(root: pathlib.Path, *, num_nodes: int = 1) -> int | None:
    """The newest step under `root` of which at least `num_nodes` nodes' parts all finished saving (their manifests
    are checked, not their checksums: this is what the end of a launch reports, not a resume), or None. Every node
    holds the same global state after an outer step, so one node's parts are enough to export the model or to
    continue the run (more nodes join it and take the state from a peer); `--resume latest` of a launch of
    `num_nodes` nodes takes the newest step that holds them all."""
    for step in reversed(list_steps(root)):
        try:
            return verify_step(root, step, checksums=False, enough=nodes_here(num_nodes)).step
        except (CorruptCheckpoint, OSError, ValueError, KeyError):
            continue
    return None


def saved_nodes(root: pathlib.Path, step: int, *, checksums: bool = False) -> list[list[str]]:
    """The parts of the nodes of step `step` under `root` whose parts all finished saving (manifests checked, and
    with `checksums` every file's SHA-256), by node; raises CorruptCheckpoint (IncompleteCheckpoint: no node
    finished) or OSError."""
    return parts_by_node(usable_nodes(verify_step(root, step, checksums=checksums,
                                                  enough=nodes_here(1, resuming=False))))


def num_nodes_saved(root: pathlib.Path, step: int) -> int:
    """How many nodes' parts of step `step` under `root` all finished saving (checksums not read); 0 when none did
    or the step is gone (a live run on a shared disk prunes its old steps)."""
    try:
        return len(saved_nodes(root, step, checksums=False))
    except (CorruptCheckpoint, OSError, ValueError, KeyError):
        return 0


def usable_nodes(found: Checkpoint) -> Checkpoint:
    """`found` with only the parts of whole nodes (a node missing a local rank's part cannot resume)."""
    named = part_info(found.part(found.parts[0]))["parts"]
    return attrs.evolve(found, parts=tuple(name for names in whole_nodes(found.parts, named) for name in names))


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
    """Where a run's checkpoints go: checkpoint.directory (`~` expanded) if set, else the run directory's own."""
    return _root(cfg.directory, run_dir)


def run_checkpoint_root(run_dir: pathlib.Path, resolved: dict[str, Any]) -> pathlib.Path:
    """checkpoint_root of a run from the resolved config its config.json holds (`to_dict` of its RunConfig)."""
    return _root(resolved["checkpoint"]["directory"], run_dir)


def _root(directory: str | None, run_dir: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(directory).expanduser() if directory else run_dir / "checkpoints"


def resolved_config(run_dir: pathlib.Path) -> dict[str, Any] | None:
    """The resolved config (`to_dict` of a RunConfig) of a run directory's newest launch: its last
    config.resumed-N.json, else its config.json; None when it has neither. A resume may change where the run saves
    (checkpoint.directory) or its length: status and export read the first launch's config only, and exported an
    older checkpoint without a word. A config.json that is not a run's (a Hugging Face export's) is a ConfigError."""
    resumed = sorted(run_dir.glob("config.resumed-*.json"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    for path in [*reversed(resumed), run_dir / "config.json"]:
        if path.is_file():
            try:
                resolved = json.loads(path.read_text())["config"]
                if isinstance(resolved, dict) and isinstance(resolved.get("checkpoint"), dict):
                    return resolved
            except (ValueError, KeyError, TypeError):
                pass
            raise ConfigError(f"{path} is not the config of an openprime run (is {run_dir} a Hugging Face export?); "
                              f"give a run directory or a checkpoint")
    return None


def node_checkpointer(cfg: CheckpointConfig, run_dir: pathlib.Path, part: str) -> Checkpointer:
    return Checkpointer(checkpoint_root(cfg, run_dir), part=part, mode=cfg.mode, num_keep=cfg.num_keep,
                        usable=nodes_here(1))


def node_state(*, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
               diloco: DiLoCo, batches: MixtureBatches, model_cfg: ModelConfig, tokens: int = 0) -> dict[str, Any]:
    """Everything this node needs to continue exactly (live tensors: the checkpointer snapshots them); `tokens`:
    the tokens per node trained so far, which a resumed run's records go on counting (`saved_tokens`)."""
    return {
        "progress": {"tokens": tokens},
        "model": local_state(get_model_state_dict(model)),
        "optim": local_state(get_optimizer_state_dict(model, opt)),
        "scheduler": sched.state_dict(),
        "diloco": diloco.state_dict(),
        "data": batches.state_dict(),
        "rng": {"torch": torch.get_rng_state()},
        "model_config": to_dict(model_cfg),
    }


# MixtureBatches' layout keys (data.batches.LAYOUT_KEYS) -> the settings that decide them.
DATA_LAYOUT_SETTINGS = {"seed": "data.seed", "seq_len": "train.seq_len", "num_slots": "mesh.max_nodes"}


def data_layout_changes(saved: dict[str, Any], current: dict[str, Any], *, where: str,
                        on_change: LayoutChange) -> list[str]:
    """How the data layout of `current` (a `MixtureBatches.state_dict()`, or the part of one a launcher knows)
    differs from the `saved` one, in settings: e.g. ["mesh.max_nodes 4 (saved: 8)"], empty if it does not.

    A changed layout cannot continue the saved data position: the sequences it counts are cut or dealt to the slots
    differently. With `on_change` REFUSE that raises ConfigError naming the settings to restore; with RESTART the
    caller reads the data slot from its start.
    """
    changes = layout_changes(saved, current)
    settings = {DATA_LAYOUT_SETTINGS[key]: values for key, values in changes.items() if key in DATA_LAYOUT_SETTINGS}
    said = [f"{name} {now} (saved: {was})" for name, (was, now) in settings.items()]
    restore = [f"--set {name}={was}" for name, (was, _) in settings.items()]
    # Other data under the same settings (the streams and their sequences per source follow train.seq_len and
    # mesh.max_nodes, so a change of those is said as that).
    if not settings and ("tokens" in changes or "rows" in changes):
        if "tokens" in changes:
            was, now = changes["tokens"]
            if len(was) != len(now):
                said.append(f"{len(now)} data sources (saved: {len(was)})")
            else:
                differ = [i for i, (a, b) in enumerate(zip(was, now, strict=True)) if a != b]
                said.append(f"the token stream of data.mixture source(s) {differ} (SHA-256 {now[differ[0]][:12]}, "
                            f"saved: {was[differ[0]][:12]})")
        else:
            was, now = changes["rows"]
            said.append(f"sequences per source in data slot {current.get('slot', '?')} {now} (saved: {was})")
        restore.append("the data it was saved with (the same files and data.mixture, data.max_chars_per_source, "
                       "data.val_fraction and data.vocab_size)")
    if not said or on_change is LayoutChange.RESTART:
        return said
    raise ConfigError(f"{where} was saved with another data layout: {', '.join(said)}; its data positions would "
                      f"name other sequences. Resume with {' and '.join(restore)} to continue the data exactly, or "
                      f"with --set data.on_layout_change=restart to have each node read its data slot from the "
                      f"start in the new layout (sequences trained on before come again)")


def restore_node(state: dict[str, Any], *, model: torch.nn.Module, opt: torch.optim.Optimizer,
                 sched: torch.optim.lr_scheduler.LRScheduler, diloco: DiLoCo,
                 batches: MixtureBatches | None, on_layout_change: LayoutChange = LayoutChange.REFUSE) -> list[str]:
    """Put a node back where `node_state` found it (its data position too, unless `batches` is None: the node
    reads another data slot than the one saved).

    The batch size may differ from the saved one: the data continues at the same sequences. Another data layout
    (`data_layout_changes`) is refused before anything is restored, or with `on_layout_change` RESTART the data
    slot is read from its start.

    The optimizer's hyperparameters and the schedule are the config's, not the checkpoint's: `opt` and `sched` come
    built from the config, and what the checkpoint saved of them (AdamW's lr, betas, eps and weight decay per
    param group; the scheduler's base lr) would silently override a change made for the resumed run, such as
    `--set optim.lr=...` after a divergence. With the config unchanged the values are the same. Returns what the
    config changed, e.g. ["optim.lr 0.003 (saved: 30)"], for the caller to say.
    """
    data_changes = []
    if batches is not None:
        data_changes = data_layout_changes(state["data"], batches.state_dict(), where="the checkpoint",
                                           on_change=on_layout_change)
        if data_changes:
            data_changes[-1] += f"; data slot {batches.slot} is read from its start (data.on_layout_change=restart)"
            batches = None
    configured = [_hyperparameters(group) for group in opt.param_groups]
    # The global state first (it also puts theta into the model), then the model's own weights: after a skipped
    # outer step a replica keeps its local weights, which are not theta (until 2026-12-07 theta replaced them and a
    # resumed run lost that replica's inner steps since its last applied outer step); otherwise they are theta.
    diloco.load_state_dict(state["diloco"])
    set_model_state_dict(model, sharded_like(state["model"], get_model_state_dict(model)))
    set_optimizer_state_dict(model, opt, sharded_like(state["optim"], get_optimizer_state_dict(model, opt)))
    changed = sorted({f"optim.{OPTIMIZER_FIELDS.get(k, k)} {v} (saved: {saved[k]})"
                      for group, want in zip(opt.param_groups, configured, strict=True)
                      for saved in [_hyperparameters(group)] for k, v in want.items()
                      if k != "lr" and saved.get(k, v) != v})
    for group, want in zip(opt.param_groups, configured, strict=True):
        group.update(want)
    follow_schedule(sched, int(state["scheduler"]["last_epoch"]))  # the config's lr at the saved step
    if batches is not None:
        batches.load_state_dict(state["data"])
        if state["data"]["batch_size"] != batches.batch_size:
            changed.append(f"train.batch_size {batches.batch_size} (saved: {state['data']['batch_size']})")
    torch.set_rng_state(state["rng"]["torch"])
    return changed + data_changes


def saved_tokens(state: dict[str, Any], tokens_per_step: int) -> int:
    """The tokens per node trained up to a checkpoint: as saved, or, for a checkpoint from before they were
    (2026-12-04), its step times this run's tokens per step."""
    return int(state.get("progress", {}).get("tokens", state["diloco"]["num_inner_steps_done"] * tokens_per_step))


# param group key -> OptimizerConfig field, where they differ ("lr" in a param group is the scheduled lr).
OPTIMIZER_FIELDS = {"initial_lr": "lr"}


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in group.items() if k != "params"}


class InnerOptimizerState(ExtraState):
    """The AdamW state a joining node takes from its donor in live recovery (paper, section 2.2), and the donor's
    count of the tokens it trained: `progress()` gives (inner steps done, tokens per node trained by then), and
    the joiner's `adopt_progress` takes the donor's. A joiner counting the run's steps at its own tokens per step
    would be off after a resume that changed the batch size."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, *,
                 progress: Callable[[], tuple[int, int]] | None = None,
                 adopt_progress: Callable[[int, int], None] | None = None) -> None:
        self.model, self.opt = model, opt
        self.progress, self.adopt_progress = progress, adopt_progress

    def own_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors, skeleton = flatten(local_state(get_optimizer_state_dict(self.model, self.opt)))
        meta: dict[str, Any] = {"optim": skeleton}
        if self.progress is not None:
            meta["steps"], meta["tokens"] = self.progress()
        return tensors, meta

    def load_own_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        like = get_optimizer_state_dict(self.model, self.opt)
        set_optimizer_state_dict(self.model, self.opt, sharded_like(unflatten(meta["optim"], tensors), like))
        if self.adopt_progress is not None and "tokens" in meta:  # a donor from before 2026-12-04 sends none
            self.adopt_progress(int(meta["steps"]), int(meta["tokens"]))


def find_checkpoint(spec: str, cfg: CheckpointConfig, run_dir: pathlib.Path, *, num_nodes: int,
                    skipped: dict[int, Exception] | None = None) -> Checkpoint:
    """`--resume latest` (the newest step of the run directory's checkpoints that holds, verified, the parts of
    `num_nodes` nodes: all of them when one disk holds the run's checkpoints, this machine's nodes' when each
    machine saves to its own) or `--resume PATH` (that step, or that root's newest such step). A step named by its
    path may hold fewer nodes than `num_nodes` (one is enough: every node holds the global state after an outer
    step): the nodes past them start without a part and take the state from a peer at the first outer step. After a
    node died, the others went on saving steps without it, and `--resume latest` of a launch of every node goes
    back to the last step that node saved (the launch's continue line names both). `skipped`: as `latest`'s, why
    each newer step of `--resume latest` was not taken."""
    if spec == "latest":
        root = checkpoint_root(cfg, run_dir)
        try:
            return usable_nodes(latest(root, enough=nodes_here(num_nodes), skipped=skipped))
        except CheckpointNotFound as e:
            if num_nodes == 1:
                raise
            try:  # with checksums: a step whose parts are damaged is no step to name (found 2026-12-07 by review)
                fewer = usable_nodes(latest(root, enough=nodes_here(1)))
            except CheckpointNotFound:
                raise e from None  # none: what latest said is the story
            held = len(parts_by_node(fewer))
            raise CheckpointNotFound(
                f"no step under {root} holds the parts of {num_nodes} nodes here (--nodes {num_nodes}); the newest "
                f"step holding a whole node, {fewer.step}, holds {held}. Resume it with --resume {fewer.path}: "
                f"its {held} node(s) continue from their parts and the other {num_nodes - held} take the state from "
                f"them at the first outer step ({e})") from None
    return usable_nodes(resolve(pathlib.Path(spec), enough=nodes_here(1)))


def load_node_part(checkpoint: Checkpoint, name: str, model: torch.nn.Module) -> dict[str, Any]:
    """This process's part of a checkpoint, after checking it was saved from the same model and sharding."""
    if name not in checkpoint.parts:
        saved_ranks = len(parts_by_node(checkpoint)[0])
        raise ConfigError(f"this process saves as {name}, but checkpoint {checkpoint.path} holds "
                          f"{list(checkpoint.parts)} here: resume with the local ranks that saved it "
                          f"(fsdp.num_local_ranks={saved_ranks})")
    part = checkpoint.part(name)
    check_compatible(part, {"model": local_state(model.state_dict())})
    # `--resume` found the checkpoint with its checksums checked (find_checkpoint): hashing it again in every
    # node would read every byte twice.
    return read_part(part, verify=not checkpoint.verified)


# ModelConfig fields a resume may change: the initialisation (the weights come from the checkpoint) and the length
# the RoPE tables cover. Any other change that keeps every shape (rope_theta, norm_eps) computes another function of
# the saved weights, and was accepted without a word until 2026-12-07.
RESUMABLE_MODEL_CHANGES = ("init", "max_seq_len")


def model_changes(saved: dict[str, Any], model: ModelConfig, *, where: str) -> None:
    """Raise a ConfigError naming the model settings (other than RESUMABLE_MODEL_CHANGES) in which the saved
    model config differs from this run's, with the --set that restores them."""
    current = to_dict(model)
    changed = [name for name in current if name not in RESUMABLE_MODEL_CHANGES and name in saved
               and saved[name] != current[name]]
    if changed:
        listing = ", ".join(f"model.{name} {current[name]!r} (saved: {saved[name]!r})" for name in changed)
        restore = " ".join(f"--set model.{name}={saved[name]}" for name in changed)
        raise ConfigError(f"{where} was saved from another model: {listing}; its weights would compute another "
                          f"function here. Resume with {restore}")


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
    directory or one part; returns (config, state dict, the part read).

    Every node holds the same weights after an outer step, so one node's parts are read, and only their files are
    checksummed (as they are read): not every part of the step, which on a shared disk is every node's optimizer
    state too. A node's parts that fail (corrupt, or deleted while they were read: a live run prunes its old
    checkpoints) give way to another node's of the same step, then to the step before, with a warning; a source
    that names a step or a part is read from that step or part only.
    """
    if not source.exists():
        raise CheckpointNotFound(f"{source} does not exist: give a run directory or a checkpoint")
    if (source / "state.json").is_file():
        return _model_weights(source)
    if (resolved := resolved_config(source)) is not None:  # a run directory: where its newest launch saves
        root, steps = run_checkpoint_root(source, resolved), None
    elif STEP_RE.match(source.name) and source.is_dir():
        root, steps = source.parent, [int(STEP_RE.match(source.name).group(1))]
    elif source.is_dir():
        root, steps = source, None
    else:
        raise CheckpointNotFound(f"{source} is neither a run directory nor a checkpoint")
    steps = steps or list(reversed(list_steps(root)))
    if not steps:
        raise CheckpointNotFound(f"no checkpoint under {root} (looked for step-NNNNNNNN directories)")
    problems = []
    for step in steps:
        try:
            nodes = saved_nodes(root, step)
        except (CorruptCheckpoint, OSError, ValueError, KeyError) as e:  # IncompleteCheckpoint: a CorruptCheckpoint
            nodes, problems = [], [*problems, f"step {step}: {e}"]
        for names in nodes:
            try:
                return _model_weights(step_dir(root, step) / names[0])
            except (CorruptCheckpoint, CheckpointNotFound, OSError, ValueError, KeyError) as e:
                problems.append(f"step {step} {names[0]}: {e}")
                log.warning("cannot read %s of checkpoint step %d: %s; trying another", names[0], step, e)
    raise CheckpointNotFound(f"no usable checkpoint under {root}" + (f" at step {steps[0]}" if len(steps) == 1 else "")
                             + ": " + "; ".join(problems))


def _model_weights(part: pathlib.Path) -> tuple[ModelConfig, dict[str, torch.Tensor], pathlib.Path]:
    """One part's model config and the run's global weights (with its local ranks' sibling parts); verified."""
    state = read_part(part, only=EXPORTED)
    model = _global_weights(state, part)
    if "-rank-" in part.name:
        # Saved by FSDP2 local ranks: rank r holds rows [r * ceil(n / R), ...) of every parameter (dim 0), so
        # the node's full weights are its ranks' shards concatenated in rank order.
        named = part_info(part)["parts"]
        (names,) = [names for names in whole_nodes(named, named) if part.name in names]
        shards = [model if name == part.name else _global_weights(read_part(part.parent / name, only=EXPORTED),
                                                                  part.parent / name) for name in names]
        model = {key: torch.cat([shard[key] for shard in shards]) for key in model}
    return model_config_from_dict(state["model_config"]), model, part


# What an export reads of a part: the model (its parameters' names and shapes) and the global weights.
EXPORTED = ("model", "diloco/theta")


def _global_weights(state: dict[str, Any], part: pathlib.Path) -> dict[str, torch.Tensor]:
    """A part's model parameters as the global weights theta hold them (the parameters' order, flattened): the
    weights every replica agreed on. After a skipped outer step a replica keeps its own local weights (its model),
    and the export took those: from a node's part its replica, not the run's (found 2026-12-07)."""
    model, theta = state["model"], (state.get("diloco") or {}).get("theta")
    if theta is None:
        return model
    if theta.numel() != sum(t.numel() for t in model.values()):
        raise CorruptCheckpoint(part, f"its global weights hold {theta.numel()} values but its model "
                                      f"{sum(t.numel() for t in model.values())}")
    views = torch.split(theta, [t.numel() for t in model.values()])
    return {key: view.view_as(t).to(t.dtype) for (key, t), view in zip(model.items(), views, strict=True)}
