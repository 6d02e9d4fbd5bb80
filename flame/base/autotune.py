"""Autotune choices shipped with flame, so that fla's Triton kernels skip their benchmarks on a new machine.

    python -m flame.base.autotune install             copy the shipped choices into Triton's cache (train.sh does this)
    python -m flame.base.autotune collect [--replace] add this machine's choices (Triton's cache) to the shipped ones
    python -m flame.base.autotune list                what is shipped, per Triton version and GPU

The rule: most of fla's kernels (and flame's fused kernels for HF models) are ``triton.autotune``d:
on first use with a new shape each benchmarks several configurations, compiling every one of them.
With ``TRITON_CACHE_AUTOTUNING=1`` (train.sh's default) Triton keeps the winner in its cache as
``<key>/<kernel>.autotune.json``, and ``<key>`` already hashes everything the choice depends on:
Triton's version and build, the GPU target, the kernel's source, the shapes in the kernel's
autotune key and the candidate configurations. A choice copied from another machine is therefore
read only where it is valid, and never where it is not: a new GPU, Triton or fla version simply
misses and tunes again.

Shipped choices live in flame/base/autotune_choices/<triton version>/<gpu>/ (the GPU's name, e.g.
``NVIDIA-H100-80GB-HBM3``: the folder that ``collect`` replaces). ``install`` copies every
shipped file that Triton's cache lacks (never overwriting one), in well under a second.
Refresh them after upgrading Triton or fla, or for a new GPU: run the standard jobs once on that
GPU (any short run of each config), then ``python -m flame.base.autotune collect --replace`` and commit
flame/base/autotune_choices/.
"""

import argparse
import os
import shutil
import sys
from pathlib import Path

SHIPPED = Path(__file__).parent / "autotune_choices"
CHOICE_SUFFIX = ".autotune.json"


def triton_cache_dir() -> Path:
    """Where Triton caches kernels on this machine: TRITON_CACHE_DIR, else Triton's default folder.

    Triton's default is <TRITON_HOME, else the home folder>/.triton/cache; read here without
    importing Triton, which the launcher does not need.
    """
    if folder := os.environ.get("TRITON_CACHE_DIR"):
        return Path(folder)
    return Path(os.environ.get("TRITON_HOME") or Path.home()) / ".triton" / "cache"


def share_triton_cache() -> Path:
    """Pin TRITON_CACHE_DIR for this process and every process it starts; returns the folder.

    The rule: fla's kernels and torch.compile's must use one Triton cache. Where the variable is
    unset, torch's inductor sets it to a folder of its own (/tmp/torchinductor_<user>/triton/<gpu>)
    as it loads its first compiled kernel. Every fla kernel that autotunes after that moment looks
    for its choice there: it misses the shipped choices (installed in Triton's default folder),
    benchmarks again (minutes at step 1 for gla), and ``collect`` never sees what it chose.
    """
    folder = triton_cache_dir()
    os.environ["TRITON_CACHE_DIR"] = str(folder)
    return folder


def triton_version() -> str:
    import triton

    return triton.__version__


def shipped_choices(root: Path = SHIPPED) -> list[Path]:
    """Every shipped choice file, as a path under ``root``."""
    return sorted(root.glob(f"*/*/*/*{CHOICE_SUFFIX}")) if root.is_dir() else []


def install(cache: Path | None = None, root: Path = SHIPPED) -> int:
    """Copy the shipped choices that ``cache`` lacks into it; returns how many were copied.

    GPUs of one architecture (an H100 and an H200: both sm_90) tune under the same keys, so their
    folders can ship a choice for the same key: the first folder's (by name) is the one copied.

    A file appears whole or not at all (copied under a temporary name, then renamed), so ranks
    of several runs that share a cache never read half of one.
    """
    cache = cache or triton_cache_dir()
    copied = 0
    for choice in shipped_choices(root):
        target = cache / choice.parent.name / choice.name  # <cache>/<key>/<kernel>.autotune.json
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        shutil.copyfile(choice, partial)
        os.replace(partial, target)
        copied += 1
    return copied


def collect(gpu: str, cache: Path | None = None, root: Path = SHIPPED, replace: bool = False) -> Path:
    """Add ``cache``'s choices to the shipped ones for ``gpu`` under this Triton version; returns that folder.

    ``replace`` drops what was shipped for that GPU and version first: after an fla upgrade the old
    choices can never be read again (their keys hash the old kernels' source).
    """
    cache = cache or triton_cache_dir()
    choices = sorted(cache.glob(f"*/*{CHOICE_SUFFIX}")) if cache.is_dir() else []
    if not choices:
        raise SystemExit(f"flame: error: {cache} holds no Triton autotune choices: run the jobs to ship once on "
                         "this GPU with TRITON_CACHE_AUTOTUNING=1 (train.sh's default), then collect")
    folder = root / triton_version() / gpu
    staging = folder.with_name(f".{folder.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    if folder.is_dir() and not replace:
        shutil.copytree(folder, staging)
    for choice in choices:
        (staging / choice.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(choice, staging / choice.parent.name / choice.name)
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return folder


def gpu_name() -> str:
    """This machine's GPU as a folder name (e.g. NVIDIA-H100-80GB-HBM3)."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("flame: error: no GPU here: collect on the GPU whose choices you want to ship")
    return torch.cuda.get_device_name().replace(" ", "-").replace("/", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flame.base.autotune", description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=("install", "collect", "list"))
    parser.add_argument("--replace", action="store_true", help="collect: drop what is shipped for this GPU first")
    parser.add_argument("--cache", type=Path, help="Triton's cache folder (default: TRITON_CACHE_DIR or ~/.triton/cache)")
    args = parser.parse_args(argv)
    if args.action == "install":
        cache = args.cache or triton_cache_dir()
        print(f"flame: {install(cache)} shipped autotune choices copied into {cache}")
    elif args.action == "collect":
        folder = collect(gpu_name(), args.cache, replace=args.replace)
        print(f"flame: {len(list(folder.glob(f'*/*{CHOICE_SUFFIX}')))} choices now shipped in {folder}")
    else:
        for folder in sorted({choice.parent.parent for choice in shipped_choices()}):
            count = len(list(folder.glob(f"*/*{CHOICE_SUFFIX}")))
            print(f"triton {folder.parent.name}, {folder.name}: {count} choices")
    return 0


if __name__ == "__main__":
    sys.exit(main())
