"""The validation set: fixed documents, packed like training's rows, dealt to the data-parallel ranks.

Its documents are a separate dataset (--validation.dataset, in --training.dataset's syntax) or
the first --validation.holdout_documents documents of every training source, in dataset order
(the training streams leave them out: flame.data.streams.MapStream). Each source is packed on its
own, with training's packing, delimiters and document masks (flame.data.packing), into rows of
--validation.seq_len tokens: every batch holds one source, so a source's loss is its batches'
summed loss. The set is packed once, as the run starts, in the same order on every rank
whatever the layout; batch ``b`` goes to data-parallel rank ``b % ranks``, so every target is
evaluated on exactly one rank, and the numbers do not depend on the number of ranks. Ranks
that have one batch fewer run a batch without targets, so that all take part in every
collective. Nothing of it is part of the training data's state: every evaluation reads the same
batches.
"""

import copy
import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
from torchtitan.components.loss import IGNORE_INDEX

from flame.data.packing import (
    DocumentMixer,
    Packer,
    Row,
    WholeDocument,
    balanced_pieces,
    collate_rows,
)
from flame.data.shards import DataPlan, document_source
from flame.data.streams import SourceExhausted


def token_bytes(tokenizer) -> np.ndarray:
    """UTF-8 bytes of text each token id stands for (bits per byte counts a target's bytes from it).

    Byte-level BPE tokens (GPT-2, Llama 3, Qwen: the tokenizer's decoder is ByteLevel) spell one
    byte per symbol of their vocabulary entry; other vocabularies (SentencePiece) spell their text,
    ``▁`` a space and ``<0xNN>`` one byte. Special tokens (BOS, EOS, chat markers) are no text: 0.
    Summing a document's tokens gives exactly the bytes of its text for byte-level BPE; for
    SentencePiece, the space it adds before the first word counts too.
    """
    size = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
    table = np.zeros(size, dtype=np.int64)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = backend is not None and type(backend.decoder).__name__ == "ByteLevel"
    special = set(tokenizer.all_special_ids)
    for token, index in tokenizer.get_vocab().items():
        if index in special:
            continue
        if byte_level:
            table[index] = len(token)  # one symbol per byte (GPT-2's bytes-to-unicode map)
        elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            table[index] = 1
        else:
            table[index] = len(token.replace("\u2581", " ").encode("utf-8"))
    return table


class _EndsInPadding:
    """A document source that, once its documents run out, hands out padding (a document without targets):
    the packer then pads the last row to its end instead of losing it."""

    def __init__(self, source, pad_id: int, seq_len: int):
        self.source, self.ended = source, False
        self.padding = WholeDocument(np.full(seq_len, pad_id, dtype=np.int64), np.full(seq_len, IGNORE_INDEX, dtype=np.int64))

    def next_document(self):
        if not self.ended:
            try:
                return self.source.next_document()
            except SourceExhausted:
                self.ended = True
        return self.padding

    def state_dict(self) -> dict:  # the packer records where documents start; validation never resumes
        return {}


def source_rows(plan: DataPlan, index: int, limit: int | None) -> list[Row]:
    """Every row of source ``index`` that holds a target, in order (at most ``limit``)."""
    source = _EndsInPadding(document_source(plan, index, 0, 1), plan.pad_id, plan.seq_len)
    packer = Packer(DocumentMixer([source], [1.0], 0, "documents"), plan.seq_len, plan.context_len,
                    plan.document_mask, plan.pad_id)
    rows = []
    while limit is None or len(rows) < limit:
        row = packer.next_row()
        if (row.labels != IGNORE_INDEX).any():
            rows.append(row)
        elif source.ended:
            break
    return rows


def validation_plan(job_config, tokenizer) -> DataPlan:
    """The validation documents as a DataPlan: one pass in a fixed order (seed 0), one shard, nothing shuffled."""
    v, training = job_config.validation, job_config.training
    if v.holdout_documents:
        config = copy.copy(job_config)
        config.validation = dataclasses.replace(v, enable=False)  # this plan reads the held-out documents
        plan = DataPlan.from_config(config, tokenizer)
        plan.datasets = [dataset.select(range(v.holdout_documents)) for dataset in plan.datasets]
    else:
        config = copy.copy(job_config)
        config.validation = dataclasses.replace(v, enable=False)
        config.training = dataclasses.replace(
            training, dataset=v.dataset, dataset_name=v.dataset_name, dataset_split=v.dataset_split,
            data_dir=v.data_dir, data_files=v.data_files, data_format=v.data_format, data_probs=None,
        )
        plan = DataPlan.from_config(config, tokenizer)
    return dataclasses.replace(
        plan, seq_len=v.seq_len, context_len=min(training.context_len, v.seq_len), batch_size=v.local_batch_size,
        shuffle_buffer=0, row_shuffle_buffer=0, stop_at_end=True, seed=0, shards=1, holdout=0,
    )


@dataclass
class Batch:
    source: int  # index into ValidationSet.names; -1: a batch without targets (this rank had none left)
    inputs: dict
    labels: torch.Tensor


@dataclass
class ValidationSet:
    """This data-parallel rank's share of the validation set, and what it counts per source."""

    names: list[str]
    batches: list[Batch]
    tokens: np.ndarray  # per source: targets in this rank's batches
    bytes: np.ndarray  # per source: UTF-8 bytes of those targets (token_bytes)

    @classmethod
    def build(cls, job_config, tokenizer, dp_rank: int, dp_world_size: int) -> "ValidationSet":
        plan = validation_plan(job_config, tokenizer)
        steps = job_config.validation.steps
        table = token_bytes(tokenizer)
        dealt = []  # (source, rows) of every batch of the set
        for index in range(len(plan.specs)):
            rows = source_rows(plan, index, None if steps == -1 else steps * plan.batch_size)
            dealt.extend((index, rows[start : start + plan.batch_size]) for start in range(0, len(rows), plan.batch_size))
        names = plan.source_names()
        tokens, nbytes = np.zeros(len(names), dtype=np.int64), np.zeros(len(names), dtype=np.int64)
        batches = []
        for number in range(dp_rank, math.ceil(len(dealt) / dp_world_size) * dp_world_size, dp_world_size):
            source, rows = dealt[number] if number < len(dealt) else (-1, [])
            rows = rows + [_empty_row(plan)] * (plan.batch_size - len(rows))  # the shapes of every batch
            inputs, labels = collate_rows(rows)
            targets = labels[labels != IGNORE_INDEX].numpy()
            if source >= 0:
                tokens[source] += len(targets)
                nbytes[source] += table[targets].sum()
            batches.append(Batch(source, inputs, labels))
        return cls(names, batches, tokens, nbytes)


def _empty_row(plan: DataPlan) -> Row:
    segments = balanced_pieces(plan.seq_len, plan.context_len)
    zeros = np.zeros(len(plan.specs), dtype=np.int64)
    return Row(np.full(plan.seq_len, plan.pad_id, dtype=np.int64), np.full(plan.seq_len, IGNORE_INDEX, dtype=np.int64),
               np.concatenate([np.arange(length) for length in segments]), segments, zeros, zeros, zeros, zeros, zeros)
