"""Document streams: one consumer's share of a dataset, read in batches, with a resumable position.

A *consumer* is one (data-parallel rank, dataloader worker) pair; consumer ``c`` of ``n``
reads every n-th document, so together the consumers read each document once per epoch.
``state_dict()`` is the position of the next ``read``; loading it makes the stream return
exactly what it would have returned then. Running out starts a new epoch (reshuffled).
"""

import copy

import numpy as np
from datasets import Dataset, IterableDataset
from datasets.distributed import split_dataset_by_node
from torchtitan.tools.logging import logger

from flame.config_manager import ConfigError


class MapStream:
    """A map-style dataset in a seeded per-epoch permutation, every n-th document for this consumer."""

    def __init__(self, dataset: Dataset, column: str, consumer: int, consumers: int, seed: int, name: str):
        self.dataset = dataset.select_columns([column])
        self.column, self.consumer, self.consumers, self.seed, self.name = column, consumer, consumers, seed, name
        if len(self.dataset) < consumers:
            raise ConfigError(
                f"dataset {name} has {len(self.dataset)} documents, fewer than the {consumers} data readers "
                "(data-parallel ranks x dataloader workers): use fewer workers or a larger dataset"
            )
        self.epoch, self.position = 0, 0
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def _share(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.dataset))
            self._order, self._order_epoch = order[self.consumer :: self.consumers], self.epoch
        return self._order

    def read(self, count: int) -> list:
        """The next documents of this reader's share: at most ``count``, never none."""
        if self.position == len(self._share()):
            self.epoch, self.position = self.epoch + 1, 0
            logger.info(f"dataset {self.name}: reader {self.consumer} starts epoch {self.epoch}")
        take = self._share()[self.position : self.position + count]
        self.position += len(take)
        return self.dataset[take.tolist()][self.column]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


class IterStream:
    """A streaming dataset split across consumers by shards (or by examples when shards are few)."""

    def __init__(self, dataset: IterableDataset, column: str, consumer: int, consumers: int, name: str):
        self.dataset = split_dataset_by_node(dataset.select_columns([column]), rank=consumer, world_size=consumers)
        self.column, self.consumer, self.name = column, consumer, name
        self.epoch = 0
        self._batches = None

    def read(self, count: int) -> list:
        """The next documents of this reader's share: at most ``count``, never none."""
        for _ in range(2):
            if self._batches is None:
                self.dataset.set_epoch(self.epoch)
                self._batches = self.dataset.iter(batch_size=count)
            batch = next(self._batches, None)
            if batch is not None:
                return batch[self.column]
            self.epoch, self._batches = self.epoch + 1, None
            logger.info(f"dataset {self.name}: reader {self.consumer} starts epoch {self.epoch}")
        raise ConfigError(f"dataset {self.name} gives reader {self.consumer} no documents")

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "stream": copy.deepcopy(self.dataset.state_dict())}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self.dataset.set_epoch(self.epoch)
        self.dataset.load_state_dict(state["stream"])
        self._batches = None
