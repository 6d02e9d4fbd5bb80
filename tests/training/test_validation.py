"""In-loop validation (--validation.*): exact numbers, training untouched, the same under every layout.

The runs: 4 steps of the tiny llama, 4 rows of 64 tokens per step, a checkpoint at step 2 and 4,
with and without validation on a separate dataset (evaluated after steps 2 and 4); the validated
run resumed from step 2, and under FSDP 2 x TP 2 and PP 2; and a run validating on documents
held out of its (pretokenized) training data, for the hand computation.
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset

from flame.launch import preflight
from flame.data.streams import MapStream
from flame.base.run_record import metrics
from tests.conftest import TOKENIZER, base_args, check, torchrun

# one LR schedule of 4 steps, also for a run stopped at step 2 and resumed
STEPS = ["--lr_scheduler.total_steps=4", "--checkpoint.interval=2", "--training.batch_size=4"]
VALIDATE = ["--validation.enable", "--validation.freq=2"]  # + --validation.dataset, written next to the run
HELD_OUT, HELD_OUT_TOKENS = 8, 16  # documents held out, and their length (delimiters included)


def _validation_data(folder: Path, corpus: str) -> Path:
    """30 documents of the corpus's kind that the training data does not hold."""
    from flame.data import builtin

    shard = sorted(Path(builtin.resolve("builtin:python-stdlib")).glob("*.jsonl"))[-1]
    with open(shard) as f:
        lines = [line for _, line in zip(range(80), f)][50:]  # conftest's corpus takes the first 50 of each shard
    path = folder / "validation.jsonl"
    path.write_text("".join(lines))
    return path


def validated_job(*flags: str, nproc: int = 1, steps: int = 4, validate: bool = True):
    """A background job: the run above, validated or not, with ``flags``."""
    def job(dump: Path, model: str, corpus: str):
        data = _validation_data(dump.parent, corpus)
        validating = [*VALIDATE, f"--validation.dataset={data}"] if validate else []
        return torchrun(base_args(model, corpus, dump, steps=steps) + STEPS + validating + list(flags), nproc=nproc)
    return job


@pytest.fixture(scope="module")
def validated(tmp_path_factory, tiny_model, corpus) -> Path:
    """The dump folder of the validated run in one process (the reference of the other runs)."""
    dump = tmp_path_factory.mktemp("validated") / "run"
    check(validated_job()(dump, tiny_model, corpus))
    return dump


def _held_out_corpus(folder: Path, corpus: str) -> tuple[Path, list[list[int]]]:
    """The corpus as token ids, its first HELD_OUT documents cut to HELD_OUT_TOKENS tokens once delimited."""
    from flame.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(TOKENIZER)
    head = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    tail = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    texts = [json.loads(line)["text"] for line in Path(corpus).read_text().splitlines()]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    ids[:HELD_OUT] = [d[: HELD_OUT_TOKENS - len(head) - len(tail)] for d in ids[:HELD_OUT]]
    path = folder / "tokens.jsonl"
    path.write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in ids))
    return path, [head + d + tail for d in ids[:HELD_OUT]]


def held_out_job(dump: Path, model: str, corpus: str):
    data, _ = _held_out_corpus(dump.parent, corpus)
    args = base_args(model, str(data), dump, steps=2) + [
        "--training.batch_size=4", "--validation.enable", f"--validation.holdout_documents={HELD_OUT}",
        "--validation.local_batch_size=1",
    ]
    return torchrun(args)


def losses(dump: Path) -> dict[int, float]:
    return {step: row["loss_metrics/global_avg_loss"] for step, row in metrics(str(dump)).items()}


def validation(dump: Path) -> dict[int, dict]:
    return {step: {k: v for k, v in row.items() if k.startswith("validation/")}
            for step, row in metrics(str(dump)).items() if "validation/loss" in row}


@pytest.mark.background_runs(held_out=held_out_job)
def test_validation_numbers_equal_a_hand_computation_over_the_held_out_documents(background_runs, tiny_model, corpus):
    run = background_runs["held_out"]
    check(run.result)
    from flame.data.tokenizer import load_tokenizer
    from flame.models import load_model_config
    from flame.checkpoint.export import load_hf_model_from_dcp

    _, documents = _held_out_corpus(run.dump.parent, corpus)
    model = load_hf_model_from_dcp(
        str(run.dump / "checkpoint" / "step-2"), load_model_config(tiny_model), runnable=True
    ).eval()
    tokenizer = load_tokenizer(TOKENIZER)
    # 4 documents of 16 tokens fill a row of 64: each is packed whole, attending to itself only; the
    # targets are every next token within a document
    nats, targets, text_bytes = 0.0, 0, 0
    with torch.no_grad():
        for document in documents:
            logits = model(torch.tensor([document])).logits[0, :-1]
            nats += F.cross_entropy(logits.double(), torch.tensor(document[1:]), reduction="sum").item()
            targets += len(document) - 1
            text_bytes += len(tokenizer.decode(document[1:], skip_special_tokens=True).encode("utf-8"))
    got = validation(run.dump)
    assert sorted(got) == [2]  # after the last step
    logged = got[2]
    assert logged["validation/tokens"] == targets == HELD_OUT * (HELD_OUT_TOKENS - 1)
    # fp32 rounding (flame's fused RMS norm and packed rows against HF's code, one document at a time):
    # a single target masked wrong or counted twice would move the mean by ~1e-2
    assert math.isclose(logged["validation/loss"], nats / targets, rel_tol=2e-5)
    assert math.isclose(logged["validation/ppl"], math.exp(logged["validation/loss"]), rel_tol=1e-12)
    assert math.isclose(logged["validation/bpb"], nats / math.log(2) / text_bytes, rel_tol=2e-5)
    assert logged["validation/time_s"] > 0


def test_held_out_documents_never_train_and_the_rest_of_the_stream_is_unchanged():
    dataset = Dataset.from_dict({"text": [f"document {i}" for i in range(40)]})
    held = {f"document {i}" for i in range(6)}

    def stream(shard: int, holdout: int) -> list[str]:  # two epochs of one of 4 data shards
        reader = MapStream(dataset, "text", shard, 4, seed=7, name="d", stop_at_end=False, holdout=holdout)
        return [doc for _ in range(2) for doc in reader.read(100)]

    for shard in range(4):
        full, kept = stream(shard, 0), stream(shard, 6)
        assert not held & set(kept)
        assert kept == [doc for doc in full if doc not in held]


@pytest.mark.background_runs(plain=validated_job(validate=False))
def test_training_losses_are_the_same_with_and_without_validation(background_runs, validated):
    plain = check(background_runs["plain"].result) and background_runs["plain"].dump
    assert losses(validated) == losses(plain)  # exactly: validation changes nothing in training
    grad_norms = [{s: row["grad_norm"] for s, row in metrics(str(dump)).items()} for dump in (validated, plain)]
    assert grad_norms[0] == grad_norms[1] and len(grad_norms[0]) == 4
    got = validation(validated)
    assert sorted(got) == [2, 4] and not validation(plain)
    assert got[4]["validation/loss"] < got[2]["validation/loss"]  # it learns (lr 3e-3)
    assert got[2]["validation/tokens"] == got[4]["validation/tokens"] > 1000  # the same documents every time


@pytest.mark.background_runs(stopped=validated_job(steps=2))
def test_exact_resume_holds_with_validation_on(background_runs, validated, tiny_model, corpus):
    run = background_runs["stopped"]
    check(run.result)
    check(validated_job()(run.dump, tiny_model, corpus))  # resumes from its step-2 checkpoint to step 4
    expected, got = losses(validated), losses(run.dump)
    assert sorted(got) == [1, 2, 3, 4] and got == expected
    # the validation set restarts from its first batch: the same numbers as the uninterrupted run's
    assert sorted(validation(run.dump)) == [2, 4]
    for step in (2, 4):
        assert {**validation(run.dump)[step], "validation/time_s": 0} == {**validation(validated)[step], "validation/time_s": 0}


@pytest.mark.background_runs(
    fsdp2_tp2=validated_job("--training.batch_size=2", "--parallelism.tensor_parallel_degree=2", nproc=4),
    pp2=validated_job("--parallelism.pipeline_parallel_degree=2", nproc=2),
)
def test_validation_under_fsdp_tensor_and_pipeline_parallelism_equals_one_process(background_runs, validated):
    for run in background_runs.values():
        check(run.result)
    expected = validation(validated)
    for name in ("fsdp2_tp2", "pp2"):
        got = validation(background_runs[name].dump)
        assert sorted(got) == sorted(expected) == [2, 4], name
        for step in got:
            assert got[step]["validation/tokens"] == expected[step]["validation/tokens"], name
            for key in ("validation/loss", "validation/bpb"):
                # the layouts train the same weights up to float rounding (tests/distributed/test_layouts.py: 1e-4)
                assert math.isclose(got[step][key], expected[step][key], rel_tol=1e-4), (name, step, key)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--validation.enable"], "--validation.enable with neither --validation.dataset nor --validation.holdout_documents"),
        (["--validation.enable", "--validation.dataset={data}", "--validation.holdout_documents=4"],
         "with both --validation.dataset and --validation.holdout_documents"),
        (["--validation.freq=10"], "--validation.freq sets up validation, which is off: add --validation.enable"),
        (["--validation.enable", "--validation.holdout_documents=4", "--training.streaming"],
         "give a separate --validation.dataset, or drop --training.streaming"),
        (["--validation.enable", "--validation.holdout_documents=400"],
         "--validation.holdout_documents 400 would hold out all 400 documents of"),
        (["--validation.enable", "--validation.holdout_documents=4", "--validation.steps=0"],
         "--validation.steps must be >= 1 (batches per source) or -1 (all), got 0"),
        (["--validation.enable", "--validation.holdout_documents=4", "--validation.freq=0"], "--validation.freq must be >= 1"),
        (["--validation.enable", "--validation.dataset={data}", "--validation.dataset_split=a,b"],
         "--validation.dataset_split has 2 entries for 1 validation datasets"),
        (["--validation.enable", "--validation.dataset={missing}"], "does not exist"),
        (["--validation.enable", "--validation.dataset_path=x"], "--validation.dataset_path is a torchtitan option flame does not use"),
    ],
)
def test_bad_validation_settings_are_one_line_errors_before_training(tmp_path, capsys, monkeypatch, tiny_model, corpus,
                                                                    flags, message):
    flags = [flag.format(data=corpus, missing=tmp_path / "missing.jsonl") for flag in flags]
    args = [f"--model.config={tiny_model}", f"--model.tokenizer_path={TOKENIZER}", f"--training.dataset={corpus}",
            "--training.seq_len=64", f"--job.dump_folder={tmp_path / 'dump'}", *flags]
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert preflight.main(["--world-size", "1", "--", *args]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("flame: error: ") and "\n" not in error
    assert message in error


def test_token_bytes_counts_the_utf8_bytes_of_byte_level_tokens():
    from flame.data.tokenizer import load_tokenizer
    from flame.data.validation import token_bytes

    tokenizer = load_tokenizer(TOKENIZER)
    table = token_bytes(tokenizer)
    text = "def f(x):\n    return 'π ≈ 3.14159'  # ünïcödé\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert table[np.asarray(ids)].sum() == len(text.encode("utf-8"))
    assert table[tokenizer.eos_token_id] == 0
