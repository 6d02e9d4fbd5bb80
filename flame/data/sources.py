"""Dataset specs from the config -> Hugging Face datasets (map-style or streaming)."""

import glob
import os
from dataclasses import dataclass

import datasets

from flame.config.manager import split_list
from flame.data import builtin
from flame.base.errors import ConfigError, gist

# file extension -> datasets' packaged builder
_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".arrow": "arrow"}


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
    paths = split_list(training.dataset)

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
            builder = _builder_for(files[0])
            if builder is None:
                raise ConfigError(
                    f"cannot tell the format of {files[0]}: use .json/.jsonl/.parquet/.txt/.arrow files or a directory"
                )
            kwargs.update(data_files=files, split="train" if spec.split == "train" else spec.split)
            return datasets.load_dataset(builder, streaming=streaming, **kwargs)
        if _looks_like_a_path(path) and not os.path.exists(path):
            raise ConfigError(f"--training.dataset {path} does not exist")
        return datasets.load_dataset(path, streaming=streaming, **kwargs)
    except ConfigError:
        raise
    except ValueError as error:
        if "corresponds to no data" in str(error):
            raise ConfigError(f"dataset {spec.path} (split {spec.split}) has no documents") from None
        if "split" in str(error).lower():
            raise ConfigError(f"dataset {spec.path}: unknown split '{spec.split}' ({gist(error)})") from None
        raise ConfigError(f"cannot load dataset {spec.path}: {gist(error)}") from None
    except (FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as error:
        raise ConfigError(
            f"dataset {spec.path} not found (not a local path, nor a hub dataset in the local HF cache): {gist(error)}"
        ) from None


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
