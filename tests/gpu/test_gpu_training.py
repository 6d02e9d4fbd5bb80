"""GPU behaviour (run on the GPU machine; skipped where there is no CUDA device)."""

import pytest
import torch

from tests.conftest import base_args, check, losses, metrics, torchrun

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_single_gpu_bf16_run_trains(tmp_path, tiny_model, corpus):
    dump = tmp_path / "run"
    result = check(torchrun(base_args(tiny_model, corpus, dump, steps=30)))
    assert "Mixed precision training is handled by AMP" in result.stdout + result.stderr
    curve = losses(dump)
    assert curve[30] < curve[1] - 1.0
    assert metrics(dump)[30]["mfu(%)"] > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_fsdp_nccl_run_trains(tmp_path, tiny_model, corpus):
    dump = tmp_path / "run"
    result = check(torchrun(base_args(tiny_model, corpus, dump, steps=30), nproc=2))
    assert "Applied FSDP2 over 2 ranks" in result.stdout + result.stderr
    curve = losses(dump)
    assert curve[30] < curve[1] - 1.0


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_four_gpu_pipeline_with_fsdp_trains(tmp_path, tiny_model, corpus):
    # FSDP's root moves a stage's inputs to the GPU: on CPU this path never shows
    dump = tmp_path / "run"
    args = base_args(tiny_model, corpus, dump, steps=30) + [
        "--training.batch_size=4", "--parallelism.pipeline_parallel_degree=2",
        "--parallelism.data_parallel_shard_degree=2"]
    result = check(torchrun(args, nproc=4))
    assert "Applied FSDP2 over 2 ranks" in result.stdout + result.stderr
    curve = losses(dump)
    assert curve[30] < curve[1] - 1.0
