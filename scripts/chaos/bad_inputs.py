"""Bad input, as a hostile new user gives it: every case must fail in one line before torchrun starts.

    python -m scripts.chaos.bad_inputs                 # every case, through `bash train.sh`
    python -m scripts.chaos.bad_inputs --only tokenizer --jobs 1 --work /tmp/bad   # cases whose name has 'tokenizer'

First trains a short run to its end (a real dump folder with checkpoints and an HF export: the
run a careless command must not touch), then runs every case of ``CASES`` and ``RESUME_CASES`` (resumes of
that run by another run) through
``bash train.sh`` (``FLAME_PYTHON``, default this interpreter) in a fresh folder of its own beside
it, hashing the finished run's files before and after each case. Prints one row per case and
the tally: cases tried / one-line errors (exit 2, stderr a single line starting "flame: error:"
and holding the case's expected words) / tracebacks / not refused before torchrun / seconds /
files of another run changed. Exits 0 when every case is a one-line error and nothing changed.

tests/prepare/test_bad_input.py runs the same cases in-process (``flame.launch.preflight.main``, train.sh's
preflight) and those of train.sh's environment through ``FLAME_DRY_RUN=1 bash train.sh``.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER, DATASET = "builtin:python-stdlib-bpe", "builtin:python-stdlib"
# the base job's model: a 2-layer llama over the builtin tokenizer's 4096 ids
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "vocab_size": 4096,
              "tie_word_embeddings": False}


def model_json(**changes) -> str:
    """The base job's model config with ``changes`` (a value of None drops that key)."""
    return json.dumps({k: v for k, v in {**TINY_LLAMA, **changes}.items() if v is not None})


@dataclass(frozen=True)
class Case:
    """One bad input. ``args`` follow the base job (a valid job in the case's folder) unless ``base`` is
    false; in args and files, {case} is the case's folder and {finished} the finished run's dump folder.
    ``files``: what to write in the case's folder first (a name ending in / is a directory; bytes are
    written as they are). ``toml``: lines added to the base job file's [training] table, its last.
    ``shell``: refused by train.sh itself (its environment), before any Python starts."""

    name: str
    args: tuple[str, ...]
    expect: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    files: Mapping[str, str | bytes | None] = field(default_factory=dict)
    toml: str = ""
    base: bool = True
    shell: bool = False


def _probs(probs: str) -> tuple[str, ...]:
    return ("--training.dataset", f"{DATASET},{DATASET}", "--training.data_probs", probs)


CASES: list[Case] = [
    # ------------------------------------------------------------------ the command line
    Case("unknown-option", ("--training.foo", "1"), ("unknown option --training.foo",)),
    Case("misspelt-section", ("--trainin.steps", "3"), ("unknown option --trainin.steps", "did you mean --training.steps")),
    Case("misspelt-key", ("--training.seq_lenn", "64"), ("did you mean --training.seq_len",)),
    Case("option-without-dashes", ("training.steps=3",), ("unexpected argument 'training.steps=3'",)),
    Case("switch-given-a-value", ("--checkpoint.enable", "true"), ("--checkpoint.enable is a switch", "--checkpoint.no-enable")),
    Case("option-without-value", ("--training.steps",), ("--training.steps needs a value",)),
    Case("integer-that-is-not", ("--training.batch_size", "abc"), ("--training.batch_size takes an integer", "'abc'")),
    Case("number-that-is-not", ("--optimizer.lr", "fast"), ("--optimizer.lr takes a number",)),
    Case("unknown-dtype", ("--training.mixed_precision_param", "fp17"), ("one of 'bfloat16', 'float32'",)),
    Case("unknown-export-dtype", ("--checkpoint.export_dtype", "fp8"), ("--checkpoint.export_dtype takes one of",)),
    Case("unknown-decay-type", ("--lr_scheduler.decay_type", "exponential"), ("'linear', 'sqrt', 'cosine'",)),
    Case("alias-set-to-none", ("--training.batch_size", "None"), ("--training.batch_size needs a value",)),
    Case("alias-and-field-disagree", ("--training.batch_size", "2", "--training.local_batch_size", "4"),
         ("are the same setting",)),
    Case("custom-config-module", ("--job.custom_config_module", "mine"), ("set by flame",)),
    Case("unused-torchtitan-option", ("--training.dataset_path", "x"), ("flame does not use", "--training.dataset")),
    Case("retired-spelling", ("--experimental.pipeline_parallel_microbatches", "4"), ("no longer a flame option",)),
    Case("other-train-spec", ("--model.name", "llama3"), ("flame trains HF/fla models only",)),
    # ------------------------------------------------------------------ the job file
    Case("job-file-missing", ("--job.config_file", "{case}/nope.toml"), ("--job.config_file", "does not exist"), base=False),
    Case("job-file-is-a-directory", ("--job.config_file", "{case}"), ("is a directory",), base=False),
    Case("job-file-twice", ("--job.config_file", "{case}/job.toml"), ("--job.config_file is given 2 times",)),
    Case("job-file-not-toml", ("--job.config_file", "{case}/bad.toml"), ("is not valid TOML", "line 1"),
         files={"bad.toml": "[training\nsteps = 3\n"}, base=False),
    Case("job-file-binary", ("--job.config_file", "{case}/bad.toml"), ("is not a text file",),
         files={"bad.toml": bytes(range(256))}, base=False),
    Case("job-file-wrong-type", (), ("'training.varlen'", "boolean"), toml="varlen = 1"),
    Case("job-file-unknown-section", (), ("unknown key 'trainig'", "did you mean 'training'"), toml="[trainig]\nsteps = 3"),
    Case("job-file-empty", ("--job.config_file", "{case}/empty.toml", "--job.dump_folder", "{case}/run"),
         ("no model given",), files={"empty.toml": ""}, base=False),
    # ------------------------------------------------------------------ the model
    Case("no-model", ("--model.tokenizer_path", TOKENIZER, "--training.dataset", DATASET, "--job.dump_folder",
                      "{case}/run"), ("no model given", "--model.config"), base=False),
    Case("model-config-missing", ("--model.config", "{case}/nope.json"), ("--model.config", "does not exist")),
    Case("model-config-directory-without-json", ("--model.config", "{case}/empty"), ("directory without config.json",),
         files={"empty/": None}),
    Case("model-json-malformed", ("--model.config", "{case}/m.json"), ("cannot read model config", "not a valid JSON"),
         files={"m.json": '{"model_type": "llama",'}),
    Case("model-json-not-an-object", ("--model.config", "{case}/m.json"), ("is not a JSON object",),
         files={"m.json": "[1, 2]"}),
    Case("model-type-missing", ("--model.config", "{case}/m.json"), ("has no 'model_type'",),
         files={"m.json": model_json(model_type=None)}),
    Case("model-type-unknown", ("--model.config", "{case}/m.json"), ("unknown model_type 'lama'", "did you mean"),
         files={"m.json": model_json(model_type="lama")}),
    Case("heads-do-not-divide-hidden", ("--model.config", "{case}/m.json"), ("hidden", "attention heads (5)"),
         files={"m.json": model_json(num_attention_heads=5, num_key_value_heads=5)}),
    Case("kv-heads-do-not-divide-heads", ("--model.config", "{case}/m.json"),
         ("num_key_value_heads 3 does not divide num_attention_heads 4",),
         files={"m.json": model_json(num_key_value_heads=3)}),
    Case("negative-hidden-size", ("--model.config", "{case}/m.json"), ("hidden_size is -64", "at least 1"),
         files={"m.json": model_json(hidden_size=-64)}),
    Case("zero-layers", ("--model.config", "{case}/m.json"), ("num_hidden_layers is 0",),
         files={"m.json": model_json(num_hidden_layers=0)}),
    Case("zero-heads", ("--model.config", "{case}/m.json"), ("num_attention_heads is 0",),
         files={"m.json": model_json(num_attention_heads=0)}),
    Case("size-given-as-text", ("--model.config", "{case}/m.json"), ("not a valid llama config",),
         files={"m.json": model_json(hidden_size="64")}),
    Case("vocab-smaller-than-tokenizer", ("--model.config", "{case}/m.json"), ("vocab_size 100 is smaller",),
         files={"m.json": model_json(vocab_size=100)}),
    Case("rows-longer-than-learned-positions", ("--model.config", "{case}/m.json"),
         ("learns 32 positions", "--training.context_len"),
         files={"m.json": json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 32,
                                      "vocab_size": 4096})}),
    Case("rope-theta-zero", ("--model.config", "{case}/m.json"), ("rope_theta is 0", "must be positive"),
         files={"m.json": model_json(rope_theta=0)}),
    Case("norm-epsilon-negative", ("--model.config", "{case}/m.json"), ("rms_norm_eps is -1e-06", "epsilon"),
         files={"m.json": model_json(rms_norm_eps=-1e-6)}),
    Case("encoder-model", ("--model.config", "{case}/m.json"), ("model_type 'bert'", "is an encoder", '"is_decoder": true'),
         files={"m.json": json.dumps({"model_type": "bert", "vocab_size": 4096, "hidden_size": 64,
                                      "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128})}),
    Case("encoder-decoder-model", ("--model.config", "{case}/m.json"), ("model_type 't5'", "has no causal LM"),
         files={"m.json": json.dumps({"model_type": "t5", "vocab_size": 4096, "d_model": 64, "num_layers": 2,
                                      "num_heads": 2, "d_ff": 128, "d_kv": 32})}),
    Case("ac-every-nth-block-past-the-model", ("--activation_checkpoint.mode", "selective",
                                                "--activation_checkpoint.selective_ac_option", "99"),
         ("checkpoints every 99th block, and the model has 2: none would be",)),
    Case("ac-blocks-past-the-model", ("--activation_checkpoint.mode", "full", "--activation_checkpoint.blocks", "9"),
         ("--activation_checkpoint.blocks 9 is more than the model's 2 blocks",)),
    Case("seed-negative", ("--debug.seed", "-1"), ("--debug.seed -1: a seed is a number from 0 to 2^32-1",)),
    Case("attention-dropout", ("--model.config", "{case}/m.json"), ("attention_dropout 0.1",),
         files={"m.json": model_json(attention_dropout=0.1)}),
    Case("model-beyond-memory", ("--model.config", "{case}/m.json"),
         ("the model's 33.3B parameters need at least 496.0 GiB a rank for their training state",),
         files={"m.json": model_json(hidden_size=8192, intermediate_size=22016, num_hidden_layers=48,
                                     num_attention_heads=64, num_key_value_heads=8)}),
    # ------------------------------------------------------------------ the tokenizer
    Case("tokenizer-missing", ("--model.tokenizer_path", "{case}/no/tokenizer"), ("does not exist", "builtin:")),
    Case("tokenizer-is-a-file", ("--model.tokenizer_path", "{case}/job.toml"), ("is a file",)),
    Case("tokenizer-folder-empty", ("--model.tokenizer_path", "{case}/tok"), ("holds no tokenizer.json",),
         files={"tok/": None}),
    Case("tokenizer-unknown-builtin", ("--model.tokenizer_path", "builtin:nosuch"), ("unknown built-in 'builtin:nosuch'",)),
    Case("tokenizer-settings-without-vocabulary", ("--model.tokenizer_path", "{case}/tok"),
         ("holds no vocabulary", "tokenizer.json, tokenizer.model"),
         files={"tok/": None, "tok/tokenizer_config.json": '{"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"}'}),
    # transformers builds a LlamaTokenizer of its 3 special tokens when tokenizer.model is missing
    Case("tokenizer-without-its-vocabulary-file", ("--model.tokenizer_path", "{case}/tok"),
         ("has no real vocabulary", "0 ordinary tokens", "lacks tokenizer.model"),
         files={"tok/": None, "tok/tokenizer_config.json": '{"tokenizer_class": "LlamaTokenizer", "bos_token": '
                                                          '"<s>", "eos_token": "</s>", "unk_token": "<unk>"}'}),
    Case("tokenizer-json-of-special-tokens-only", ("--model.tokenizer_path", "{case}/tok"),
         ("has no real vocabulary", "its tokenizer.json holds no vocabulary"),
         files={"tok/": None, "tok/tokenizer.json": json.dumps({
             "version": "1.0", "truncation": None, "padding": None, "normalizer": None, "pre_tokenizer": None,
             "post_processor": None, "decoder": None, "model": {"type": "BPE", "vocab": {"</s>": 0}, "merges": []},
             "added_tokens": [{"id": 0, "content": "</s>", "single_word": False, "lstrip": False, "rstrip": False,
                               "normalized": False, "special": True}]})}),
    Case("no-tokenizer", ("--model.config", "{case}/m.json", "--training.dataset", DATASET, "--job.dump_folder",
                          "{case}/run"), ("no tokenizer given",), files={"m.json": model_json()}, base=False),
    # ------------------------------------------------------------------ the data
    Case("no-dataset", ("--model.config", "{case}/m.json", "--model.tokenizer_path", TOKENIZER, "--job.dump_folder",
                        "{case}/run"), ("no dataset given",), files={"m.json": model_json()}, base=False),
    Case("dataset-missing", ("--training.dataset", "{case}/no/data.jsonl"), ("does not exist",)),
    Case("dataset-unknown-builtin", ("--training.dataset", "builtin:nosuch"), ("unknown built-in",)),
    Case("dataset-glob-matches-nothing", ("--training.dataset", "{case}/*.parquet"), ("matches no files",)),
    Case("dataset-without-text-column", ("--training.dataset", "{case}/d.jsonl"),
         ("has no 'text', 'content' or 'input_ids' column", "its columns are: body"),
         files={"d.jsonl": '{"body": "x"}\n'}),
    Case("text-column-missing", ("--training.text_column", "body"), ("has no column 'body'",)),
    Case("text-column-holds-numbers", ("--training.dataset", "{case}/d.jsonl"), ("holds int values",),
         files={"d.jsonl": '{"text": 5}\n'}),
    Case("dataset-file-empty", ("--training.dataset", "{case}/d.jsonl"), ("empty",), files={"d.jsonl": ""}),
    Case("dataset-file-not-json", ("--training.dataset", "{case}/d.jsonl"), ("cannot read dataset",),
         files={"d.jsonl": "not json\n"}),
    Case("dataset-folder-empty", ("--training.dataset", "{case}/data"), ("dataset folder", "/data is empty"),
         files={"data/": None}),
    Case("dataset-folder-without-data-files", ("--training.dataset", "{case}/data"),
         ("cannot read dataset", "a folder without data files"), files={"data/": None, "data/notes.md": "x"}),
    Case("dataset-saved-incompletely", ("--training.dataset", "{case}/data"),
         ("a dataset saved with save_to_disk, but incomplete",), files={"data/": None, "data/state.json": "{}"}),
    Case("dataset-glob-of-two-formats", ("--training.dataset", "{case}/data/*"),
         ("matches files of several formats (1 .jsonl, 1 .parquet)", "one glob per format"),
         files={"data/": None, "data/a.jsonl": '{"text": "x"}\n', "data/b.parquet": "x"}),
    Case("dataset-glob-matching-a-file-of-no-format", ("--training.dataset", "{case}/data/*"),
         ("cannot tell the format of", "/data/notes.md", "a glob that matches only those"),
         files={"data/": None, "data/a.jsonl": '{"text": "x"}\n', "data/notes.md": "x"}),
    Case("dataset-format-unknown", ("--training.dataset", "{case}/d.csv2"), ("cannot tell the format",),
         files={"d.csv2": "x"}),
    Case("dataset-split-missing", ("--training.dataset", "{case}/d.jsonl", "--training.dataset_split", "validation"),
         ("validation",), files={"d.jsonl": '{"text": "x"}\n'}),
    # records past the first: the preflight check reads every record of a map-style source
    Case("record-null-text", ("--training.dataset", "{case}/d.jsonl"),
         ("record 2 (line 3 of", "d.jsonl) of column 'text' has no value (null)"),
         files={"d.jsonl": '{"text": "a"}\n{"text": "b"}\n{"text": null}\n'}),
    Case("record-number-among-text", ("--training.dataset", "{case}/d.jsonl"),
         ("record 1 (line 2 of", "holds int 7, not text"), files={"d.jsonl": '{"text": "a"}\n{"text": 7}\n'}),
    Case("record-not-utf8", ("--training.dataset", "{case}/d.jsonl"), ("record 1 (line 2 of", "is not valid UTF-8 text"),
         files={"d.jsonl": b'{"text": "a"}\n{"text": "caf\xe9"}\n'}),
    Case("record-id-past-the-vocabulary", ("--training.dataset", "{case}/d.jsonl"),
         ("record 1 (line 2 of", "holds token id 99999, outside the vocabulary", "(ids 0 to 4095)"),
         files={"d.jsonl": '{"input_ids": [5, 6]}\n{"input_ids": [5, 99999]}\n'}),
    Case("record-negative-id", ("--training.dataset", "{case}/d.jsonl"),
         ("record 1 (line 2 of", "holds token id -1: token ids are never negative"),
         files={"d.jsonl": '{"input_ids": [5, 6]}\n{"input_ids": [-1, 5]}\n'}),
    Case("gz-file-not-gzip", ("--training.dataset", "{case}/d.jsonl.gz"),
         ("Not a gzipped file", "(BadGzipFile)", "rename a plain file without .gz"),
         files={"d.jsonl.gz": '{"text": "a"}\n'}),
    Case("data-probs-count", ("--training.data_probs", "1,2"), ("has 2 entries for 1 datasets",)),
    Case("data-probs-nan", _probs("nan,1"), ("must all be finite numbers >= 0",)),
    Case("data-probs-negative", _probs("1,-1"), ("must all be finite numbers >= 0",)),
    Case("data-probs-not-numbers", _probs("a,b"), ("must be numbers",)),
    Case("dataset-name-count", ("--training.dataset_name", "a,b"), ("--training.dataset_name has 2 entries",)),
    Case("separator-not-a-token", ("--training.separator_token", "<nosuch>"), ("is not a token of",)),
    # ------------------------------------------------------------------ training numbers
    Case("steps-zero", ("--training.steps", "0"), ("--training.steps must be >= 1",)),
    Case("steps-negative", ("--training.steps", "-3"), ("--training.steps must be >= 1",)),
    Case("batch-size-zero", ("--training.batch_size", "0"), ("--training.batch_size must be positive",)),
    Case("seq-len-negative", ("--training.seq_len", "-5"), ("--training.seq_len must be positive",)),
    Case("context-longer-than-rows", ("--training.context_len", "128"), ("between 1 and --training.seq_len 64",)),
    Case("accumulation-zero", ("--training.gradient_accumulation_steps", "0"), ("gradient_accumulation_steps must be >= 1",)),
    Case("varlen-with-two-rows", ("--training.varlen",), ("--training.varlen packs one row",)),
    Case("seq-len-beyond-32-bit-offsets", ("--training.seq_len", str(2**40)),
         (f"--training.seq_len {2**40} is beyond 2,147,483,647 tokens", "32-bit", "lower --training.seq_len")),
    Case("batch-beyond-32-bit-offsets", ("--training.batch_size", str(10**9)),
         ("64,000,000,000 tokens a micro-batch", "lower --training.batch_size to at most 33,554,431")),
    # more than the host holds: its token ids on the host, else its activations on the device
    Case("batch-beyond-memory", ("--training.batch_size", "30000000"),
         ("--training.batch_size 30000000 rows of --training.seq_len 64", "lower --training.batch_size")),
    Case("row-beyond-memory", ("--training.seq_len", "30000000", "--training.batch_size", "1"),
         ("--training.seq_len 30000000: one row keeps at least", "at most about", "lower --training.seq_len")),
    # the dense reference attention's masks grow with the square of the row: refused before they are built
    Case("row-whose-attention-masks-overflow-memory",
         ("--training.seq_len", "300000", "--training.batch_size", "1", "--model.attention", "sdpa"),
         ("--training.seq_len 300000: one row keeps at least", "dense attention masks (300,000 x 300,000 entries",
          "lower --training.seq_len", "or --activation_checkpoint.mode full")),
    Case("max-norm-negative", ("--training.max_norm", "-1"), ("--training.max_norm must be positive",)),
    Case("max-norm-nan", ("--training.max_norm", "nan"), ("--training.max_norm is NaN",)),
    Case("lr-negative", ("--optimizer.lr", "-1e-3"), ("--optimizer.lr must be a number at least 0",)),
    Case("lr-infinite", ("--optimizer.lr", "inf"), ("--optimizer.lr must be a number",)),
    Case("optimizer-unknown", ("--optimizer.name", "Lion"), ("--optimizer.name Lion", "AdamW")),
    Case("beta-out-of-range", ("--optimizer.beta2", "1.5"), ("--optimizer.beta2 must be a number in [0, 1)",)),
    Case("weight-decay-negative", ("--optimizer.weight_decay", "-0.1"), ("--optimizer.weight_decay",)),
    Case("param-group-unknown-kind", ("--optimizer.param_groups", "embedings: lr=2"),
         ("--optimizer.param_groups selects 'embedings'", "a kind (embeddings, head")),
    Case("param-group-pattern-selects-nothing", ("--optimizer.param_groups", r"re:.*\.ffn\..*: lr=2"),
         ("which matches no trainable parameter of the model", "model.embed_tokens.weight")),
    Case("global-batch-not-dividing", ("--training.global_batch_size", "7"),
         ("--training.global_batch_size 7 gives each of the 1 data-parallel ranks 7 rows a step",)),
    Case("global-batch-tokens-not-rows", ("--training.global_batch_tokens", "100"),
         ("--training.global_batch_tokens 100 is not a whole number of rows of --training.seq_len 64",)),
    Case("gpu-blocks-without-on-host", ("--optimizer.gpu_blocks", "4"),
         ("--optimizer.gpu_blocks keeps some of the optimizer state on the GPU", "add --optimizer.on_host")),
    Case("muon-setting-without-muon", ("--optimizer.muon_lr", "0.02"),
         ("--optimizer.muon_lr sets the Muon optimizer", "--optimizer.name Muon")),
    Case("muon-momentum-of-one", ("--optimizer.name", "Muon", "--optimizer.muon_momentum", "1"),
         ("--optimizer.muon_momentum must be a number in [0, 1)",)),
    Case("muon-without-iterations", ("--optimizer.name", "Muon", "--optimizer.muon_ns_steps", "0"),
         ("--optimizer.muon_ns_steps must be a number in [1, 99]",)),
    Case("muon-unknown-scale-rule", ("--optimizer.name", "Muon", "--optimizer.muon_adjust_lr", "spectral"),
         ("--optimizer.muon_adjust_lr takes one of", "match_rms_adamw")),
    Case("muon-with-cpu-offload", ("--optimizer.name", "Muon", "--training.enable_cpu_offload"),
         ("--optimizer.name Muon does not combine with --training.enable_cpu_offload",)),
    Case("nsys-window-without-end", ("--profiling.nsys_start_step", "3"), ("--profiling.nsys_stop_step is missing",)),
    Case("nsys-window-empty", ("--profiling.nsys_start_step", "5", "--profiling.nsys_stop_step", "5"),
         ("give 1 <= start < stop",)),
    Case("warmup-negative", ("--lr_scheduler.warmup_steps", "-1"), ("--lr_scheduler.warmup_steps must be >= 0",)),
    Case("decay-ratio-above-one", ("--lr_scheduler.decay_ratio", "2"), ("--lr_scheduler.decay_ratio", "[0, 1]")),
    Case("min-lr-above-lr", ("--lr_scheduler.min_lr_factor", "2"), ("--lr_scheduler.min_lr_factor",)),
    Case("schedule-of-zero-steps", ("--lr_scheduler.total_steps", "0"), ("--lr_scheduler.total_steps must be >= 1",)),
    Case("workers-negative", ("--training.num_workers", "-1"), ("--training.num_workers must be >= 0",)),
    Case("prefetch-without-workers", ("--training.prefetch_factor", "4"), ("no", "--training.num_workers")),
    Case("skip-limit-without-skipping", ("--training.max_skipped_steps", "3"),
         ("--training.max_skipped_steps limits skipped updates",)),
    Case("spike-sigma-negative", ("--training.spike_sigma", "-1"), ("--training.spike_sigma must be a number",)),
    Case("spike-window-without-sigma", ("--training.spike_window", "50"), ("loss-spike policy, which is off",)),
    Case("spike-window-below-minimum", ("--training.spike_sigma", "6", "--training.spike_window", "10"),
         ("spike_min_steps <= spike_window",)),
    # ------------------------------------------------------------------ checkpoints and metrics
    Case("keep-latest-negative", ("--checkpoint.keep_latest_k", "-1"), ("--checkpoint.keep_latest_k -1", "use 0")),
    Case("keep-latest-one", ("--checkpoint.keep_latest_k", "1"), ("--checkpoint.keep_latest_k 1",)),
    Case("checkpoint-interval-zero", ("--checkpoint.interval", "0"), ("--checkpoint.interval must be positive",)),
    Case("load-step-with-checkpointing-off", ("--checkpoint.load_step", "7"), ("checkpointing is off",)),
    Case("load-step-not-in-finished-run", ("--job.dump_folder", "{finished}", "--checkpoint.enable",
                                           "--checkpoint.load_step", "7", "--checkpoint.export_dtype", "bfloat16"),
         ("--checkpoint.load_step 7", "no complete step-7")),
    Case("initial-load-path-missing", ("--checkpoint.enable", "--checkpoint.initial_load_path", "{case}/nope/step-3"),
         ("--checkpoint.initial_load_path", "no .metadata")),
    Case("seed-checkpoint-on-two-processes", ("--checkpoint.enable", "--checkpoint.create_seed_checkpoint"),
         ("NGPU=1",), env={"NGPU": "2"}),
    Case("accept-changes-unknown", ("--checkpoint.accept_changes", "lr,sead"), ("--checkpoint.accept_changes sead",
                                                                             "not a field of a run's identity")),
    Case("log-freq-zero", ("--metrics.log_freq", "0"), ("--metrics.log_freq must be positive",)),
    Case("log-freq-negative", ("--metrics.log_freq", "-10"), ("--metrics.log_freq must be positive",)),
    # ------------------------------------------------------------------ parallelism and processes
    Case("tensor-parallel-does-not-divide", ("--parallelism.tensor_parallel_degree", "3"), ("does not divide the 1 processes",)),
    Case("pipeline-on-one-process", ("--parallelism.pipeline_parallel_degree", "2"), ("does not divide the 1 processes",)),
    Case("context-parallel-zero", ("--parallelism.context_parallel_degree", "0"), ("context_parallel_degree must be >= 1",)),
    Case("degrees-do-not-multiply", ("--parallelism.data_parallel_shard_degree", "1"), ("there are 2 processes",),
         env={"NGPU": "2"}),
    Case("expert-parallel-dense-model", ("--parallelism.expert_parallel_degree", "2"), ("has no experts",),
         env={"NGPU": "2"}),
    Case("expert-parallel-uneven-experts", ("--model.config", "configs/tiny/qwen3_moe.json",
                                            "--parallelism.expert_parallel_degree", "3"),
         ("8 experts do not split evenly over 3 ranks",), env={"NGPU": "3"}),
    Case("router-bias-without-a-bias", ("--model.config", "configs/tiny/qwen3_moe.json", "--training.router_bias_rate",
                                        "1e-3"), ("routes without a selection bias",)),
    Case("expert-parallel-beyond-the-shard-ranks", ("--parallelism.expert_parallel_degree", "4"),
         ("does not divide the 2 data-parallel shard ranks",), env={"NGPU": "2"}),
    Case("more-ranks-than-the-host-has", (), ("512 ranks (NGPU) on this", "set NGPU to at most"), env={"NGPU": "512"}),
    # ------------------------------------------------------------------ the dump folder
    Case("dump-folder-under-a-file", ("--job.dump_folder", "{case}/afile/run"), ("is a file, not a folder",),
         files={"afile": "x"}),
    Case("dump-folder-is-a-file", ("--job.dump_folder", "{case}/afile"), ("is a file, not a folder",),
         files={"afile": "x"}),
    Case("dump-folder-empty", ("--job.dump_folder", ""), ("--job.dump_folder is empty",)),
    Case("dump-folder-not-writable", ("--job.dump_folder", "/proc/self/flame-run"), ("is not writable",)),
    # ------------------------------------------------------------------ paths that leave home
    Case("checkpoint-folder-leaves-the-dump-folder", ("--checkpoint.folder", "../../x"),
         ("--checkpoint.folder ../../x leaves the dump folder", "--job.allow_absolute_folders")),
    Case("checkpoint-folder-absolute", ("--checkpoint.folder", "{case}/elsewhere"),
         ("/elsewhere is outside the dump folder", "--job.allow_absolute_folders")),
    Case("tensorboard-folder-leaves-the-dump-folder", ("--metrics.save_tb_folder", "../tb"),
         ("--metrics.save_tb_folder ../tb leaves the dump folder",)),
    Case("traces-folder-leaves-the-dump-folder", ("--comm.save_traces_folder", "../traces"),
         ("--comm.save_traces_folder ../traces leaves the dump folder",)),
    Case("dump-folder-names-an-unset-variable", ("--job.dump_folder", "$FLAME_NO_SUCH_VARIABLE/run"),
         ("names the environment variable FLAME_NO_SUCH_VARIABLE, which is not set",)),
    Case("dump-folder-in-the-home-of-no-user", ("--job.dump_folder", "~flame_no_such_user/run"),
         ("there is no user 'flame_no_such_user'",)),
    Case("export-folder-holds-other-files", ("--checkpoint.enable",),
         ("/run/hf exists and is not an export flame wrote (it holds notes.txt)", "give another --job.dump_folder"),
         files={"run/hf/": None, "run/hf/notes.txt": "mine"}),
    Case("export-folder-is-a-file", ("--checkpoint.enable",), ("/run/hf is a file",), files={"run/": None, "run/hf": "mine"}),
    # ------------------------------------------------------------------ train.sh's environment
    Case("ngpu-not-a-number", (), ("NGPU must be a whole number >= 1, not 'abc'",), env={"NGPU": "abc"}, shell=True),
    Case("ngpu-zero", (), ("NGPU must be a whole number >= 1, not '0'",), env={"NGPU": "0"}, shell=True),
    Case("nnode-not-a-number", (), ("NNODE must be a whole number >= 1, not 'two'",), env={"NNODE": "two"}, shell=True),
    Case("node-rank-too-high", (), ("NODE_RANK 2 is not below NNODE 2",), env={"NNODE": "2", "NODE_RANK": "2"},
         shell=True),
    Case("master-port-not-a-port", (), ("MASTER_PORT must be a free port number",),
         env={"NNODE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "abc"}, shell=True),
    Case("several-nodes-without-master-addr", (), ("needs MASTER_ADDR",), env={"NNODE": "2"}, shell=True),
    Case("log-rank-beyond-ngpu", (), ("LOG_RANK 5 is not a local rank",), env={"LOG_RANK": "5"}, shell=True),
    Case("dump-stacks-after-not-seconds", (), ("FLAME_DUMP_STACKS_AFTER must be a whole number of seconds",),
         env={"FLAME_DUMP_STACKS_AFTER": "soon"}, shell=True),
]



def _resume(*args: str) -> tuple[str, ...]:
    """The base job resuming the finished run (its 2 saved steps; the base job's 4 continue it) with ``args``."""
    return ("--job.dump_folder", "{finished}", "--checkpoint.enable", *args)


def _accept(field: str) -> str:
    return f"--checkpoint.accept_changes {field}"


# Resumes of the finished run by another run (flame.checkpoint.identity): they need its real checkpoints,
# which tests/prepare/test_bad_input.py's stand-in lacks (tests/checkpoint/test_run_identity.py runs them).
RESUME_CASES: list[Case] = [
    Case("resume-with-another-lr", _resume("--optimizer.lr", "1e-4"),
         ("lr (--optimizer.lr 0.0008 -> 0.0001)", _accept("lr"))),
    Case("resume-with-another-seed", _resume("--debug.seed", "7"), ("seed (--debug.seed 42 -> 7)", _accept("seed"))),
    Case("resume-with-another-activation", _resume("--model.config", "{case}/m.json"),
         ("model (--model.config's hidden_act silu -> gelu)", _accept("model")), files={"m.json": model_json(hidden_act="gelu")}),
    Case("resume-with-another-rope-theta", _resume("--model.config", "{case}/m.json"),
         ("rope_parameters.rope_theta 10000.0 -> 500000.0", _accept("model")),
         files={"m.json": model_json(rope_theta=500000.0)}),
    Case("resume-with-longer-rows", _resume("--training.seq_len", "128"),
         ("seq_len (--training.seq_len 64 -> 128)", "--checkpoint.accept_changes seq_len,context_len")),
    Case("resume-with-shorter-context", _resume("--training.context_len", "32"),
         ("context_len (--training.context_len 64 -> 32)", _accept("context_len"))),
    Case("resume-with-a-bigger-batch", _resume("--training.batch_size", "4"), ("batch (", "2 -> 4", _accept("batch"))),
    Case("resume-with-accumulation", _resume("--training.gradient_accumulation_steps", "2"),
         ("batch (", "2 -> 4", _accept("batch"))),
    Case("resume-with-another-warmup", _resume("--lr_scheduler.warmup_steps", "1"),
         ("schedule (--lr_scheduler.warmup_steps 200 -> 1)", _accept("schedule"))),
    Case("resume-with-another-optimizer", _resume("--optimizer.name", "Adam"),
         ("optimizer (--optimizer.name AdamW -> Adam)", _accept("optimizer"))),
    Case("resume-with-another-optimizer-keeping-its-state", _resume("--optimizer.name", "Adam", "--checkpoint.accept_changes",
                                                                    "optimizer"),
         ("optimizer state belongs to --optimizer.name AdamW", "--checkpoint.exclude_from_loading optimizer")),
    Case("resume-with-another-dataset", _resume("--training.dataset", "{case}/d.jsonl"),
         ("data (--training.dataset builtin:python-stdlib -> ", _accept("data")),
         files={"d.jsonl": '{"text": "def f():\\n    return 1\\n"}\n' * 8}),
    Case("resume-with-another-checkpoint-folder", _resume("--checkpoint.folder", "ckpt"),
         ("--checkpoint.folder ckpt holds no checkpoint", "steps 1, 2", "give --checkpoint.folder checkpoint",
          "--job.dump_folder")),
]


def base_job(folder: Path, toml: str = "") -> Path:
    """A valid job in ``folder``: the tiny llama on the builtin corpus, dump folder ``folder/run``."""
    (folder / "model.json").write_text(model_json())
    job = folder / "job.toml"
    job.write_text(
        f'[job]\ndump_folder = "{folder / "run"}"\n[model]\nconfig = "{folder / "model.json"}"\n'
        f'tokenizer_path = "{TOKENIZER}"\n[metrics]\nlog_freq = 1\n'
        f'[training]\ndataset = "{DATASET}"\nseq_len = 64\nbatch_size = 2\nsteps = 4\n{toml}\n'
    )
    return job


def prepare(case: Case, folder: Path, finished: Path) -> list[str]:
    """Write the case's files (and the base job) into ``folder``; the train.sh arguments of the case."""
    folder.mkdir(parents=True, exist_ok=True)
    fill = {"{case}": str(folder), "{finished}": str(finished)}

    def filled(text: str) -> str:
        for key, value in fill.items():
            text = text.replace(key, value)
        return text

    for name, content in case.files.items():
        path = folder / name
        if content is None:
            path.mkdir(parents=True, exist_ok=True)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(filled(content))
    args = [filled(arg) for arg in case.args]
    if case.base:
        args = ["--job.config_file", str(base_job(folder, case.toml)), *args]
    return args


def world_size(case: Case) -> int:
    return int(case.env.get("NGPU", "1")) * int(case.env.get("NNODE", "1"))


def fingerprint(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` -> its sha256."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line_error(returncode: int, stderr: str) -> str | None:
    """The refusal's line, when the output is exactly what a refusal must be; else None."""
    lines = stderr.strip().splitlines()
    if returncode == 2 and len(lines) == 1 and lines[0].startswith("flame: error: "):
        return lines[0]
    return None


@dataclass
class Outcome:
    case: Case
    returncode: int
    seconds: float
    stderr: str
    stdout: str
    changed: list[str]  # files of the finished run changed (or added, or removed) while the case ran
    started: bool  # torchrun started (its log folder exists): the case was not refused in the preflight

    @property
    def line(self) -> str | None:
        return one_line_error(self.returncode, self.stderr)

    @property
    def expected(self) -> bool:
        return self.line is not None and all(fragment in self.line for fragment in self.case.expect)

    @property
    def traceback(self) -> bool:
        return "Traceback (most recent call last)" in self.stderr + self.stdout


def train_sh(args: list[str], env: Mapping[str, str], python: str, timeout: int) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "FLAME_PYTHON": python, "NGPU": "1", "OMP_NUM_THREADS": "1", **env}
    try:
        return subprocess.run(["bash", str(ROOT / "train.sh"), *args], cwd=ROOT, env=full_env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        return subprocess.CompletedProcess(expired.cmd, 124, str(expired.stdout or ""), f"timed out after {timeout} s")


def run_case(case: Case, work: Path, finished: Path, python: str, timeout: int) -> Outcome:
    folder = work / "cases" / case.name
    args = prepare(case, folder, finished)
    before = fingerprint(finished)
    start = time.perf_counter()
    result = train_sh(args, case.env, python, timeout)
    seconds = time.perf_counter() - start
    after = fingerprint(finished)
    changed = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
    started = (folder / "run" / "logs").exists()  # torchrun's agent makes it as it starts the ranks
    return Outcome(case, result.returncode, seconds, result.stderr, result.stdout, changed, started)


def finish_a_run(work: Path, python: str) -> Path:
    """A finished run beside the cases: 2 steps with checkpoints, exported to HF."""
    folder = work / "finished-job"
    folder.mkdir(parents=True)
    dump = work / "finished"
    result = train_sh(["--job.config_file", str(base_job(folder)), "--job.dump_folder", str(dump), "--training.steps",
                       "2", "--checkpoint.enable", "--checkpoint.interval", "1"], {}, python, timeout=900)
    if result.returncode != 0:
        sys.exit(f"the reference run failed (exit {result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return dump


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, help="folder for the finished run and the cases (default: a new temporary one)")
    parser.add_argument("--only", default="", help="run only the cases whose name holds this text")
    parser.add_argument("--jobs", type=int, default=2, help="cases run at a time")
    parser.add_argument("--timeout", type=int, default=600, help="seconds a case may take")
    parser.add_argument("--python", default=os.environ.get("FLAME_PYTHON", sys.executable), help="FLAME_PYTHON for train.sh")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="flame-bad-inputs-"))
    work.mkdir(parents=True, exist_ok=True)
    cases = [case for case in CASES + RESUME_CASES if args.only in case.name]
    print(f"flame bad inputs: {len(cases)} cases in {work}; training the finished run first", flush=True)
    finished = finish_a_run(work, args.python)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_case, case, work, finished, args.python, args.timeout) for case in cases]
        outcomes = []
        for future in futures:
            outcome = future.result()
            outcomes.append(outcome)
            verdict = ("one line" if outcome.expected else "one line, other words" if outcome.line
                       else "TRACEBACK" if outcome.traceback else f"NOT ONE LINE (exit {outcome.returncode})")
            if outcome.changed:
                verdict += f"; CHANGED {', '.join(outcome.changed[:3])}"
            shown = outcome.line or (outcome.stderr.strip().splitlines() or [""])[-1]
            print(f"{outcome.case.name:38s} {outcome.seconds:5.1f}s  {verdict:12s}  {shown[:160]}", flush=True)
    one_line = sum(o.expected for o in outcomes)
    other_words = sum(o.line is not None and not o.expected for o in outcomes)
    tracebacks = sum(o.traceback for o in outcomes)
    started = sum(o.started for o in outcomes)
    changed = sorted({name for o in outcomes for name in o.changed})
    seconds = [o.seconds for o in outcomes]
    print(
        f"\ncases tried {len(outcomes)} / one-line errors {one_line} (+{other_words} one line without the expected "
        f"words) / tracebacks {tracebacks} / not refused before torchrun {started} / seconds each: median "
        f"{sorted(seconds)[len(seconds) // 2]:.1f}, max {max(seconds):.1f} / files of another run changed {len(changed)}"
    )
    return 0 if one_line == len(outcomes) and not changed else 1


if __name__ == "__main__":
    sys.exit(main())
