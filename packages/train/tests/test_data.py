"""Tests of the data pipeline on the built-in corpora: tokenizer, cache, splits, packed batches, the config.

Mixtures of local files, their batches and the tokenizer tool are tested in test_data_mixture.py.
"""

from __future__ import annotations

import time

import attrs
import numpy as np
import pytest
import torch

from openprime.core.config import override
from openprime.core.errors import ConfigError
from openprime.train.data import (
    DataConfig,
    PackedBatches,
    Source,
    Split,
    WeightedSource,
    cache_key,
    cpython_documents,
    kjv_documents,
    load_tokenizer,
    load_tokens,
    prepare_data,
)

SMALL_CHARS = 200_000


@pytest.fixture(scope="module")
def small_cfg(tmp_path_factory) -> DataConfig:
    cache = tmp_path_factory.mktemp("openprime-cache")
    return DataConfig(vocab_size=4096, max_chars_per_source=SMALL_CHARS, val_fraction=0.05, cache_dir=str(cache))


@pytest.fixture(scope="module")
def prepared(small_cfg):
    return prepare_data(small_cfg)


def test_kjv_documents_are_chapters_without_verse_numbers():
    first = next(kjv_documents())
    assert first.startswith("Genesis 1\n\nIn the beginning God created")
    assert "1:2" not in first and "And the earth was without form" in first
    assert "31:49" not in next(d for d in kjv_documents() if d.startswith("Genesis 31\n"))


def test_cpython_documents_are_standard_library_sources():
    first = next(cpython_documents())
    assert "__future__" in first or "import" in first


def test_tokenizer_round_trips_real_text(prepared):
    tokenizer = load_tokenizer(prepared)
    verse = next(kjv_documents()).split("\n\n", 1)[1][:400]
    code = 'def f(x: int) -> str:\n    """Docstring."""\n    return f"{x!r:>10}"  # ünïcødé\n\tpass\n'
    for text in (verse, code):
        ids = tokenizer.encode(text).ids
        assert tokenizer.decode(ids) == text
    # A trained BPE compresses English prose well below one token per byte.
    assert len(tokenizer.encode(verse).ids) < len(verse.encode()) / 2.5


def test_the_end_of_text_token_s_name_inside_a_document_is_text(prepared):
    """Code and web text contain "<|end_of_text|>": it was encoded as the end-of-text id, a document boundary the
    model saw where there was none, and the document did not decode back (review of 2026-12-07)."""
    from openprime.train.data.prepare import EOT_TOKEN, tokenize_documents

    tokenizer = load_tokenizer(prepared)
    document = f'EOT = "{EOT_TOKEN}"  # Llama-3\'s end of a document'
    stream = tokenize_documents(tokenizer, [document, "and the next"], prepared.eot_id, np.uint16)
    ends = np.flatnonzero(stream == prepared.eot_id).tolist()
    assert len(ends) == 2 and ends[-1] == len(stream) - 1  # one after each document, none inside
    assert tokenizer.decode(stream[:ends[0]].tolist()) == document
    assert not tokenizer.encode_special_tokens  # the tokenizer is left as it was


def test_vocab_size_and_streams(prepared, small_cfg):
    assert prepared.vocab_size == load_tokenizer(prepared).get_vocab_size() == small_cfg.vocab_size
    assert [s.spec for s in prepared.sources] == ["kjv", "cpython"]
    for source in prepared.sources:
        stream = np.load(source.tokens_path)
        assert stream.dtype == np.uint16
        assert len(stream) == source.num_tokens
        assert stream.max() < small_cfg.vocab_size
        assert (stream == prepared.eot_id).sum() == source.num_documents
        assert stream[-1] == prepared.eot_id
        assert 0 < source.num_chars <= SMALL_CHARS
    assert prepared.num_tokens == sum(s.num_tokens for s in prepared.sources)


def test_train_and_val_split_each_source(prepared):
    for i, source in enumerate(prepared.sources):
        train, val = load_tokens(prepared, Split.TRAIN, i), load_tokens(prepared, "val", source.spec)
        assert len(train) + len(val) == source.num_tokens
        assert len(val) == int(source.num_tokens * 0.05)
        assert np.array_equal(np.concatenate([train, val]), np.load(source.tokens_path))
    # Without a source: every source's part, in mixture order.
    assert np.array_equal(load_tokens(prepared, Split.TRAIN),
                          np.concatenate([load_tokens(prepared, Split.TRAIN, i) for i in range(2)]))


def test_prepare_twice_reuses_the_cache(prepared, small_cfg):
    mtimes = {p: p.stat().st_mtime_ns for p in prepared.directory.iterdir()}
    start = time.perf_counter()
    again = prepare_data(small_cfg)
    assert time.perf_counter() - start < 0.1
    assert again == prepared
    assert {p: p.stat().st_mtime_ns for p in again.directory.iterdir()} == mtimes
    assert not [p for p in prepared.directory.iterdir() if p.name.endswith(".tmp")]
    # val_fraction, seed, weights and names do not change the tokens, so they share the entry.
    assert prepare_data(attrs.evolve(small_cfg, val_fraction=0.1, seed=3)).directory == prepared.directory
    weighted = (WeightedSource(source=Source.KJV, weight=3.0, name="bible"), WeightedSource(source="cpython"))
    assert prepare_data(attrs.evolve(small_cfg, mixture=weighted)).directory == prepared.directory
    # The sources do.
    assert cache_key(attrs.evolve(small_cfg, sources=(Source.KJV,))) != cache_key(small_cfg)
    assert cache_key(attrs.evolve(small_cfg, sources=(Source.CPYTHON, Source.KJV))) != cache_key(small_cfg)


def test_preparation_is_deterministic(prepared, small_cfg, tmp_path):
    elsewhere = prepare_data(attrs.evolve(small_cfg, cache_dir=str(tmp_path)))
    assert elsewhere.directory != prepared.directory
    assert elsewhere.tokens_sha256 == prepared.tokens_sha256
    assert elsewhere.tokenizer_path.read_text() == prepared.tokenizer_path.read_text()


def test_nodes_get_disjoint_sequences_covering_the_stream(prepared):
    tokens = load_tokens(prepared, Split.TRAIN)
    seq_len, num_nodes = 64, 3
    num_rows = len(tokens) // (seq_len + 1)
    seen: list[bytes] = []
    for rank in range(num_nodes):
        batches = PackedBatches(tokens, seq_len=seq_len, batch_size=1, node_rank=rank, num_nodes=num_nodes,
                                seed=0)
        rows = [next(batches) for _ in range(batches.batches_per_epoch)]
        seen.extend(torch.cat([x[0], y[0, -1:]]).numpy().astype(np.uint16).tobytes() for x, y in rows)
    expected = [tokens[i * (seq_len + 1):(i + 1) * (seq_len + 1)].tobytes() for i in range(num_rows)]
    assert sorted(seen) == sorted(expected)  # every row exactly once across the nodes


def test_batches_shapes_and_shift(prepared):
    tokens = load_tokens(prepared, Split.TRAIN)
    batches = PackedBatches(tokens, seq_len=32, batch_size=4, node_rank=0, num_nodes=2, seed=0)
    inputs_BL, targets_BL = next(batches)
    assert inputs_BL.shape == targets_BL.shape == (4, 32)
    assert inputs_BL.dtype == targets_BL.dtype == torch.int64
    assert torch.equal(inputs_BL[:, 1:], targets_BL[:, :-1])
    # Each row is a contiguous run of the stream starting at a multiple of seq_len + 1.
    for row_L, last in zip(inputs_BL.numpy(), targets_BL[:, -1].numpy(), strict=True):
        starts = [s for s in range(0, len(tokens) - 32, 33) if np.array_equal(tokens[s:s + 32], row_L)]
        assert starts and tokens[starts[0] + 32] == last


def test_epochs_reshuffle_and_wrap(prepared):
    tokens = load_tokens(prepared, Split.TRAIN)[:33 * 40]
    batches = PackedBatches(tokens, seq_len=32, batch_size=8, node_rank=0, num_nodes=1, seed=0)
    assert batches.batches_per_epoch == 5
    epoch0 = [next(batches)[0] for _ in range(5)]
    epoch1 = [next(batches)[0] for _ in range(5)]
    assert batches.state_dict()["epoch"] == 1
    key = lambda batch: sorted(map(bytes, batch.numpy()))  # noqa: E731
    assert sorted(r for b in epoch0 for r in key(b)) == sorted(r for b in epoch1 for r in key(b))
    assert not all(torch.equal(a, b) for a, b in zip(epoch0, epoch1, strict=True))


def test_state_dict_resumes_exactly(prepared):
    tokens = load_tokens(prepared, Split.TRAIN)
    make = lambda: PackedBatches(tokens, seq_len=16, batch_size=8, node_rank=1, num_nodes=2, seed=7)  # noqa: E731
    original = make()
    for _ in range(original.batches_per_epoch - 2):  # stop near an epoch boundary
        next(original)
    state = original.state_dict()
    expected = [next(original) for _ in range(5)]
    resumed = make()
    resumed.load_state_dict(state)
    for (x, y), (rx, ry) in zip(expected, (next(resumed) for _ in range(5)), strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    with pytest.raises(ValueError, match="num_nodes"):
        PackedBatches(tokens, seq_len=16, batch_size=8, node_rank=1, num_nodes=3, seed=7).load_state_dict(state)


def test_same_seed_same_batches_other_seed_other_order(prepared):
    tokens = load_tokens(prepared, Split.TRAIN)
    make = lambda seed: PackedBatches(tokens, seq_len=32, batch_size=4, node_rank=0, num_nodes=1, seed=seed)  # noqa: E731
    a, b, c = make(0), make(0), make(1)
    for _ in range(3):
        xa, xb, xc = next(a)[0], next(b)[0], next(c)[0]
        assert torch.equal(xa, xb)
    assert not torch.equal(xa, xc)


def test_too_little_data_is_refused():
    with pytest.raises(ConfigError, match="batch_size"):
        PackedBatches(np.arange(100, dtype=np.uint16), seq_len=32, batch_size=4, node_rank=0, num_nodes=1,
                      seed=0)
    with pytest.raises(ConfigError, match="node_rank"):
        PackedBatches(np.arange(100, dtype=np.uint16), seq_len=8, batch_size=1, node_rank=2, num_nodes=2,
                      seed=0)


@pytest.mark.parametrize(("changes", "message"), [
    ({"sources": ()}, "DataConfig.sources is empty"),
    ({"sources": (Source.KJV, Source.KJV)}, "twice"),
    ({"sources": ("kjv",)}, "DataConfig.sources"),
    ({"mixture": ()}, "DataConfig.mixture is empty"),
    ({"mixture": ("kjv",)}, r"DataConfig.mixture\[0\] is 'kjv', not a WeightedSource"),
    ({"mixture": (WeightedSource(source="/data/x", weight=2.0),), "sources": (Source.KJV,)}, "set only mixture"),
    ({"vocab_size": 200}, "DataConfig.vocab_size"),
    ({"val_fraction": 1.0}, "DataConfig.val_fraction"),
    ({"max_chars_per_source": 0}, "DataConfig.max_chars_per_source"),
])
def test_bad_configs_are_refused(changes, message):
    with pytest.raises(ConfigError, match=message):
        DataConfig(**changes)


def test_the_default_is_kjv_and_cpython_with_equal_weights():
    cfg = DataConfig()
    assert [entry.corpus for entry in cfg.mixture] == [Source.KJV, Source.CPYTHON]
    assert cfg.weights == (0.5, 0.5)


def test_sources_is_a_shorthand_for_an_equal_mixture():
    cfg = DataConfig(sources=(Source.CPYTHON,))
    assert cfg == DataConfig(mixture=(WeightedSource(source=Source.CPYTHON),))
    assert cfg.sources is None and cfg.weights == (1.0,)
    # A plain mixture of corpora can be replaced by sources (as --set data.sources=... does) ...
    assert attrs.evolve(cfg, sources=(Source.KJV,)).mixture == (WeightedSource(source=Source.KJV),)
    # ... a weighted one cannot: the weights would be lost silently.
    weighted = DataConfig(mixture=(WeightedSource(source=Source.KJV, weight=2.0),))
    with pytest.raises(ConfigError, match="set only mixture"):
        attrs.evolve(weighted, sources=(Source.KJV,))


def test_sources_can_be_set_from_the_command_line():
    assert override(DataConfig(), "sources", "kjv").mixture == (WeightedSource(source=Source.KJV),)
    assert [e.corpus for e in override(DataConfig(), "sources", "cpython,kjv").mixture] == [Source.CPYTHON,
                                                                                             Source.KJV]
