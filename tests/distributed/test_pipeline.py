"""Pipeline parallelism on CPU (gloo): stages give the losses of one process, checkpoints move across layouts."""

import json
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flame.launch import preflight
from flame.distributed.pipeline import stage_layers
from tests.conftest import ROOT, assert_same_curve, base_args, check, metrics, torchrun, two_at_a_time

LLAMA_4_LAYERS = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "vocab_size": 4096,
    "tie_word_embeddings": False,
}
PP2 = ["--parallelism.pipeline_parallel_degree=2"]


def write_config(directory: Path, config: dict) -> str:
    path = directory / f"{config['model_type']}.json"
    path.write_text(json.dumps(config))
    return str(path)


def run(args: list[str], nproc: int) -> dict[int, dict]:
    check(torchrun(args, nproc=nproc))
    return metrics(Path(next(a.split("=", 1)[1] for a in args if a.startswith("--job.dump_folder="))))


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return write_config(tmp_path_factory.mktemp("pp_model"), LLAMA_4_LAYERS)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, llama, corpus) -> Path:
    """Reference: 4 steps in one process, batch 4, a checkpoint at the end."""
    dump = tmp_path_factory.mktemp("pp_reference")
    run([*base_args(llama, corpus, dump, steps=4), "--training.batch_size=4"], nproc=1)
    return dump


def test_two_stages_match_one_process_and_export_the_same_model(tmp_path, llama, corpus, one_process):
    dump = tmp_path / "pp2"
    args = [*base_args(llama, corpus, dump, steps=4), "--training.batch_size=4", *PP2]
    assert_same_curve(run(args, nproc=2), metrics(one_process))

    # the pipeline checkpoint exports to the same HF model as the single process's step 4
    from flame.checkpoint import export

    for path in (dump, one_process):
        assert export.main(["--path", str(path), "--out", str(path / "hf")]) == 0
    exported, expected = load_file(dump / "hf" / "model.safetensors"), load_file(one_process / "hf" / "model.safetensors")
    assert sorted(exported) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(exported[name], tensor, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_interleaved_stages_with_fsdp_activation_checkpointing_and_the_fused_loss_match_one_process(tmp_path, llama, corpus, one_process):
    # 4 ranks: 2 pipeline ranks x 2 FSDP shards; 2 rows per data-parallel rank = the reference's 4 rows
    args = [
        *base_args(llama, corpus, tmp_path / "pp2_fsdp2", steps=4), "--checkpoint.no-enable", "--training.batch_size=2",
        *PP2, "--parallelism.pipeline_parallel_schedule=Interleaved1F1B", "--parallelism.data_parallel_shard_degree=2",
        "--activation_checkpoint.mode=full", "--training.fused_cross_entropy=on",
    ]
    assert_same_curve(run(args, nproc=4), metrics(one_process))


def test_custom_model_pipelines_with_tensor_parallel_stages_like_one_process(tmp_path, corpus):
    # 4 ranks: 2 pipeline stages, each tensor-parallel over 2 ranks (stages pass sequence shards)
    config = json.loads((ROOT / "custom_models" / "example_lm" / "config_tiny.json").read_text())
    model = write_config(tmp_path, {**config, "tie_word_embeddings": False, "num_hidden_layers": 3})
    common = ["--checkpoint.no-enable", "--training.batch_size=2"]
    split = ["--parallelism.pipeline_parallel_split_points=1", "--parallelism.tensor_parallel_degree=2"]  # blocks 0 | 1, 2
    one, pp = two_at_a_time(partial(run, [*base_args(model, corpus, tmp_path / "one", steps=3), *common], nproc=1),
                            partial(run, [*base_args(model, corpus, tmp_path / "pp", steps=3), *common, *PP2, *split],
                                    nproc=4))
    assert_same_curve(pp, one)


def test_balanced_split_counts_embedding_and_head_as_blocks():
    class Job:
        class parallelism:
            pipeline_parallel_split_points = ""
            pipeline_parallel_first_stage_less_layers = 1
            pipeline_parallel_last_stage_less_layers = 1

    assert stage_layers(6, 2, Job) == [(0, 1, 2), (3, 4, 5)]
    assert stage_layers(8, 4, Job) == [(0,), (1, 2, 3), (4, 5, 6), (7,)]
    Job.parallelism.pipeline_parallel_split_points = "2,5"
    assert stage_layers(8, 3, Job) == [(0, 1), (2, 3, 4), (5, 6, 7)]


def preflight_error(tmp_path, capsys, model: str, *flags: str, world_size: int = 2) -> str:
    from tests.conftest import TOKENIZER

    args = [f"--model.config={model}", f"--model.tokenizer_path={TOKENIZER}", "--training.dataset=builtin:python-stdlib",
            "--training.seq_len=64", *flags]
    assert preflight.main(["--world-size", str(world_size), "--", *args]) == 2
    return capsys.readouterr().err.strip()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--parallelism.pipeline_parallel_split_points=2,1"], "need 1 increasing block indices between 1 and 3"),
        (["--parallelism.pipeline_parallel_split_points=4"], "need 1 increasing block indices between 1 and 3"),
        (["--parallelism.pipeline_parallel_split_points=layers.2"], "give the index of the first decoder block"),
        (["--parallelism.pipeline_parallel_schedule=Interleaved1F1B", "--parallelism.pipeline_parallel_first_stage_less_layers=3"],
         "leave a stage without blocks"),
        (["--training.batch_size=3", "--parallelism.pipeline_parallel_microbatch_size=2"], "not a multiple of"),
        (["--parallelism.module_fqns_per_model_part=[['layers.0']]"], "use --parallelism.pipeline_parallel_split_points"),
        (["--parallelism.pipeline_parallel_schedule=ZBVZeroBubble"], "not in the V this schedule needs"),
    ],
)
def test_impossible_pipeline_layouts_are_refused_before_launch(tmp_path, capsys, llama, flags, message):
    error = preflight_error(tmp_path, capsys, llama, *PP2, *flags)
    assert message in error and error.count("\n") == 0


def test_tied_embeddings_are_refused_under_pipeline_parallelism(tmp_path, capsys):
    model = write_config(tmp_path, {**LLAMA_4_LAYERS, "tie_word_embeddings": True})
    error = preflight_error(tmp_path, capsys, model, *PP2)
    assert "ties its lm_head to the input embedding" in error and "tie_word_embeddings to false" in error


def test_context_parallel_pipelines_are_refused(tmp_path, capsys, llama):
    error = preflight_error(tmp_path, capsys, llama, *PP2, "--parallelism.context_parallel_degree=2", world_size=4)
    assert "context" in error and error.count("\n") == 0


def test_pipeline_degree_beyond_the_blocks_is_refused(tmp_path, capsys, llama):
    error = preflight_error(tmp_path, capsys, llama, "--parallelism.pipeline_parallel_degree=8", world_size=8)
    assert "8 pipeline stages for 4 decoder blocks" in error


@pytest.fixture(autouse=True)
def _no_stale_dumps(tmp_path):
    yield
    shutil.rmtree(tmp_path, ignore_errors=True)
