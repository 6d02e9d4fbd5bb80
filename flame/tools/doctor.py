"""``flame doctor``: what this machine gives flame, in the lines a bug report needs.

The versions of flame's stack (3rdparty/requirements.txt pins the ones it is tested with), the GPUs torch sees, and where the caches live with their sizes: the Hugging
Face hub and datasets caches, Triton's kernel cache (fla's autotune choices) and flame's built-in corpora.
It imports torch (seconds) and nothing that starts a run.
"""

from __future__ import annotations

import os
import sys
from importlib import metadata
from pathlib import Path

from flame.base import autotune
from flame.base.cli import ArgumentParser

# what flame runs on, in the order a reader checks them
STACK = ("torch", "torchtitan", "flash-linear-attention", "fla-core", "transformers", "datasets", "tokenizers",
         "triton", "mamba-ssm", "tilelang", "lm-eval", "huggingface-hub", "flame")


def versions() -> list[tuple[str, str]]:
    found = []
    for name in STACK:
        try:
            found.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            found.append((name, "not installed"))
    return found


def gpus() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return ["none visible to torch (training runs on the CPU, with gloo between processes)"]
    lines = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        lines.append(f"{index}: {props.name}, {props.total_memory / 2**30:.1f} GiB, "
                     f"compute capability {props.major}.{props.minor}")
    return lines


def folder_size(path: Path) -> str:
    if not path.is_dir():
        return "absent"
    total = sum(file.stat().st_size for file in path.rglob("*") if file.is_file() and not file.is_symlink())
    return f"{total / 2**30:.2f} GiB" if total >= 2**30 else f"{total / 2**20:.1f} MiB"


def caches() -> list[tuple[str, Path]]:
    from huggingface_hub import constants

    import datasets

    return [
        ("Hugging Face hub (models, tokenizers)", Path(constants.HF_HUB_CACHE)),
        ("datasets", Path(datasets.config.HF_DATASETS_CACHE)),
        ("Triton kernels and autotune choices", Path(autotune.triton_cache_dir())),
        ("flame's built-in corpora (FLAME_CACHE)", Path(os.environ.get("FLAME_CACHE", "~/.cache/flame")).expanduser()),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="flame doctor", description=__doc__.split("\n")[0])
    parser.add_argument("--no_sizes", action="store_true", help="skip measuring the caches (a large cache takes seconds)")
    args = parser.parse_args(argv)
    print(f"python  {sys.version.split()[0]} ({sys.executable})")
    width = max(len(name) for name in STACK)
    for name, version in versions():
        print(f"{name:<{width}}  {version}")
    print("GPUs:")
    for line in gpus():
        print(f"  {line}")
    print("caches:")
    for what, path in caches():
        size = "" if args.no_sizes else f"  ({folder_size(path)})"
        print(f"  {what}: {path}{size}")
    offline = [name for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if os.environ.get(name)]
    if offline:
        print(f"offline: {', '.join(offline)} set: hub names resolve from the caches only")
    return 0
