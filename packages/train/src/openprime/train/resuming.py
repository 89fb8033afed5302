"""What a launch with `--resume` checks before its nodes start (openprime.train.cli, and its --dry-run): the checkpoint
found and verified, saved from this recipe's model by nodes of as many local ranks, the data layout it was saved
with, and the later steps of another timeline in the run's checkpoint directory, set aside once the launch goes on.
"""

from __future__ import annotations

import datetime
import pathlib

import torch

from openprime.ckpt import Checkpoint, abandoned_steps, check_compatible, list_steps
from openprime.ckpt.store import part_info, step_dir
from openprime.core.errors import ConfigError
from openprime.train.checkpointing import (
    checkpoint_root,
    data_layout_changes,
    find_checkpoint,
    model_changes,
    nodes_here,
    parts_by_node,
)
from openprime.train.config import RunConfig
from openprime.train.data import PreparedData
from openprime.train.model import Llama


def check_resume_spec(spec: str | None, cfg: RunConfig, run_dir: pathlib.Path | None) -> None:
    """ConfigError for `--resume latest` with no run directory given (`run_dir` None) and no checkpoint.directory:
    nowhere to look for the newest checkpoint."""
    if spec == "latest" and run_dir is None and not cfg.checkpoint.directory:
        raise ConfigError("--resume latest needs the --run-dir of the run to continue")


def resume_checkpoint(spec: str, cfg: RunConfig, run_dir: pathlib.Path | None, *, num_nodes: int,
                      skipped: dict[int, Exception]) -> tuple[Checkpoint, list[int]]:
    """The checkpoint that `--resume spec` names (checksums verified), checked against the recipe's model and local
    ranks and against the launch's checkpoint directory; and the later steps in that directory. `run_dir`: the
    launch's (None: one yet to be made, which holds no checkpoints); `skipped`: filled as find_checkpoint's."""
    check_resume_spec(spec, cfg, run_dir)
    # A run directory yet to be made holds no checkpoints: only a path or checkpoint.directory are looked at.
    where = run_dir or pathlib.Path("runs").resolve()
    found = find_checkpoint(spec, cfg.checkpoint, where, num_nodes=num_nodes, skipped=skipped)
    root = checkpoint_root(cfg.checkpoint, where)
    later = [step for step in list_steps(root) if step > found.step] if run_dir or cfg.checkpoint.directory else []
    if spec != "latest" and later:
        raise ConfigError(f"{root}, where this run saves, holds checkpoints of steps {later} after the one resumed "
                          f"({found.path}, step {found.step}): this run's saves would mix with them, and a later "
                          f"--resume latest would continue from them. Move them out of {root} (they are another "
                          f"timeline of the run), or give this run another --run-dir")
    nodes = parts_by_node(found)
    ranks = cfg.fsdp.num_local_ranks
    if len(nodes[0]) != ranks:
        raise ConfigError(f"checkpoint {found.path} was saved by nodes of {len(nodes[0])} local rank(s), each holding "
                          f"its own shard, but fsdp.num_local_ranks is {ranks}: resume with "
                          f"--set fsdp.num_local_ranks={len(nodes[0])}")
    with torch.device("meta"):  # the recipe's model, to compare shapes with the saved one: nothing allocated
        model = Llama(cfg.model)
    # Local rank 0 of R holds the first ceil(n / R) rows of every n-row parameter (FSDP2 shards dim 0).
    expected = {name: torch.empty((-(-t.shape[0] // ranks), *t.shape[1:]), device="meta")
                for name, t in model.state_dict().items()}
    first_part = found.part(nodes[0][0])
    check_compatible(first_part, {"model": expected})
    model_changes(part_info(first_part)["state"]["model_config"], cfg.model, where=f"checkpoint {found.path}")
    return found, later


def resume_from(spec: str, cfg: RunConfig, run_dir: pathlib.Path, prepared: PreparedData, *, num_nodes: int,
                joined: bool) -> tuple[Checkpoint, list[int]]:
    """The checkpoint that `--resume spec` names, checked against the `num_nodes` nodes of the launch and the data it
    prepared, and the later steps of another timeline to set aside (`set_aside`) if the launch goes ahead. `joined`:
    the launch joins another's coordinator (--join)."""
    skipped: dict[int, Exception] = {}  # why each later step was not taken (their checksums checked)
    found, later = resume_checkpoint(spec, cfg, run_dir, num_nodes=num_nodes, skipped=skipped)
    nodes, ranks = parts_by_node(found), cfg.fsdp.num_local_ranks
    first_part = found.part(nodes[0][0])
    # The data layout's settings and token streams (prepared above), before any node starts (each node checks
    # its sequences per source as it loads).
    layout = {"seed": cfg.data.seed, "seq_len": cfg.train.seq_len, "num_slots": cfg.mesh.max_nodes,
              "tokens": [source.tokens_sha256 for source in prepared.sources]}
    changes = data_layout_changes(part_info(first_part)["state"]["data"], layout,
                                  where=f"checkpoint {found.path}", on_change=cfg.data.on_layout_change)
    if changes:
        print(f"openprime: the data layout changed ({', '.join(changes)}): every node reads its data slot from the "
              f"start (data.on_layout_change=restart)", flush=True)
    print(f"openprime: resuming from {found.path} ({len(nodes)} nodes"
          f"{f' of {ranks} local ranks' if ranks > 1 else ''}, checksums verified)", flush=True)
    # Later steps that hold a whole node that verifies, but that some of this launch's nodes never saved, are another
    # timeline's checkpoints; the others (saves a crash cut short before any node's finished, steps every node saved
    # that are damaged on disk since) the run's own saves replace as before. Checksums included: a damaged newest
    # step was moved aside as another timeline, with the advice to resume from it (found 2026-12-07 by review), and
    # so was a step with one damaged part of two. What `latest` found of them decides, without checking their
    # checksums a second time.
    # Only under the run directory this launch holds locked: a checkpoint.directory elsewhere may be another live
    # run's, still writing those steps.
    root = checkpoint_root(cfg.checkpoint, run_dir)
    if joined or not root.resolve().is_relative_to(run_dir.resolve()):
        return found, []
    return found, abandoned_steps(root, later, enough=nodes_here(num_nodes), usable=nodes_here(1), skipped=skipped)


def set_aside(root: pathlib.Path, later: list[int], resumed: int) -> None:
    """Move the steps after the one `--resume latest` resumed out of the run's checkpoint root: they hold fewer
    nodes than this launch (a node died and the others saved on without it), so they are another timeline. Left in
    place, they stayed the run's newest: status, export and the continue line's second command took them, and
    a later resume of fewer nodes continued the abandoned timeline (found 2026-12-07). Not for a --join launch: on
    a disk shared by machines, another machine's launch may be reading them."""
    aside = root / f"abandoned-after-step-{resumed:08d}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    try:
        aside.mkdir()
        for step in later:
            step_dir(root, step).rename(aside / step_dir(root, step).name)
    except OSError as e:
        raise ConfigError(f"cannot move the later steps {later} of {root} aside ({e.strerror or e}: {e.filename}): "
                          f"they are another timeline's; move them out of {root} yourself, then resume") from None
    print(f"openprime: steps {later} under {root} hold fewer nodes than this launch (a node died and the others "
          f"saved on without it): moved to {aside}, out of this run's timeline. To continue that timeline instead, "
          f"stop this launch and resume with --resume {step_dir(aside, later[-1])}", flush=True)
