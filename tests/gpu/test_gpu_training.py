"""GPU behaviour (run on the GPU machine; skipped where there is no CUDA device)."""

import pytest
import torch

from tests.conftest import (
    assert_same_curve,
    base_args,
    check,
    losses,
    metrics,
    torchrun,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_single_gpu_bf16_run_trains(tmp_path, tiny_model, corpus):
    dump = tmp_path / "run"
    result = check(torchrun(base_args(tiny_model, corpus, dump, steps=30)))
    assert "Mixed precision training is handled by AMP" in result.stdout + result.stderr
    curve = losses(dump)
    assert curve[30] < curve[1] - 1.0
    assert metrics(dump)[30]["mfu(%)"] > 0


def test_one_gpu_offloading_to_the_host_trains_the_curve_of_the_run_on_the_gpu_and_resumes(tmp_path, tiny_model, corpus):
    seed = tmp_path / "seed"  # one set of initial weights: offload initializes them on the host, from its RNG
    check(torchrun([*base_args(tiny_model, corpus, seed, steps=8), "--checkpoint.create_seed_checkpoint"]))
    # the LR schedule spans 8 steps in every run, the one stopped at step 4 too
    flags = [f"--checkpoint.initial_load_path={seed / 'checkpoint' / 'step-0'}", "--lr_scheduler.total_steps=8",
             "--checkpoint.interval=4"]
    offload = [*flags, "--training.enable_cpu_offload"]
    on_gpu, offloaded, resumed = tmp_path / "gpu", tmp_path / "offload", tmp_path / "resumed"
    check(torchrun([*base_args(tiny_model, corpus, on_gpu, steps=8), *flags]))
    result = check(torchrun([*base_args(tiny_model, corpus, offloaded, steps=8), *offload]))
    assert "Applied FSDP2 over 1 ranks" in result.stdout + result.stderr
    # bf16 both: autocast on the GPU run, FSDP's cast weights on the offloaded one (no autocast: degrees.fsdp_alone)
    assert_same_curve(metrics(offloaded), metrics(on_gpu), rel=2e-2)
    check(torchrun([*base_args(tiny_model, corpus, resumed, steps=4), *offload]))
    check(torchrun([*base_args(tiny_model, corpus, resumed, steps=8), *offload]))
    assert_same_curve(metrics(resumed), metrics(offloaded), rel=1e-5, steps=[5, 6, 7, 8])


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
