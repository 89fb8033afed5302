"""The manifest of a checkpoint directory: every file's size and SHA-256, checked before anything is loaded.

A checkpoint is written into a temporary directory, its manifest last, and only then renamed into
place, so a directory under its final name is complete unless the disk corrupted it afterwards, which
the checksums catch. SHA-256 (about 1.2 GB/s per core here, with the CPU's SHA instructions) rather than
a CRC because anyone can check it with `sha256sum`. The manifest itself is JSON, never pickle.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

from openprime.core.errors import OpenPrimeError

MANIFEST = "MANIFEST.json"
FORMAT = 1
READ_BYTES = 16 << 20


class CorruptCheckpoint(OpenPrimeError):
    """A checkpoint whose files do not match its manifest (or that has none)."""

    def __init__(self, path: pathlib.Path, reason: str) -> None:
        super().__init__(f"checkpoint {path} is corrupt: {reason}")
        self.path, self.reason = path, reason


def file_digest(path: pathlib.Path) -> str:
    """SHA-256 of a file's bytes, read in large blocks (hashlib releases the GIL on them)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(READ_BYTES):
            h.update(block)
    return h.hexdigest()


def fsync_path(path: pathlib.Path) -> None:
    """Flush a file or a directory entry to the disk (a rename is durable only once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(directory: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(directory: pathlib.Path) -> dict:
    """Checksum every file under `directory` and write MANIFEST.json (fsynced); returns the manifest."""
    files = {}
    for path in _files(directory):
        files[path.relative_to(directory).as_posix()] = {"bytes": path.stat().st_size, "sha256": file_digest(path)}
    manifest = {"format": FORMAT, "files": files}
    target = directory / MANIFEST
    with open(target, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return manifest


def read_manifest(directory: pathlib.Path) -> dict:
    """The manifest of a checkpoint directory, or CorruptCheckpoint if it is missing or unreadable."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        raise CorruptCheckpoint(directory, f"no {MANIFEST} (the save did not finish)") from None
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(directory, f"{MANIFEST} is unreadable: {e}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or manifest.get("format") != FORMAT:
        raise CorruptCheckpoint(directory, f"{MANIFEST} is not a format-{FORMAT} manifest")
    return manifest


def verify_manifest(directory: pathlib.Path, *, checksums: bool = True) -> dict:
    """Check every file's size (and, with `checksums`, its SHA-256) against the manifest; returns it.

    Raises CorruptCheckpoint naming the first file that is missing, truncated, grown or altered.
    """
    manifest = read_manifest(directory)
    for name, expected in manifest["files"].items():
        path = directory / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CorruptCheckpoint(directory, f"file {name} is missing") from None
        if size != expected["bytes"]:
            raise CorruptCheckpoint(directory, f"file {name} has {size} bytes, the manifest says {expected['bytes']} "
                                               f"(truncated or overwritten)")
        if checksums and file_digest(path) != expected["sha256"]:
            raise CorruptCheckpoint(directory, f"file {name} does not match its SHA-256 checksum")
    return manifest
