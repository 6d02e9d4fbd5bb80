"""fla's mamba3 with the real mamba_ssm, built without its CUDA extensions as preflight's hint installs it.

mamba_ssm's ``__init__`` imports its compiled selective-scan extension, so fla alone finds none of
the package's Mamba-3 kernels; flame loads them for fla's layer (flame.compat.mamba_ssm). The
checks run tests/scripts/mamba3_kernels_probe.py in a fresh interpreter, with a build made here
(preflight's command, into a folder) or a damaged copy of it first on the path.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import CheckpointError, checkpoint

from flame.compat.mamba_ssm import unpack_saved_tensors_once
from flame.base.errors import ConfigError
from flame.models import load_model_config
from flame.models.support import support_for
from flame.prepare.model import check_mamba3_kernels
from tests.conftest import ROOT, SCRIPTS, check


@pytest.fixture(scope="module")
def mamba_ssm_without_cuda(tmp_path_factory) -> Path:
    """A directory holding mamba_ssm installed with preflight's command (pinned, into a target directory)."""
    target = tmp_path_factory.mktemp("mamba_ssm")
    install = support_for("mamba3").package("mamba_ssm").install
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # the venv's pip
    check(subprocess.run(["bash", "-c", f"{install} --quiet --target {target}"],
                         check=False, env=env, capture_output=True, text=True, timeout=600))
    return target


def probe(*sites: Path) -> dict:
    """tests/scripts/mamba3_kernels_probe.py's report on the tiny mamba3, with ``sites`` first on sys.path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [*sites, ROOT])), "TRANSFORMERS_VERBOSITY": "error"}
    result = check(subprocess.run([sys.executable, str(SCRIPTS / "mamba3_kernels_probe.py"),
                                   str(ROOT / "configs/tiny/mamba3.json")],
                                  check=False, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT))
    return json.loads(result.stdout.splitlines()[-1])


def test_mamba3_gets_the_kernels_of_a_mamba_ssm_built_without_cuda(mamba_ssm_without_cuda):
    report = probe(mamba_ssm_without_cuda)
    # the package as installed cannot be imported, so fla alone has no kernel
    assert report["fla_alone"] is False
    # through flame: mamba_ssm's own Triton scan, and nothing else changed
    assert report["siso"] == "mamba_ssm.ops.triton.mamba3.mamba3_siso_combined"
    assert report["fast_path"] is True
    assert report["mamba_ssm_after"] == "No module named 'selective_scan_cuda'"
    assert report["mamba2_fast_path"] is False  # fla's mamba2 keeps its PyTorch path (mamba_ssm's needs causal_conv1d)
    assert report["preflight_siso"] == "accepted"
    # what flame's GPU runs needed: checkpointing and compile (tested below and in docs/models-verified.md)
    assert report["siso_backward_unpacks_once"] is True
    assert report["norms_eager"] is True
    # MIMO runs TileLang, not installed here: refused with its install command
    assert report["mimo"] is None
    for name in ("preflight_mimo", "preflight_mimo_chunk16"):
        assert report[name].startswith("fla's mamba3 with is_mimo true needs the Mamba-3 MIMO kernels")
        assert "pip install tilelang (not installed here)" in report[name]


def test_mamba3_mimo_is_refused_where_mamba_ssms_tilelang_kernels_cannot_run(mamba_ssm_without_cuda, tmp_path, monkeypatch):
    # mamba_ssm requires tilelang==0.1.8; the 0.1.15 the GPU machines have failed to compile its MIMO
    # kernels on an H100. Here only that TileLang's version is installed (its package would be imported by fla).
    (tmp_path / "tilelang-0.1.15.dist-info").mkdir()
    (tmp_path / "tilelang-0.1.15.dist-info/METADATA").write_text("Metadata-Version: 2.1\nName: tilelang\nVersion: 0.1.15\n")
    monkeypatch.syspath_prepend(str(mamba_ssm_without_cuda))  # its metadata; nothing here imports it
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_model_config(str(ROOT / "configs/tiny/mamba3.json"))
    check_mamba3_kernels(config)  # SISO: no TileLang involved
    config.is_mimo = True
    # fla's default chunk_size 64 with mimo_rank 4 asked for 410 KB of shared memory on the H100
    with pytest.raises(ConfigError, match=r"^fla's mamba3 with is_mimo true: chunk_size 64 x mimo_rank 4 needs more.*"
                                          r"set chunk_size to 16 in the model config$"):
        check_mamba3_kernels(config)
    config.chunk_size = 16
    with pytest.raises(ConfigError) as error:
        check_mamba3_kernels(config)
    assert str(error.value) == (
        "fla's mamba3 with is_mimo true runs mamba_ssm's TileLang kernels, written for tilelang==0.1.8, not the "
        "0.1.15 installed: pip install 'tilelang==0.1.8', or set is_mimo to false in the model config"
    )


def test_a_backward_reading_saved_tensors_twice_runs_under_activation_checkpointing():
    # mamba_ssm's Mamba-3 backward checks len(ctx.saved_tensors) before it unpacks them
    class Cube(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x**3

        @staticmethod
        def backward(ctx, grad):
            assert len(ctx.saved_tensors) == 1
            (x,) = ctx.saved_tensors
            return 3 * x**2 * grad

    x = torch.randn(5, requires_grad=True)

    def checkpointed_backward():
        x.grad = None
        checkpoint(Cube.apply, x, use_reentrant=False).sum().backward()

    with pytest.raises(CheckpointError, match="already unpacked once"):
        checkpointed_backward()
    unpack_saved_tensors_once(Cube)
    checkpointed_backward()
    torch.testing.assert_close(x.grad, 3 * x.detach() ** 2)


def test_mamba3_with_a_mamba_ssm_older_than_its_kernels_is_refused(mamba_ssm_without_cuda, tmp_path):
    # mamba_ssm before 2.3.2 is the same package without the mamba3 kernel files
    shutil.copytree(mamba_ssm_without_cuda, tmp_path / "site")
    shutil.rmtree(tmp_path / "site/mamba_ssm/ops/triton/mamba3")
    report = probe(tmp_path / "site")
    assert report["siso"] is None
    error = report["preflight_siso"]
    assert error.startswith("fla's mamba3 found no mamba3_siso_combined in the mamba_ssm installed here (")
    assert "mamba-ssm >= 2.3.2 has the Mamba-3 kernels: " in error and error.endswith("mamba-ssm==2.3.2.post1 --upgrade")
