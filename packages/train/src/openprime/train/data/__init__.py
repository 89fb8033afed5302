"""Training data without a download: weighted mixtures of local sources, a tokenizer, packed batches.

INTELLECT-1 (arXiv 2412.01152, section 3.1, Table 1) trained its 10B model on a weighted mix of
FineWeb-Edu (55%), FineWeb (10%), the Stack (20%), DCLM (10%) and OpenWebMath (5%), tokenized with the
Llama-3 tokenizer. This package builds the same pipeline from text that is on the machine:

- `config`: `DataConfig`, a mixture of `WeightedSource`s (built-in corpora or local files) with weights;
- `sources`: reading documents from the built-in corpora and from .txt / .jsonl / .parquet files;
- `prepare`: `prepare_data` trains a byte-level BPE on all sources and caches one token stream each;
- `batches`: `node_batches`, a slot's disjoint, weighted, resumable share of the mixture, and
  `validation_batches`, the held-out tails, the same on every node.

A node does `node_batches(prepare_data(cfg), cfg, seq_len=..., batch_size=..., slot=..., num_slots=...)`.
"""

from openprime.train.data.batches import (
    MixtureBatches,
    PackedBatches,
    draw_counts,
    layout_changes,
    node_batches,
    validation_batches,
)
from openprime.train.data.config import (
    DEFAULT_MIXTURE,
    DataConfig,
    LayoutChange,
    Source,
    Split,
    WeightedSource,
    parse_mixture,
)
from openprime.train.data.prepare import (
    EOT_TOKEN,
    FORMAT_VERSION,
    PreparedData,
    PreparedSource,
    cache_key,
    default_cache_dir,
    load_tokenizer,
    load_tokens,
    prepare_data,
    tokenize_documents,
    train_tokenizer,
)
from openprime.train.data.sources import (
    cpython_documents,
    documents,
    kjv_documents,
    read_documents,
    source_files,
)

__all__ = [
    "DEFAULT_MIXTURE",
    "EOT_TOKEN",
    "FORMAT_VERSION",
    "DataConfig",
    "LayoutChange",
    "MixtureBatches",
    "PackedBatches",
    "PreparedData",
    "PreparedSource",
    "Source",
    "Split",
    "WeightedSource",
    "cache_key",
    "cpython_documents",
    "default_cache_dir",
    "documents",
    "draw_counts",
    "kjv_documents",
    "layout_changes",
    "load_tokenizer",
    "load_tokens",
    "node_batches",
    "parse_mixture",
    "prepare_data",
    "read_documents",
    "source_files",
    "tokenize_documents",
    "train_tokenizer",
    "validation_batches",
]
