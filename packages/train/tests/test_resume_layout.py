"""A resumed run whose data layout differs from the checkpoint's: refused with the settings to restore, or the
data slot read from its start (data.on_layout_change=restart). Before, the node died in MixtureBatches with a
traceback naming its internals ("saved num_slots=8 but these batches have num_slots=4"), and a changed batch
size, which the positions survive, was refused the same way."""

import pytest

from openprime.core.errors import ConfigError
from openprime.train.checkpointing import data_layout_changes, saved_tokens
from openprime.train.data import LayoutChange

SAVED = {"batch": 20, "epochs": [0, 0], "positions": [80, 80], "rows": [935, 1013], "seed": 0, "seq_len": 32,
         "batch_size": 8, "slot": 1, "num_slots": 8}


def _changes(on_change=LayoutChange.REFUSE, **now):
    return data_layout_changes(SAVED, {**SAVED, **now}, where="checkpoint X", on_change=on_change)


def test_the_same_layout_or_another_batch_size_changes_nothing():
    assert _changes() == []
    assert _changes(batch_size=4, batch=3, positions=[1, 2]) == []


def test_another_layout_is_refused_with_the_settings_that_restore_it():
    with pytest.raises(ConfigError) as e:
        _changes(num_slots=4, seq_len=64, rows=[1870, 2026])
    message = str(e.value)
    assert message.startswith("checkpoint X was saved with another data layout: train.seq_len 64 (saved: 32), "
                              "mesh.max_nodes 4 (saved: 8); its data positions would name other sequences")
    # The sequences per source follow from those two settings: not listed as a change of its own.
    assert "sequences per source" not in message
    assert "Resume with --set train.seq_len=32 and --set mesh.max_nodes=8 to continue the data exactly" in message
    assert "--set data.on_layout_change=restart" in message
    with pytest.raises(ConfigError, match=r"data.seed 5 \(saved: 0\).*--set data.seed=0"):
        _changes(seed=5)


def test_other_data_under_the_same_settings_is_named_by_its_sequences():
    with pytest.raises(ConfigError, match=r"sequences per source in data slot 1 \[900, 1013\] \(saved: \[935, 1013\]\)"
                                          r".*Resume with the data it was saved with"):
        _changes(rows=[900, 1013])


def test_other_data_with_as_many_sequences_is_named_by_its_token_streams():
    """A new tokenizer or an edited file changes each source's sequence count in only some slots: the others
    continued their saved positions on other tokens without a word (found 2026-12-07: 3 of 8 slots of a run whose
    vocab_size changed). Each source's stream SHA-256 is saved with the positions and compared."""
    saved = {**SAVED, "tokens": ["a" * 64, "b" * 64]}
    with pytest.raises(ConfigError, match=r"the token stream of data.mixture source\(s\) \[1\] \(SHA-256 cccccccccccc, "
                                          r"saved: bbbbbbbbbbbb\).*Resume with the data it was saved with"):
        data_layout_changes(saved, {**saved, "tokens": ["a" * 64, "c" * 64]}, where="X",
                            on_change=LayoutChange.REFUSE)
    with pytest.raises(ConfigError, match=r"3 data sources \(saved: 2\)"):
        data_layout_changes(saved, {**saved, "tokens": ["a" * 64, "b" * 64, "c" * 64]}, where="X",
                            on_change=LayoutChange.REFUSE)
    # What the launcher knows (the settings and the streams, before a node loads its slot) is enough to refuse.
    launcher = {"seed": 0, "seq_len": 32, "num_slots": 8, "tokens": ["a" * 64, "c" * 64]}
    assert data_layout_changes(saved, launcher, where="X", on_change=LayoutChange.RESTART)[0].startswith(
        "the token stream of data.mixture source(s) [1]")
    assert data_layout_changes(SAVED, launcher, where="X", on_change=LayoutChange.REFUSE) == []  # saved before


def test_restart_returns_the_changes_for_the_node_to_say():
    assert _changes(LayoutChange.RESTART, num_slots=4, rows=[1870, 2026]) == ["mesh.max_nodes 4 (saved: 8)"]
    # A launcher knows the settings before the data is loaded: it compares those.
    assert data_layout_changes(SAVED, {"seed": 0, "seq_len": 32, "num_slots": 4}, where="X",
                               on_change=LayoutChange.RESTART) == ["mesh.max_nodes 4 (saved: 8)"]


def test_the_tokens_trained_come_from_the_checkpoint_or_from_its_step_when_it_has_none():
    assert saved_tokens({"progress": {"tokens": 7680}, "diloco": {"num_inner_steps_done": 30}}, 128) == 7680
    assert saved_tokens({"diloco": {"num_inner_steps_done": 30}}, 128) == 30 * 128  # saved before 2026-12-04
