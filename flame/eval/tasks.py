"""lm-eval tasks by name, built (their data loaded) before any model is: a bad name or data not at hand fails in one line.

A task's dataset is read from the local HF cache (HF_HOME) first, without a request; only a dataset not there
is fetched, where the hub answers (flame.base.hub). A local task is a YAML file under --include_path over local
files (configs/eval/).
"""

import difflib
import functools
import json
import os

import datasets
from lm_eval.tasks import TaskManager
from lm_eval.utils import pattern_match

from flame.base import hub
from flame.base.errors import ConfigError, gist

EXAMPLE = "configs/eval/ holds an example"
_LOCAL_TASK = f"or evaluate a local task: a YAML file under --include_path ({EXAMPLE})"


def task_manager(include_path: str | None, metadata: dict | None = None) -> TaskManager:
    """lm-eval's index of its tasks and those under ``include_path``; ``metadata`` goes to every task (--metadata)."""
    if include_path is not None and not os.path.isdir(include_path):
        raise ConfigError(f"--include_path {include_path} is not a directory; give the folder of your task YAML files ({EXAMPLE})")
    return _manager(include_path, json.dumps(metadata or {}, sort_keys=True, default=str))


@functools.cache  # it reads every YAML file of lm-eval's (seconds): once per process and setting
def _manager(include_path: str | None, metadata: str) -> TaskManager:
    return TaskManager(include_path=include_path, metadata=json.loads(metadata))


def _names(manager: TaskManager, requested: list[str]) -> list[str]:
    """The task names ``requested`` means (globs expanded), or the error naming an unknown one and its close matches."""
    names = []
    for name in requested:
        found = [name] if name.endswith(".yaml") and os.path.isfile(name) else pattern_match([name], manager.all_tasks)
        if not found:
            close = difflib.get_close_matches(name, manager.all_tasks, n=5, cutoff=0.6)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(
                f"unknown lm-eval task '{name}'{hint}; `lm_eval ls tasks` lists lm-eval's {len(manager.all_tasks)} "
                f"tasks, and your own go in YAML files under --include_path ({EXAMPLE})"
            )
        names.extend(n for n in found if n not in names)
    return names


def _dataset_of(manager: TaskManager, name: str) -> str:
    config = getattr(manager.task_index.get(name), "cfg", None) or {}
    path, subset = config.get("dataset_path"), config.get("dataset_name")
    return f"{path}{f' ({subset})' if subset else ''}" if path else "its dataset"


def load(requested: list[str], include_path: str | None, metadata: dict | None = None) -> tuple[TaskManager, list]:
    """(the task manager, the built tasks and groups ``requested`` names), their data loaded."""
    manager = task_manager(include_path, metadata)
    built = []
    for name in _names(manager, requested):
        try:
            loaded = hub.cache_first(
                f"task {name}: {_dataset_of(manager, name)}", "run this command once where there is network, with this "
                f"HF_HOME (the task's data is cached there), {_LOCAL_TASK}", lambda: manager.load([name]), datasets.config)
        except ConfigError:
            raise
        except OSError as error:  # the hub answered, but without the data: not found, refused, cut off
            raise ConfigError(
                f"task {name}: {_dataset_of(manager, name)} is not at hand ({gist(error)}); check the task's "
                f"dataset_path and the network, {_LOCAL_TASK}"
            ) from None
        except Exception as error:  # a task's YAML or code that does not build
            raise ConfigError(f"task {name} cannot be built: {gist(error)}; fix its YAML file or leave it out") from None
        built.extend([loaded["groups"][name]] if name in loaded["groups"] else loaded["tasks"].values())
    return manager, built
