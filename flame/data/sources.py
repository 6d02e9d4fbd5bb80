"""Dataset specs from the config -> Hugging Face datasets (map-style or streaming)."""

import glob
import gzip
import os
import zlib
from collections import Counter
from dataclasses import dataclass

import datasets

from flame.config.manager import split_list
from flame.data import builtin
from flame.base import hub
from flame.base.errors import ConfigError, gist

# file extension -> datasets' packaged builder
_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".arrow": "arrow"}
_EXTENSIONS = "/".join(_BUILDERS)
# datasets reads a hub dataset offline from its own cache, which a load without streaming fills (a streamed one
# caches nothing), not from the hub files `hf download` fetches: those load as a local folder
_HUB_DATASET_REMEDY = ("load it once where there is network, into this HF_HOME and without --training.streaming, or "
                       "download its files (hf download {name} --repo-type dataset --local-dir DIR) and give "
                       "--training.dataset DIR")


@dataclass(frozen=True)
class SourceSpec:
    """One entry of --training.dataset with its per-entry options."""

    path: str
    name: str | None = None
    split: str = "train"
    data_dir: str | None = None
    data_files: str | None = None
    data_format: str | None = None  # its format's name (flame.data.formats); None: the default


def source_specs(training) -> list[SourceSpec]:
    paths = split_list(training.dataset, paths=True)

    def per_entry(value: str | None) -> list[str | None]:
        entries = split_list(value)
        if len(entries) == 1:
            entries = entries * len(paths)
        return [entry or None for entry in entries] or [None] * len(paths)

    return [
        SourceSpec(path=path, name=name, split=split or "train", data_dir=data_dir, data_files=data_files,
                   data_format=data_format)
        for path, name, split, data_dir, data_files, data_format in zip(
            paths,
            per_entry(training.dataset_name),
            per_entry(training.dataset_split),
            per_entry(training.data_dir),
            per_entry(training.data_files),
            per_entry(training.data_format),
        )
    ]


def _builder_for(path: str) -> str | None:
    suffix = os.path.splitext(path.removesuffix(".gz"))[1]
    return _BUILDERS.get(suffix)


def load_source(spec: SourceSpec, streaming: bool) -> datasets.Dataset | datasets.IterableDataset:
    """The split ``spec`` names, as a map-style or streaming dataset; ConfigError if it cannot be read or is empty."""
    try:
        dataset = _load(spec, streaming)
    except (StopIteration, IndexError) as error:  # what datasets raises for empty files/tables
        raise ConfigError(f"dataset {spec.path} is empty or unreadable ({type(error).__name__})") from None
    except datasets.exceptions.DatasetGenerationError as error:
        raise ConfigError(f"cannot read dataset {spec.path}: {gist(error)}; fix or remove the file") from None
    except (OSError, EOFError, zlib.error) as error:  # e.g. a .gz file that is not gzip, or is cut short
        hint = (" (a .gz file must hold gzip data: rename a plain file without .gz)"
                if isinstance(error, (gzip.BadGzipFile, EOFError, zlib.error)) else "")
        raise ConfigError(f"cannot read dataset {spec.path}: {gist(error)} ({type(error).__name__}); fix or remove "
                          f"the file{hint}") from None
    empty = len(dataset) == 0 if isinstance(dataset, datasets.Dataset) else next(iter(dataset.take(1)), None) is None
    if empty:
        raise ConfigError(f"dataset {spec.path} (split {spec.split}) has no documents")
    return dataset


def _load(spec: SourceSpec, streaming: bool) -> datasets.Dataset | datasets.IterableDataset:
    path = builtin.resolve(spec.path) if builtin.is_builtin(spec.path) else spec.path
    kwargs = {"name": spec.name, "data_dir": spec.data_dir, "data_files": spec.data_files, "split": spec.split}
    try:
        if os.path.isdir(path) and _is_saved_to_disk(path):
            dataset = datasets.load_from_disk(path)
            if isinstance(dataset, datasets.DatasetDict):
                if spec.split not in dataset:
                    raise ConfigError(f"{path} has no split '{spec.split}'; it has: {', '.join(dataset)}")
                dataset = dataset[spec.split]
            return dataset.to_iterable_dataset(num_shards=max(1, min(64, len(dataset)))) if streaming else dataset
        if os.path.isfile(path) or glob.has_magic(path):
            files = sorted(glob.glob(path))
            if not files:
                raise ConfigError(f"--training.dataset {path} matches no files")
            builder = _one_builder(path, files)
            kwargs.update(data_files=files, split="train" if spec.split == "train" else spec.split)
            return datasets.load_dataset(builder, streaming=streaming, **kwargs)
        if _looks_like_a_path(path) and not os.path.exists(path):
            raise ConfigError(f"--training.dataset {path} does not exist: give a data file ({_EXTENSIONS}), a folder "
                              "of them, a glob, a dataset saved with save_to_disk, or a hub dataset name")
        if os.path.exists(path):  # a folder of data files
            if not os.listdir(path):
                raise ConfigError(f"dataset folder {path} is empty: put its data files there ({_EXTENSIONS} files), "
                                  "or give another --training.dataset")
            return datasets.load_dataset(path, streaming=streaming, **kwargs)
        return hub.cache_first(f"dataset {path}", _HUB_DATASET_REMEDY.format(name=path),
                               lambda: datasets.load_dataset(path, streaming=streaming, **kwargs), datasets.config)
    except ConfigError:
        raise
    except ValueError as error:
        if "corresponds to no data" in str(error):
            raise ConfigError(f"dataset {spec.path} (split {spec.split}) has no documents") from None
        if "split" in str(error).lower():
            raise ConfigError(f"dataset {spec.path}: unknown split '{spec.split}' ({gist(error)}); set "
                              "--training.dataset_split to one it has") from None
        fix = "fix or remove the file" if os.path.isfile(path) or glob.has_magic(path) else (
            "check it and its --training.dataset_name, data_dir and data_files")
        raise ConfigError(f"cannot load dataset {spec.path}: {gist(error)}; {fix}") from None
    except (FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as error:
        if os.path.isdir(path):  # there, but not what datasets reads: not "not found"
            what = ("a dataset saved with save_to_disk, but incomplete" if _is_saved_to_disk(path)
                    else "a folder without data files datasets can read")
            raise ConfigError(f"cannot read dataset {spec.path}: it is {what} ({gist(error)}); give a folder of data "
                              "files, one saved whole with save_to_disk, or the files themselves") from None
        raise ConfigError(
            f"dataset {spec.path} not found (not a local path, nor a hub dataset in the local HF cache or on the hub): "
            f"{gist(error)}"
        ) from None


def _one_builder(path: str, files: list[str]) -> str:
    """The builder that reads every one of ``files`` (what ``path`` names or matches): one format per source."""
    builders = {file: _builder_for(file) for file in files}
    if unknown := [file for file, builder in builders.items() if builder is None]:
        others = f" (and {len(unknown) - 1} more files)" if len(unknown) > 1 else ""
        raise ConfigError(f"cannot tell the format of {unknown[0]}{others}, which --training.dataset {path} names: use "
                          f"{_EXTENSIONS} files, a glob that matches only those, or a directory")
    if len(set(builders.values())) > 1:
        counts = Counter(os.path.splitext(file.removesuffix(".gz"))[1] for file in files)
        found = ", ".join(f"{count} {extension}" for extension, count in sorted(counts.items()))
        folder = os.path.dirname(path) or "."
        raise ConfigError(
            f"--training.dataset {path} matches files of several formats ({found}), and a source reads one: give one "
            f"glob per format, comma-separated (e.g. {folder}/*{min(counts)},{folder}/*{max(counts)})"
        )
    return builders[files[0]]


def _looks_like_a_path(spec: str) -> bool:
    """A spec that cannot be a hub name ('org/name'): absolute, relative, or with a file extension."""
    return spec.startswith(("/", "./", "../", "~")) or _builder_for(spec) is not None or spec.count("/") > 1


def _is_saved_to_disk(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, marker)) for marker in ("dataset_dict.json", "state.json"))


def column_names(dataset) -> list[str]:
    if dataset.column_names is not None:
        return list(dataset.column_names)
    first = next(iter(dataset.take(1)), None)
    return list(first) if first else []


def document_column(dataset, spec: SourceSpec, preferred: str | None) -> tuple[str, bool]:
    """(column, holds token ids): --training.text_column, else 'text', 'content', then 'input_ids'."""
    columns = column_names(dataset)
    if not columns:
        raise ConfigError(f"dataset {spec.path} (split {spec.split}) is empty")
    candidates = [preferred] if preferred else ["text", "content", "input_ids"]
    for name in candidates:
        if name in columns:
            return name, _holds_token_ids(dataset, name, spec)
    wanted = f"column '{preferred}'" if preferred else "'text', 'content' or 'input_ids' column"
    raise ConfigError(
        f"dataset {spec.path} has no {wanted}; its columns are: {', '.join(columns)} (set --training.text_column)"
    )


def _holds_token_ids(dataset, column: str, spec: SourceSpec) -> bool:
    first = next(iter(dataset.select_columns([column]).take(1)))[column]
    if isinstance(first, str):
        return False
    if isinstance(first, (list, tuple)) and all(isinstance(token, int) for token in first):
        return True
    raise ConfigError(
        f"column '{column}' of dataset {spec.path} holds {type(first).__name__} values; "
        "flame reads text (str) or token ids (list of int)"
    )


def record_location(path: str, index: int) -> str:
    """"record N" of source ``path`` (0-based, as datasets numbers them), with the file and line (or row) that hold it
    when the source is local JSON-lines, text or parquet files; only looked up for an error message."""
    where = f"record {index}"
    files = sorted(glob.glob(path)) if os.path.isfile(path) or glob.has_magic(path) else []
    for file in files:
        found = _records_in_file(file)
        if found is None:
            return where
        count, name = found
        if index < count:
            return f"{where} ({name(index)} of {file})"
        index -= count
    return where


def _records_in_file(file: str):
    """(records in ``file``, the name of its i-th record's place), or None where the file does not tell."""
    builder = _builder_for(file)
    try:
        if builder == "parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(file).metadata.num_rows, lambda i: f"row {i}"
        if builder not in ("json", "text"):
            return None
        with (gzip.open if file.endswith(".gz") else open)(file, "rb") as stream:
            lines = stream.read().splitlines()
    except (OSError, EOFError, zlib.error, ValueError):
        return None
    if builder == "text":
        return len(lines), lambda i: f"line {i + 1}"
    if next((line.strip()[:1] for line in lines if line.strip()), b"") == b"[":  # one JSON array, not JSON lines
        return None
    numbers = [number for number, line in enumerate(lines, 1) if line.strip()]  # datasets skips blank lines
    return len(numbers), lambda i: f"line {numbers[i]}"
