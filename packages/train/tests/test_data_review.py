"""Tests of bad local input the data pipeline met in review: files a download cut short, links, one huge text file.

Each is a way a user's downloaded data can look; each must either be read as the user meant or be refused with a
ConfigError that names the source, the file and what to do (not a traceback from deep inside a reader).
"""

from __future__ import annotations

import gzip
import json
import os

import pytest

from openprime.core.errors import ConfigError
from openprime.train.data import (
    DataConfig,
    WeightedSource,
    cache_key,
    load_tokenizer,
    load_tokens,
    prepare_data,
    read_documents,
    source_files,
)

DOCS = [json.dumps({"text": f"document {i}: " + "the quick brown fox " * 40}) for i in range(2000)]


def _gzipped_lines() -> bytes:
    return gzip.compress(("\n".join(DOCS) + "\n").encode())


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_a_gzip_file_a_download_cut_short_or_damaged_names_the_file(tmp_path, damage):
    """A .jsonl.gz whose download stopped half way raised EOFError ("Compressed file ended before the end-of-stream
    marker was reached"), and damaged bytes raised zlib.error: neither is an OSError, so neither named the source nor
    the file, and the run stopped with a traceback from the gzip module."""
    data = _gzipped_lines()
    data = data[:len(data) // 2] if damage == "truncated" else data[:30] + b"\x00" * 64 + data[94:]
    path = tmp_path / "web.jsonl.gz"
    path.write_bytes(data)
    with pytest.raises(ConfigError, match=r"source 'web' \(.*web.jsonl.gz\): .*web.jsonl.gz is not a complete gzip "
                                          r"file .*download it again"):
        read_documents(WeightedSource(source=str(path), name="web"), max_chars=10**9)


def test_a_large_text_file_is_read_only_as_far_as_needed(tmp_path):
    """Sources are read lazily, only as far as max_chars_per_source: a .txt file (one document) was read whole, so a
    single multi-gigabyte text dump was loaded into memory to keep its first 2M characters. Bytes that are not UTF-8
    far past the cap show whether the reader went there."""
    path = tmp_path / "dump.txt"
    with open(path, "wb") as f:
        f.write(b"in the beginning " * 10_000)  # 170,000 characters
        f.write(b"\xff\xfe not text \xff" * 1000)
    taken = read_documents(WeightedSource(source=str(path)), max_chars=5_000)
    assert taken == [("in the beginning " * 10_000)[:5_000]]
    gz = tmp_path / "dump.txt.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert read_documents(WeightedSource(source=str(gz)), max_chars=5_000) == taken
    with pytest.raises(ConfigError, match="dump.txt is not UTF-8"):  # the whole file, when it is asked for
        read_documents(WeightedSource(source=str(path)), max_chars=10**9)


def test_a_link_to_a_missing_file_in_a_source_names_the_file(tmp_path):
    """A directory copied from the Hugging Face cache with `cp -r` holds links to ../../blobs/..., which point nowhere
    in the copy. Listing the source for the cache key raised FileNotFoundError, naming neither the source nor what to
    do; the reader itself already said "cannot read"."""
    source = tmp_path / "fineweb"
    source.mkdir()
    (source / "a.txt").write_text("some text")
    (source / "b.txt").symlink_to(tmp_path / "blobs" / "b")
    cfg = DataConfig(mixture=(WeightedSource(source=str(source), name="fineweb"),))
    with pytest.raises(ConfigError, match=r"source 'fineweb' \(.*\): .*b.txt is a link to .*blobs/b, which does not "
                                          r"exist; copy the files the links point to \(cp -L\)"):
        cache_key(cfg)


def test_a_linked_subdirectory_of_a_source_is_read(tmp_path):
    """A source directory whose parts are links to other disks (data/mix/fineweb -> /mnt/nvme/fineweb) was read
    without them: os.walk does not follow links, so their files were left out without a word (or the source "holds
    no documents ... no files at all"), while the glob data/mix/**/*.txt read them. A link back up (a loop) and two
    links to one directory read each file once."""
    disk = tmp_path / "disk" / "fineweb"
    (disk / "part").mkdir(parents=True)
    (disk / "part" / "a.txt").write_text("on the other disk")
    mix = tmp_path / "mix"
    mix.mkdir()
    (mix / "b.txt").write_text("here")
    (mix / "fineweb").symlink_to(disk, target_is_directory=True)
    (mix / "again").symlink_to(disk, target_is_directory=True)
    (disk / "part" / "loop").symlink_to(disk, target_is_directory=True)
    files = source_files(WeightedSource(source=str(mix)))
    assert sorted(os.path.realpath(f) for f in files) == sorted(
        os.path.realpath(p) for p in (disk / "part" / "a.txt", mix / "b.txt"))
    only_links = tmp_path / "only-links"
    only_links.mkdir()
    (only_links / "fineweb").symlink_to(disk, target_is_directory=True)
    assert [os.path.realpath(f) for f in source_files(WeightedSource(source=str(only_links)))] == [
        os.path.realpath(disk / "part" / "a.txt")]


def test_a_lone_surrogate_escaped_in_jsonl_is_read_as_a_replacement_character(tmp_path):
    """Web text cut in the middle of an emoji holds an escaped half of a surrogate pair ("\\ud83d"): valid JSON, but
    not a character that UTF-8 (and so the tokenizer) can encode. One such record among millions stopped
    prepare_data with UnicodeEncodeError from the tokenizers library, naming neither the source, the file nor the
    line. It is read as U+FFFD, as a UTF-8 decoder reads bytes it cannot decode; a whole pair is the emoji."""
    (tmp_path / "web.jsonl").write_text('{"text": "cut \\ud83d here"}\n{"text": "whole \\ud83d\\ude00 pair"}\n')
    entry = WeightedSource(source=str(tmp_path / "web.jsonl"))
    assert read_documents(entry, max_chars=1000) == ["cut \ufffd here", "whole \U0001F600 pair"]
    prepared = prepare_data(DataConfig(mixture=(entry,), vocab_size=300, max_chars_per_source=1000,
                                       cache_dir=str(tmp_path / "cache")))
    tokenizer = load_tokenizer(prepared)
    stream = load_tokens(prepared, "train").tolist() + load_tokens(prepared, "val").tolist()
    assert {tokenizer.decode([t for t in stream if t != prepared.eot_id])} <= {
        "cut \ufffd herewhole \U0001F600 pair", "whole \U0001F600 paircut \ufffd here"}


@pytest.mark.parametrize("weights", [(1e308, 1e308), (1e-320, 1e10)])
def test_weights_whose_shares_cannot_be_computed_are_refused_with_the_config(weights):
    """Each weight was checked alone (finite, > 0), not what the batches use, their shares: weights that overflow
    their sum, or one too small next to another, gave shares of 0.0 and the run stopped later in MixtureBatches with
    "need one weight > 0 per stream", naming neither the setting nor the fix."""
    mixture = tuple(WeightedSource(source=s, weight=w) for s, w in zip(("kjv", "cpython"), weights, strict=True))
    with pytest.raises(ConfigError, match=r"DataConfig.mixture: the weights .* write them on one scale"):
        DataConfig(mixture=mixture)


def test_a_jsonl_record_whose_text_is_null_is_skipped_as_parquet_s_nulls_are(tmp_path):
    # It refused the whole source, with the advice to set text_field, which named the right field.
    (tmp_path / "web.jsonl").write_text('{"text": "first"}\n{"text": null}\n{"text": "third"}\n')
    assert read_documents(WeightedSource(source=str(tmp_path / "web.jsonl")), max_chars=1000) == ["first", "third"]
    (tmp_path / "nulls.jsonl").write_text('{"text": null}\n')  # nothing but nulls: no text, as a blank file
    with pytest.raises(ConfigError, match="holds no text"):
        read_documents(WeightedSource(source=str(tmp_path / "nulls.jsonl")), max_chars=1000)
