"""Write a local lm-eval task sized for timing `python -m flame.eval`: rolling loglikelihood (a
perplexity task, as wikitext) over the first N documents of the built-in corpus.

    python -m scripts.bench.eval_task --out /tmp/evtask --documents 500
    python -m flame.eval --model <dump> --tasks flame_bench_text --include_path /tmp/evtask

configs/eval/ holds tasks for trying the commands; they are too small to time anything.
The task reads its jsonl by absolute path, so it works from any directory on that machine.
"""

import argparse
import json
from pathlib import Path

from flame.data import builtin

TASK = """task: flame_bench_text
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the task YAML and its jsonl")
    parser.add_argument("--documents", type=int, default=500, help="documents of the built-in corpus")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = sorted(Path(builtin.resolve(builtin.PREFIX + builtin.CORPUS)).glob("*.jsonl"))
    texts = [json.loads(line)["text"] for line in corpus[0].read_text().splitlines()[: args.documents]]
    data = args.out / "flame_bench_text.jsonl"  # not text.jsonl, the name of configs/eval/text.jsonl
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    (args.out / "flame_bench_text.yaml").write_text(TASK.format(data=data.resolve()))
    print(f"{len(texts)} documents, {sum(map(len, texts)):,} characters: --tasks flame_bench_text --include_path {args.out}")


if __name__ == "__main__":
    main()
