"""Checkpoint manifests: every file of a complete checkpoint step, with its size and CRC-32.

A step folder (``<dump_folder>/checkpoint/step-N``) is complete when its ``manifest.json`` is
there: flame writes it last, after DCP's ``.metadata``, once every rank's files are written
(flame.checkpoint.manager for the trainer's saves, flame.checkpoint.import_hf for its
own). A step is checked against its manifest before anything reads it, so that a truncated,
changed or missing file is found, and named, before DCP unpickles the step's ``.metadata``.

A manifest shows that the files are the ones that were written, not who wrote them: DCP's
``.metadata`` (and every non-tensor value of a checkpoint) is a pickle, so loading a checkpoint
means trusting its author. A step that has no manifest (one from elsewhere) is loaded only once
you record one, which says you trust it:

    python -m flame.checkpoint.manifest <step folder>
"""

import argparse
import json
import os
import re
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from flame.base.cli import expanded_path

MANIFEST = "manifest.json"
METADATA = ".metadata"  # DCP's, written last of its files
FORMAT = 1
_CHUNK = 8 << 20
# the files DCP's FileSystemWriter writes for rank R: __R_<n>.distcp
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp")
_STEP = re.compile(r"step-(\d+)")


class Defect(NamedTuple):
    """What keeps a step from loading: ``kind`` ("incomplete" or "damaged") and the problem, naming the file."""

    kind: str
    problem: str


def crc32(path: str) -> str:
    """The CRC-32 of a file, as 8 hex digits (zlib's, read in chunks; it releases the GIL, so threads add up).

    The fastest checksum of the standard library (against SHA-1 and BLAKE2b: docs/perf-log.md, 2026-11-25):
    it finds truncated or changed files; a manifest is no signature, whatever the hash.
    """
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return f"{value:08x}"


def step_files(folder: str) -> list[str]:
    """Every file of a step folder (relative paths, sorted), the manifest itself excluded."""
    names = []
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.relpath(os.path.join(root, name), folder)
            if path != MANIFEST and not path.startswith(MANIFEST + "."):
                names.append(path)
    return sorted(names)


def owner(name: str, ranks: int) -> int:
    """The rank, of ``ranks``, that hashes or checks file ``name``: DCP's writer of it, rank 0 for the rest."""
    match = _RANK_FILE.fullmatch(os.path.basename(name))
    return int(match.group(1)) % ranks if match else 0


def describe(folder: str, names: list[str]) -> dict[str, dict]:
    """Size and CRC-32 of each of ``names`` (relative to ``folder``), several files at a time."""

    def one(name: str) -> tuple[str, dict]:
        path = os.path.join(folder, name)
        return name, {"size": os.path.getsize(path), "crc32": crc32(path)}

    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(names)))) as pool:
        return dict(pool.map(one, names))


def _write_json(path: str, value) -> None:
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)  # whole or absent, whenever a reader looks


def write(folder: str, files: dict[str, dict], identity: dict | None = None) -> None:
    """Write the step's manifest atomically: it marks the step complete, so it comes last. ``identity``: the run's
    (flame.checkpoint.identity), which a resume compares with its own."""
    content = {"format": FORMAT, "files": dict(sorted(files.items()))}
    if identity is not None:
        content["identity"] = identity
    _write_json(os.path.join(folder, MANIFEST), content)


def unmark(folder: str) -> None:
    """Remove a step's manifest and its ranks' parts: the step is about to be written again."""
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        if name == MANIFEST or name.startswith(f"{MANIFEST}.rank-"):
            os.remove(os.path.join(folder, name))


def write_part(folder: str, rank: int, files: dict[str, dict] | None, error: str | None = None) -> None:
    """One rank's share of a step's manifest (or why it has none), for rank 0 to collect."""
    _write_json(os.path.join(folder, f"{MANIFEST}.rank-{rank}"), {"files": files, "error": error})


def collect_parts(folder: str, ranks: range, timeout: float) -> dict[str, dict]:
    """The files the parts of ``ranks`` list, once all are there (they are removed); RuntimeError when
    a rank had none, TimeoutError when one has not come within ``timeout`` seconds."""
    paths = {rank: os.path.join(folder, f"{MANIFEST}.rank-{rank}") for rank in ranks}
    deadline = time.monotonic() + timeout
    while missing := [rank for rank, path in paths.items() if not os.path.isfile(path)]:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank {missing[0]}'s share of it did not appear within {timeout:.0f} s (on several nodes, the dump "
                "folder must be on a filesystem all of them share)"
            )
        time.sleep(0.1)
    files = {}
    for rank, path in paths.items():
        with open(path) as f:
            part = json.load(f)
        if part["error"]:
            raise RuntimeError(f"rank {rank}: {part['error']}")
        files.update(part["files"])
    for path in paths.values():
        os.remove(path)
    return files


def record(folder: str) -> None:
    """Hash every file of a step folder and write its manifest (one process)."""
    write(folder, describe(folder, step_files(folder)))


def read(folder: str) -> dict[str, dict]:
    """The files the step's manifest lists (path -> size, crc32); ValueError when it is not a manifest."""
    with open(os.path.join(folder, MANIFEST)) as f:
        manifest = json.load(f)  # ValueError when it is not JSON
    files = manifest.get("files") if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None
    if not isinstance(files, dict) or METADATA not in files or not all(
        isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("crc32"), str)
        for entry in files.values()
    ):
        raise ValueError(f"not a flame manifest of format {FORMAT} listing {METADATA}")
    return files


def read_identity(folder: str) -> dict | None:
    """The identity of the run that saved the step (its manifest's), or None: saved before flame recorded one, or
    recorded by hand (``python -m flame.checkpoint.manifest``). Read from a step already checked against its manifest."""
    with open(os.path.join(folder, MANIFEST)) as f:
        identity = json.load(f).get("identity")
    return identity if isinstance(identity, dict) else None


def defect(folder: str, checksums: list[str] | None = None) -> Defect | None:
    """What is wrong with a step folder, or None when every file matches its manifest.

    The sizes of all files are checked, and the checksums of ``checksums`` (default: all files;
    ``[]``: none): a rank checks its share of a step that all ranks check together.
    """
    if not os.path.isfile(os.path.join(folder, MANIFEST)):
        if not os.path.isfile(os.path.join(folder, METADATA)):
            return Defect("incomplete", f"it has no {METADATA}, so its save did not finish")
        return Defect("incomplete", f"it has no {MANIFEST}, so its save did not finish or flame did not write it")
    try:
        files = read(folder)
    except (OSError, ValueError) as error:
        return Defect("damaged", f"{MANIFEST} is unreadable ({error})")
    for name, expected in files.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return Defect("damaged", f"{name} is missing")
        if os.path.getsize(path) != expected["size"]:
            return Defect("damaged", f"{name} has {os.path.getsize(path)} bytes, not the {expected['size']} it was written with")
    names = list(files) if checksums is None else [name for name in checksums if name in files]
    for name, found in describe(folder, names).items():
        if found["crc32"] != files[name]["crc32"]:
            return Defect("damaged", f"{name} is not the file that was written (its checksum differs)")
    return None


def unrecorded(folder: str) -> bool:
    """Whether a step folder holds a complete DCP checkpoint but no manifest (one written by another program)."""
    return os.path.isfile(os.path.join(folder, METADATA)) and not os.path.isfile(os.path.join(folder, MANIFEST))


def step_folders(folder: str) -> dict[int, str]:
    """step -> path of every ``step-N`` folder (steps set aside as ``step-N.damaged`` etc. are not steps)."""
    if not os.path.isdir(folder):
        return {}
    steps = {}
    for name in os.listdir(folder):
        match = _STEP.fullmatch(name)
        if match and os.path.isdir(os.path.join(folder, name)):
            steps[int(match.group(1))] = os.path.join(folder, name)
    return steps


def complete_steps(folder: str) -> list[int]:
    """The steps whose save finished: their manifest is there (written after DCP's .metadata)."""
    return sorted(step for step, path in step_folders(folder).items() if os.path.isfile(os.path.join(path, MANIFEST)))


def set_aside(path: str, kind: str) -> str:
    """Rename a step folder that cannot be loaded to ``<path>.<kind>`` (``.2``, ... when taken); returns the new path.

    Nothing is deleted, and a run that reaches the step again writes a fresh folder. Another
    process (a second node's preflight) may have renamed it first: then that name is returned.
    """
    for attempt in range(1, 1000):
        target = f"{path}.{kind}" if attempt == 1 else f"{path}.{kind}.{attempt}"
        if os.path.exists(target):
            continue
        try:
            os.rename(path, target)
        except FileNotFoundError:
            return target if os.path.isdir(target) else path
        except OSError:  # taken in between
            continue
        return target
    raise OSError(f"cannot set {path} aside: {path}.{kind}.2 to .999 all exist")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Record the manifest of a checkpoint step you trust (see flame.checkpoint.manifest).")
    parser.add_argument("step", type=expanded_path, help="a DCP step folder, e.g. exp/run/checkpoint/step-1000")
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.step, METADATA)):
        print(f"flame.checkpoint.manifest: error: {args.step} has no {METADATA}: it is not a complete DCP checkpoint", file=sys.stderr)
        return 2
    if os.path.isfile(os.path.join(args.step, MANIFEST)):
        print(f"flame.checkpoint.manifest: error: {args.step} has a manifest already; delete it first to record the files as they are now",
              file=sys.stderr)
        return 2
    record(args.step)
    print(f"recorded {os.path.join(args.step, MANIFEST)}: loading this step now means trusting whoever wrote it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
