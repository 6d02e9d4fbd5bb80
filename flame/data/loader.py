"""The per-rank stateful data loader: sources -> tokenize -> pack -> batches.

Each (data-parallel rank, worker) pair is one *reader*; reader ``rank * workers + worker``
of ``ranks * workers`` reads a disjoint share of every source. The loader's state (saved in
every checkpoint, one entry per data-parallel rank) holds each worker's packing position,
so a resumed run gets exactly the batches an uninterrupted run would have got.
"""

import os
import pickle
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset, get_worker_info
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.tools.logging import logger

from flame.config_manager import ConfigError, split_list
from flame.data.packing import DocumentMixer, Packer, TokenizedSource, collate_rows
from flame.data.sources import load_source, source_specs, text_column
from flame.data.streams import IterStream, MapStream
from flame.data.tokenizer import document_delimiters

# Workers fork after the tokenizer is loaded; Rust-side threads do not survive a fork.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class PackedDataset(IterableDataset, Stateful):
    """Batches of packed rows for one data-parallel rank (shared out among its workers)."""

    def __init__(self, job_config, tokenizer, dp_rank: int, dp_world_size: int):
        training = job_config.training
        self.specs = source_specs(training)
        self.probabilities = [float(p) for p in split_list(training.data_probs)] or [1.0] * len(self.specs)
        self.streaming = training.streaming
        self.text_column = training.text_column
        self.seq_len, self.context_len = training.seq_len, training.context_len
        self.batch_size = training.local_batch_size
        self.seed = job_config.debug.seed or 0
        self.tokenizer = tokenizer
        self.delimiters = document_delimiters(tokenizer)
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        # Load (and check) every source now, in the main process: bad input fails before training.
        self.sources = [load_source(spec, self.streaming) for spec in self.specs]
        self.columns = [text_column(ds, spec, self.text_column) for ds, spec in zip(self.sources, self.specs)]
        self._packer: Packer | None = None
        self._reader: tuple[int, int] | None = None
        self._pending_state: dict | None = None

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def _build(self, reader: int, readers: int) -> Packer:
        streams = []
        for dataset, column, spec in zip(self.sources, self.columns, self.specs):
            if self.streaming:
                streams.append(IterStream(dataset, column, reader, readers, spec.path))
            else:
                streams.append(MapStream(dataset, column, reader, readers, self.seed, spec.path))
        sources = [TokenizedSource(stream, self._tokenize, self.delimiters) for stream in streams]
        mixer = DocumentMixer(sources, self.probabilities, seed=self.seed * 1_000_003 + reader)
        return Packer(mixer, self.seq_len, self.context_len)

    def _current_reader(self) -> tuple[int, int]:
        worker = get_worker_info()
        workers, worker_id = (worker.num_workers, worker.id) if worker else (1, 0)
        return self.dp_rank * workers + worker_id, self.dp_world_size * workers

    def __iter__(self):
        reader, readers = self._current_reader()
        if self._packer is None or self._reader != (reader, readers):
            self._packer, self._reader = self._build(reader, readers), (reader, readers)
        if self._pending_state is not None:
            saved = (self._pending_state["reader"], self._pending_state["readers"])
            if saved != (reader, readers):
                raise ConfigError(
                    f"data loader state was saved by reader {saved[0]} of {saved[1]} but this is reader {reader} of "
                    f"{readers}: resume with the same number of data-parallel ranks and --training.num_workers"
                )
            self._packer.load_state_dict(self._pending_state["packer"])
            self._pending_state = None
        while True:
            yield collate_rows([self._packer.next_row() for _ in range(self.batch_size)])

    def state_dict(self) -> dict[str, Any]:
        if self._packer is None:
            return self._pending_state or {}
        reader, readers = self._reader
        return {"reader": reader, "readers": readers, "packer": self._packer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending_state = state or None


class FlameDataLoader(ParallelAwareDataloader):
    """torchtitan's per-rank stateful loader; a checkpoint that does not fit is an error, not a restart."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self._rank_id not in state_dict:
            raise ConfigError(
                f"the checkpoint has no data loader state for data-parallel rank {self.dp_rank}; "
                "it was saved with a different data-parallel layout"
            )
        if state_dict["world_size"] != self.dp_world_size:
            raise ConfigError(
                f"the checkpoint's data loader state is for {state_dict['world_size']} data-parallel ranks, "
                f"this run has {self.dp_world_size}: resume with the same layout"
            )
        try:
            state = pickle.loads(state_dict[self._rank_id])
        except Exception as error:
            raise ConfigError(f"data loader state of data-parallel rank {self.dp_rank} is corrupt: {error}") from None
        super(ParallelAwareDataloader, self).load_state_dict(state)


def build_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config) -> FlameDataLoader:
    """torchtitan TrainSpec hook: the loader for one data-parallel rank."""
    dataset = PackedDataset(job_config, tokenizer, dp_rank, dp_world_size)
    loader_config = job_config.training.dataloader
    logger.info(
        f"Data: {', '.join(spec.path for spec in dataset.specs)} "
        f"({'streaming' if dataset.streaming else 'map-style'}), rows of {dataset.seq_len} tokens, "
        f"segments <= {dataset.context_len}, {loader_config.num_workers} workers"
    )
    return FlameDataLoader(
        dataset,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        batch_size=None,
        num_workers=loader_config.num_workers,
        persistent_workers=loader_config.persistent_workers,
        prefetch_factor=loader_config.prefetch_factor,
        pin_memory=loader_config.pin_memory,
    )
