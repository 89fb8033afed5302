"""Tokenizing a mixture once: a byte-level BPE trained on all its sources, one token stream per source, cached.

INTELLECT-1 (arXiv 2412.01152, section 3.1) used the Llama-3 tokenizer on its Table 1 mix. Here
`prepare_data` trains a byte-level BPE (GPT-2 / Llama-3 style, with the `tokenizers` package) on the
first `max_chars_per_source` characters of every source of the mixture, then tokenizes each source
into its own stream (`tokens-NN.npy`), an end-of-text token after every document. Each source keeps its
own stream so that batches can draw from the sources by weight, and so that each source holds out its
own validation tail.

Tokenizer and streams are cached under a key hashed from everything that determines them: the sources
(for local files, their paths and sizes), the vocabulary size and `max_chars_per_source`. Weights,
names, the seed and `val_fraction` are not in it: they change which tokens a run reads, not the tokens.
`prepare_data` is idempotent and safe to run from several processes at once: every file is written
to a temporary name in the same directory and moved into place with `os.replace`, and `meta.json`,
written last, marks a complete entry. The launcher calls it once; every node then finds the entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import platform
import sys
import tempfile
import time
from typing import Any

import attrs
import numpy as np

from openprime.core.errors import ConfigError
from openprime.train.data.config import DataConfig, Source, Split, WeightedSource
from openprime.train.data.sources import read_documents, source_fingerprint

# Bump when the text extraction, the tokenizer recipe or the file layout changes: it is part of the
# cache key, so old entries are simply not found again.
FORMAT_VERSION = 3  # 3: "<|end_of_text|>" inside a document is text (tokenize_documents)
EOT_TOKEN = "<|end_of_text|>"  # Llama-3's name for the end-of-document token
_DOC_ORDER_SEED = 0  # fixed: the order of documents is part of the cached stream, not of a run


@attrs.frozen(kw_only=True)
class PreparedSource:
    """One source's token stream in the cache."""

    spec: str  # the source as configured: corpus name or path
    tokens_path: pathlib.Path
    num_documents: int
    num_chars: int
    num_tokens: int
    tokens_sha256: str


@attrs.frozen(kw_only=True)
class PreparedData:
    """The cached result of `prepare_data`: the tokenizer and one token stream per source, in mixture order."""

    directory: pathlib.Path
    tokenizer_path: pathlib.Path
    vocab_size: int  # of the trained tokenizer; can be below the configured size on very little text
    eot_id: int
    sources: tuple[PreparedSource, ...]
    tokens_sha256: str  # over every source's stream: nodes on different machines compare it
    val_fraction: float

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sources)

    @property
    def num_documents(self) -> int:
        return sum(s.num_documents for s in self.sources)


# ---------------------------------------------------------------- tokenizer


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
    """One stream: each document's tokens followed by the end-of-text token. The text "<|end_of_text|>" inside a
    document (a tokenizer's code, a chat log) is encoded as text: it became the end-of-text id, a document boundary
    the model saw where there was none (until 2026-12-07, format 2)."""
    encode_special_tokens = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True
    try:
        encodings = tokenizer.encode_batch(documents, add_special_tokens=False)
    finally:
        tokenizer.encode_special_tokens = encode_special_tokens
    stream = np.empty(sum(len(e.ids) + 1 for e in encodings), dtype=dtype)
    offset = 0
    for encoding in encodings:
        stream[offset:offset + len(encoding.ids)] = encoding.ids
        offset += len(encoding.ids)
        stream[offset] = eot_id
        offset += 1
    return stream


def load_tokenizer(prepared: PreparedData):  # -> tokenizers.Tokenizer
    """The trained tokenizer (`encode(text).ids`, `decode(ids)`)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(prepared.tokenizer_path))


# ---------------------------------------------------------------- cache


def default_cache_dir() -> pathlib.Path:
    """$OPENPRIME_CACHE, else ~/.cache/openprime."""
    return pathlib.Path(os.environ.get("OPENPRIME_CACHE") or pathlib.Path.home() / ".cache" / "openprime")


def _source_key(entry: WeightedSource, fingerprint: list[list[str | int]] | None) -> dict[str, Any]:
    corpus = entry.corpus
    if corpus is Source.CPYTHON:  # the standard library differs between Python versions
        return {"corpus": corpus.value, "python": ".".join(platform.python_version_tuple()[:2])}
    if corpus is not None:
        return {"corpus": corpus.value}
    files = json.dumps(fingerprint).encode()
    return {"path": entry.spec, "text_field": entry.text_field, "files": hashlib.sha256(files).hexdigest()}


def cache_key(cfg: DataConfig) -> str:
    """Hash of everything that determines the tokenizer and the streams (not weights, names, seed, val_fraction).

    Raises ConfigError if a local source is missing or empty, or if two read a file in common (it lists the files
    to hash them).
    """
    fingerprints = {i: source_fingerprint(entry) for i, entry in enumerate(cfg.mixture) if entry.corpus is None}
    _refuse_shared_files(cfg, fingerprints)
    parts: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "sources": [_source_key(entry, fingerprints.get(i)) for i, entry in enumerate(cfg.mixture)],
        "vocab_size": cfg.vocab_size,
        "max_chars_per_source": cfg.max_chars_per_source,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _atomic_write(path: pathlib.Path, write: Any) -> None:
    """Call write(file) on a temporary file next to `path`, then move it into place atomically."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise _unwritable_cache(path.parent, e) from e
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        pathlib.Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise _unwritable_cache(path.parent, e) from e
        raise


def _unwritable_cache(directory: pathlib.Path, e: OSError) -> ConfigError:
    """A read-only home (a container's), a full disk: said as what to change, not as a traceback."""
    return ConfigError(f"cannot write the data cache {directory}: {e.strerror or e} ({e.filename or directory}); set "
                       f"data.cache_dir (--set data.cache_dir=DIR) or $OPENPRIME_CACHE to a directory this user can "
                       f"write, with room for the tokenized data")


def progress(message: str) -> None:
    print(f"openprime data: {message}", file=sys.stderr, flush=True)


def _prepared_from_meta(directory: pathlib.Path, meta: dict[str, Any], val_fraction: float) -> PreparedData:
    sources = tuple(PreparedSource(spec=s["spec"], tokens_path=directory / s["file"], num_documents=s["num_documents"],
                                   num_chars=s["num_chars"], num_tokens=s["num_tokens"],
                                   tokens_sha256=s["tokens_sha256"]) for s in meta["sources"])
    return PreparedData(directory=directory, tokenizer_path=directory / "tokenizer.json",
                        vocab_size=meta["tokenizer_vocab_size"], eot_id=meta["eot_id"], sources=sources,
                        tokens_sha256=meta["tokens_sha256"], val_fraction=val_fraction)


def _read_complete_entry(directory: pathlib.Path, key: str) -> dict[str, Any] | None:
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if meta.get("key") != key or not (directory / "tokenizer.json").is_file():
        return None
    return meta if all((directory / s["file"]).is_file() for s in meta["sources"]) else None


def read_mixture(cfg: DataConfig) -> list[list[str]]:
    """Each source's documents (its first `max_chars_per_source` characters), in a fixed shuffled order.

    Shuffled so that each source's validation tail, its last tokens, is a sample of the source rather
    than its last files (the Bible's last book, the standard library's last packages).
    """
    per_source = []
    for entry in cfg.mixture:
        documents = read_documents(entry, cfg.max_chars_per_source)
        order = np.random.default_rng(_DOC_ORDER_SEED).permutation(len(documents))
        per_source.append([documents[i] for i in order])
    return per_source


def _refuse_shared_files(cfg: DataConfig, fingerprints: dict[int, list[list[str | int]]]) -> None:
    """ConfigError when two local sources of the mixture read a file in common (a directory and a glob inside it, a
    relative and an absolute path: DataConfig compares the paths as written). The same documents would count twice,
    so the weights would not be those written, and one source's held-out tail would be the other's training text.
    `fingerprints`: the local sources' `source_fingerprint`s by mixture index (their files are listed once)."""
    owner: dict[str, int] = {}
    for i, fingerprint in fingerprints.items():
        for path, *_ in fingerprint:
            first = owner.setdefault(os.path.realpath(path), i)
            if first != i:
                raise ConfigError(f"DataConfig.mixture entries {first} ({cfg.mixture[first].label!r}) and {i} "
                                  f"({cfg.mixture[i].label!r}) both read {path}: the same documents would count twice "
                                  f"and one source's validation text would be the other's training text; give each "
                                  f"file to one source (a narrower path or glob)")


def prepare_data(cfg: DataConfig) -> PreparedData:
    """Train the tokenizer and tokenize the sources once; later calls return the cached entry.

    Takes a few seconds for the default 2M characters per source; prints progress to stderr. Raises
    ConfigError naming the source and the path when a local source is missing, empty or unreadable.
    """
    key = cache_key(cfg)
    directory = pathlib.Path(cfg.cache_dir).expanduser() if cfg.cache_dir is not None else default_cache_dir()
    directory = directory / f"data-{key}"
    meta = _read_complete_entry(directory, key)
    if meta is not None:
        return _prepared_from_meta(directory, meta, cfg.val_fraction)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unwritable_cache(directory, e) from e

    start = time.perf_counter()
    per_source = read_mixture(cfg)
    num_chars = [sum(len(d) for d in documents) for documents in per_source]
    progress(f"training a {cfg.vocab_size}-token byte-level BPE on {sum(num_chars):,} characters from "
             + ", ".join(f"{e.label} ({n:,})" for e, n in zip(cfg.mixture, num_chars, strict=True)))
    tokenizer = train_tokenizer([d for documents in per_source for d in documents], cfg.vocab_size)
    eot_id = tokenizer.token_to_id(EOT_TOKEN)
    dtype = np.dtype(np.uint16 if tokenizer.get_vocab_size() <= np.iinfo(np.uint16).max + 1 else np.uint32)
    _atomic_write(directory / "tokenizer.json", lambda f: f.write(tokenizer.to_str().encode()))

    sources = []
    for i, (entry, documents) in enumerate(zip(cfg.mixture, per_source, strict=True)):
        stream = tokenize_documents(tokenizer, documents, eot_id, dtype)
        name = f"tokens-{i:02d}.npy"
        _atomic_write(directory / name, lambda f, stream=stream: np.save(f, stream))
        sources.append({"spec": entry.spec, "file": name, "num_documents": len(documents), "num_chars": num_chars[i],
                        "num_tokens": int(len(stream)), "tokens_sha256": hashlib.sha256(stream.tobytes()).hexdigest()})
        progress(f"{entry.label}: {len(documents):,} documents, {len(stream):,} tokens "
                 f"({num_chars[i] / len(stream):.2f} characters per token)")
    progress(f"done in {time.perf_counter() - start:.1f} s -> {directory}")

    meta = {
        "key": key, "format": FORMAT_VERSION, "vocab_size": cfg.vocab_size,
        "tokenizer_vocab_size": tokenizer.get_vocab_size(), "max_chars_per_source": cfg.max_chars_per_source,
        "python": platform.python_version(), "dtype": dtype.name, "eot_id": eot_id, "sources": sources,
        "tokens_sha256": hashlib.sha256("".join(s["tokens_sha256"] for s in sources).encode()).hexdigest(),
    }
    _atomic_write(directory / "meta.json", lambda f: f.write(json.dumps(meta, indent=1).encode()))
    return _prepared_from_meta(directory, meta, cfg.val_fraction)


# ---------------------------------------------------------------- reading the streams


def source_index(prepared: PreparedData, source: int | str) -> int:
    """The position of `source` (an index, or its spec: corpus name or path) among the prepared sources."""
    if isinstance(source, int):
        if not 0 <= source < len(prepared.sources):
            raise ConfigError(f"source index {source} is outside the mixture's {len(prepared.sources)} sources")
        return source
    specs = [s.spec for s in prepared.sources]
    if source not in specs:
        raise ConfigError(f"no source {source!r} in the prepared data; it has: {', '.join(specs)}")
    return specs.index(source)


def load_tokens(prepared: PreparedData, split: Split | str, source: int | str | None = None) -> np.ndarray:
    """The train or validation part of one source's stream, memory-mapped (read-only, no copy).

    `source` is an index into the mixture or a source's spec. With None and a mixture of several
    sources, the sources' parts are concatenated into one array in memory (a copy): a convenience for
    tools; training reads each source on its own (`node_batches`).
    """
    split = Split(split)
    if source is None and len(prepared.sources) > 1:
        return np.concatenate([load_tokens(prepared, split, i) for i in range(len(prepared.sources))])
    stream = np.load(prepared.sources[source_index(prepared, source or 0)].tokens_path, mmap_mode="r")
    boundary = len(stream) - int(len(stream) * prepared.val_fraction)
    return stream[:boundary] if split is Split.TRAIN else stream[boundary:]


def check_matches(prepared: PreparedData, cfg: DataConfig) -> None:
    """Refuse prepared data that was made for another mixture (the streams would not be the sources)."""
    specs = [s.spec for s in prepared.sources]
    if specs != [entry.spec for entry in cfg.mixture]:
        raise ConfigError(f"the prepared data holds the sources {specs} but DataConfig.mixture has "
                          f"{[entry.spec for entry in cfg.mixture]}; call prepare_data with this config")


__all__ = ["EOT_TOKEN", "FORMAT_VERSION", "PreparedData", "PreparedSource", "cache_key", "check_matches",
           "default_cache_dir", "load_tokenizer", "load_tokens", "prepare_data", "read_mixture", "source_index",
           "tokenize_documents", "train_tokenizer"]
