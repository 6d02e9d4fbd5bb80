"""The records of every source checked before training (train.sh's preflight), so that a bad one fails in seconds.

A text source's documents must be text (str, valid UTF-8, not null); a source of token ids must hold lists of
integers inside the tokenizer's vocabulary (an id the tokenizer never produces means the data was tokenized with
another one; an id past the model's embedding would stop the run at its first step, on a GPU with a
device-side assert). A map-style source is checked whole, column-wise in Arrow (seconds per GB), up to
``WHOLE_BYTES`` of the column; past that, chunks spread evenly over it, and the log says so. A streamed source
cannot be read ahead: its first ``STREAMED_SAMPLE`` records are. A record the check did not read fails when a
rank reads it, in one line naming it (flame.data.packing). SFT sources encode their first records
(flame.data.sft), token files check a sample of their ids (flame.data.token_arrays).
"""

import itertools

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset, IterableDataset
from torchtitan.tools.logging import logger

from flame.base.errors import DataError, preview
from flame.data.formats.text import TextEncoder
from flame.data.shards import DataPlan
from flame.data.sources import SourceSpec, record_location
from flame.data.tokenizer import id_outside_vocabulary

WHOLE_BYTES = 4 << 30  # a column up to this size is checked in full
STREAMED_SAMPLE = 1000


def check_records(plan: DataPlan) -> None:
    """Raise DataError naming the first bad record of any text or token-id source of ``plan``."""
    for spec, dataset, encoder in zip(plan.specs, plan.datasets, plan.encoders):
        if not isinstance(encoder, TextEncoder) or not isinstance(dataset, (Dataset, IterableDataset)):
            continue  # SFT records and token files are checked where they are opened
        check = RecordCheck(spec, encoder.columns, encoder.vocabulary if encoder.tokenizer is None else None,
                            plan.tokenizer.name_or_path)
        if isinstance(dataset, Dataset) and dataset._indices is None:
            check.whole(dataset)
        else:
            check.values(record[encoder.columns] for record in itertools.islice(iter(dataset), STREAMED_SAMPLE))


class RecordCheck:
    """The checks of one source's document column: text, or token ids below ``vocabulary`` (not None)."""

    def __init__(self, spec: SourceSpec, column: str, vocabulary: int | None, tokenizer: str):
        self.spec, self.column, self.vocabulary, self.tokenizer = spec, column, vocabulary, tokenizer

    def whole(self, dataset: Dataset) -> None:
        column = dataset.data.table.column(self.column)
        expected = _is_id_lists if self.vocabulary is not None else _is_text
        if not expected(column.type):  # mixed types (datasets' Json feature) and the like: record by record
            self.values(itertools.chain.from_iterable(batch[self.column] for batch in dataset.iter(batch_size=1024)))
            return
        if column.null_count:
            self.refuse(_first(pc.is_null(column)), "has no value (null)", "fix or remove that record")
        checked = 0
        for chunk, start in _spread(column):
            checked += chunk.nbytes
            if self.vocabulary is None:
                self._check_text(chunk, start)
            else:
                self._check_ids(chunk, start)
        if checked < column.nbytes:
            logger.info(f"dataset {self.spec.path}: {checked / 2**30:.1f} of its {column.nbytes / 2**30:.1f} GiB of "
                        "documents checked before training (chunks spread over it); a bad record elsewhere stops the "
                        "run when it is read, naming it")

    def values(self, values) -> None:
        """Check documents one by one (a streamed sample, or a column of mixed types)."""
        for index, value in enumerate(values):
            if value is None:
                self.refuse(index, "has no value (null)", "fix or remove that record")
            if self.vocabulary is None and not isinstance(value, str):
                self.refuse(index, f"holds {type(value).__name__} {preview(value)}, not text",
                            "make every document of the column a string")
            if self.vocabulary is not None:
                if not isinstance(value, (list, tuple)) or not all(isinstance(i, int) for i in value):
                    self.refuse(index, f"holds {preview(value)}, not a list of token ids",
                                "make every document of the column a list of integers")
                if value and (min(value) < 0 or max(value) >= self.vocabulary):
                    self.refuse_id(index, next(i for i in value if not 0 <= i < self.vocabulary))

    def _check_text(self, chunk: pa.Array, start: int) -> None:
        try:
            chunk.validate(full=True)  # UTF-8 included
        except pa.ArrowInvalid:
            for index in range(len(chunk)):
                try:
                    chunk[index].as_py()
                except UnicodeDecodeError:
                    self.refuse(start + index, "is not valid UTF-8 text",
                                "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8), or remove that record")

    def _check_ids(self, chunk: pa.Array, start: int) -> None:
        ids = pc.list_flatten(chunk)
        parents = None
        if ids.null_count:
            parents = pc.list_parent_indices(chunk)
            self.refuse(start + parents[_first(pc.is_null(ids))].as_py(), "holds a null token id",
                        "fix or remove that record")
        if not len(ids):
            return
        low, high = (value.as_py() for value in pc.min_max(ids).values())
        if low < 0 or high >= self.vocabulary:
            outside = pc.or_(pc.less(ids, 0), pc.greater_equal(ids, self.vocabulary))
            at = _first(outside)
            parents = pc.list_parent_indices(chunk) if parents is None else parents
            self.refuse_id(start + parents[at].as_py(), ids[at].as_py())

    def refuse_id(self, index: int, token_id: int) -> None:
        what, _, fix = id_outside_vocabulary(token_id, self.vocabulary, self.tokenizer).partition(": ")
        self.refuse(index, what, fix)

    def refuse(self, index: int, what: str, fix: str) -> None:
        raise DataError(f"dataset {self.spec.path}: {record_location(self.spec.path, index)} of column '{self.column}' "
                        f"{what}: {fix}")


def _is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _is_id_lists(kind: pa.DataType) -> bool:
    return (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_integer(kind.value_type)


def _first(mask) -> int:
    return pc.index(mask, True).as_py()


def _spread(column: pa.ChunkedArray):
    """(chunk, its first record's index) of the chunks to check: all up to WHOLE_BYTES, else evenly spread ones."""
    starts = np.cumsum([0, *(len(chunk) for chunk in column.chunks)])
    chunks = list(zip(column.chunks, starts.tolist()))
    if column.nbytes <= WHOLE_BYTES:
        return chunks
    share = WHOLE_BYTES / column.nbytes
    picked, owed = [], 0.0
    for chunk in chunks:  # every chunk owes its share; a chunk is read when the owed bytes reach its size
        owed += share * chunk[0].nbytes
        if owed >= chunk[0].nbytes or not picked:
            picked.append(chunk)
            owed -= chunk[0].nbytes
    return picked
