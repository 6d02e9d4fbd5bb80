"""python -m flame.eval: score an HF export or a dump folder's checkpoint with lm-evaluation-harness.

    python -m flame.eval --model <HF dir | dump folder> [--step N] --tasks piqa,hellaswag [lm-eval's options]
    NGPU=8 bash eval.sh --model exp/run --tasks ...      (data parallel: torchrun -m flame.eval)

Every option but --model and --step is lm-eval's own (``lm_eval run -h``) and means what it
means there; --model_args may set dtype and HFLM's scoring options, not a model to load.
"""

import argparse
import logging
import os
import signal
import sys

from flame.base import autotune
from flame.base.cli import expanded_path
from flame.base.errors import ConfigError, gist
from flame.base.process import PARENT_PID, die_with_parent

PROG = "flame eval"


def _lm_eval_parser() -> argparse.ArgumentParser:
    from lm_eval._cli.run import Run

    commands = argparse.ArgumentParser(prog=PROG).add_subparsers()
    Run.create(commands)
    return commands.choices["run"]


def parse(argv: list[str]) -> tuple[argparse.Namespace, object]:
    """(flame's options, lm-eval's EvaluatorConfig of the others), or ConfigError."""
    own = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0], add_help=False, allow_abbrev=False)
    own.add_argument("--model", type=expanded_path, help="an HF model directory, or a run's dump folder (a DCP step, loaded in memory)")
    own.add_argument("--step", type=int, help="the dump folder's step (default: its latest complete checkpoint)")
    own.add_argument("-h", "--help", action="store_true", help="this help, then lm-eval's options")
    args, rest = own.parse_known_args(argv)
    lm_eval = _lm_eval_parser()
    if args.help:
        own.print_help()
        print("\nlm-eval's options (lm_eval run -h):")
        lm_eval.print_help()
        sys.exit(0)
    if not args.model:
        raise ConfigError("--model is required: an HF model directory or a run's dump folder (e.g. --model exp/debug)")
    options = lm_eval.parse_args(rest)
    if options.model is not None or options.config is not None:
        raise ConfigError("-M and --config are lm-eval's ways to pick a model; flame.eval scores --model: drop them")
    from lm_eval.config.evaluate_config import EvaluatorConfig

    args.device = options.device  # lm-eval's config defaults it to cuda; flame.eval picks the device itself
    try:
        return args, EvaluatorConfig.from_cli(options)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{gist(error)} (lm-eval's options: {PROG} -h)") from None


def evaluate(args: argparse.Namespace, cfg) -> int:
    import torch
    from lm_eval import simple_evaluate

    from flame.base import device
    from flame.eval import model, report, tasks
    from flame.models.registry import register_all

    rank, world, default_device = device.evaluation_process()
    if world > 1 and args.device:
        raise ConfigError(f"--device {args.device}: under torchrun every process scores on its own GPU; drop --device")
    register_all()  # every model type flame trains loads (flame.register)
    source = model.resolve(args.model, args.step)
    model.check_model_args(cfg.model_args)
    hflm_args = {key: value for key, value in cfg.model_args.items() if key != "dtype"}
    manager, built = tasks.load(cfg.tasks, cfg.include_path, cfg.metadata)  # before the model: data problems fail fast
    folder = report.output_folder(source, cfg.output_path)
    on = torch.device(args.device) if args.device else default_device
    if on.type == "cuda":
        kernels_keep_their_tile_choices()
    network, tokenizer = model.load(source, cfg.model_args.get("dtype", "auto"), on)
    batch_size = model.batch_size_for(network, cfg.batch_size)
    lm = model.FlameLM(network, tokenizer, rank, world, batch_size=batch_size, max_batch_size=cfg.max_batch_size, **hflm_args)
    writer = report.tracker(folder, cfg.hf_hub_log_args)
    seeds = cfg.seed or [None] * 4  # as lm-eval's command line: no --seed, no seeding
    results = simple_evaluate(
        model=lm, model_args={"pretrained": source.path, **({"step": source.step} if source.step is not None else {})},
        tasks=built, task_manager=manager, num_fewshot=cfg.num_fewshot, batch_size=batch_size,
        max_batch_size=cfg.max_batch_size, device=str(on), use_cache=cfg.use_cache,
        cache_requests=cfg.cache_requests.get("cache_requests", False),
        rewrite_requests_cache=cfg.cache_requests.get("rewrite_requests_cache", False),
        delete_requests_cache=cfg.cache_requests.get("delete_requests_cache", False),
        limit=cfg.limit, samples=cfg.samples, check_integrity=cfg.check_integrity, write_out=cfg.write_out,
        log_samples=cfg.log_samples, evaluation_tracker=writer, system_instruction=cfg.system_instruction,
        apply_chat_template=cfg.apply_chat_template, fewshot_as_multiturn=cfg.fewshot_as_multiturn,
        gen_kwargs=cfg.gen_kwargs, predict_only=cfg.predict_only, random_seed=seeds[0], numpy_random_seed=seeds[1],
        torch_random_seed=seeds[2], fewshot_random_seed=seeds[3],
        confirm_run_unsafe_code=cfg.confirm_run_unsafe_code, metadata=cfg.metadata,
    )
    if results is None:  # a process other than rank 0: rank 0 aggregates and writes
        return 0
    samples = results.pop("samples", None) if cfg.log_samples else None
    report.save(results, samples, writer)
    report.log_to_run(source, results)
    table = report.write_table(results, folder)
    print(f"flame.eval: {source.label}: results in {os.path.dirname(table)}")
    return 0


def kernels_keep_their_tile_choices() -> None:
    """fla's kernels read their autotune choices from this machine's Triton cache, as in training (train.sh).

    A Triton kernel that autotunes picks its tile sizes by timing them, so two processes can pick
    differently and sum in another order: scores would then differ in the last digits between one
    GPU and several, or between two runs. Cached choices (flame's shipped ones, then each new
    shape's first winner) make every later process use the same tiles, and skip the tuning.
    """
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    autotune.share_triton_cache()
    autotune.install()


def main(argv: list[str] | None = None) -> int:
    if os.environ.get(PARENT_PID):  # started by a training rank (flame.training.evaluation): it ends with it
        die_with_parent(signal.SIGTERM)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as lm-eval's command line: no fork warnings
    try:
        status = evaluate(*parse(sys.argv[1:] if argv is None else argv))
    except ConfigError as error:
        print(f"flame.eval: error: {error}", file=sys.stderr)
        return 2
    leave_process_group()
    return status


def leave_process_group() -> None:
    """Under torchrun, every rank waits for rank 0's report, then ends the process group itself.

    Left to the interpreter's exit, gloo's threads can abort a finished rank ("terminate called
    without an active exception", SIGABRT) while rank 0 still writes, and torchrun then fails the
    whole evaluation.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
