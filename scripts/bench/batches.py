"""Benchmark batches from flame's own data pipeline, as the trainer gets them.

The embedded default job's data (configs/debug.toml: the builtin Python-stdlib corpus and its
BPE tokenizer; no network) goes through flame.data's loader for one rank: documents packed
into rows of ``seq_len`` tokens, split at ``context_len``, labels that never cross a document.
``data_flags`` are the same rows as `bash train.sh` flags, so a worker and a flame run given
the same sizes read the same kind of batches.
"""

import itertools
from pathlib import Path

import torch

from flame.prepare import prepared
from flame.data.loader import build_dataloader
from flame.data.tokenizer import load_tokenizer

DEBUG_JOB = Path(__file__).resolve().parents[2] / "configs" / "debug.toml"


def data_flags(rows: int, seq_len: int, context_len: int = 4096) -> list[str]:
    """train.sh flags for ``rows`` rows of ``seq_len`` tokens per step (one row: varlen)."""
    flags = ["--training.batch_size", str(rows), "--training.seq_len", str(seq_len),
             "--training.context_len", str(min(context_len, seq_len))]
    return flags + ["--training.varlen"] if rows == 1 else flags


def packed_batches(count: int, rows: int, seq_len: int, context_len: int = 4096,
                   device: str = "cuda") -> list[tuple[dict, torch.Tensor]]:
    """``count`` batches of ``(inputs, labels)`` as the trainer receives them, moved to ``device``.

    ``inputs`` holds ``input`` [rows, seq_len], ``position_ids``, ``cu_seqlens`` and ``max_seqlen``
    (flame.data.packing.collate_rows); labels are -100 after each document's last token.
    """
    flags = ["--job.config_file", str(DEBUG_JOB), *data_flags(rows, seq_len, context_len), "--training.num_workers", "0",
             "--memory.plan", "off"]  # batches of exactly ``rows`` rows, never split into micro-batches
    job = prepared(flags)
    loader = build_dataloader(1, 0, load_tokenizer(job.model.tokenizer_path), job)
    batches = []
    for inputs, labels in itertools.islice(loader, count):
        inputs = {key: value.to(device) for key, value in inputs.items() if key != "max_seqlen"} | {
            "max_seqlen": int(inputs["max_seqlen"])}  # a Python int: kernels size their grid by it
        batches.append((inputs, labels.to(device)))
    return batches
