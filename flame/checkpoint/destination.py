"""Where an HF export may go: a new folder, an empty one, or an earlier export, which it replaces whole.

An export is written beside its destination and swapped in (flame.checkpoint.export), so the folder
it replaces is deleted: that may only be a folder flame made. ``check`` refuses, in one line and
before any weight is read, a destination that is a file, a folder holding anything but an export,
or one this user cannot replace; train.sh's preflight checks <dump_folder>/hf the same way before
training, not after it. A symbolic link is followed: the export replaces the folder it points to,
and the link stays.

Flame's exports hold ``MARKER``. An export by an earlier flame, without one, is recognized at the
run's own export folder (<dump_folder>/hf, beside its job_config.json) when it holds only the files
an HF export consists of.
"""

import json
import os
import re

from flame.base.dump_folder import RUN_CONFIG_FILE
from flame.base.errors import ConfigError

MARKER = ".flame_export"  # hidden: flame push leaves it out, and transformers ignores it
_EXPORT_FILES = {
    "config.json", "generation_config.json", "model.safetensors.index.json", "adapter_config.json",
    "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json", "README.md", MARKER,
}
_SHARD = re.compile(r"model(-\d+-of-\d+)?\.safetensors")


def write_marker(folder: str) -> None:
    """Mark ``folder`` (an export being written) as one flame made, which a later export may replace."""
    with open(os.path.join(folder, MARKER), "w") as file:
        json.dump({"written_by": "flame export"}, file)


def is_export(folder: str) -> bool:
    """Whether ``folder`` is an HF export flame wrote (``MARKER``, or an earlier flame's at <dump_folder>/hf)."""
    if os.path.isfile(os.path.join(folder, MARKER)):
        return True
    names = os.listdir(folder)
    run_folder = os.path.dirname(os.path.abspath(folder))
    return (os.path.basename(os.path.abspath(folder)) == "hf" and os.path.isfile(os.path.join(run_folder, RUN_CONFIG_FILE))
            and bool({"config.json", "adapter_config.json"} & set(names))
            and all(name in _EXPORT_FILES or _SHARD.fullmatch(name) for name in names))


def check(out: str, what: str, elsewhere: str = "give a new or empty folder") -> str:
    """The folder an export to ``out`` writes (``out``, or the folder a link there points to); ConfigError where no
    export may go. ``what``: how a refusal names ``out`` (``--out exp/x``); ``elsewhere``: how to export elsewhere."""
    target = os.path.realpath(out) if os.path.islink(out) else out
    subject = what if target == out else f"{what} (a link to {target})"
    if os.path.exists(target) and not os.path.isdir(target):
        raise ConfigError(f"{subject} is a file, and an export is a folder; move the file, or {elsewhere}")
    if os.path.isdir(target):
        names = sorted(os.listdir(target))
        if names and not is_export(target):
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise ConfigError(
                f"{subject} exists and is not an export flame wrote (it holds {shown}); an export replaces its folder "
                f"whole: move that folder away yourself, or {elsewhere}"
            )
        if names and not os.access(target, os.W_OK | os.X_OK):
            raise ConfigError(f"{subject} holds an earlier export this user cannot delete, which an export replaces; "
                              f"make it writable, or {elsewhere}")
    existing = os.path.dirname(os.path.abspath(target))
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{subject}: {existing} is not a folder this user can write, and the export is written there "
                          f"first; make it writable, or {elsewhere}")
    return target
