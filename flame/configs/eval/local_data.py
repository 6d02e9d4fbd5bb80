"""Load an example task's data from files beside this module, whatever the working directory.

lm-eval calls ``custom_dataset`` with the task's ``dataset_kwargs`` (and its metadata, ignored
here); a plain ``dataset_path: json`` task would read ``data_files`` relative to the directory
lm-eval runs in instead.
"""

import os

import datasets

HERE = os.path.dirname(os.path.abspath(__file__))


def load(data_files: dict[str, str], **_metadata) -> datasets.DatasetDict:
    """{split: file name beside this module} -> the DatasetDict of those jsonl files."""
    return datasets.load_dataset("json", data_files={split: os.path.join(HERE, name) for split, name in data_files.items()})
