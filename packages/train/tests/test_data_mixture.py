"""Tests of weighted mixtures of local sources (paper Table 1): reading files, weighted and disjoint batches,
exact resume, validation batches, the errors a user sees, and tools/train_tokenizer.py."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import pathlib
import subprocess
import sys
from collections import Counter

import attrs
import numpy as np
import pytest

from openprime.core.errors import ConfigError
from openprime.train.data import (
    DataConfig,
    MixtureBatches,
    PackedBatches,
    Source,
    Split,
    WeightedSource,
    cache_key,
    cpython_documents,
    kjv_documents,
    layout_changes,
    load_tokens,
    node_batches,
    parse_mixture,
    prepare_data,
    read_documents,
    source_files,
    validation_batches,
)

ROOT = pathlib.Path(__file__).resolve().parents[3]
SEQ_LEN, BATCH_SIZE = 16, 10
WEIGHTS = (55.0, 25.0, 20.0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> pathlib.Path:
    """Real text as a user would download it: a directory of .txt chapters and a gzipped .jsonl of code."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "bible" / "nested").mkdir(parents=True)
    for i, chapter in enumerate(itertools.islice(kjv_documents(), 40)):
        (root / "bible" / ("nested" if i % 2 else "") / f"chapter{i:03d}.txt").write_text(chapter)
    (root / "bible" / "README.md").write_text("not a document: only .txt / .jsonl / .parquet are read")
    code = itertools.islice(cpython_documents(), 200, 240)  # not the files the cpython corpus starts with
    with gzip.open(root / "code.jsonl.gz", "wt", encoding="utf-8") as f:
        for i, text in enumerate(code):
            f.write(json.dumps({"id": i, "content": text}) + "\n")
    return root


@pytest.fixture(scope="module")
def cfg(corpus, tmp_path_factory) -> DataConfig:
    mixture = (WeightedSource(source=str(corpus / "bible"), weight=WEIGHTS[0], name="bible"),
               WeightedSource(source=str(corpus / "code.jsonl.gz"), weight=WEIGHTS[1], text_field="content",
                              name="code"),
               WeightedSource(source=Source.CPYTHON, weight=WEIGHTS[2]))
    return DataConfig(mixture=mixture, vocab_size=512, max_chars_per_source=60_000, val_fraction=0.1,
                      cache_dir=str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def prepared(cfg):
    return prepare_data(cfg)


def _row_sources(prepared, split: Split) -> dict[bytes, int]:
    """Which source each sequence (row of SEQ_LEN + 1 tokens) of `split` comes from."""
    owner: dict[bytes, int] = {}
    for i in range(len(prepared.sources)):
        tokens = load_tokens(prepared, split, i)
        for r in range(len(tokens) // (SEQ_LEN + 1)):
            row = tokens[r * (SEQ_LEN + 1):(r + 1) * (SEQ_LEN + 1)].astype(np.int64).tobytes()
            assert owner.setdefault(row, i) == i, "two sources share a sequence: the test could not tell them apart"
    return owner


def _rows_of(batch) -> list[bytes]:
    inputs_BL, targets_BL = batch
    full_BS = np.concatenate([inputs_BL.numpy(), targets_BL[:, -1:].numpy()], axis=1)
    return [row.tobytes() for row in full_BS]


def _draw(prepared, cfg, *, slot: int, num_slots: int, num_batches: int):
    batches = node_batches(prepared, cfg, seq_len=SEQ_LEN, batch_size=BATCH_SIZE, slot=slot, num_slots=num_slots)
    drawn = [next(batches) for _ in range(num_batches)]
    return batches, drawn


def test_local_sources_are_read_as_documents(corpus, cfg):
    bible, code, _ = cfg.mixture
    files = source_files(bible)
    assert files == sorted(files)
    assert len(files) == 40 and all(f.suffix == ".txt" for f in files)  # README.md is not a document
    assert read_documents(bible, 10**9)[0].startswith("Genesis 1\n\n")
    documents = read_documents(code, 10**9)
    assert len(documents) == 40 and documents[0] == next(itertools.islice(cpython_documents(), 200, None))
    assert sum(map(len, read_documents(code, 1000))) == 1000  # max_chars cuts the source short
    glob_entry = WeightedSource(source=str(corpus / "bible" / "**" / "*.txt"))
    assert source_files(glob_entry) == files


def test_each_source_is_tokenized_on_its_own(prepared, cfg):
    assert [s.spec for s in prepared.sources] == [e.spec for e in cfg.mixture]
    assert all(0 < s.num_chars <= cfg.max_chars_per_source for s in prepared.sources)
    assert prepared.vocab_size == 512


def test_batches_draw_from_the_sources_by_weight(prepared, cfg):
    owner = _row_sources(prepared, Split.TRAIN)
    batches, drawn = _draw(prepared, cfg, slot=0, num_slots=2, num_batches=300)
    per_source = Counter(owner[row] for batch in drawn for row in _rows_of(batch))
    shares = np.array([per_source[i] for i in range(3)]) / (300 * BATCH_SIZE)
    # Expected exactly the weights; the per-batch remainder draw leaves well under 1% over 3000 sequences.
    assert np.allclose(shares, np.array(WEIGHTS) / sum(WEIGHTS), atol=0.01), shares
    # Every batch is within one sequence of batch_size * weight (5.5, 2.5, 2.0 here).
    batches, drawn = _draw(prepared, cfg, slot=0, num_slots=2, num_batches=50)
    for batch in drawn:
        counts = Counter(owner[row] for row in _rows_of(batch))
        assert counts[0] in (5, 6) and counts[1] in (2, 3) and counts[2] == 2
    assert batches.last_counts == tuple(Counter(owner[row] for row in _rows_of(drawn[-1]))[i] for i in range(3))


# Synthetic streams where every token is its own position plus SOURCE_STRIDE * source: each sequence
# tells which source and which row it is, even where real text repeats itself.
SOURCE_STRIDE = 10**7
SYNTHETIC_ROWS = (1500, 700, 400)


def _synthetic(*, slot: int, num_slots: int, seed: int = 0, batch_size: int = BATCH_SIZE) -> MixtureBatches:
    streams = [np.arange(n * (SEQ_LEN + 1), dtype=np.uint32) + i * SOURCE_STRIDE
               for i, n in enumerate(SYNTHETIC_ROWS)]
    return MixtureBatches(streams, WEIGHTS, seq_len=SEQ_LEN, batch_size=batch_size, slot=slot, num_slots=num_slots,
                          seed=seed)


def _source_rows(batch) -> list[tuple[int, int]]:
    """(source, row) of every sequence of a synthetic batch, after checking it is a whole row, shifted."""
    inputs_BL, targets_BL = batch
    first_B = inputs_BL[:, 0].numpy()
    expected_BL = first_B[:, None] + np.arange(SEQ_LEN)
    assert np.array_equal(inputs_BL.numpy(), expected_BL) and np.array_equal(targets_BL.numpy(), expected_BL + 1)
    assert np.all(first_B % SOURCE_STRIDE % (SEQ_LEN + 1) == 0)
    return [(int(t // SOURCE_STRIDE), int(t % SOURCE_STRIDE // (SEQ_LEN + 1))) for t in first_B]


def test_slots_get_disjoint_shares_of_every_source():
    seen = []
    for slot in range(3):
        batches = _synthetic(slot=slot, num_slots=3)
        drawn = {row for _ in range(300) for row in _source_rows(next(batches))}
        assert min(batches.epochs) >= 1  # every source went round at least once
        assert all(row % 3 == slot for _, row in drawn)
        seen.append(drawn)
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])
    # Together the slots cover every sequence of every source.
    assert seen[0] | seen[1] | seen[2] == {(i, r) for i, n in enumerate(SYNTHETIC_ROWS) for r in range(n)}


def test_a_source_that_runs_out_starts_its_next_epoch():
    batches = _synthetic(slot=1, num_slots=2)
    uses: Counter = Counter()
    for _ in range(400):
        uses.update(_source_rows(next(batches)))
        # No sequence repeats before its source has used all the slot's: after any batch the use counts of a
        # source's rows differ by at most one.
        for i in range(3):
            counts = [uses[(i, r)] for r in range(1, SYNTHETIC_ROWS[i], 2)]
            assert max(counts) - min(counts) <= 1
    for i, source in enumerate(batches.sources):
        assert len(source.row_ids) == SYNTHETIC_ROWS[i] // 2
        drawn = sum(n for (s, _), n in uses.items() if s == i)
        assert batches.epochs[i] == drawn // len(source.row_ids)  # epochs are counted per source
    # The 20% source, a quarter the size of the 55% one, wraps more often.
    assert batches.epochs[2] > batches.epochs[0] >= 1


def test_every_epoch_is_a_new_permutation():
    one = MixtureBatches([np.arange(40 * (SEQ_LEN + 1), dtype=np.uint32)], [1.0], seq_len=SEQ_LEN, batch_size=8,
                         slot=0, num_slots=1, seed=0)
    epochs = [[row for _ in range(5) for _, row in _source_rows(next(one))] for _ in range(3)]
    assert all(sorted(rows) == list(range(40)) for rows in epochs)
    assert epochs[0] != epochs[1] != epochs[2] and one.epochs == [3]


def test_proportions_converge_to_the_weights():
    batches = _synthetic(slot=0, num_slots=1, seed=5)
    totals = np.zeros(3)
    for _ in range(1000):
        counts = np.bincount([source for source, _ in _source_rows(next(batches))], minlength=3)
        assert np.array_equal(counts, batches.last_counts)
        totals += counts
    # 10,000 sequences: the remainder draw's noise is about 0.3% of a share; 1% is a wide margin.
    assert np.allclose(totals / totals.sum(), np.array(WEIGHTS) / sum(WEIGHTS), atol=0.01), totals


def test_state_dict_resumes_exactly():
    for stop in (0, 1, 137, 251):  # 251 batches: every source is past an epoch boundary
        batches = _synthetic(slot=1, num_slots=2, seed=3)
        for _ in range(stop):
            next(batches)
        state = json.loads(json.dumps(batches.state_dict()))  # it goes into a JSON checkpoint
        assert all(isinstance(v, int) or all(isinstance(x, int) for x in v) for v in state.values())
        expected = [next(batches) for _ in range(60)]
        resumed = _synthetic(slot=1, num_slots=2, seed=3)
        resumed.load_state_dict(state)
        for (x, y), (rx, ry) in zip(expected, (next(resumed) for _ in range(60)), strict=True):
            assert x.equal(rx) and y.equal(ry)
        assert resumed.state_dict() == batches.state_dict()
    with pytest.raises(ValueError, match="slot"):
        _synthetic(slot=0, num_slots=2, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        _synthetic(slot=1, num_slots=2, seed=4).load_state_dict(state)
    old = PackedBatches(np.arange(1000, dtype=np.uint16), seq_len=SEQ_LEN, batch_size=2, node_rank=0, num_nodes=1,
                        seed=0)
    with pytest.raises(ValueError, match="not saved by MixtureBatches"):
        _synthetic(slot=1, num_slots=2).load_state_dict(old.state_dict())


def test_a_resume_with_another_batch_size_continues_every_source_where_it_was():
    """The positions count sequences: with batch size 3 instead of 10, each source goes on with the very sequences
    (in its epoch's order) that it would have given next at 10, none skipped and none read twice."""
    batches = _synthetic(slot=1, num_slots=2, seed=3)
    for _ in range(137):
        next(batches)
    state = json.loads(json.dumps(batches.state_dict()))
    resumed = _synthetic(slot=1, num_slots=2, seed=3, batch_size=3)
    resumed.load_state_dict(state)
    drawn = [row for _ in range(40) for row in _source_rows(next(resumed))]
    assert len(drawn) == 120 and resumed.batch == 137 + 40
    expected = _synthetic(slot=1, num_slots=2, seed=3)
    expected.load_state_dict(state)
    for source in range(len(WEIGHTS)):
        rows = Counter(row for s, row in drawn if s == source)
        assert rows, source
        # What the source would have given next, at any batch size; 2 rows apart are the slot's (row % 2 == 1).
        following = Counter(int(i) for i in expected.sources[source].take(sum(rows.values())))
        assert rows == following, source
    with pytest.raises(ValueError, match="seq_len"):
        MixtureBatches([np.zeros(4000, dtype=np.uint32)] * 3, WEIGHTS, seq_len=SEQ_LEN * 2, batch_size=3, slot=1,
                       num_slots=2, seed=3).load_state_dict(state)


def test_a_state_that_does_not_fit_leaves_the_batches_where_they_were():
    """load_state_dict set each source's position as it checked it: a state whose last source did not fit raised
    after the first sources had moved, and a node that caught the error and "read its slot from the start" (the
    trainer's inherited slot state) read the first sources from the saved position and the others from the start."""
    batches = _synthetic(slot=1, num_slots=2, seed=3)
    for _ in range(5):
        next(batches)
    before = batches.state_dict()
    for bad in ({**before, "epochs": [7, 7, 7], "positions": [3, 4, 10**6]},  # the last source's is outside
                {**before, "epochs": [7], "positions": [3]}):  # one source's position for three sources
        with pytest.raises(ValueError):
            batches.load_state_dict(bad)
        assert batches.state_dict() == before


def test_a_source_with_fewer_sequences_than_slots_is_refused_in_every_slot():
    """With 3 sequences and 5 slots, slots 0 to 2 were accepted and only a node given slot 3 or 4 was refused: a run
    went on until a fourth node joined it (hours later, at an outer step) and that node died at start."""
    streams = [np.arange(3 * (SEQ_LEN + 1), dtype=np.uint32), np.arange(100 * (SEQ_LEN + 1), dtype=np.uint32)]
    for slot in range(5):
        with pytest.raises(ConfigError, match="'small' has 3 sequences of 17 tokens, fewer than the 5 data slots"):
            MixtureBatches(streams, (1.0, 1.0), seq_len=SEQ_LEN, batch_size=2, slot=slot, num_slots=5, seed=0,
                           labels=["small", "big"])


def test_layout_changes_names_what_moved_the_positions():
    saved = _synthetic(slot=0, num_slots=2).state_dict()
    assert layout_changes(saved, _synthetic(slot=0, num_slots=2, batch_size=3).state_dict()) == {}
    rows_of_4 = _synthetic(slot=0, num_slots=4).state_dict()["rows"]
    assert layout_changes(saved, _synthetic(slot=0, num_slots=4, seed=1).state_dict()) == {
        "seed": (0, 1), "num_slots": (2, 4), "rows": (saved["rows"], rows_of_4)}
    # A launcher knows the layout's settings before the data is loaded: only the keys on both sides are compared.
    assert layout_changes(saved, {"seq_len": SEQ_LEN, "num_slots": 3, "seed": 0}) == {"num_slots": (2, 3)}


def test_node_batches_resume_exactly(prepared, cfg):
    batches, _ = _draw(prepared, cfg, slot=2, num_slots=3, num_batches=137)
    state = json.loads(json.dumps(batches.state_dict()))
    expected = [next(batches) for _ in range(20)]
    resumed, _ = _draw(prepared, cfg, slot=2, num_slots=3, num_batches=0)
    resumed.load_state_dict(state)
    assert all(x.equal(rx) and y.equal(ry) for (x, y), (rx, ry) in zip(expected, resumed, strict=False))


def test_the_seed_decides_the_batches(prepared, cfg):
    _, a = _draw(prepared, cfg, slot=0, num_slots=1, num_batches=3)
    _, b = _draw(prepared, cfg, slot=0, num_slots=1, num_batches=3)
    _, c = _draw(prepared, attrs.evolve(cfg, seed=1), slot=0, num_slots=1, num_batches=3)
    assert all(x[0].equal(y[0]) for x, y in zip(a, b, strict=True))
    assert not all(x[0].equal(z[0]) for x, z in zip(a, c, strict=True))


def test_validation_batches_are_deterministic_and_held_out(prepared, cfg):
    owner = _row_sources(prepared, Split.VAL)
    first = list(validation_batches(prepared, cfg, seq_len=SEQ_LEN, batch_size=BATCH_SIZE))
    again = list(validation_batches(prepared, cfg, seq_len=SEQ_LEN, batch_size=BATCH_SIZE))
    assert len(first) >= 5
    assert all(x.equal(rx) and y.equal(ry) for (x, y), (rx, ry) in zip(first, again, strict=True))
    rows = [row for batch in first for row in _rows_of(batch)]
    assert all(row in owner for row in rows) and not set(rows) & set(_row_sources(prepared, Split.TRAIN))
    # The default number of batches reads no tail twice.
    assert all(n <= sum(o == i for o in owner.values()) for i, n in Counter(owner[row] for row in rows).items())
    shares = np.bincount([owner[row] for row in rows], minlength=3) / len(rows)
    assert np.allclose(shares, np.array(WEIGHTS) / sum(WEIGHTS), atol=0.1)
    code = list(validation_batches(prepared, cfg, seq_len=SEQ_LEN, batch_size=BATCH_SIZE, source=1))
    assert code and {owner[row] for batch in code for row in _rows_of(batch)} == {1}
    assert len(code) == sum(o == 1 for o in owner.values()) // BATCH_SIZE
    more = list(validation_batches(prepared, cfg, seq_len=SEQ_LEN, batch_size=BATCH_SIZE, num_batches=200))
    assert len(more) == 200 and all(x.equal(y[0]) for x, y in zip((b[0] for b in first), more, strict=False))
    with pytest.raises(ConfigError, match="validation split is too small"):
        validation_batches(prepared, cfg, seq_len=SEQ_LEN, batch_size=10_000)


def test_cache_key_follows_the_files_not_the_weights(corpus, cfg, tmp_path):
    key = cache_key(cfg)
    reweighted = tuple(attrs.evolve(e, weight=1.0) for e in cfg.mixture)
    assert cache_key(attrs.evolve(cfg, mixture=reweighted)) == key
    renamed = (attrs.evolve(cfg.mixture[0], text_field="body"), *cfg.mixture[1:])
    assert cache_key(attrs.evolve(cfg, mixture=renamed)) != key
    copy = tmp_path / "bible"
    copy.mkdir()
    for f in source_files(cfg.mixture[0])[:3]:
        (copy / f.name).write_text(f.read_text())
    entry = WeightedSource(source=str(copy))
    small = attrs.evolve(cfg, mixture=(entry,))
    before = cache_key(small)
    (copy / "extra.txt").write_text("a new document")
    assert cache_key(small) != before
    # An edit that keeps the size (a typo fixed) is seen too: it was served the old tokens (review of 2026-12-07).
    before = cache_key(small)
    edited = copy / "extra.txt"
    edited.write_text("a New document")
    os.utime(edited, ns=(edited.stat().st_atime_ns, edited.stat().st_mtime_ns + 1_000_000))  # a later edit
    assert cache_key(small) != before


def test_prepared_data_must_match_the_mixture(prepared, cfg):
    other = attrs.evolve(cfg, mixture=cfg.mixture[:2])
    with pytest.raises(ConfigError, match="call prepare_data with this config"):
        node_batches(prepared, other, seq_len=SEQ_LEN, batch_size=BATCH_SIZE, slot=0, num_slots=1)
    with pytest.raises(ConfigError, match="fewer than the 100000 data slots"):
        node_batches(prepared, cfg, seq_len=SEQ_LEN, batch_size=BATCH_SIZE, slot=99_999, num_slots=100_000)


# ---------------------------------------------------------------- errors a user sees


def _prepare(tmp_path: pathlib.Path, *entries: WeightedSource):
    return prepare_data(DataConfig(mixture=entries, vocab_size=300, max_chars_per_source=5000,
                                   cache_dir=str(tmp_path / "cache")))


def test_a_missing_path_names_the_path_and_the_source(tmp_path):
    missing = tmp_path / "fineweb-edu"
    with pytest.raises(ConfigError, match=rf"source 'fineweb-edu' \({missing}\): {missing} does not exist"):
        _prepare(tmp_path, WeightedSource(source=str(missing), name="fineweb-edu"))
    with pytest.raises(ConfigError, match=r"nothing matches .*\*\.parquet"):
        _prepare(tmp_path, WeightedSource(source=str(tmp_path / "*.parquet")))


def test_two_sources_that_read_the_same_file_are_refused(corpus, tmp_path, monkeypatch):
    """The mixture refuses a source listed twice by its path as written; a directory and a glob inside it, or a
    relative and an absolute path, read the same documents under other names (review of 2026-12-07: 89 of 133
    sequences of one's validation split were in the other's training split)."""
    bible = corpus / "bible"
    with pytest.raises(ConfigError, match=r"entries 0 \('whole'\) and 1 \('some'\) both read .*chapter000.txt: the "
                                          r"same documents would count twice"):
        _prepare(tmp_path, WeightedSource(source=str(bible), name="whole"),
                 WeightedSource(source=str(bible / "chapter00*.txt"), name="some"))
    monkeypatch.chdir(corpus)
    with pytest.raises(ConfigError, match=r"entries 0 \('bible'\) and 1 \('again'\) both read"):
        _prepare(tmp_path, WeightedSource(source="bible"), WeightedSource(source=str(bible), name="again"))
    _prepare(tmp_path, WeightedSource(source=str(bible / "nested")), WeightedSource(source=str(bible / "chapter0*")))


def test_a_directory_without_documents_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no documents.*found: no files at all"):
        _prepare(tmp_path, WeightedSource(source=str(tmp_path / "empty")))
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "data.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match="holds no documents.*found: data.csv"):
        _prepare(tmp_path, WeightedSource(source=str(tmp_path / "csv")))
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match="is not a file openprime reads"):
        _prepare(tmp_path, WeightedSource(source=str(tmp_path / "data.csv")))
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    with pytest.raises(ConfigError, match="holds no text"):
        _prepare(tmp_path, WeightedSource(source=str(tmp_path / "blank")))


@pytest.mark.parametrize(("lines", "text_field", "message"), [
    ([{"content": "hi"}], "text", r"line 1 has no field 'text' \(it has: 'content'\); set WeightedSource.text_field"),
    ([{"text": "fine"}, {"body": "x"}], "text", "line 2 has no field 'text'"),
    ([{"text": 3}], "text", "field 'text' is int, not text"),
    (["[1, 2]"], "text", "line 1 has no field 'text' .*list"),
    (["{not json"], "text", "line 1 is not JSON"),
])
def test_bad_jsonl_is_refused_with_the_line(tmp_path, lines, text_field, message):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    with pytest.raises(ConfigError, match=message):
        _prepare(tmp_path, WeightedSource(source=str(path), text_field=text_field))


def test_text_that_is_not_utf8_is_refused(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ConfigError, match="latin1.txt is not UTF-8"):
        _prepare(tmp_path, WeightedSource(source=str(tmp_path / "latin1.txt")))


def test_parquet_without_pyarrow_says_how_to_install_it(tmp_path):
    try:
        import pyarrow  # noqa: F401
        pytest.skip("pyarrow is installed, so parquet files are read")
    except ImportError:
        pass
    (tmp_path / "part-0.parquet").write_bytes(b"PAR1")
    with pytest.raises(ConfigError, match="reading it needs pyarrow: pip install pyarrow"):
        _prepare(tmp_path, WeightedSource(source=str(tmp_path)))


@pytest.mark.parametrize(("entry", "message"), [
    ({"source": "kjv", "weight": 0.0}, "weight of 'kjv' must be a finite number > 0"),
    ({"source": "kjv", "weight": -1.0}, "weight of 'kjv' must be a finite number > 0"),
    ({"source": "kjv", "weight": float("inf")}, "finite number > 0"),
    ({"source": "kjv", "weight": "55"}, "WeightedSource.weight must be float"),
    ({"source": ""}, "WeightedSource.source must be a built-in corpus"),
    ({"source": 3}, "WeightedSource.source must be a built-in corpus"),
])
def test_bad_entries_are_refused(entry, message):
    with pytest.raises(ConfigError, match=message):
        WeightedSource(**entry)


@pytest.mark.parametrize(("mixture", "message"), [
    ((WeightedSource(source=Source.KJV), WeightedSource(source="kjv", weight=2.0)), "lists the source 'kjv' twice"),
    ((WeightedSource(source="./data/x"), WeightedSource(source="data/x/")), "twice"),
    ((WeightedSource(source="/a", name="web"), WeightedSource(source="/b", name="web")), "both named 'web'"),
])
def test_duplicate_sources_are_refused(mixture, message):
    with pytest.raises(ConfigError, match=message):
        DataConfig(mixture=mixture)


def test_the_command_line_spelling_of_a_mixture():
    assert parse_mixture("kjv:55, /data/web/*.jsonl:10 ,cpython") == (
        WeightedSource(source=Source.KJV, weight=55.0), WeightedSource(source="/data/web/*.jsonl", weight=10.0),
        WeightedSource(source=Source.CPYTHON))
    assert parse_mixture("C:/data/web")[0].source == "C:/data/web"


@pytest.mark.parametrize("text", ["kjv:0", "kjv:-1", "kjv:nan", "/data/web/*.jsonl:0"])
def test_a_bad_weight_in_the_command_line_spelling_is_refused_as_a_weight(text):
    """"kjv:0" was read as the local path 'kjv:0' with weight 1 (the weight's ConfigError is a ValueError, taken for
    "the colon belongs to the path"): the run then failed with "kjv:0 does not exist; download the data there"."""
    with pytest.raises(ConfigError, match="must be a finite number > 0.*leave the source out of the mixture"):
        parse_mixture(f"{text},cpython")


def test_a_source_without_text_says_what_to_do(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"empty.jsonl' holds no text \(every document is empty\); put documents in "
                                          r"it or leave it out of DataConfig.mixture"):
        _prepare(tmp_path, WeightedSource(source=str(tmp_path / "empty.jsonl")))


# ---------------------------------------------------------------- tools/train_tokenizer.py


TOKENIZER_TOOL = ROOT / "tools" / "train_tokenizer.py"


def _tool(*args: str) -> subprocess.CompletedProcess:
    """The tool run as a command (its `__main__`, in a process of its own)."""
    return subprocess.run([sys.executable, str(TOKENIZER_TOOL), *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def tool(monkeypatch):
    """The tool's `main` run in this process, as `_tool` runs the command: each command paid about 3 s of imports
    (torch, openprime.train), 20 s of this file's time for its error paths. Single-threaded: the tokenizers
    library's worker threads in the test process made its later forks (the node processes) warn."""
    import contextlib
    import importlib.util
    import io

    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    spec = importlib.util.spec_from_file_location("train_tokenizer", TOKENIZER_TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def run(*args: str) -> subprocess.CompletedProcess:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = module.main(list(args))
            except SystemExit as e:  # argparse: --help, a usage error
                code = e.code if isinstance(e.code, int) else 2
        return subprocess.CompletedProcess(["train_tokenizer.py", *args], code, out.getvalue(), err.getvalue())
    return run


def test_tokenizer_tool_trains_on_local_files(corpus, tmp_path):
    from tokenizers import Tokenizer

    out = tmp_path / "tok"
    proc = _tool(str(out), str(corpus / "bible"), str(corpus / "code.jsonl.gz"), "--text-field", "content",
                 "--vocab-size", "400", "--max-chars-per-source", "30000")
    assert proc.returncode == 0, proc.stderr
    assert "read source" in proc.stderr and "training a 400-token byte-level BPE" in proc.stderr
    assert f"wrote {out / 'tokenizer.json'}: vocabulary size 400" in proc.stdout
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "In the beginning was the code: def f(x): return x  # ünïcødé"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    assert tokenizer.token_to_id("<|end_of_text|>") == 0


def test_tokenizer_tool_help_and_errors(tool, tmp_path):
    help_text = tool("--help")
    assert help_text.returncode == 0 and ".jsonl" in help_text.stdout and "--recipe" in help_text.stdout
    missing = tool(str(tmp_path / "t.json"), str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "nowhere does not exist" in missing.stderr
    assert tool(str(tmp_path / "t.json")).returncode == 2  # neither sources nor --recipe


def test_tokenizer_tool_says_what_it_cannot_do_before_it_trains(tool, corpus, tmp_path):
    # An OUT it cannot create was a traceback after the training (found 2026-12-07); a vocabulary the text cannot
    # fill was written smaller without a word; --vocab-size 0 said "must be >= 1".
    (tmp_path / "a-file").write_text("")
    proc = tool(str(tmp_path / "a-file" / "t.json"), str(corpus / "bible"), "--vocab-size", "300")
    assert proc.returncode == 2 and "cannot write" in proc.stderr and "choose another OUT" in proc.stderr, proc
    assert "read source" not in proc.stderr and "Traceback" not in proc.stderr
    (tmp_path / "dangling.json").symlink_to(tmp_path / "missing-dir" / "t.json")  # passes the early check
    late = tool(str(tmp_path / "dangling.json"), str(corpus / "bible"), "--vocab-size", "300",
                "--max-chars-per-source", "20000")
    assert late.returncode == 2 and "error: cannot write" in late.stderr and "Traceback" not in late.stderr, late
    small = tool(str(tmp_path / "t.json"), str(corpus / "bible"), "--vocab-size", "100")
    assert small.returncode == 2 and "--vocab-size 100 is too small" in small.stderr and "257 tokens" in small.stderr
    (tmp_path / "tiny.txt").write_text("abc abc abd")
    tiny = tool(str(tmp_path / "tiny.json"), str(tmp_path / "tiny.txt"), "--vocab-size", "5000")
    assert tiny.returncode == 0 and "warning: the text holds only" in tiny.stderr
    size = int(tiny.stdout.split("vocabulary size ")[1].split()[0])
    assert size < 5000 and f"model.vocab_size={size} and data.vocab_size={size}" in tiny.stderr
    (tmp_path / "docs.jsonl").write_text('{"body": "some text"}\n')
    field = tool(str(tmp_path / "f.json"), str(tmp_path / "docs.jsonl"))
    assert field.returncode == 2 and "set --text-field" in field.stderr, field.stderr


VAL_SEQ_LEN, VAL_BATCH_SIZE, VAL_STRIDE = 16, 10, 10**7
VAL_ROWS = (60, 45)


def test_default_validation_batches_score_distinct_sequences(monkeypatch):
    """validation_batches reads each source's held-out sequences in order, so the default number of batches scores
    every validation sequence at most once and as many distinct ones as fit. With the per-source position not moving
    on (a hand mutation), every batch repeated the first few sequences of each source: the eval loss was that of
    about batch_size sequences, scored num_batches times, and the test above still passed (it counts rows, not
    distinct rows). Synthetic streams (token = position + source * 10**7) make every sequence tell its source and
    row, so the check does not depend on real text having no repeated sequence."""
    import types

    from openprime.train.data import batches as batches_module

    cfg = DataConfig()  # two sources of equal weight
    assert len(cfg.mixture) == len(VAL_ROWS)
    streams = [np.arange(n * (VAL_SEQ_LEN + 1), dtype=np.int64) + i * VAL_STRIDE for i, n in enumerate(VAL_ROWS)]
    monkeypatch.setattr(batches_module, "check_matches", lambda prepared, cfg: None)
    monkeypatch.setattr(batches_module, "load_tokens", lambda prepared, split, i: streams[i])
    prepared = types.SimpleNamespace(sources=[object()] * len(VAL_ROWS))
    drawn = list(validation_batches(prepared, cfg, seq_len=VAL_SEQ_LEN, batch_size=VAL_BATCH_SIZE))
    assert len(drawn) >= 5
    firsts = [int(t) for inputs_BL, _ in drawn for t in inputs_BL[:, 0]]
    rows = [(t // VAL_STRIDE, t % VAL_STRIDE // (VAL_SEQ_LEN + 1)) for t in firsts]
    assert len(set(rows)) == len(rows), "a validation sequence was scored twice within the default batches"
    for source in range(len(VAL_ROWS)):  # each source's sequences are read in order from its first
        mine = [r for s, r in rows if s == source]
        assert mine == list(range(len(mine)))
