"""The model card: hub metadata that parses back, and a body that names no place on this machine."""

import json
import os

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM, LlamaConfig

from flame.checkpoint import model_card
from tests.conftest import ROOT, TINY_DECODER

REAL_HOME = os.path.expanduser("~")


@pytest.fixture
def llama():
    config = LlamaConfig(**TINY_DECODER, vocab_size=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config), config


def write_run(tmp_path, monkeypatch, init_from: str) -> tuple:
    """A dump folder as a fine-tuning run leaves it, full of this machine's paths: its job config, logged
    metrics (a local source's counters are named by its path), lm-eval results of step 4, train.sh's command."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    dump, corpus = tmp_path / "exp" / "run", tmp_path / "data" / "corpus.jsonl"
    corpus.parent.mkdir(parents=True)
    corpus.write_text('{"text": "x"}\n')
    (dump / "attempts" / "1").mkdir(parents=True)
    sources = f"HuggingFaceFW/fineweb-edu,{corpus},builtin:python-stdlib"
    run = {"model": {"config": str(tmp_path / "model.json"), "init_from": init_from},
           "training": {"dataset": sources, "dataset_name": "sample-10BT,,", "data_probs": "0.5,0.3,0.2",
                        "seq_len": 64, "context_len": 64},
           "optimizer": {"name": "AdamW", "lr": 3e-4, "weight_decay": 0.1}}
    (dump / "metrics.jsonl").write_text(json.dumps(
        {"step": 4, "loss_metrics/global_avg_loss": 5.5, "n_tokens_seen": 512, "data/HuggingFaceFW/fineweb-edu/tokens": 256,
         f"data/{corpus}/tokens": 128, "data/python-stdlib/tokens": 128}) + "\n")
    (dump / "eval" / "step-4" / "model").mkdir(parents=True)
    (dump / "eval" / "step-4" / "model" / "results_2026-01-01.json").write_text(json.dumps(
        {"results": {"arc_easy": {"acc,none": 0.3125, "acc_stderr,none": 0.01, "acc_norm,none": 0.25}},
         "configs": {"arc_easy": {"dataset_path": "allenai/ai2_arc", "dataset_name": "ARC-Easy", "test_split": "test"}}}))
    (dump / "attempts" / "1" / "command.txt").write_text(
        f"NGPU=1 bash train.sh --job.config_file {tmp_path}/job.toml --job.dump_folder={dump} "
        f"--model.tokenizer_path ~/tokenizers/bpe --training.dataset {sources} "
        f"--checkpoint.initial_load_path {dump}/checkpoint/step-2 --model.init_from '{init_from}'\n")
    return dump, run


def cached_base(tmp_path, license: str = "apache-2.0") -> str:
    """A hub model's snapshot folder as the HF cache keeps it, its card naming a license."""
    folder = tmp_path / "home" / ".cache" / "huggingface" / "hub" / "models--org--base" / "snapshots" / "abc123"
    folder.mkdir(parents=True)
    (folder / "README.md").write_text(f"---\nlicense: {license}\n---\n\n# base\n")
    return str(folder)


def test_the_card_names_no_path_of_this_machine(tmp_path, monkeypatch, llama):
    model, config = llama
    dump, run = write_run(tmp_path, monkeypatch, cached_base(tmp_path))
    card = model_card.render(str(dump), 4, model, config, run)
    for place in (str(tmp_path), REAL_HOME, "~/"):
        assert place not in card, place
    for shown in ("step 4 of the run `run`", "| local file `corpus.jsonl` | split train, probability 0.3 of documents |",
                  "| source `HuggingFaceFW/fineweb-edu` | config sample-10BT, split train, probability 0.5 of documents |",
                  "HuggingFaceFW/fineweb-edu 256 (50.0%), corpus.jsonl 128 (25.0%), python-stdlib 128 (25.0%)",
                  "NGPU=1 bash train.sh --job.config_file job.toml --job.dump_folder=run --model.tokenizer_path bpe "
                  "--training.dataset HuggingFaceFW/fineweb-edu,corpus.jsonl,builtin:python-stdlib "
                  "--checkpoint.initial_load_path checkpoint/step-2 --model.init_from org/base",
                  "Fine-tuned from [`org/base`](https://huggingface.co/org/base)."):
        assert shown in card, shown


def test_the_metadata_parses_back_with_base_model_datasets_license_and_eval_results(tmp_path, monkeypatch, llama):
    model, config = llama
    dump, run = write_run(tmp_path, monkeypatch, cached_base(tmp_path))
    data = ModelCard(model_card.render(str(dump), 4, model, config, run)).data
    assert (data.library_name, data.pipeline_tag, data.tags) == ("transformers", "text-generation", ["flame", "llama"])
    assert (data.base_model, data.license) == ("org/base", "apache-2.0")
    assert data.datasets == ["HuggingFaceFW/fineweb-edu"]  # not the local file, not builtin:
    results = {(r.dataset_type, r.dataset_name, r.dataset_config, r.dataset_split, r.metric_type): r.metric_value
               for r in data.eval_results}
    assert results == {("allenai/ai2_arc", "arc_easy", "ARC-Easy", "test", "acc"): 0.3125,
                       ("allenai/ai2_arc", "arc_easy", "ARC-Easy", "test", "acc_norm"): 0.25}
    assert data.model_name == "run" and {r.source_name for r in data.eval_results} == {"lm-evaluation-harness"}


def test_a_hub_name_is_the_base_model_and_a_local_folder_is_named_only_by_its_base_name(tmp_path, monkeypatch, llama):
    model, config = llama
    dump, run = write_run(tmp_path, monkeypatch, "Qwen/Qwen2.5-0.5B")
    assert ModelCard(model_card.render(str(dump), 4, model, config, run)).data.base_model == "Qwen/Qwen2.5-0.5B"

    local = tmp_path / "models" / "my-base"
    local.mkdir(parents=True)
    run["model"]["init_from"] = str(local)
    card = model_card.render(str(dump), 4, model, config, run)
    data = ModelCard(card).data
    assert data.base_model is None and data.license is None  # no hub id, no card of its own
    assert "Fine-tuned from a local model (`my-base`)." in card and str(tmp_path) not in card


def test_a_run_without_records_gets_a_card_without_eval_results(tmp_path, llama):
    model, config = llama
    card = model_card.render(str(tmp_path / "bare"), 0, model, config, {})
    data = ModelCard(card).data
    assert data.eval_results is None and data.base_model is None and data.datasets is None
    assert "Not recorded (a launch without train.sh)" in card and str(tmp_path) not in card


def test_an_fla_model_is_tagged_fla_and_says_how_to_load_it(tmp_path):
    from flame.models import load_model_config
    from flame.models.registry import meta_model

    config = load_model_config(str(ROOT / "configs" / "tiny" / "gla.json"))
    card = model_card.render(str(tmp_path / "gla"), 0, meta_model(config), config, {})
    assert ModelCard(card).data.tags == ["flame", "gla", "fla"] and model_card.LOAD_FLAME in card


@pytest.mark.parametrize("location, expected", [
    ("HuggingFaceFW/fineweb-edu", "HuggingFaceFW/fineweb-edu"), ("wikitext", "wikitext"),
    ("/data/corpus.jsonl", None), ("corpus.jsonl", None), ("./shards", None), ("~/data", None), ("builtin:python-stdlib", None),
    ("json", None), ("a/b/c", None), ("/cache/hub/datasets--org--set/snapshots/abc", "org/set"),
])
def test_hub_ids_of_dataset_sources(location, expected):
    assert model_card.hub_id(location, "datasets") == expected


def test_an_existing_folder_is_no_hub_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert model_card.hub_id("org/name") is None
