"""On a GPU (flame.base.triton_kernels): the kernels a run compiles, recorded as it compiles them, are compiled from
that record into a fresh Triton cache on a pool of processes; a second run on that cache then finds every one of its
kernels there (its compiles add no binary to the cache) and reaches the end of its step sooner. And a cold step whose
autotuners compile their configurations side by side (flame.compat.triton) ends sooner, with the same loss."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from flame.base import triton_kernels
from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEP = """
import sys, time, torch
from flame.base import triton_kernels
from flame.models import load_model_config
from flame.models.builder import FlameModelArgs, build_model
if len(sys.argv) > 2 and sys.argv[2] == "together":
    from flame.compat import triton as compat_triton
    compat_triton.configurations_compiled_together(max(2, compat_triton.compile_threads()))
elif len(sys.argv) > 2:
    triton_kernels.record_compiled_kernels(sys.argv[2], "gla")
path = sys.argv[1]
torch.manual_seed(0)
args = FlameModelArgs(config_path=path)
args._config = load_model_config(path)
model = build_model(args).cuda().to(torch.bfloat16)
ids = torch.randint(0, 4096, (1, 512), generator=torch.Generator().manual_seed(1)).cuda()
started = time.monotonic()
loss = model(ids, labels=ids).loss
loss.backward()
torch.cuda.synchronize()
print(f"LOSS {loss.item():.6f}")
print(f"SECONDS {time.monotonic() - started:.2f}")
"""


def _step(config: str, cache, *record) -> tuple[float, float]:
    """(seconds, loss) of one forward and backward in a fresh process on the Triton cache ``cache``."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "TRITON_CACHE_AUTOTUNING": "1"}
    result = subprocess.run([sys.executable, "-c", STEP, config, *map(str, record)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return float(result.stdout.split("SECONDS ")[-1]), float(result.stdout.split("LOSS ")[-1].split()[0])


def _binaries(cache) -> set[str]:
    return {path.parent.name for path in cache.rglob("*.cubin")}


def test_a_warmed_cache_holds_every_kernel_the_run_compiles(tmp_path):
    config = str(ROOT / "configs" / "tiny" / "gla.json")
    recorded, first, warmed = tmp_path / "kernels.jsonl", tmp_path / "first", tmp_path / "warmed"
    cold, _ = _step(config, first, recorded)
    kernels = triton_kernels.read(recorded)
    assert kernels and all(kernel["target"]["backend"] == "cuda" for kernel in kernels)
    os.environ["TRITON_CACHE_DIR"] = str(warmed)
    try:
        started = time.monotonic()
        _, compiled, failures = triton_kernels.warm(kernels, jobs=max(1, (os.cpu_count() or 2) - 2),
                                                    model_type=lambda: "gla")
        warming = time.monotonic() - started
    finally:
        os.environ.pop("TRITON_CACHE_DIR")
    # the winners' autotune choices, as the shipped ones would be (flame.base.autotune)
    for choice in first.rglob("*.autotune.json"):
        (warmed / choice.parent.name).mkdir(parents=True, exist_ok=True)
        (warmed / choice.parent.name / choice.name).write_bytes(choice.read_bytes())
    before = _binaries(warmed)
    warm, _ = _step(config, warmed)
    print(json.dumps({"kernels": len(kernels), "compiled": compiled, "warming_s": round(warming, 1), "cold_step_s": cold,
                      "warm_step_s": warm, "failures": failures[:3]}))
    assert not failures and _binaries(warmed) == before
    assert warm < cold


def test_a_cold_step_with_configurations_compiled_together_ends_sooner(tmp_path):
    config = str(ROOT / "configs" / "tiny" / "gla.json")
    alone, loss = _step(config, tmp_path / "alone")
    together, loss_together = _step(config, tmp_path / "together", "together")
    print(json.dumps({"cold_step_s": alone, "together_step_s": together, "losses": [loss, loss_together]}))
    assert together < alone
    assert loss_together == pytest.approx(loss, rel=1e-3)  # the same model and batch (the kernels' choices may differ)
