"""The data-format record: what flame knows about reading one kind of dataset record (flame.data.formats)."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from flame.data.packing import ROW_COUNTERS, TokenizedSource
from flame.data.sources import SourceSpec, load_source
from flame.data.tokenizer import Delimiters


class SourceEncoder(Protocol):
    """One source's reader, made once in the main process and pickled to the loader's workers."""

    columns: str | tuple[str, ...]  # what its streams read: one column's values, or records (dicts) of several

    def documents(self, stream: Any, window: int, shuffle_seed: tuple[int, ...] | None = None) -> TokenizedSource:
        """The source's documents from ``stream``, read ``window`` records at a time (flame.data.packing)."""
        ...


# (dataset, its spec, the job's training config, tokenizer, delimiters) -> the source's encoder, its columns
# and a first sample checked, so that a source the format cannot read fails before training (ConfigError)
EncoderFactory = Callable[[Any, SourceSpec, Any, PreTrainedTokenizerBase, Delimiters], SourceEncoder]
# (its spec, the job's training config, tokenizer, delimiters) -> the source's dataset: map-style (len, select,
# select_columns, rows by a list of indices) or a datasets.IterableDataset; ConfigError when it cannot be read
SourceOpener = Callable[[SourceSpec, Any, PreTrainedTokenizerBase, Delimiters], Any]


def hf_dataset(spec: SourceSpec, training: Any, tokenizer: PreTrainedTokenizerBase, delimiters: Delimiters) -> Any:
    """A Hugging Face dataset: hub name, directory, files or globs, streamed with --training.streaming."""
    return load_source(spec, training.streaming)


@dataclass(frozen=True)
class Option:
    """A --training field only this format's sources read: set away from its default, it needs one of them."""

    name: str  # the field of --training
    default: Any

    def flag(self, value: Any) -> str:
        """How a message names the field set to ``value``: a switch by its name, others with their value."""
        return f"--training.{self.name}" if value is True else f"--training.{self.name} {value}"


@dataclass(frozen=True)
class DataFormat:
    """How flame reads the sources of one --training.data_format / --validation.data_format entry."""

    name: str  # its entry in a data_format list
    summary: str  # one line: what its records hold and which tokens are targets (the docs' table)
    encoder: EncoderFactory  # how its records become token documents (with labels, for a WholeDocument)
    label: str  # how messages name its sources ("SFT sources")
    kind: str  # the datasets messages advise it for ("set --training.data_format sft for the chat datasets")
    # why its documents must be kept apart (--training.document_mask), as messages say it; "": they need not be
    document_mask: str = ""
    counters: tuple[str, ...] = ("tokens", "documents")  # the ROW_COUNTERS logged per source (data/<source>/...)
    options: tuple[Option, ...] = ()  # --training fields only its sources read
    validation: str = ""  # what validation scores of its sources (docs/evaluation.md's set, packed as training's)
    opener: SourceOpener = hf_dataset  # how a source of this format is opened as a dataset
    # whether a dataset path is of this format by itself (its files tell): an entry of the default format is read
    # as this one then, since the default cannot read it; None: only an explicit entry names it
    detect: Callable[[str], bool] | None = None

    def __post_init__(self) -> None:
        if unknown := set(self.counters) - set(ROW_COUNTERS):
            raise ValueError(f"data format {self.name}: counters {sorted(unknown)} are not Row counters {ROW_COUNTERS}")
