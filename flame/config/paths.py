"""The job's paths: the settings that name files and folders, and the folders that belong to the dump folder.

``expand_paths`` (called as the config parses) expands ``~`` and environment variables in every
setting that names a path (flame.base.paths), in the TOML file and on the command line alike.
``IN_DUMP_FOLDER`` are the places torchtitan joins to the dump folder; flame.prepare keeps them
inside it (``outside_dump_folder``): ``--checkpoint.folder ../../x`` would scatter a run's files
over the disk, and one run's checkpoints could land in another's folder.
"""

import os
from typing import Any

from flame.base.paths import expand, expand_list

# settings that name one file or folder
PATHS = ("job.dump_folder", "model.config", "model.tokenizer_path", "model.init_from", "checkpoint.initial_load_path",
         "eval.include_path")
# comma lists with one entry per dataset
PATH_LISTS = ("training.dataset", "training.data_files", "training.data_dir", "validation.dataset",
              "validation.data_files", "validation.data_dir")
# paths relative to the dump folder, where the run writes them
IN_DUMP_FOLDER = ("checkpoint.folder", "metrics.save_tb_folder", "comm.save_traces_folder", "profiling.save_traces_folder",
                  "profiling.save_memory_snapshot_folder", "job.save_config_file")
ABSOLUTE_OPT_IN = "job.allow_absolute_folders"


def _section_and_name(config: Any, dotted: str) -> tuple[Any, str]:
    *parents, last = dotted.split(".")
    for part in parents:
        config = getattr(config, part)
    return config, last


def expand_paths(config: Any) -> None:
    """Expand ``~`` and ``$VAR`` in every path setting of ``config``, in place (ConfigError: a variable not set)."""
    for names, expand_one in ((PATHS + IN_DUMP_FOLDER, expand), (PATH_LISTS, expand_list)):
        for dotted in names:
            section, name = _section_and_name(config, dotted)
            value = getattr(section, name)
            if isinstance(value, str) and value:
                setattr(section, name, expand_one(value, f"--{dotted}"))


def outside_dump_folder(config: Any) -> list[tuple[str, str]]:
    """(setting, the place it names) of each ``IN_DUMP_FOLDER`` setting that leaves the dump folder."""
    dump = os.path.abspath(config.job.dump_folder)
    outside = []
    for dotted in IN_DUMP_FOLDER:
        section, name = _section_and_name(config, dotted)
        value = getattr(section, name)
        if not isinstance(value, str):
            continue
        place = os.path.abspath(os.path.join(dump, value))  # as torchtitan joins them: an absolute path replaces dump
        if os.path.relpath(place, dump).split(os.sep)[0] == os.pardir:
            outside.append((dotted, value))
    return outside
