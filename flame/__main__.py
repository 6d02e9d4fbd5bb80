"""The ``flame`` command: one entry to every tool, ``flame <subcommand> -h`` for each one's options.

    flame train [--job.config_file configs/flame.toml] [--section.key value ...]   (train.sh's launcher)
    flame eval --model exp/run --tasks piqa        flame export exp/run        flame plot exp/run
    flame convert hf_to_dcp --model <hf dir> --checkpoint exp/run/checkpoint/step-0
    flame push exp/run --repo_id you/name [--dry_run]      flame models      flame doctor

Installed by ``pip install`` of the package (``[project.scripts]``), and ``python -m flame`` in a checkout.
Each subcommand is a module's ``main(argv)``: this file only dispatches, so ``flame -h`` imports nothing heavy.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
from pathlib import Path

# subcommand -> (module whose main(argv) runs it, one line of help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("", "train a model: flame's launcher (the same as bash train.sh in a checkout)"),
    "eval": ("flame.eval.__main__", "score an HF export or a run's checkpoint with lm-evaluation-harness"),
    "export": ("flame.checkpoint.export", "export a run's checkpoint as a Hugging Face model (<dump>/hf)"),
    "average": ("flame.checkpoint.average", "average a run's last checkpoints into one HF model, scored beside them"),
    "convert": ("", "convert checkpoints: dcp_to_hf (as export) or hf_to_dcp (an HF model as a step-0 checkpoint)"),
    "plot": ("flame.tools.plot", "draw the curves of one run or several (curves.png)"),
    "push": ("flame.tools.push", "upload a run's HF export to the Hugging Face hub"),
    "preprocess": ("flame.tools.preprocess", "tokenize a corpus once, to disk, for many runs"),
    "models": ("flame.models.support_table", "what flame supports, per model type"),
    "doctor": ("flame.tools.doctor", "what is installed, the GPUs, the caches: what to paste in a bug report"),
}
CONVERSIONS = {"dcp_to_hf": "flame.checkpoint.export", "hf_to_dcp": "flame.checkpoint.import_hf"}
LAUNCHER = Path(__file__).resolve().parent / "launch" / "train.sh"


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:<{width}}  {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "usage: flame <subcommand> [options]   (flame <subcommand> -h: its options)\n\n" + "\n".join(lines)


def train(argv: list[str]) -> int:
    """The launcher script with this interpreter (a pip-installed flame has no managed .venv to set up), in place of
    this process: a signal (Ctrl-C, Slurm's SIGTERM) reaches the launcher, which saves before stopping."""
    env = {**os.environ, "FLAME_PYTHON": os.environ.get("FLAME_PYTHON", sys.executable)}
    env.setdefault("FLAME_COMMAND", "flame train")
    os.execvpe("bash", ["bash", str(LAUNCHER), *argv], env)


def evaluate(argv: list[str]) -> int:
    """flame.eval in this process, or under torchrun with NGPU processes (data parallel) when NGPU > 1."""
    ngpu = os.environ.get("NGPU", "")
    if ngpu and (not ngpu.isdigit() or int(ngpu) < 1):
        print(f"flame eval: error: NGPU must be a whole number >= 1, not '{ngpu}'", file=sys.stderr)
        return 2
    if ngpu.isdigit() and int(ngpu) > 1:
        os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                  ngpu, "-m", "flame.eval", *argv])
    return run_module("flame.eval.__main__", argv)


def run_module(module: str, argv: list[str]) -> int:
    if module in ("flame.eval.__main__", "flame.checkpoint.export", "flame.tools.push"):
        # as their own `python -m` entries do: before transformers' model classes load
        from flame.compat.transformers import scikit_learn_imported_when_used

        scikit_learn_imported_when_used()
    return int(importlib.import_module(module).main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    if argv is None and hasattr(signal, "SIGPIPE"):  # `flame models | head`: end quietly when the reader has gone
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"flame: error: no subcommand '{name}'; choose one of {', '.join(SUBCOMMANDS)} (flame -h)", file=sys.stderr)
        return 2
    if name == "train":
        return train(rest)
    if name == "eval":
        return evaluate(rest)
    if name == "convert":
        if not rest or rest[0] not in CONVERSIONS:
            asked = rest[:1] in (["-h"], ["--help"])
            print(f"{'usage' if asked else 'flame convert: error: say which way'}: flame convert "
                  f"{' | '.join(CONVERSIONS)} [options] (flame convert <way> -h)", file=sys.stdout if asked else sys.stderr)
            return 0 if asked else 2
        return run_module(CONVERSIONS[rest[0]], rest[1:])
    return run_module(SUBCOMMANDS[name][0], rest)


if __name__ == "__main__":
    sys.exit(main())
