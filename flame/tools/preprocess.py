"""Pretokenize a corpus to disk, in a form flame's loader reads directly.

    python -m flame.utils.preprocess --dataset HuggingFaceFW/fineweb-edu --dataset_name sample-10BT \\
        --tokenizer fla-hub/transformer-1.3B-100B --out data/fineweb-edu-10BT --num_proc 16

Writes a ``save_to_disk`` dataset with one column, ``input_ids``: every document tokenized
and delimited exactly as the loader would do online (same --delimiters rules). Train on it
with ``--training.dataset data/fineweb-edu-10BT``: the loader sees token ids and skips
tokenization (and does not delimit twice). Start-up is faster and the token stream no longer
depends on the tokenizer library version.
"""

import json
import os
import sys

import pyarrow.compute

from flame.data.sources import SourceSpec, document_column, load_source
from flame.data.tokenizer import document_delimiters, load_tokenizer
from flame.base.errors import ConfigError
from flame.base.cli import ArgumentParser


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="flame preprocess", description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", required=True, path=True, help="as --training.dataset (one source)")
    parser.add_argument("--dataset_name", help="as --training.dataset_name")
    parser.add_argument("--dataset_split", default="train", help="as --training.dataset_split")
    parser.add_argument("--data_dir", help="as --training.data_dir")
    parser.add_argument("--data_files", path=True, help="as --training.data_files")
    parser.add_argument("--text_column", help="as --training.text_column")
    parser.add_argument("--tokenizer", required=True, path=True, help="as --model.tokenizer_path")
    parser.add_argument("--delimiters", default="auto", choices=["auto", "eos", "bos", "bos+eos"])
    parser.add_argument("--separator_token", help="as --training.separator_token")
    parser.add_argument("--out", required=True, path=True, help="output directory (must not exist)")
    parser.add_argument("--num_proc", type=int, default=os.cpu_count(), help="tokenizing processes")
    args = parser.parse_args(argv)

    try:
        if os.path.exists(args.out):
            raise ConfigError(f"{args.out} exists; choose a new output directory")
        spec = SourceSpec(args.dataset, args.dataset_name, args.dataset_split, args.data_dir, args.data_files)
        dataset = load_source(spec, streaming=False)
        column, pretokenized = document_column(dataset, spec, args.text_column)
        if pretokenized:
            raise ConfigError(f"column '{column}' of {args.dataset} already holds token ids")
        tokenizer = load_tokenizer(args.tokenizer)
        delimiters = document_delimiters(tokenizer, args.delimiters, args.separator_token)
    except ConfigError as error:
        print(f"preprocess: error: {error}", file=sys.stderr)
        return 2

    def tokenize(batch: dict) -> dict:
        ids = tokenizer(batch[column], add_special_tokens=False)["input_ids"]
        return {"input_ids": [delimiters.wrap(document) for document in ids]}

    tokenized = dataset.map(
        tokenize,
        batched=True,
        num_proc=max(1, min(args.num_proc, len(dataset))),
        remove_columns=dataset.column_names,
        desc="tokenizing",
    )
    tokenized.save_to_disk(args.out)
    tokens = pyarrow.compute.sum(pyarrow.compute.list_value_length(tokenized.data.column("input_ids"))).as_py()
    with open(os.path.join(args.out, "flame_preprocess.json"), "w") as f:
        json.dump({"source": vars(args), "documents": len(tokenized), "tokens": tokens}, f, indent=2)
    print(f"wrote {len(tokenized):,} documents ({tokens:,} tokens) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
