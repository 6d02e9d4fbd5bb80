"""Logical data shards: the unit of data distribution, checkpointing and elastic resume.

A run has a fixed number S of logical shards. Shard ``s`` is a complete pipeline over the
1/S share of every source (streams -> tokenize -> mix -> pack -> rows) with a small
positional state. Shards are dealt to the readers (data-parallel rank x dataloader worker)
of the current run, so a run resumed with another number of ranks or workers gives each
shard a new reader and every shard continues from where it stopped: the same global stream,
no document repeated or skipped.
"""

from dataclasses import dataclass

import numpy as np
from datasets import IterableDataset
from torchtitan.tools.logging import logger

from flame.config.curriculum import Curriculum
from flame.config.manager import split_list
from flame.data.formats import DataFormat, SourceEncoder, data_format
from flame.data.packing import (
    DOCUMENTS_PER_READ,
    DocumentMixer,
    Packer,
    Row,
    RowShuffler,
    TokenizedSource,
)
from flame.data.sft import padding_token
from flame.data.sources import SourceSpec, source_specs
from flame.data.streams import IterStream, MapStream
from flame.data.tokenizer import Delimiters, document_delimiters
from flame.base.errors import ConfigError

DEFAULT_SHARDS = 64


@dataclass
class DataPlan:
    """Everything a data shard needs, resolved and checked once in the main process (picklable)."""

    specs: list[SourceSpec]
    formats: list[DataFormat]  # each source's record (flame.data.formats)
    datasets: list  # each source's dataset: map-style, or streamed (a datasets.IterableDataset)
    encoders: list[SourceEncoder]  # each source's reader, made by its format's record
    probabilities: list[float]
    mix_unit: str
    streaming: bool
    tokenizer: object
    delimiters: Delimiters
    seq_len: int
    context_len: int
    batch_size: int
    document_mask: bool
    shuffle_buffer: int
    row_shuffle_buffer: int
    stop_at_end: bool
    seed: int
    shards: int  # 0: decided at the first start (default_shards) or taken from the checkpoint
    pad_id: int  # pads a row where the next conversation does not fit
    holdout: int = 0  # the first documents of every source: the validation set, never trained on
    curriculum: Curriculum = Curriculum()  # what changes with the step: context length, data phase, global batch
    global_rows: int = 0  # rows a step over all ranks, without a batch ramp (finds the step of a row)

    @classmethod
    def from_config(cls, job_config, tokenizer) -> "DataPlan":
        training = job_config.training
        specs = source_specs(training)
        formats = [data_format(spec.data_format, spec.path) for spec in specs]
        delimiters = document_delimiters(tokenizer, training.delimiters, training.separator_token)
        datasets = [fmt.opener(spec, training, tokenizer, delimiters) for fmt, spec in zip(formats, specs)]
        encoders = [fmt.encoder(dataset, spec, training, tokenizer, delimiters)
                    for fmt, dataset, spec in zip(formats, datasets, specs)]
        validation = job_config.validation
        holdout = validation.holdout_documents if validation.enable else 0
        for spec, dataset in zip(specs, datasets):
            if holdout and len(dataset) <= holdout:
                raise ConfigError(
                    f"--validation.holdout_documents {holdout} would hold out all {len(dataset)} documents of {spec.path}, "
                    "leaving none to train on: hold out fewer"
                )
        probabilities = [float(p) for p in split_list(training.data_probs)] or [1.0] * len(specs)
        if training.data_probs is not None and abs(sum(probabilities) - 1) > 1e-6:
            logger.warning(f"--training.data_probs {training.data_probs} sum to {sum(probabilities):g}; normalizing")
        return cls(
            specs=specs,
            formats=formats,
            datasets=datasets,
            encoders=encoders,
            probabilities=probabilities,
            mix_unit=training.mix_unit,
            streaming=training.streaming,
            tokenizer=tokenizer,
            delimiters=delimiters,
            seq_len=training.seq_len,
            context_len=training.context_len,
            batch_size=training.local_batch_size,
            document_mask=training.document_mask,
            shuffle_buffer=training.shuffle_buffer,
            row_shuffle_buffer=training.row_shuffle_buffer,
            stop_at_end=training.source_exhausted == "stop",
            seed=job_config.debug.seed or 0,
            shards=training.data_shards,
            pad_id=padding_token(tokenizer, delimiters),
            holdout=holdout,
            curriculum=Curriculum.of(training),
            global_rows=training.global_batch_size,
        )

    def default_shards(self, readers: int) -> int:
        """max(64, readers), but no more than the smallest map-style source has documents."""
        sizes = [len(dataset) - self.holdout for dataset in self.datasets if not isinstance(dataset, IterableDataset)]
        return max(readers, min([DEFAULT_SHARDS, *sizes]))

    def source_names(self) -> list[str]:
        return [spec.path.removeprefix("builtin:") for spec in self.specs]

    def warn_about_stream_splitting(self, shards: int) -> None:
        if not self.streaming:
            return
        for spec, dataset in zip(self.specs, self.datasets):
            if isinstance(dataset, IterableDataset) and dataset.num_shards % shards:
                logger.warning(
                    f"streaming dataset {spec.path} has {dataset.num_shards} file shards, not a multiple of the "
                    f"{shards} data shards: each data shard reads the whole stream and keeps 1/{shards} of it. "
                    "This is exact but reads more; more files (or --training.data_shards dividing them) read less"
                )


class DataShard:
    """Logical shard ``shard`` of ``shards``: rows from its share of every source."""

    def __init__(self, plan: DataPlan, shard: int, shards: int):
        sources = [document_source(plan, index, shard, shards) for index in range(len(plan.specs))]
        mixer = DocumentMixer(sources, plan.probabilities, np.random.SeedSequence([plan.seed, shard]), plan.mix_unit,
                              [phase.probabilities for phase in plan.curriculum.phases])
        self.packer = Packer(mixer, plan.seq_len, plan.context_len, plan.document_mask, plan.pad_id, plan.curriculum)
        self.rows = (
            RowShuffler(self.packer, plan.row_shuffle_buffer, (plan.seed, shard))
            if plan.row_shuffle_buffer > 0
            else self.packer
        )

    def next_row(self, step: int | None = None) -> Row:
        """The next row, made for ``step`` (what the curriculum sets for it; None: the run's settings)."""
        return self.rows.next_row(step)

    def state_dict(self) -> dict:
        return self.rows.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.rows.load_state_dict(state)


def document_source(plan: DataPlan, index: int, shard: int, shards: int) -> TokenizedSource:
    """Source ``index``'s documents in shard ``shard`` of ``shards``, encoded as its format encodes them."""
    dataset, encoder, spec = plan.datasets[index], plan.encoders[index], plan.specs[index]
    column = encoder.columns
    # a source is streamed when its dataset is a stream: token files are map-style even with --training.streaming
    streamed = isinstance(dataset, IterableDataset)
    if streamed:
        stream = IterStream(dataset, column, shard, shards, spec.path, stop_at_end=plan.stop_at_end)
    else:
        stream = MapStream(dataset, column, shard, shards, plan.seed, spec.path, stop_at_end=plan.stop_at_end,
                           holdout=plan.holdout)
    shuffled = streamed and plan.shuffle_buffer > 0
    window = max(DOCUMENTS_PER_READ, plan.shuffle_buffer) if shuffled else DOCUMENTS_PER_READ
    shuffle_seed = (plan.seed, shard, index) if shuffled else None
    return encoder.documents(stream, window, shuffle_seed)


def shards_of_reader(reader: int, readers: int, shards: int) -> list[int]:
    """The logical shards reader ``reader`` of ``readers`` serves (dealt round-robin)."""
    if readers > shards:
        raise ConfigError(
            f"{readers} data readers (data-parallel ranks x dataloader workers) but only {shards} data shards: "
            "use fewer --training.num_workers, or start the run with more --training.data_shards"
        )
    return list(range(reader, shards, readers))
