"""One record per data format: everything flame knows about reading one kind of dataset record, in one place.

A source's format is its entry of --training.data_format (or --validation.data_format); an empty
entry is the default, text. Every consumer reads the record, none compares a format's name
(tests/data/test_format_records.py checks):
- how its records become token documents: ``encoder`` (the planner, flame.data.shards.DataPlan),
- whether its documents must be masked from each other: ``document_mask`` (flame.prepare.settings),
- the --training fields only it reads: ``options`` (flame.prepare.settings refuses them without one of its sources),
- the loader counters logged per source: ``counters`` (flame.training.metrics.data_metrics),
- what validation scores of it: ``validation``, and every field's line of docs/data.md's table (``markdown_table``),
- how its sources are opened as datasets: ``opener`` (the planner; Hugging Face datasets unless the record says),
- whether a path is of it by its files alone: ``detect`` (``data_format``: an entry of the default format, text,
  is read as the format whose files the path names, e.g. a Megatron .bin/.idx pair).

Adding a format: README.md beside this file.
"""

from flame.base.errors import ConfigError
from flame.data.formats.record import DataFormat, Option, SourceEncoder
from flame.data.formats.sft import SFT
from flame.data.formats.text import TEXT
from flame.data.formats.tokens import MEGATRON, NUMPY

__all__ = ["DATA_FORMATS", "DEFAULT", "DataFormat", "Option", "SourceEncoder", "choices", "data_format",
           "markdown_table"]

DATA_FORMATS: dict[str, DataFormat] = {record.name: record for record in (TEXT, SFT, MEGATRON, NUMPY)}
DEFAULT = TEXT  # the format of an empty (or absent) data_format entry


def choices() -> str:
    """The formats' names as messages list them: "text or sft"."""
    names = list(DATA_FORMATS)
    return " or ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} or {names[-1]}"


def data_format(name: str | None, path: str | None = None) -> DataFormat:
    """The record of one data_format entry (empty or None: the default) for the dataset ``path``; ConfigError
    naming the choices. The default's entry for a path another record detects (its files) is that record."""
    if name and name not in DATA_FORMATS:
        raise ConfigError(f"{name} is not a format; give {choices()} per dataset")
    record = DATA_FORMATS[name] if name else DEFAULT
    if record is DEFAULT and path is not None:
        return next((other for other in DATA_FORMATS.values() if other.detect and other.detect(path)), record)
    return record


def markdown_table() -> str:
    """docs/data.md's table of the formats, from the records."""
    lines = ["| format | records | kept apart | logged per source | its own flags | validation scores |",
             "| --- | --- | --- | --- | --- | --- |"]
    for record in DATA_FORMATS.values():
        default = " (default)" if record is DEFAULT else ""
        options = ", ".join(f"`--training.{option.name}`" for option in record.options) or "none"
        counters = ", ".join(f"`{counter}`" for counter in record.counters)
        apart = (f"always: it {record.document_mask} (`--training.no-document_mask` refused)" if record.document_mask
                 else "unless `--training.no-document_mask`")
        lines.append(f"| `{record.name}`{default} | {record.summary} | {apart} | {counters} | {options} "
                     f"| {record.validation} |")
    return "\n".join(lines)
