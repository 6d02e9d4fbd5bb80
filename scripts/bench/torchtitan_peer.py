"""torchtitan's own llama3 trainer at a flame config's sizes: the peer that flame's runs are measured against.

    python -m scripts.bench.torchtitan_peer --config configs/llama_340M.json --tokens 32768 --steps 20 [--compile]
    python -m scripts.bench.torchtitan_peer --config configs/llama_4M.json --tokens 1024 --steps 2 --device cpu
    python -m scripts.bench.torchtitan_peer --config configs/llama_340M.json --gpus 4 --compile   FSDP over 4 GPUs

Runs torchtitan 0.2.2's trainer as it ships (``torchtitan.train.main(Trainer)`` under torchrun,
one process per GPU: its default layout shards the model over them, FSDP), with nothing of
flame in the training path:
- the model is torchtitan's llama3 at the config's sizes, registered as an extra flavor of
  ``llama3_args`` (``flame_<config name>``): dim, layers, heads, vocabulary and the FFN width of
  the HF llama or fla transformer config. Before training, both models are built on the meta
  device and must count the same parameters, or the run is refused;
- attention: its ``varlen`` kernel with ``block_causal`` masks (documents end at the
  tokenizer's EOS), so one row of packed documents is attended per document, as in flame's
  varlen rows. ``--attention sdpa`` (causal over the whole row) is the CPU's default: varlen
  has no CPU kernel;
- data: flame's builtin corpus (the Python standard library's source), written once as one
  jsonl of its documents and read by torchtitan's ``c4_test`` loader through
  ``--training.dataset_path``; the tokenizer is flame's builtin BPE folder as
  ``--model.hf_assets_path``. One row of --tokens per step and GPU, no activation checkpointing, bf16
  autocast (torchtitan's single-GPU mixed precision), AdamW at lr 3e-4, warmup half the steps;
- ``--compile`` adds ``--compile.enable`` (torchtitan compiles each block and the loss).
Flags after ``--`` go to torchtitan's trainer as they are. Its log prints a line per logged
step (``step: ... memory: ...GiB(...%)  tps: ...``); scripts/bench/reports.py reads it. Its MFU
counts attention over the whole row, not per document: compare tokens/s, not its MFU.

On a machine without CUDA the worker first applies flame's CPU seam to torchtitan
(flame.compat.torchtitan.cpu_without_accelerator: gloo, fp32): only to check this script there.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flame.data import builtin

if TYPE_CHECKING:  # torchtitan's import takes seconds: the launcher never needs it
    from torchtitan.models.llama3 import TransformerModelArgs

ROOT = Path(__file__).resolve().parents[2]
SPEC_ENV = "FLAME_TORCHTITAN_PEER"  # set by the launcher: this process is torchrun's worker
CORPUS_VERSION = "v1"
LR = "3e-4"


def ffn_args(dim: int, width: int) -> tuple[int, float | None]:
    """torchtitan's ``multiple_of`` and ``ffn_dim_multiplier`` that give its FeedForward exactly ``width``.

    torchtitan sizes the FFN as int(8 * dim / 3), times the multiplier, rounded up to a multiple
    of ``multiple_of``; 256 gives llama's usual widths (dim 1024: 2816), any other width is hit
    by making it the multiple itself.
    """
    base = int(2 * 4 * dim / 3)
    if 256 * -(-base // 256) == width:
        return 256, None
    return (width, None) if width >= base else (width, width / base)


def flavor_args(config, ffn_width: int, attention: str) -> dict:
    """``TransformerModelArgs`` fields for torchtitan's llama3 at the sizes of an HF llama or fla transformer config."""
    if config.model_type not in ("llama", "transformer"):
        raise ValueError(f"model_type {config.model_type!r}: torchtitan's llama3 mirrors llama and fla transformer configs")
    if config.tie_word_embeddings:
        raise ValueError("tied embeddings: torchtitan's llama3 has an untied output layer; set tie_word_embeddings false")
    if getattr(config, "window_size", None):
        raise ValueError("a sliding-window transformer has no torchtitan llama3 twin; use a config without window_size")
    heads = getattr(config, "num_attention_heads", None) or config.num_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None) or heads
    rope = getattr(config, "rope_parameters", None) or {}
    multiple_of, multiplier = ffn_args(config.hidden_size, ffn_width)
    return {
        "dim": config.hidden_size, "n_layers": config.num_hidden_layers, "n_heads": heads, "n_kv_heads": kv_heads,
        "vocab_size": config.vocab_size, "multiple_of": multiple_of, "ffn_dim_multiplier": multiplier,
        "norm_eps": getattr(config, "rms_norm_eps", None) or getattr(config, "norm_eps", 1e-6),
        "rope_theta": getattr(config, "rope_theta", None) or rope.get("rope_theta", 10000.0),
        "attn_type": attention, "attn_mask_type": "causal" if attention == "sdpa" else "block_causal",
    }


def export_corpus() -> Path:
    """flame's builtin corpus as one jsonl of its documents ({"text": ...}), written once into flame's cache."""
    target = builtin.cache_dir() / "builtin" / f"torchtitan-corpus-{CORPUS_VERSION}"
    if not (target / "train.jsonl").is_file():
        source = Path(builtin.resolve(builtin.PREFIX + builtin.CORPUS))
        target.mkdir(parents=True, exist_ok=True)
        partial = target / f".train.jsonl.{os.getpid()}"  # renamed when whole: a reader never sees half of it
        with open(partial, "w") as out:
            for shard in sorted(source.glob("*.jsonl")):
                for line in open(shard):
                    out.write(json.dumps({"text": json.loads(line)["text"]}) + "\n")
        partial.replace(target / "train.jsonl")
    return target


def torchtitan_flags(args: argparse.Namespace, flavor: str, corpus: Path, tokenizer: str) -> list[str]:
    """torchtitan's command line for this run."""
    flags = ["--model.name", "llama3", "--model.flavor", flavor, "--model.hf_assets_path", tokenizer,
             "--training.dataset", "c4_test", "--training.dataset_path", str(corpus),
             "--training.local_batch_size", "1", "--training.seq_len", str(args.tokens),
             "--training.steps", str(args.steps), "--activation_checkpoint.mode", "none",
             "--optimizer.lr", LR, "--lr_scheduler.warmup_steps", str(max(1, args.steps // 2)),
             "--metrics.log_freq", str(args.log_freq or max(1, args.steps // 2)), "--metrics.disable_color_printing",
             "--job.dump_folder", str(args.dump or Path("/tmp/flame-torchtitan") / flavor)]
    return flags + (["--compile.enable"] if args.compile else []) + args.torchtitan


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="an HF llama or fla transformer config JSON")
    parser.add_argument("--tokens", type=int, default=32768, help="tokens per step: one row of packed documents")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--log-freq", type=int, help="steps per logged window (default: half the steps)")
    parser.add_argument("--compile", action="store_true", help="torchtitan's --compile.enable")
    parser.add_argument("--gpus", type=int, default=1, help="processes, one per GPU (FSDP over them; default 1)")
    parser.add_argument("--attention", choices=["varlen", "sdpa"],
                        help="varlen: per document (default; CUDA); sdpa: causal over the row (the CPU's default)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--dump", type=Path, help="torchtitan's --job.dump_folder (default /tmp/flame-torchtitan/<flavor>)")
    parser.add_argument("torchtitan", nargs="*", help="after --: more flags for torchtitan's trainer")
    args = parser.parse_args(argv)
    args.attention = args.attention or ("varlen" if args.device == "cuda" else "sdpa")
    if args.device == "cpu" and args.attention == "varlen":
        parser.error("--attention varlen runs a CUDA kernel; on the CPU use --attention sdpa")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device is visible; run with --device cpu (and --attention sdpa)")
    if args.device == "cpu" and args.gpus > 1:
        parser.error(f"--gpus {args.gpus} shards the model with torchtitan's FSDP, whose gradient reduction gloo "
                     "cannot run (PREMUL_SUM): on the CPU use --gpus 1")
    if args.device == "cuda" and args.gpus > torch.cuda.device_count():
        parser.error(f"--gpus {args.gpus}: only {torch.cuda.device_count()} CUDA devices are visible")
    if not Path(args.config).is_file():
        parser.error(f"--config {args.config} not found")
    for value, name in ((args.tokens, "--tokens"), (args.steps, "--steps"), (args.log_freq, "--log-freq"),
                        (args.gpus, "--gpus")):
        if value is not None and value <= 0:
            parser.error(f"{name} must be positive, got {value}")
    return args


def launch(argv: list[str] | None = None) -> int:
    """Write the corpus, then run torchtitan's trainer under torchrun with this module as its entry."""
    args = parse_args(argv)
    flavor = f"flame_{Path(args.config).stem}"
    corpus = export_corpus()
    tokenizer = builtin.resolve(builtin.PREFIX + builtin.TOKENIZER)
    spec = {"config": str(Path(args.config).resolve()), "flavor": flavor, "attention": args.attention}
    env = dict(os.environ)
    env[SPEC_ENV] = json.dumps(spec)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("HF_DATASETS_OFFLINE", "1")  # the corpus is a local file: nothing to download
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.gpus),
               "-m", "scripts.bench.torchtitan_peer", *torchtitan_flags(args, flavor, corpus, tokenizer)]
    print(f"torchtitan_peer: {shlex.join(command)}", flush=True)
    return subprocess.call(command, cwd=ROOT, env=env)


def twin_of(config_path: str, attention: str) -> tuple["TransformerModelArgs", int, int]:
    """torchtitan's ``TransformerModelArgs`` mirroring the config, and both models' parameter counts (meta device)."""
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs
    from transformers import AutoModelForCausalLM

    from flame.models import load_model_config
    from flame.models.registry import decoder_layers

    config = load_model_config(config_path)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        hf_model = AutoModelForCausalLM.from_config(config)
        ffn_width = decoder_layers(hf_model)[0].mlp.down_proj.in_features
        model_args = TransformerModelArgs(**flavor_args(config, ffn_width, attention))
        twin = Transformer(model_args)
    hf_count = sum({id(p): p.numel() for p in hf_model.parameters()}.values())
    return model_args, hf_count, sum(p.numel() for p in twin.parameters())


def worker(spec: dict) -> None:
    """torchrun's process: register the flavor, check its size against the config, run torchtitan's trainer."""
    if not torch.cuda.is_available():
        from flame.compat import torchtitan as torchtitan_seam

        torchtitan_seam.cpu_without_accelerator()
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.train import Trainer, main

    try:
        model_args, hf_count, twin_count = twin_of(spec["config"], spec["attention"])
    except ValueError as reason:
        sys.exit(f"torchtitan_peer: error: {spec['config']}: {reason}")
    if hf_count != twin_count:
        sys.exit(f"torchtitan_peer: error: {spec['config']} has {hf_count:,} parameters, torchtitan's llama3 at its "
                 f"sizes {twin_count:,}; only untied llama-shaped configs have an equal twin")
    print(f"torchtitan_peer: {spec['flavor']}: {twin_count:,} parameters, as {spec['config']}", flush=True)
    llama3_args[spec["flavor"]] = model_args  # the dict torchtitan's llama3 TrainSpec reads flavors from
    main(Trainer)


if __name__ == "__main__":
    if SPEC_ENV in os.environ:
        worker(json.loads(os.environ[SPEC_ENV]))
    else:
        sys.exit(launch())
