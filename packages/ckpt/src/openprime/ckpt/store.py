"""Checkpoints on disk: written atomically, verified before use, the newest complete one found, old ones pruned.

Layout of a checkpoint root (a run's `checkpoints/`):

    step-00000040/            the state after inner step 40 (an outer-step boundary)
        slot-0/               one part: what one node (or one local rank) needs to continue
            .metadata, __0_0.distcp    tensors, by torch.distributed.checkpoint (sharded under FSDP2)
            state.json                 everything else, as JSON (openprime.ckpt.state)
            MANIFEST.json              size and SHA-256 of every file (openprime.ckpt.manifest)
        slot-1/
    step-00000060/

Each part is written to `step-N/.tmp-PART-...` and renamed to `step-N/PART` once its manifest is on
disk, so a crash mid-save leaves a temporary directory (cleaned up later) and never a part that looks
complete. A save of a part that is already there (a step saved again after a resume from an older one) swaps the
two in one rename, so that `step-N/PART` holds a complete part, the old or the new, at every instant. Each part
names the parts its step needs (the nodes of that outer step); a step is complete when all of them are present and
verify. A run whose machines save to their own disks holds only some parts
of each step on each machine: `latest(root, enough=...)` then takes the newest step whose parts here verify
and are enough for the caller (e.g. the nodes that this machine resumes). DCP's tensor files are read with
`weights_only` and the rest is JSON, but DCP's own `.metadata` is a pickle that torch.distributed.checkpoint
loads as it is: load checkpoints you trust, as with torch.load. The manifest's checksums catch damage, not
tampering (whoever can write the files can write the manifest).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import logging
import os
import pathlib
import re
import shutil
import sys
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from openprime.ckpt.manifest import CorruptCheckpoint, fsync_path, read_manifest, verify_manifest, write_manifest
from openprime.ckpt.state import SEP, flatten, unflatten
from openprime.core.errors import ConfigError, OpenPrimeError

log = logging.getLogger("openprime.ckpt")
# What a long check of checksums says before it starts (at INFO): the `openprime` command shows it.
verify_log = logging.getLogger("openprime.ckpt.verify")
# A node of a 10B model holds about 200 GB (fp32 weights, AdamW's two moments, DiLoCo's copy and momentum): minutes
# of SHA-256 before a resume starts, in which it said nothing. A check of this much or more says so first.
SAY_CHECKING_BYTES = 1 << 30
CHECKSUM_BYTES_PER_S = 1.0e9  # SHA-256 on one core, roughly (manifest.py: about 1.2 GB/s here)
STATE_FILE = "state.json"
STEP_RE = re.compile(r"^step-(\d{8,})$")
TMP_PREFIX = ".tmp-"


class CheckpointNotFound(OpenPrimeError):
    """No usable checkpoint where one was asked for."""


class IncompleteCheckpoint(CorruptCheckpoint):
    """A step of which too few parts are here, and verify, for the caller (see verify_step's `enough`).

    `parts`: those that verify; `named`: every part the step names; `damaged`: those that finished saving (renamed
    into place) but do not verify. What a resume needs to tell a step some nodes never saved (another timeline's)
    from one damaged on disk, without checking its checksums again (`abandoned_steps`)."""

    def __init__(self, path: pathlib.Path, reason: str, *, parts: Sequence[str] = (), named: Sequence[str] = (),
                 damaged: Sequence[str] = ()) -> None:
        OpenPrimeError.__init__(self, f"checkpoint {path} is not usable here: {reason}")
        self.path, self.reason = path, reason
        self.parts, self.named, self.damaged = tuple(parts), tuple(named), tuple(damaged)


class SaveNotDurable(OpenPrimeError):
    """A part that was saved whole and renamed into place, but whose directories' fsync failed after the rename: the
    part is there and verifies (a resume uses it), but the disk did not confirm that the rename survives a power
    cut. The save is done; older checkpoints should not be pruned on its account (write_part)."""

    def __init__(self, path: pathlib.Path, cause: OSError) -> None:
        super().__init__(f"checkpoint {path} is saved, but the disk did not confirm it durable (fsync of its "
                         f"directory failed: {cause}): a power cut might lose it")
        self.path, self.cause = path, cause


class CheckpointMismatch(ConfigError):
    """A checkpoint of a different model (or state layout) than the one loading it."""


@attrs.frozen(kw_only=True)
class Fingerprint:
    """What a part shares with its step's other parts: the parts of one group hold the same state when saved
    together (every node's global weights after an outer step), so they record the same digest."""

    group: str  # the parts that hold the same state (e.g. one local rank's shard on every node)
    digest: str  # a hash of that state (DiLoCo's global-state hash, which the replicas agreed on)


@attrs.frozen
class Checkpoint:
    """One complete step of a checkpoint root."""

    step: int
    path: pathlib.Path
    parts: tuple[str, ...]
    verified: bool = False  # every part's checksums were checked when it was found: reading it need not again

    def part(self, name: str) -> pathlib.Path:
        return self.path / name


def step_dir(root: pathlib.Path, step: int) -> pathlib.Path:
    return root / f"step-{step:08d}"


def finished_parts(path: pathlib.Path) -> list[str]:
    """The parts of a step directory that finished saving (renamed into place), sorted."""
    return sorted(p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith(TMP_PREFIX))


def list_steps(root: pathlib.Path) -> list[int]:
    """The steps that have a directory under `root`, oldest first (complete or not)."""
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := STEP_RE.match(p.name)))


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    with warnings.catch_warnings():
        # DCP warns that it "assumes the intent is to save in a single process": that is the intent here.
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def write_part(root: pathlib.Path, step: int, part: str, state: Mapping[str, Any], *,
               parts: Sequence[str], fingerprint: Fingerprint | None = None) -> pathlib.Path:
    """Write one part of step `step` atomically; `parts` names every part the step needs. Returns its path.
    `fingerprint`: what the part shares with its siblings, checked when the step is used (verify_step).

    On any error before the part is in place (a full disk, a killed process) the temporary directory is removed
    when possible and nothing under the final name changes; the error propagates to the caller. A step directory
    left empty by the failure is removed too, so that it does not read as the run's newest step. A part of that name
    already there (the step saved again, after a resume from an older one) is replaced by `_put_in_place`: a
    complete part, the old or the new, is under the final name at every instant.

    Once the part is in place, a failure to fsync its directories raises SaveNotDurable (the part stays: it is
    complete and verifies, but the rename's durability is not confirmed).
    """
    if part not in parts:
        raise ValueError(f"part {part!r} is not among the step's parts {list(parts)}")
    # Before the step directory is made: a state that cannot be stored (TypeError) left it empty, read as the newest.
    tensors, skeleton = flatten(state)
    target = step_dir(root, step)
    target.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(target, part)
    final = target / part
    try:
        tmp.mkdir(parents=True)  # with its step directory, should another part's failed save have removed it
        with _quiet_dcp():
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True, thread_count=1), no_dist=True)
        meta = {"step": step, "part": part, "parts": list(parts), "state": skeleton}
        if fingerprint is not None:
            meta["fingerprint"] = attrs.asdict(fingerprint)
        with open(tmp / STATE_FILE, "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        write_manifest(tmp)
        fsync_path(tmp)
        replaced = _put_in_place(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(OSError):  # not empty: other parts of the step are there or on their way
            target.rmdir()
        raise
    try:
        fsync_path(target)
        # The step directory's own entry too (made by this save or a sibling's): a power cut must not lose it while
        # a later prune's deletions of older steps survive.
        fsync_path(root)
    except OSError as e:
        # The part is in place and complete: the save is not lost, only its durability unconfirmed. A part it
        # replaced stays under its temporary name (the part's next prune removes it), as the swap may not be durable.
        raise SaveNotDurable(final, e) from e
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)  # what is left of it is removed by the part's next prune
    return final


def _tmp_name(target: pathlib.Path, part: str) -> pathlib.Path:
    """A temporary name for a part of step directory `target`: `.tmp-PART-PID-RANDOM` (writing_pids reads the pid;
    prune removes a part's leftovers)."""
    return target / f"{TMP_PREFIX}{part}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _put_in_place(new: pathlib.Path, final: pathlib.Path) -> pathlib.Path | None:
    """Rename the directory `new` to `final`; returns where the part it replaced now is (None: there was none), for
    the caller to remove once the rename is durable.

    A part already under `final` is swapped with the new one in one atomic rename (renameat2's RENAME_EXCHANGE), so
    that a crash at any instant leaves a complete part under `final`, the old or the new: removing it first and
    then renaming lost the step's part to a crash (or an error) in between. Where the kernel or the filesystem
    cannot swap (not Linux, NFS), the old part is renamed aside first, and back if the new one's rename fails; a
    crash between those two renames leaves it aside, under a temporary name of the part, until its next prune.
    """
    if not os.path.lexists(final):
        os.rename(new, final)
        return None
    if _exchange(new, final):
        return new  # `new` now names the old part
    aside = _tmp_name(final.parent, final.name)
    os.rename(final, aside)
    try:
        os.rename(new, final)
    except BaseException:
        os.rename(aside, final)
        raise
    return aside


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # linux/fs.h


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    """The C library's renameat2 (Linux, glibc 2.28 and later), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: pathlib.Path, b: pathlib.Path) -> bool:
    """Swap the names `a` and `b` in one atomic rename; False where the C library, the kernel or the filesystem
    cannot (nothing changed then). Other errors raise OSError."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _metadata(path: pathlib.Path) -> dict[str, TensorStorageMetadata]:
    entries = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {k: v for k, v in entries.items() if isinstance(v, TensorStorageMetadata)}


def check_compatible(path: pathlib.Path, expected: Mapping[str, Any]) -> None:
    """Refuse a part whose tensors differ from `expected` (a nested state of the same layout).

    Only the tensors in `expected` are compared, e.g. `{"model": model.state_dict()}`: the first one
    missing, or of another shape or dtype, is named in the error with both shapes.
    """
    saved = _metadata(path)
    wanted, _ = flatten(expected)
    for name, tensor in wanted.items():
        if name not in saved:
            raise CheckpointMismatch(f"checkpoint {path} has no tensor {name!r} (shape {tuple(tensor.shape)} here): "
                                     f"it was saved from a different model or layout")
        meta = saved[name]
        if tuple(meta.size) != tuple(tensor.shape) or meta.properties.dtype != tensor.dtype:
            raise CheckpointMismatch(
                f"checkpoint {path} does not fit this model: tensor {name!r} is {tuple(meta.size)} "
                f"{meta.properties.dtype} in the checkpoint but {tuple(tensor.shape)} {tensor.dtype} here; "
                f"resume with the recipe (model config) that saved it")
    prefixes = {name.split("/", 1)[0] for name in wanted}
    extra = sorted(n for n in saved if n.split("/", 1)[0] in prefixes and n not in wanted)
    if extra:
        raise CheckpointMismatch(f"checkpoint {path} has tensor {extra[0]!r} that this model does not have "
                                 f"(and {len(extra) - 1} more): it was saved from a different model")


def read_part(path: pathlib.Path, *, verify: bool = True, only: Sequence[str] = ()) -> dict[str, Any]:
    """Load one part into fresh host tensors: the nested state as it was saved (tuples as lists).

    With `verify`, every file is first checked against the manifest (CorruptCheckpoint otherwise). `only`: the
    tensors to load, by path prefix ("model", "diloco/theta"); the others come back as None. An export needs the
    weights: it read the AdamW moments and the outer momentum too, five times the model's bytes in memory.
    """
    if not path.is_dir():
        raise CheckpointNotFound(f"no checkpoint at {path}")
    if verify:
        verify_manifest(path)
    try:
        meta = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(path, f"{STATE_FILE} is unreadable: {e}") from None
    tensors = {name: torch.empty(tuple(m.size), dtype=m.properties.dtype) for name, m in _metadata(path).items()
               if not only or any(name == prefix or name.startswith(prefix + SEP) for prefix in only)}
    try:
        with _quiet_dcp():
            dcp.load(tensors, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    except CheckpointException as e:  # a BaseException: it would pass every `except Exception` on its way up
        raise CorruptCheckpoint(path, f"reading its tensors failed after its manifest verified ({dcp_cause(e)}); "
                                      f"was it deleted or changed while it was read?") from None
    try:
        return unflatten(meta["state"], tensors, partial=bool(only))
    except KeyError as e:
        raise CorruptCheckpoint(path, f"{STATE_FILE} refers to tensor {e} that is not stored") from None


def dcp_inner(e: BaseException) -> BaseException:
    """The error under a torch.distributed.checkpoint failure (DCP wraps it in its own), or `e`."""
    if isinstance(e, CheckpointException) and e.failures:
        inner = next(iter(e.failures.values()))  # (exception, traceback) by rank
        e = inner[0] if isinstance(inner, tuple) else getattr(inner, "exc", inner)
    return e


def dcp_cause(e: BaseException) -> str:
    """`Type: message` of the error under a torch.distributed.checkpoint failure (DCP wraps it in its own)."""
    e = dcp_inner(e)
    return f"{type(e).__name__}: {e}"


# What a failed write's errno says to check, in a save's error line; any other error: a full disk, the usual cause.
_WRITE_ERRORS = {errno.EACCES: "no permission to write there?", errno.EPERM: "no permission to write there?",
                 errno.EROFS: "the disk is mounted read-only", errno.EIO: "the disk or its network mount failed?"}


def write_error_hint(e: BaseException) -> str:
    """A few words on what to check after a save failed with `e` (a DCP failure is read through)."""
    inner = dcp_inner(e)
    return _WRITE_ERRORS.get(inner.errno, "is the disk full?") if isinstance(inner, OSError) else "is the disk full?"


def part_info(path: pathlib.Path) -> dict[str, Any]:
    """The step, part name and sibling parts recorded in a part's state.json, its fingerprint (None: saved without
    one) and its state's skeleton (the plain values as saved, each tensor a {"__tensor__": path} reference): what
    can be checked without reading tensors."""
    meta = json.loads((path / STATE_FILE).read_text())
    fingerprint = Fingerprint(**meta["fingerprint"]) if "fingerprint" in meta else None
    return {"step": meta["step"], "part": meta["part"], "parts": tuple(meta["parts"]), "fingerprint": fingerprint,
            "state": meta["state"]}


def _check_one_save(path: pathlib.Path, fingerprints: Mapping[str, Fingerprint | None]) -> None:
    """CorruptCheckpoint if two parts of one group hold different states (their fingerprints, by part, differ): the
    step mixes two saves of it. A run resumed from an older step saves the later steps again, part by part, over
    its earlier timeline's; one of those saves cut short (a kill, a full disk) leaves a step whose every part
    verifies, that resumed into replicas that differ (ReplicaDivergence at the first outer step, each time)."""
    seen: dict[str, tuple[str, str]] = {}
    for part, fingerprint in fingerprints.items():
        if fingerprint is None:
            continue
        first = seen.setdefault(fingerprint.group, (part, fingerprint.digest))
        if first[1] != fingerprint.digest:
            raise CorruptCheckpoint(path, f"parts {first[0]} and {part} hold different global states (hashes "
                                          f"{first[1][:16]} and {fingerprint.digest[:16]}): the step mixes two "
                                          f"saves of it (a save after a resume from an older step did not finish)")


PartsCheck = Callable[[tuple[str, ...], tuple[str, ...]], str | None]
"""Given the parts of a step that are here and verify, and every part the step names, why those here are not
enough to use it (None: enough)."""


def verify_step(root: pathlib.Path, step: int, *, checksums: bool = True,
                enough: PartsCheck | None = None) -> Checkpoint:
    """The step as a Checkpoint if it can be used; CorruptCheckpoint otherwise.

    By default every part the step names must be here and verify. With `enough`, the parts that are here and
    verify are kept (a corrupt one is logged and left out) and `enough` decides whether they suffice: on a run
    whose machines save to their own disks, each machine holds only its own nodes' parts of every step.
    Checkpoint.parts lists the parts that may be read.
    """
    path = step_dir(root, step)
    present = finished_parts(path)
    if not present:
        raise CorruptCheckpoint(path, "no part finished saving")
    if checksums:
        _say_checking(path, present)
    if enough is not None:
        good: dict[str, Fingerprint | None] = {}
        named, problems = set(), []  # problems: (part, why it was left out)
        for part in present:
            try:
                verify_manifest(path / part, checksums=checksums)
                info = part_info(path / part)
            except (CorruptCheckpoint, OSError, ValueError, KeyError) as e:
                problems.append((part, e))
                log.warning("leaving part %s of checkpoint step %d out: %s", part, step, e)
                continue
            named.update(info["parts"])
            good[part] = info["fingerprint"]
        if not good:  # every part here is damaged: say that, not "0 whole nodes of the 0 that saved it"
            raise CorruptCheckpoint(path, "; ".join(
                f"part {part} is corrupt: {e.reason}" if isinstance(e, CorruptCheckpoint) else f"part {part}: {e}"
                for part, e in problems))
        # Before `enough`: a step that mixes two saves is corrupt whatever the caller needs of it (and an
        # IncompleteCheckpoint's parts are then one save's, for abandoned_steps).
        _check_one_save(path, good)
        why = enough(tuple(good), tuple(sorted(named)))
        if why is not None:
            raise IncompleteCheckpoint(path, why + "".join(f"; {e}" for _, e in problems), parts=tuple(good),
                                       named=tuple(sorted(named)), damaged=tuple(part for part, _ in problems))
        return Checkpoint(step=step, path=path, parts=tuple(good), verified=checksums)
    verify_manifest(path / present[0], checksums=checksums)
    first = part_info(path / present[0])
    parts = first["parts"]
    missing = [p for p in parts if p not in present]
    if missing:
        raise CorruptCheckpoint(path, f"part {missing[0]} of {list(parts)} is missing (that node did not finish "
                                      f"saving)")
    for part in parts:
        if part != present[0]:
            verify_manifest(path / part, checksums=checksums)
    _check_one_save(path, {part: (first if part == present[0] else part_info(path / part))["fingerprint"]
                           for part in parts})
    return Checkpoint(step=step, path=path, parts=tuple(parts), verified=checksums)


def _say_checking(path: pathlib.Path, parts: Sequence[str]) -> None:
    """Log (INFO, verify_log) the size and rough duration of checking these parts' checksums, when it is long."""
    total = 0
    for part in parts:
        with contextlib.suppress(CorruptCheckpoint, OSError, ValueError, KeyError, TypeError):  # verify says why
            total += sum(int(f["bytes"]) for f in read_manifest(path / part)["files"].values())
    if total >= SAY_CHECKING_BYTES:
        verify_log.info("checking the SHA-256 checksums of %s: %.1f GB in %d part(s), about %.0f s", path,
                        total / 1e9, len(parts), total / CHECKSUM_BYTES_PER_S)


def latest(root: pathlib.Path, *, checksums: bool = True, enough: PartsCheck | None = None,
           skipped: dict[int, Exception] | None = None) -> Checkpoint:
    """The newest usable, verified step under `root` (see verify_step for `enough`); older ones are tried when
    newer ones fail (logged). `skipped`, when given, gets why each newer step failed, by step (abandoned_steps reads
    it: checking their checksums again took as long again)."""
    steps = list_steps(root)
    problems = []
    for step in reversed(steps):
        try:
            found = verify_step(root, step, checksums=checksums, enough=enough)
        except (CorruptCheckpoint, OSError, ValueError, KeyError) as e:
            if skipped is not None:
                skipped[step] = e
            problems.append(str(e))
            log.warning("skipping checkpoint step %d: %s; falling back to the previous one", step, e)
            continue
        return found
    if not steps:
        raise CheckpointNotFound(f"no checkpoint under {root} (looked for step-NNNNNNNN directories)")
    raise CheckpointNotFound(f"no usable checkpoint under {root}: {len(steps)} step(s), none complete, intact and "
                             f"enough here: " + "; ".join(problems))


def abandoned_steps(root: pathlib.Path, steps: Sequence[int], *, enough: PartsCheck, usable: PartsCheck,
                    skipped: Mapping[int, Exception] | None = None) -> list[int]:
    """Of `steps` (after the step a resume took with `latest(root, enough=enough)`), those of another timeline: the
    parts of them that verify hold what `usable` asks (e.g. one whole node), but the parts that finished saving,
    damaged or not, would not be `enough`: some of the nodes the resume continues never saved them (a node died and
    the others saved on without it). A step that falls short only because some of its parts are damaged on disk is
    this timeline's, and one of which nothing `usable` verifies is none's: both are left to the run's own saves.

    `skipped`: what `latest` found of these steps (its argument of that name), so that their checksums are not checked
    a second time; a step not in it is verified here, checksums included.
    """
    found = []
    for step in steps:
        why = (skipped or {}).get(step)
        if why is None:
            try:
                verify_step(root, step, checksums=True, enough=enough)
                continue  # usable as it is (saved since `latest` looked): no other timeline's
            except (CorruptCheckpoint, OSError, ValueError, KeyError) as e:
                why = e
        if not isinstance(why, IncompleteCheckpoint) or usable(why.parts, why.named) is not None:
            continue  # corrupt, mixing two saves, or nothing usable verifies: no timeline to keep
        finished = tuple(sorted((set(why.parts) | set(why.damaged)) & set(why.named)))
        if enough(finished, why.named) is None:
            continue  # every node needed saved it: damaged on disk, not another timeline
        found.append(step)
    return found


def resolve(path: pathlib.Path, *, checksums: bool = True, enough: PartsCheck | None = None) -> Checkpoint:
    """A checkpoint from a path: a step directory itself, or a root (its newest usable step)."""
    if STEP_RE.match(path.name) and path.is_dir():
        return verify_step(path.parent, int(STEP_RE.match(path.name).group(1)), checksums=checksums, enough=enough)
    return latest(path, checksums=checksums, enough=enough)


def writing_pids(root: pathlib.Path, *, since: float = 0.0) -> set[int]:
    """The processes whose write of a part under `root` is under way: the pids in the names of the temporary
    directories (`write_part`) modified at `since` (a `time.time()`) or later. A writer killed mid-write leaves its
    directory until that part's next save: callers compare with processes they know are alive, started after
    `since` (a leftover whose pid a new process got is older than that process)."""
    pids = set()
    for tmp in root.glob(f"step-*/{TMP_PREFIX}*"):
        with contextlib.suppress(ValueError, IndexError, OSError):  # OSError: renamed or removed since the glob
            if tmp.stat().st_mtime >= since:
                pids.add(int(tmp.name.rsplit("-", 2)[1]))
    return pids


def check_num_keep(num_keep: int) -> None:
    """ValueError unless `num_keep` is 1 or more. With 0, prune kept every step (the oldest complete one was the
    oldest kept: the disk filled) and, with no complete step yet, raised IndexError, in a Checkpointer's writer
    thread where it was lost with the save's result."""
    if not isinstance(num_keep, int) or num_keep < 1:
        raise ValueError(f"num_keep={num_keep!r}: keep at least the newest checkpoint (num_keep=1 or more; "
                         f"checkpoint.num_keep in a recipe)")


def prune(root: pathlib.Path, part: str, *, num_keep: int, saved: int | None = None,
          usable: PartsCheck | None = None) -> list[int]:
    """Delete the steps before the `num_keep` newest complete ones, and leftovers of this part's failed saves.

    Only complete steps count (`_complete_steps`): a step whose sibling parts are still being written (an
    asynchronous save slower than a checkpoint interval), failed (a full disk) or were killed is kept, with every
    step after the oldest of the `num_keep`, so that the newest complete checkpoint is never among those removed.
    Counting steps alone, one part's writer removed its part of the last complete step while a sibling was still
    writing the next one: a kill then left no step that held every part. The steps before those are removed whole,
    their other parts too: the writer whose save completed a step is the one that can tell (a run that stops leaves
    no older part behind). A sibling's temporary directory is left alone in the steps kept (its own next save removes
    it); a step removed whole takes every part's with it. Called
    after a save succeeded (no save of this part is running then). `saved`: the step just saved; steps after it are
    another timeline's (a run resumed from an older checkpoint) and are left alone. Returns those later steps.
    `usable`: what a step's present parts must hold besides (as `latest`'s `enough`: a whole node).
    """
    check_num_keep(num_keep)
    steps = list_steps(root)
    later = [s for s in steps if saved is not None and s > saved]
    complete = _complete_steps(root, [s for s in steps if s not in later], usable)
    oldest_kept = complete[-num_keep] if len(complete) >= num_keep else None
    for step in steps:
        path = step_dir(root, step)
        for leftover in path.glob(f"{TMP_PREFIX}{part}-*"):  # no save of this part is running now
            shutil.rmtree(leftover, ignore_errors=True)
        if oldest_kept is not None and step < oldest_kept:
            with contextlib.suppress(OSError):  # removed meanwhile by a sibling's prune
                for name in finished_parts(path):
                    shutil.rmtree(path / name, ignore_errors=True)
                # And every part's leftover: a writer killed mid-save whose part never saves again (its node gone
                # for good) left a temporary directory, a whole node's state at worst, in this step for ever.
                for leftover in path.glob(f"{TMP_PREFIX}*"):
                    shutil.rmtree(leftover, ignore_errors=True)
        with contextlib.suppress(OSError):
            path.rmdir()  # fails while a sibling's leftover or a later timeline's part remains
    return later


def _complete_steps(root: pathlib.Path, steps: Sequence[int], usable: PartsCheck | None = None) -> list[int]:
    """The steps among `steps` that hold every part this disk holds of their layout, by presence (no checksums),
    and that `usable` accepts.

    A step names its parts (the nodes of its outer step, times the local ranks). A disk shared by the nodes holds
    them all; a machine saving to its own disk holds only its own nodes' parts. So, within the steps that name the
    same parts (one layout), the parts this disk holds are those that finished in any of them, and a step is
    complete when it holds all of those. A step with no finished part, or one whose state.json cannot be read,
    is not complete, nor is one whose parts' fingerprints disagree (`_mixes_two_saves`). Of a layout's first steps
    the parts held are only those saved so far: when every node's local rank 1 failed (a full disk) or was killed
    and its rank 0 saved, the step held all of them, no whole node, and its prune removed the last step that held
    one (2026-12-07); `usable` (a whole node) refuses such a step.
    """
    present: dict[int, frozenset[str]] = {}
    layout: dict[int, tuple[str, ...]] = {}
    for step in steps:
        with contextlib.suppress(OSError):
            present[step] = frozenset(finished_parts(step_dir(root, step)))
        for name in sorted(present.get(step, ())):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                layout[step] = tuple(sorted(part_info(step_dir(root, step) / name)["parts"]))
                break
    held: dict[tuple[str, ...], set[str]] = {}
    for step, parts in layout.items():  # only parts the layout names: a directory put beside them is no part
        held.setdefault(parts, set()).update(present[step] & set(parts))
    return [step for step in steps if step in layout and held[layout[step]] <= present[step]
            and (usable is None or usable(tuple(sorted(present[step])), layout[step]) is None)
            and not _mixes_two_saves(step_dir(root, step), present[step] & set(layout[step]))]


def _mixes_two_saves(path: pathlib.Path, parts: Iterable[str]) -> bool:
    """Whether the fingerprints of these parts of a step disagree (`_check_one_save`): a run rolled back to an older
    step saves the later ones again, part by part, and until its last part lands (or for good, when that part's save
    fails) such a step holds every part but is no checkpoint. Counted complete, it let prune remove the last step a
    resume could use (a kill then found none). A part whose state.json cannot be read says nothing here."""
    fingerprints = {}
    for name in sorted(parts):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            fingerprints[name] = part_info(path / name)["fingerprint"]
    try:
        _check_one_save(path, fingerprints)
    except CorruptCheckpoint:
        return True
    return False
