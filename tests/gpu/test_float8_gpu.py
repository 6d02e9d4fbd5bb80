"""On an FP8 GPU (flame.models.float8): the measured choice of layers keeps a matmul too small to gain in bf16 and
converts one large enough, the measurement is cached, and a compiled run trains with FP8 beside its bf16 twin."""

import json
import math
import re

import pytest
import torch

from flame.models import float8
from tests.conftest import ROOT, base_args, check, metrics, torchrun

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a GPU with FP8 tensor cores")


def test_the_measured_choice_keeps_small_matmuls_in_bf16_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAME_CACHE", str(tmp_path))
    small, large = ((256, 256),), ((4096, 14336),)
    qkv, q = ((2048, 2048),) * 3, ((2048, 2048),)  # an attention's projections of one input, and one alone
    chosen = float8.faster_in_fp8([small, large, qkv, q], 16384, "tensorwise", compiled=True)
    cached = json.loads(next((tmp_path / "float8").glob("*.json")).read_text())["times"]
    print("group ms (bf16, fp8):", cached)
    assert small not in chosen  # four casting passes outweigh a matmul of 2 GFLOP
    assert large in chosen  # a 1.9 TFLOP forward and backward: FP8's GEMM wins
    times = {tuple(map(tuple, group)): (bf16, fp8) for group, bf16, fp8 in cached}
    # the input cast once for three GEMMs: FP8's share of bf16's time is smaller for the group than for one layer
    assert times[qkv][1] / times[qkv][0] < times[q][1] / times[q][0]
    assert float8.faster_in_fp8([small, large, qkv, q], 16384, "tensorwise", compiled=True) == chosen  # read, not timed


@pytest.mark.parametrize("config", ["llama", "transformer"])
def test_a_compiled_fp8_run_trains_beside_its_bf16_twin(tiny_model, corpus, tmp_path, config):
    """Compiled blocks (llama), or fla's transformer, whose blocks stay eager under --training.compile: each of its
    converted layers compiled on its own."""
    model = tiny_model if config == "llama" else str(ROOT / "configs" / "tiny" / "transformer.json")
    flags = ["--training.compile", "--training.steps=12", "--training.seq_len=2048", "--checkpoint.no-enable"]
    runs = {}
    for name, extra in (("bf16", []), ("fp8", ["--float8.recipe_name=tensorwise", "--float8.layers=all"])):
        result = check(torchrun([*base_args(model, corpus, tmp_path / name), *flags, *extra]))
        runs[name] = metrics(tmp_path / name)
        if extra:
            log = result.stdout + result.stderr
            assert re.search(r"FP8 \(tensorwise\): (\d+) of \1 eligible linear layers", log), log[-2000:]
            assert ("each converted layer is compiled on its own" in log) == (config == "transformer")
    loss = "loss_metrics/global_avg_loss"
    assert runs["fp8"][12][loss] < runs["fp8"][1][loss]
    for step in (1, 6, 12):
        assert math.isclose(runs["fp8"][step][loss], runs["bf16"][step][loss], rel_tol=0.03), step
