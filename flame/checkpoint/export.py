"""Export a flame DCP checkpoint as a Hugging Face model (safetensors, config, tokenizer).

    python -m flame.utils.convert_dcp_to_hf --path exp/run [--step N] [--config cfg.json]
        [--tokenizer path] [--out exp/run/hf] [--dtype bfloat16] [--export_as llama] [--lora_export merged]
        [--sample "def main("]

By default everything comes from the run itself (<path>/job_config.json): the model config,
the tokenizer, the checkpoint folder, checkpoint.export_dtype and checkpoint.export_as; --step
defaults to the latest complete checkpoint, which must match its manifest (flame.checkpoint.manifest).
``--export_as llama`` writes fla's transformer under llama's architecture (flame.checkpoint.llama_export);
``auto`` (the default) does so where its own architecture would need flash-attn to load, and says why.
The export holds a model card, README.md (flame.checkpoint.model_card). The export is
written next to its destination (``.hf-<host>-<pid>-*``) and swapped in only when complete, so
an earlier export is never left half-overwritten; the next export removes what a killed one left
there (exports of one folder do not run at once: train.sh's runs hold the dump folder). The
destination must be new, empty or an earlier export (flame.checkpoint.destination): an export never
deletes a folder flame did not make. A failed write (a full disk) is one line; nothing of it stays.

A LoRA run (--lora.rank, flame.models.lora) exports as its lora.export says (--lora_export
overrides it): ``adapter`` writes PEFT's adapter_config.json and adapter_model.safetensors (with
the tokenizer), whose base_model_name_or_path is the run's model.config directory, for
``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out)``; ``merged`` writes
the plain model with the adapters added into its weights.
"""

import json
import os
import re
import shutil
import socket
import sys
import tempfile
import warnings

if __name__ == "__main__":  # before the imports below load transformers' model classes
    from flame.compat.transformers import scikit_learn_imported_when_used

    scikit_learn_imported_when_used()

import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM, GenerationConfig

from flame.checkpoint import manifest
from flame.checkpoint.steps import EMA_STATE, complete_steps, weight_mismatches
from flame.data.tokenizer import load_tokenizer
from flame.base.dump_folder import RUN_CONFIG_FILE, pid_alive
from flame.base.cli import ArgumentParser
from flame.base.errors import ConfigError, gist
from flame.models import load_model_config, lora
from flame.models.registry import meta_model
from flame.checkpoint import destination, llama_export, model_card

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def run_settings(path: str) -> dict:
    """The job config a run saved in its dump folder ({} if there is none)."""
    saved = os.path.join(path, RUN_CONFIG_FILE)
    if not os.path.isfile(saved):
        return {}
    with open(saved) as f:
        return json.load(f)


def find_step(path: str, run: dict, step: int = -1, checkpoint_folder: str | None = None) -> tuple[str, int]:
    """(the checkpoint folder of ``step`` in the dump folder ``path``, the step); -1: the latest complete one."""
    folder = os.path.join(path, checkpoint_folder or run.get("checkpoint", {}).get("folder", "checkpoint"))
    steps = complete_steps(folder)
    step = steps[-1] if step == -1 and steps else step
    # a step folder named explicitly is checked as it loads, which says what it lacks
    if step not in steps and not (step != -1 and os.path.isdir(os.path.join(folder, f"step-{step}"))):
        named = f" for step {step}" if step != -1 else ""
        raise ConfigError(f"no complete checkpoint{named} in {folder}; complete steps: {steps}")
    return os.path.join(folder, f"step-{step}"), step


def load_hf_model_from_dcp(checkpoint: str, config, runnable: bool = False, ema: bool = False) -> torch.nn.Module:
    """An HF model (fp32, CPU) holding the weights of a DCP checkpoint, once its files match its manifest.

    ``runnable``: also set what a checkpoint does not hold, the non-persistent buffers (rotary
    frequencies, ...), as the model's HF initialization does; an export writes only what it holds.
    ``ema``: the average of the weights the run kept (--training.ema_decay) instead of the weights.
    """
    if found := manifest.defect(checkpoint):
        raise ConfigError(
            f"checkpoint {checkpoint} is {found.kind}: {found.problem}; use an intact step (--step), or, for a step "
            f"from elsewhere that you trust, record its manifest: python -m flame.checkpoint.manifest {checkpoint}"
        )
    model = meta_model(config)
    model.to_empty(device="cpu")
    if runnable:
        from flame.models.builder import (
            reinitialize,  # imports torchtitan: only where a model will run
        )

        reinitialize(model)
    state_dict = model.state_dict()
    metadata = dcp.FileSystemReader(checkpoint).read_metadata()
    problems = weight_mismatches(metadata, state_dict)
    if problems:
        raise ConfigError(
            f"checkpoint {checkpoint} does not hold this model's weights ({'; '.join(problems[:3])}): "
            "is --config the model the run trained?"
        )
    if ema:
        state_dict = _average_entries(checkpoint, metadata, state_dict)
    dcp.load(state_dict, checkpoint_id=checkpoint)
    return model


def _average_entries(checkpoint: str, metadata, state_dict: dict) -> dict:
    """``state_dict`` under the names of the checkpoint's average of the weights (ema.<name>); a tied weight once."""
    prefix = f"{EMA_STATE}."
    if not any(name.startswith(prefix) for name in metadata.state_dict_metadata):
        raise ConfigError(f"checkpoint {checkpoint} holds no average of the weights: its run trained without "
                          "--training.ema_decay; export the weights themselves (drop --ema)")
    entries, storages = {}, set()
    for name, tensor in state_dict.items():
        if prefix + name in metadata.state_dict_metadata:
            entries[prefix + name] = tensor
            storages.add(tensor.untyped_storage().data_ptr())
    for name, tensor in state_dict.items():  # what has no average: a tied alias (loaded already), or frozen weights
        if prefix + name not in metadata.state_dict_metadata and tensor.untyped_storage().data_ptr() not in storages:
            entries[name] = tensor
    return entries


def _alive_here(host: str, pid: int) -> bool:
    # one folder is exported from one machine at a time: another machine's staging folder is a leftover
    return host == socket.gethostname() and pid_alive(pid)


def remove_stale_staging(out: str) -> None:
    """Remove the staging folders of exports to ``out`` that were killed, restoring ``out`` if one was swapping it."""
    parent, name = os.path.split(os.path.abspath(out))
    if not os.path.isdir(parent):
        return
    # tempfile's 8 random characters; without host and pid: an export by an earlier flame
    staging = re.compile(rf"\.{re.escape(name)}-(?:(?P<host>.+)-(?P<pid>\d+)-)?[a-z0-9_]{{8}}(?P<previous>\.previous)?")
    stale = []
    for entry in sorted(os.listdir(parent)):
        match = staging.fullmatch(entry)
        if match and not (match["pid"] and _alive_here(match["host"], int(match["pid"]))):
            stale.append((os.path.join(parent, entry), match["previous"]))
    for path, previous in stale:
        if previous and not os.path.exists(out):  # killed between swapping the old export out and the new one in
            os.rename(path, out)
        else:
            shutil.rmtree(path, ignore_errors=True)


def export(model, tokenizer, out: str, dtype: torch.dtype, max_shard_size: str, card: str | None = None) -> None:
    """Write ``model`` (in ``dtype``), its tokenizer, a generation config and ``card`` (README.md) to ``out``, whole or not at all."""
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    remove_stale_staging(out)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}-{socket.gethostname()}-{os.getpid()}-", dir=parent)
    try:
        model.to(dtype)
        model.config.dtype = dtype
        if hasattr(model, "peft_config"):  # a LoRA adapter, in PEFT's format
            with warnings.catch_warnings():  # that its base holds no config: the export's note says so
                warnings.simplefilter("ignore")
                model.save_pretrained(staging)
        else:
            model.save_pretrained(staging, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(staging)
        GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        ).save_pretrained(staging)
        if card is not None:
            with open(os.path.join(staging, "README.md"), "w") as f:
                f.write(card)
        destination.write_marker(staging)
        _make_readable(staging)
        if os.path.exists(out):
            previous = staging + ".previous"
            os.rename(out, previous)
            os.rename(staging, out)
            shutil.rmtree(previous, ignore_errors=True)  # the new export is in place; the next export removes a rest
        else:
            os.rename(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _make_readable(folder: str) -> None:
    # mkdtemp (and atomic writers) create owner-only files; an export is meant to be shared.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o666 & ~umask)


def sample(out: str, prompt: str, max_new_tokens: int = 48) -> str:
    """Load the export with plain transformers and continue ``prompt`` (seeded sampling, T=0.7)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)  # an adapter: over its base model
    inputs = tokenizer(prompt, return_tensors="pt")
    torch.manual_seed(0)
    generated = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=True, temperature=0.7, top_k=40)
    return tokenizer.decode(generated[0], skip_special_tokens=True)


def load_adapters(model: torch.nn.Module, settings: lora.LoraSettings, checkpoint: str, base_model: str) -> torch.nn.Module:
    """A PeftModel over ``model`` (its base weights loaded) holding the adapters of the DCP ``checkpoint``."""
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, settings.peft_config())
    peft_model.peft_config[lora.ADAPTER].base_model_name_or_path = base_model
    adapters = {
        lora.checkpoint_name(name.removeprefix("base_model.model.")): param.data
        for name, param in peft_model.named_parameters() if param.requires_grad
    }
    problems = weight_mismatches(dcp.FileSystemReader(checkpoint).read_metadata(), adapters)
    if problems:
        raise ConfigError(
            f"checkpoint {checkpoint} does not hold the adapters of the run's --lora settings ({'; '.join(problems[:3])}): "
            "was it saved by this run?"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # that no process group exists: the export runs in one process
        dcp.load(adapters, checkpoint_id=checkpoint)
    return peft_model


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="flame export", description=__doc__.split("\n")[0])
    parser.add_argument("folder", nargs="?", path=True, help="the run's dump folder (or --path)")
    parser.add_argument("--path", path=True, help="the run's dump folder")
    parser.add_argument("--step", type=int, default=-1, help="checkpoint step (default: latest complete one)")
    parser.add_argument("--config", path=True, help="HF model config (default: the run's model.config)")
    parser.add_argument("--tokenizer", path=True, help="tokenizer (default: the run's model.tokenizer_path)")
    parser.add_argument("--checkpoint_folder", help="checkpoint folder under --path (default: the run's)")
    parser.add_argument("--out", path=True, help="output directory (default: <path>/hf)")
    parser.add_argument("--dtype", choices=DTYPES, help="weights dtype (default: the run's checkpoint.export_dtype)")
    parser.add_argument("--max_shard_size", default="5GB", help="safetensors shard size (default 5GB)")
    parser.add_argument("--export_as", choices=llama_export.FORMATS,
                        help="native: the model's own architecture; llama: fla's transformer as LlamaForCausalLM; "
                             "auto: llama where the own architecture needs flash-attn to load and llama expresses it, "
                             "else native (default: the run's checkpoint.export_as)")
    parser.add_argument("--lora_export", choices=("adapter", "merged"), help="a LoRA run's export (default: the run's lora.export)")
    parser.add_argument("--ema", action="store_true",
                        help="export the average of the weights the run kept (--training.ema_decay) instead of them")
    parser.add_argument("--sample", metavar="PROMPT", help="after exporting, load the model and print a continuation")
    args = parser.parse_args(argv)
    if bool(args.folder) == bool(args.path):
        parser.error("give the run's dump folder once: flame export <dump folder> (or --path <dump folder>)")
    args.path = args.path or args.folder

    step, out = args.step, args.out or os.path.join(args.path, "hf")
    try:
        run = run_settings(args.path)
        config_path = args.config or run.get("model", {}).get("config")
        tokenizer_path = args.tokenizer or run.get("model", {}).get("tokenizer_path")
        if not config_path or not tokenizer_path:
            raise ConfigError(f"{args.path} has no {RUN_CONFIG_FILE}: pass --config and --tokenizer")
        checkpoint, step = find_step(args.path, run, args.step, args.checkpoint_folder)
        dtype = DTYPES[args.dtype or run.get("checkpoint", {}).get("export_dtype", "float32")]
        target = destination.check(out, f"--out {out}" if args.out else f"the run's export folder {out}")
        requested = args.export_as or run.get("checkpoint", {}).get("export_as", "auto")

        adapters = lora.LoraSettings.of(run.get("lora") or {})
        if args.lora_export and adapters is None:
            raise ConfigError(f"--lora_export: {args.path} is no LoRA run (its job config sets no lora.rank); drop --lora_export")
        merge = (args.lora_export or run.get("lora", {}).get("export")) == "merged"
        # the weights the adapters were trained over: the run's --model.init_from, else its model config's folder
        base_model = lora.base_model_path(run.get("model", {}).get("init_from") or config_path)
        if adapters is not None and not merge and args.sample is not None and not lora.holds_weights(base_model):
            raise ConfigError(
                f"--sample loads the adapter over its base model {base_model}, which holds no weights; export the merged "
                "model (--lora_export merged) to sample from it"
            )
        config = load_model_config(config_path)
        export_as, chosen = llama_export.choose(config, requested, "--export_as" if args.export_as else
                                                "--checkpoint.export_as", adapter=adapters is not None and not merge)
        if export_as == "llama":  # before reading any weight
            llama_export.check(config, "--export_as llama")
            if adapters is not None and not merge:
                raise ConfigError("--export_as llama renames a whole model, not a LoRA adapter: add --lora_export merged")
        tokenizer = load_tokenizer(tokenizer_path)
        if args.ema and adapters is not None:
            raise ConfigError("--ema exports a whole model's average, and this is a LoRA run: export its adapters "
                              "without --ema")
        model = load_hf_model_from_dcp(checkpoint, config, ema=args.ema)
        if adapters is not None:
            model = load_adapters(model, adapters, checkpoint, base_model)
            model = model.merge_and_unload() if merge else model
        if export_as == "llama":
            model = llama_export.as_llama(model)
        card = model_card.render(args.path, step, model, config, run, exported_as=export_as if export_as != "native" else None,
                                 dtype=str(dtype).removeprefix("torch."), export_choice=chosen)
        export(model, tokenizer, target, dtype, args.max_shard_size, card)
    except ConfigError as error:
        print(f"convert_dcp_to_hf: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a full disk, a folder gone: the checkpoint is untouched, and so is an earlier export
        which = f"step {step}" if step != -1 else "the latest step"
        print(f"convert_dcp_to_hf: error: the export of {which} to {out} failed ({gist(error)}): nothing of it was "
              f"kept, and an earlier export there is as it was; fix that and export again: flame export {args.path}",
              file=sys.stderr)
        return 1
    what = "the LoRA adapter of " if adapters is not None and not merge else ("the weights' average (EMA) of " if args.ema else "")
    as_llama = " as llama" if export_as == "llama" else ""
    print(f"exported {what}step {step} of {args.path} to {out}{as_llama} ({str(dtype).removeprefix('torch.')}): {chosen}")
    if adapters is not None and not merge and not lora.holds_weights(base_model):
        print(f"note: its base model {base_model} holds no weights (they are in the checkpoint): export the merged "
              "model (--lora_export merged) for a model that loads on its own")
    if args.sample is not None:
        print(f"sample from {out}:\n{sample(out, args.sample)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
