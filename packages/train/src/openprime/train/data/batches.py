"""Batches of packed sequences: one node's disjoint share of a weighted mixture, resumable, and validation batches.

INTELLECT-1 (arXiv 2412.01152, section 3.1, Table 1) mixed its sources by weight, and each DiLoCo node
trained on its own shard of the data. Every source's training stream is cut into non-overlapping
sequences of seq_len + 1 tokens (GPT-style packing: documents run into each other, separated by
end-of-text); sequence i of a source belongs to slot i % num_slots, so the slots' shares of every
source are disjoint. Each batch draws its sequences from the sources in proportion to the weights
(`draw_counts`), deterministically from (seed, slot, batch number); each source visits the slot's
sequences in a fresh permutation every epoch and starts its next epoch when it runs out, on its own
(a 5% source is not rewound when a 55% one wraps). The position is the batch number plus each
source's (epoch, position): `state_dict()` gives it as plain ints and `load_state_dict()` continues
exactly.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from openprime.core.errors import ConfigError
from openprime.train.data.config import DataConfig, Split
from openprime.train.data.prepare import PreparedData, check_matches, load_tokens, source_index

Batch = tuple[torch.Tensor, torch.Tensor]
# Tags that keep the random streams of different uses apart although they share the seed.
_DRAW_STREAM, _SHUFFLE_STREAM, _VAL_STREAM = 1, 2, 3


def _rows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """The stream as non-overlapping rows of seq_len + 1 tokens (the tail that does not fill a row is dropped).

    A view, not a copy: with a memory-mapped stream only the rows of each batch are read.
    """
    num_rows = len(tokens) // (seq_len + 1)
    return tokens[:num_rows * (seq_len + 1)].reshape(num_rows, seq_len + 1)


def _to_batch(batch_BS: np.ndarray) -> Batch:
    """(inputs_BL, targets_BL) int64 tensors from rows of L + 1 tokens: the targets are shifted by one."""
    batch_BS = batch_BS.astype(np.int64)
    return torch.from_numpy(batch_BS[:, :-1].copy()), torch.from_numpy(batch_BS[:, 1:].copy())


def draw_counts(weights_S: np.ndarray, batch_size: int, rng: np.random.Generator) -> np.ndarray:
    """How many of a batch's sequences each source gives: expected batch_size * weight, exactly.

    Each source gets floor(batch_size * w) sequences, and the few left over go to sources picked by
    systematic sampling over the fractional parts (one uniform draw), so a source gets one more with
    probability equal to its fractional part. Every batch is within one sequence of the weights, and the
    totals over many batches converge to them without any state carried between batches.
    """
    expected_S = batch_size * weights_S
    counts_S = np.floor(expected_S).astype(np.int64)
    remainder = batch_size - int(counts_S.sum())
    offset = rng.random()
    if remainder > 0:
        cumulative_S = np.cumsum(expected_S - counts_S)
        cumulative_S *= remainder / cumulative_S[-1]  # the fractional parts sum to `remainder` up to rounding
        picked = np.searchsorted(cumulative_S, offset + np.arange(remainder), side="right")
        counts_S += np.bincount(np.minimum(picked, len(counts_S) - 1), minlength=len(counts_S))
    return counts_S


class _SourceRows:
    """One source's sequences that belong to one slot, visited in a fresh permutation every epoch."""

    def __init__(self, tokens: np.ndarray, *, seq_len: int, slot: int, num_slots: int, key: list[int],
                 label: str) -> None:
        self.rows_NS = _rows(tokens, seq_len)
        self.row_ids = np.arange(slot, len(self.rows_NS), num_slots)
        # Refused in every slot, not only in those left without a sequence: else the first nodes run and the node
        # that is given a later slot (one that joins hours on) is the one refused.
        if len(self.rows_NS) < num_slots:
            raise ConfigError(f"source {label!r} has {len(self.rows_NS)} sequences of {seq_len + 1} tokens, fewer "
                              f"than the {num_slots} data slots; give it more data (max_chars_per_source) or use "
                              f"shorter sequences or fewer slots (mesh.max_nodes)")
        self.key = key
        self.epoch, self.position = 0, 0
        self._order_epoch, self._order = -1, self.row_ids

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            rng = np.random.default_rng([*self.key, self.epoch])
            self._order, self._order_epoch = self.row_ids[rng.permutation(len(self.row_ids))], self.epoch
        return self._order

    def take(self, count: int) -> np.ndarray:
        """The next `count` rows (as row indices), starting further epochs as often as needed."""
        taken = []
        while count > 0:
            order = self._epoch_order()
            part = order[self.position:self.position + count]
            taken.append(part)
            self.position += len(part)
            count -= len(part)
            if self.position == len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return np.concatenate(taken) if taken else np.empty(0, dtype=np.int64)


class MixtureBatches:
    """Endless (inputs_BL, targets_BL) int64 batches of one slot's share of a weighted mixture of token streams.

    `streams` are the sources' training tokens, `weights` their relative weights. Sequences within a
    batch are shuffled, so that the local ranks that split a node's batch each get a mix. `last_counts`
    holds how many sequences each source gave to the last batch.
    """

    def __init__(self, streams: Sequence[np.ndarray], weights: Sequence[float], *, seq_len: int, batch_size: int,
                 slot: int, num_slots: int, seed: int, labels: Sequence[str] | None = None,
                 tokens: Sequence[str] | None = None) -> None:
        if seq_len < 1 or batch_size < 1:
            raise ConfigError(f"MixtureBatches: seq_len {seq_len} and batch_size {batch_size} must be >= 1")
        if not 0 <= slot < num_slots:
            raise ConfigError(f"MixtureBatches: slot {slot} is not in [0, num_slots {num_slots})")
        if len(streams) != len(weights) or not streams or min(weights) <= 0:
            raise ConfigError(f"MixtureBatches: need one weight > 0 per stream, got {len(streams)} streams and "
                              f"weights {list(weights)}")
        labels = list(labels) if labels is not None else [f"source {i}" for i in range(len(streams))]
        self.seq_len, self.batch_size, self.slot, self.num_slots, self.seed = seq_len, batch_size, slot, num_slots, seed
        self.labels = labels
        self.tokens = list(tokens) if tokens is not None else None  # each stream's SHA-256: which data it is
        self.weights_S = np.asarray(weights, dtype=np.float64) / np.sum(weights)
        self.sources = [_SourceRows(tokens, seq_len=seq_len, slot=slot, num_slots=num_slots,
                                    key=[seed, slot, _SHUFFLE_STREAM, i], label=label)
                        for i, (tokens, label) in enumerate(zip(streams, labels, strict=True))]
        self.batch = 0
        self.last_counts: tuple[int, ...] = (0,) * len(streams)

    def __iter__(self) -> MixtureBatches:
        return self

    def __next__(self) -> Batch:
        rng = np.random.default_rng([self.seed, self.slot, _DRAW_STREAM, self.batch])
        counts_S = draw_counts(self.weights_S, self.batch_size, rng)
        rows = [source.rows_NS[source.take(int(n))] for source, n in zip(self.sources, counts_S, strict=True) if n]
        batch_BS = np.concatenate(rows)[rng.permutation(self.batch_size)]  # S = seq_len + 1
        self.batch += 1
        self.last_counts = tuple(int(n) for n in counts_S)
        return _to_batch(batch_BS)

    @property
    def epochs(self) -> list[int]:
        """How many times each source has wrapped around for this slot."""
        return [source.epoch for source in self.sources]

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and lists (JSON- and msgpack-friendly): the position plus the layout it refers to.

        The weights are not part of it: resuming with other weights continues every source where it was
        and draws in the new proportions from then on.
        """
        state = {"batch": self.batch, "epochs": self.epochs, "positions": [s.position for s in self.sources],
                 "rows": [len(s.row_ids) for s in self.sources], "seed": self.seed, "seq_len": self.seq_len,
                 "batch_size": self.batch_size, "slot": self.slot, "num_slots": self.num_slots}
        if self.tokens is not None:
            state["tokens"] = self.tokens
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; it must come from batches of the same slot and layout (`layout_changes`).

        The batch size may differ: the positions count sequences, not batches, so every source continues at
        the sequence where it was and the batches draw the new number from then on.
        """
        if "positions" not in state:
            raise ValueError("MixtureBatches.load_state_dict: this state was not saved by MixtureBatches (a "
                             "checkpoint from before data mixtures?); start the data from the beginning instead")
        changed = layout_changes(state, self.state_dict())
        if state["slot"] != self.slot:
            changed["slot"] = (state["slot"], self.slot)
        if changed:
            name, (saved, mine) = next(iter(changed.items()))
            raise ValueError(f"MixtureBatches.load_state_dict: saved {name}={saved} but these batches "
                             f"have {name}={mine}; the positions would not match")
        # Everything is checked before anything is set: a caller that catches the error reads the slot from its
        # start (the trainer, with a position another node reported), which a half-loaded state was not.
        epochs, positions, batch = list(state["epochs"]), list(state["positions"]), int(state["batch"])
        if not len(epochs) == len(positions) == len(self.sources):
            raise ValueError(f"MixtureBatches.load_state_dict: the state holds {len(positions)} positions and "
                             f"{len(epochs)} epochs for {len(self.sources)} sources")
        for source, position in zip(self.sources, positions, strict=True):
            if not 0 <= position < len(source.row_ids):
                raise ValueError(f"MixtureBatches.load_state_dict: position {position} is outside "
                                 f"[0, {len(source.row_ids)})")
        for source, epoch, position in zip(self.sources, epochs, positions, strict=True):
            source.epoch, source.position = int(epoch), int(position)
        self.batch = batch


# What a saved position refers to: with any of these changed, the saved positions name other sequences (rows: how
# many sequences each source has in the slot, which changes with the data, its tokenizer or its validation split;
# tokens: each source's token stream's SHA-256. The rows alone missed most changes: a new tokenizer or an edited
# file changes the count of only some slots, and the others continued on other tokens without a word.)
LAYOUT_KEYS = ("seed", "seq_len", "num_slots", "rows", "tokens")


def layout_changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{key: (saved, current)} for the `LAYOUT_KEYS` in which two `MixtureBatches.state_dict()`s differ.

    Keys missing from either side are not compared, so a launcher that knows only part of the layout before the
    data is loaded can check that part.
    """
    return {key: (saved[key], current[key]) for key in LAYOUT_KEYS
            if key in saved and key in current and saved[key] != current[key]}


def node_batches(prepared: PreparedData, cfg: DataConfig, *, seq_len: int, batch_size: int, slot: int,
                 num_slots: int) -> MixtureBatches:
    """The training batches of data slot `slot` of `num_slots`: what a node trains on.

    Slots have disjoint shares of every source; `cfg.seed` (with the slot) seeds the shuffles and draws.
    """
    check_matches(prepared, cfg)
    streams = [load_tokens(prepared, Split.TRAIN, i) for i in range(len(prepared.sources))]
    return MixtureBatches(streams, cfg.weights, seq_len=seq_len, batch_size=batch_size, slot=slot,
                          num_slots=num_slots, seed=cfg.seed, labels=[entry.label for entry in cfg.mixture],
                          tokens=[source.tokens_sha256 for source in prepared.sources])


def validation_batches(prepared: PreparedData, cfg: DataConfig, *, seq_len: int, batch_size: int,
                       num_batches: int | None = None, source: int | str | None = None) -> Iterator[Batch]:
    """Batches of the held-out tails (`val_fraction` of each source), the same on every node and every call.

    Each batch draws from the sources by weight as training does (`draw_counts`, from cfg.seed alone);
    each source's validation sequences are read in order. The default `num_batches` is the most for
    which no source's tail is read twice; more wrap around. With `source` (an index or a spec) the
    batches come from that source alone: per-source losses weighted by `cfg.weights` give the mixture's
    loss without sampling noise.
    """
    check_matches(prepared, cfg)
    indices = range(len(prepared.sources)) if source is None else [source_index(prepared, source)]
    rows = [_rows(load_tokens(prepared, Split.VAL, i), seq_len) for i in indices]
    weights_S = np.asarray([cfg.weights[i] for i in indices])
    weights_S /= weights_S.sum()
    # A batch takes at most floor(batch_size * w) + 1 sequences of a source.
    most_S = np.floor(batch_size * weights_S).astype(np.int64) + (len(indices) > 1)
    fits = min(len(r) // m for r, m in zip(rows, most_S, strict=True) if m)
    if fits == 0 and num_batches is None:
        sizes = ", ".join(f"{cfg.mixture[i].label}: {len(r)}" for i, r in zip(indices, rows, strict=True))
        raise ConfigError(f"the validation split is too small for one batch of {batch_size} sequences of "
                          f"{seq_len + 1} tokens ({sizes} sequences); raise DataConfig.val_fraction or use "
                          f"shorter sequences or smaller batches")
    if num_batches is not None and (empty := [i for i, r in zip(indices, rows, strict=True) if len(r) == 0]):
        tokens = len(load_tokens(prepared, Split.VAL, empty[0]))
        raise ConfigError(f"source {cfg.mixture[empty[0]].label!r} has no validation sequence of {seq_len + 1} tokens "
                          f"(its held-out tail, val_fraction={cfg.val_fraction}, is {tokens:,} tokens): raise "
                          f"data.val_fraction or shorten train.seq_len")
    return _validation_iterator(rows, weights_S, batch_size, fits if num_batches is None else num_batches, cfg.seed)


def _validation_iterator(rows: list[np.ndarray], weights_S: np.ndarray, batch_size: int, num_batches: int,
                         seed: int) -> Iterator[Batch]:
    positions = [0] * len(rows)
    for b in range(num_batches):
        counts_S = draw_counts(weights_S, batch_size, np.random.default_rng([seed, _VAL_STREAM, b]))
        parts = []
        for i, count in enumerate(counts_S):
            parts.append(rows[i][np.arange(positions[i], positions[i] + count) % len(rows[i])])
            positions[i] += int(count)
        yield _to_batch(np.concatenate(parts))


class PackedBatches:
    """Endless (inputs_BL, targets_BL) int64 batches of one node's share of a single token stream.

    The stream is cut into non-overlapping rows of seq_len + 1 tokens (the tail that does not fill a
    row is dropped); row i belongs to node i % num_nodes. Each epoch the node visits its rows in a
    permutation drawn from (seed, epoch) and yields floor(rows / batch_size) batches, dropping the
    remainder. The position is (epoch, batches yielded in the epoch), all a resumed run needs.
    Training on a mixture uses `node_batches`; this is the one-stream form.
    """

    def __init__(self, tokens: np.ndarray, *, seq_len: int, batch_size: int, node_rank: int, num_nodes: int,
                 seed: int) -> None:
        if seq_len < 1 or batch_size < 1:
            raise ConfigError(f"PackedBatches: seq_len {seq_len} and batch_size {batch_size} must be >= 1")
        if not 0 <= node_rank < num_nodes:
            raise ConfigError(f"PackedBatches: node_rank {node_rank} is not in [0, num_nodes {num_nodes})")
        self.seq_len, self.batch_size = seq_len, batch_size
        self.node_rank, self.num_nodes, self.seed = node_rank, num_nodes, seed
        self._rows_NS = _rows(tokens, seq_len)
        self.row_ids = np.arange(node_rank, len(self._rows_NS), num_nodes)
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

    def __next__(self) -> Batch:
        if self.position == self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * self.batch_size
        rows = self._epoch_order()[start:start + self.batch_size]
        self.position += 1
        return _to_batch(self._rows_NS[rows])

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


__all__ = ["LAYOUT_KEYS", "MixtureBatches", "PackedBatches", "draw_counts", "layout_changes", "node_batches",
           "validation_batches"]
