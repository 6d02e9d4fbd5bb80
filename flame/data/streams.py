"""Document streams: one logical data shard's share of a dataset, read in batches, resumable.

Shard ``c`` of ``n`` reads every n-th document, so together the shards read each document
once per epoch. ``state_dict()`` is the position of the next ``read``; loading it makes the
stream return exactly what it would have returned then. Running out starts a new epoch
(reshuffled), or raises SourceExhausted when the run stops at the end of its data.
"""

import copy

import numpy as np
from datasets import Dataset, IterableDataset
from datasets.distributed import split_dataset_by_node
from torchtitan.tools.logging import logger

from flame.base.errors import ConfigError, DataError, gist, preview
from flame.data.sources import record_location


class SourceExhausted(Exception):
    """A source reached the end of its data and --training.source_exhausted is 'stop'."""


def _values(batch: dict, column: str | tuple[str, ...]) -> list:
    """A read batch's documents: the column's values, or for several columns one dict per record."""
    if isinstance(column, str):
        return batch[column]
    return [dict(zip(column, values)) for values in zip(*(batch[name] for name in column))]


class MapStream:
    """A map-style dataset in a seeded per-epoch permutation, every n-th document for this consumer.

    ``column`` names the documents' column, or a tuple of columns to read records (dicts) of them.
    The first ``holdout`` documents (the validation set, --validation.holdout_documents) are left
    out of the permutation after it is dealt, so that every other document keeps its place in the
    stream of a run without them.
    """

    def __init__(
        self, dataset: Dataset, column: str | tuple[str, ...], consumer: int, consumers: int, seed: int, name: str,
        stop_at_end: bool = False, holdout: int = 0,
    ):
        self.dataset = dataset.select_columns([column] if isinstance(column, str) else list(column))
        self.column, self.consumer, self.consumers, self.seed, self.name = column, consumer, consumers, seed, name
        self.stop_at_end, self.holdout = stop_at_end, holdout
        if len(self.dataset) - holdout < consumers:
            held = f" ({holdout} held out for validation)" if holdout else ""
            raise ConfigError(
                f"dataset {name} has {len(self.dataset) - holdout} documents to train on{held}, fewer than the "
                f"{consumers} data shards: lower --training.data_shards (at the start of a run) or use a larger dataset"
            )
        self.epoch, self.position = 0, 0
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)
        self.last_read: list[int] = []  # the dataset rows the last read returned (error messages name them)

    def _share(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.dataset))[self.consumer :: self.consumers]
            self._order, self._order_epoch = order[order >= self.holdout], self.epoch
            if not len(self._order):
                raise ConfigError(
                    f"dataset {self.name}: data shard {self.consumer} holds only documents held out for validation; "
                    "lower --validation.holdout_documents or --training.data_shards"
                )
        return self._order

    def read(self, count: int) -> list:
        """The next documents of this shard's share: at most ``count``, never none."""
        if self.position == len(self._share()):
            if self.stop_at_end:
                raise SourceExhausted(self.name)
            self.epoch, self.position = self.epoch + 1, 0
            if self.consumer == 0:
                logger.info(f"dataset {self.name}: epoch {self.epoch} starts (reshuffled)")
        take = self._share()[self.position : self.position + count]
        self.position += len(take)
        self.last_read = take.tolist()
        try:
            return _values(self.dataset[self.last_read], self.column)
        except Exception as error:  # e.g. text that is not UTF-8: name the record
            for row in self.last_read:
                try:
                    self.dataset[row]
                except Exception as failure:
                    raise DataError(f"dataset {self.name}: {record_location(self.name, row)} cannot be read: "
                                    f"{gist(failure)} ({type(failure).__name__}): fix or remove that record, then run "
                                    "the same command again (the run resumes from its last checkpoint)") from error
            raise

    def record_name(self, index: int, value) -> str:
        """The ``index``-th document of the last read, for a message: its record (file and line where known)."""
        return record_location(self.name, self.last_read[index])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


class IterStream:
    """A streaming dataset split across consumers by shards (or by examples when shards are few).

    ``column`` as MapStream's.
    """

    def __init__(
        self, dataset: IterableDataset, column: str | tuple[str, ...], consumer: int, consumers: int, name: str,
        stop_at_end: bool = False,
    ):
        columns = [column] if isinstance(column, str) else list(column)
        self.dataset = split_dataset_by_node(dataset.select_columns(columns), rank=consumer, world_size=consumers)
        self.column, self.consumer, self.name, self.stop_at_end = column, consumer, name, stop_at_end
        self.epoch = 0
        self._batches = None

    def read(self, count: int) -> list:
        """The next documents of this shard's share: at most ``count``, never none."""
        for _ in range(2):
            if self._batches is None:
                self.dataset.set_epoch(self.epoch)
                self._batches = self.dataset.iter(batch_size=count)
            try:
                batch = next(self._batches, None)
            except Exception as error:  # a file cut, replaced or deleted under the stream, a record datasets refuses
                raise DataError(
                    f"dataset {self.name}: reading its stream failed (data shard {self.consumer}, epoch {self.epoch}): "
                    f"{gist(error)} ({type(error).__name__}); a streamed file must stay as it was while the run "
                    "reads it: restore it (or fix the record), then run the same command again (the run resumes "
                    "from its last checkpoint)") from error
            if batch is not None:
                return _values(batch, self.column)
            if self.stop_at_end:
                raise SourceExhausted(self.name)
            self.epoch, self._batches = self.epoch + 1, None
            if self.consumer == 0:
                logger.warning(
                    f"dataset {self.name}: epoch {self.epoch} starts; the stream repeats in its order, "
                    "shuffled only within --training.shuffle_buffer windows (0 = not at all)"
                )
        raise ConfigError(
            f"dataset {self.name} gives data shard {self.consumer} no documents: lower --training.data_shards"
        )

    def record_name(self, index: int, value) -> str:
        """The ``index``-th document of the last read, for a message (a stream tells no record numbers): its start."""
        return f"a record streamed to data shard {self.consumer} in epoch {self.epoch} ({preview(value)})"

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "stream": copy.deepcopy(self.dataset.state_dict())}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self.dataset.set_epoch(self.epoch)
        self.dataset.load_state_dict(state["stream"])
        self._batches = None
