"""Muon on a GPU: bf16 Newton-Schulz on CUDA, and the gathered whole matrices under FSDP over NCCL."""

import pytest
import torch

from tests.conftest import base_args, check, losses, torchrun

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MUON = ["--optimizer.name=Muon", "--checkpoint.no-enable"]


def test_single_gpu_muon_run_trains(tmp_path, tiny_model, corpus):
    dump = tmp_path / "run"
    result = check(torchrun(base_args(tiny_model, corpus, dump, steps=30) + MUON))
    assert "Muon on 14 hidden matrices" in result.stdout + result.stderr
    curve = losses(dump)
    assert curve[30] < curve[1] - 0.7  # 8.34 -> 7.00 on CPU


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_fsdp_muon_run_trains(tmp_path, tiny_model, corpus):
    dump = tmp_path / "run"
    result = check(torchrun(base_args(tiny_model, corpus, dump, steps=30) + MUON, nproc=2))
    assert "Applied FSDP2 over 2 ranks" in result.stdout + result.stderr
    curve = losses(dump)
    assert curve[30] < curve[1] - 0.7  # 8.34 -> 7.00 on CPU
