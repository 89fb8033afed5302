"""Train a byte-level BPE tokenizer on local text and save it as tokenizer.json.

INTELLECT-1 (arXiv 2412.01152, section 3.1) used the Llama-3 tokenizer, a byte-level BPE. This tool
trains one of the same kind (the `tokenizers` package, the recipe `prepare_data` uses, end-of-text
at id 0) on the first --max-chars-per-source characters of each source, and writes it to OUT (a file,
or a directory that gets OUT/tokenizer.json). A source is a built-in corpus (kjv, cpython) or local
files: a directory, a glob or a file of .txt (one document per file), .jsonl (one document per line,
text in --text-field) or .parquet (needs pyarrow). Instead of sources, --recipe takes the data mixture
(and vocabulary size) of a run's recipe.

    python tools/train_tokenizer.py out/tokenizer.json ~/data/fineweb-edu "~/data/stack/*.jsonl" --vocab-size 32000
    python tools/train_tokenizer.py out/ --recipe recipes/debug.py
    python tools/train_tokenizer.py out/ kjv cpython --vocab-size 4096
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import attrs

from openprime.core.errors import ConfigError
from openprime.train.data import EOT_TOKEN, DataConfig, WeightedSource, read_documents, train_tokenizer
from openprime.train.data.sources import describe


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="train_tokenizer.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Each source is sampled from its start up to --max-chars-per-source characters; the tokenizer "
               "is trained on all the samples together. Progress goes to stderr; the last line of stdout "
               "names the file and the vocabulary size.")
    parser.add_argument("out", help="where to write: a .json file, or a directory (gets tokenizer.json)")
    parser.add_argument("sources", nargs="*", metavar="SOURCE",
                        help="kjv, cpython, or a directory, glob or file of .txt / .jsonl / .parquet documents")
    parser.add_argument("--recipe", help="train on the data mixture of this recipe (instead of SOURCEs)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="vocabulary size, end-of-text and the 256 bytes included (default: the recipe's, "
                             "else 4096)")
    parser.add_argument("--max-chars-per-source", type=int, default=None,
                        help="characters read from each source (default: the recipe's, else 2000000)")
    parser.add_argument("--text-field", default="text",
                        help="field holding the text in .jsonl / .parquet (default: text)")
    args = parser.parse_args(argv)
    if bool(args.recipe) == bool(args.sources):
        parser.error("give either SOURCEs or --recipe (exactly one of them)")
    if args.vocab_size is not None and args.vocab_size < 257:
        parser.error(f"--vocab-size {args.vocab_size} is too small: a byte-level BPE holds end-of-text and the 256 "
                     f"bytes, 257 tokens at least")
    return args


def data_config(args: argparse.Namespace) -> DataConfig:
    """The mixture to train on: the recipe's, or one entry per SOURCE; command-line sizes win."""
    if args.recipe:
        from openprime.train.recipe import recipe_config

        cfg = recipe_config(args.recipe).data
    else:
        cfg = DataConfig(mixture=tuple(WeightedSource(source=s, text_field=args.text_field) for s in args.sources))
    sizes = {"vocab_size": args.vocab_size, "max_chars_per_source": args.max_chars_per_source}
    return attrs.evolve(cfg, **{k: v for k, v in sizes.items() if v is not None})


def output_path(out: str) -> pathlib.Path:
    path = pathlib.Path(out).expanduser()
    if path.is_dir() or out.endswith(("/", "\\")) or not path.suffix:
        return path / "tokenizer.json"
    return path


def check_writable(path: pathlib.Path) -> None:
    """ConfigError unless the tokenizer can be written at `path` (its directory made if missing): said before the
    sources are read and the BPE trained, not after (it was a traceback then)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot write {path}: {e.strerror or e} ({e.filename or path.parent}); choose another "
                          f"OUT") from None
    if path.is_dir() or not os.access(path.parent, os.W_OK):
        why = "it is a directory" if path.is_dir() else f"{path.parent} is not writable"
        raise ConfigError(f"cannot write {path}: {why}; choose another OUT")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = data_config(args)
        path = output_path(args.out)
        check_writable(path)
        documents: list[str] = []
        for entry in cfg.mixture:
            start = time.perf_counter()
            taken = read_documents(entry, cfg.max_chars_per_source)
            documents.extend(taken)
            print(f"read {describe(entry)}: {len(taken):,} documents, {sum(map(len, taken)):,} characters in "
                  f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    except ConfigError as e:
        message = str(e)
        if not args.recipe:  # the sources' settings are this tool's flags
            message = message.replace("set WeightedSource.text_field", "set --text-field")
        print(f"error: {message}", file=sys.stderr)
        return 2
    num_chars = sum(map(len, documents))
    print(f"training a {cfg.vocab_size}-token byte-level BPE on {num_chars:,} characters ...", file=sys.stderr,
          flush=True)
    start = time.perf_counter()
    tokenizer = train_tokenizer(documents, cfg.vocab_size)
    sample = documents[:1000]  # compression on a sample: encoding everything again would double the time
    num_tokens = sum(len(e.ids) for e in tokenizer.encode_batch(sample, add_special_tokens=False))
    print(f"trained in {time.perf_counter() - start:.1f} s; {sum(map(len, sample)) / max(num_tokens, 1):.2f} "
          f"characters per token on {len(sample):,} of the documents", file=sys.stderr, flush=True)
    try:
        tokenizer.save(str(path))
    except Exception as e:  # tokenizers raises a plain Exception ("No such file or directory (os error 2)")
        print(f"error: cannot write {path}: {e}; choose another OUT", file=sys.stderr)
        return 2
    size = tokenizer.get_vocab_size()
    print(f"wrote {path}: vocabulary size {size} (end-of-text {EOT_TOKEN} = {tokenizer.token_to_id(EOT_TOKEN)})")
    if size < cfg.vocab_size:
        print(f"warning: the text holds only {size} tokens' worth of merges, not the {cfg.vocab_size} asked for: a "
              f"model using this tokenizer needs model.vocab_size={size} and data.vocab_size={size}, or give more "
              f"text", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
