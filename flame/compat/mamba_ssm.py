"""mamba_ssm's seam: fla's mamba3 layer runs mamba_ssm's Mamba-3 kernels.

Written for mamba-ssm 2.3.2.post1 (the release fla 0.6's mamba3 layer calls) and fla-core 0.6.0.
mamba_ssm is optional: flame.compat.apply_after_fla_import applies these only where it is
installed; without it flame.preflight refuses mamba3 with the install command. A kernel that
cannot be imported from the mamba_ssm installed here is recorded in ``mamba3_kernel_errors``,
and flame.preflight refuses the mamba3 configs that need it with the reason.
"""

import importlib
import importlib.util
import sys

import torch

from flame.compat.fla import FLA
from flame.compat.guard import Library, Target, patch

MAMBA_SSM = Library("mamba_ssm", "mamba-ssm", "2.3.2.post1")

# fla.layers.mamba3's names for the kernels it trains with -> (mamba_ssm module, name there)
MAMBA3_KERNELS = {
    "mamba3_siso_combined": ("mamba_ssm.ops.triton.mamba3.mamba3_siso_combined", "mamba3_siso_combined"),
    "mamba3_mimo_combined": ("mamba_ssm.ops.tilelang.mamba3.mamba3_mimo", "mamba3_mimo"),
}
# kernel name -> why it could not be imported from the installed mamba_ssm (preflight reports it)
mamba3_kernel_errors: dict[str, str] = {}

_MAMBA3_LAYER = "fla.layers.mamba3"


@patch(MAMBA_SSM, *(Target(FLA, _MAMBA3_LAYER, name) for name in (*MAMBA3_KERNELS, "is_fast_path_available")))
def mamba3_kernels_from_mamba_ssm() -> None:
    """Give fla's mamba3 layer the kernels an installed mamba_ssm has, even one that cannot be imported.

    Upstream: fla's mamba3 layer imports its scan from mamba_ssm (>= 2.3.2): Triton (SISO) or
    TileLang (MIMO) files. But ``mamba_ssm/__init__`` imports the compiled selective-scan
    extension, which Mamba-3 never calls, so a build without it (``MAMBA_SKIP_CUDA_BUILD=TRUE``:
    no nvcc, seconds instead of a long compile) fails to import and fla's layer finds no kernel.
    flame: imports the kernel modules under a stand-in ``mamba_ssm`` package whose ``__init__``
    is not run (its subpackages' are empty), then removes the stand-in: ``import mamba_ssm``
    fails afterwards as before, and fla's other layers keep the paths they chose at import.
    """
    layer = importlib.import_module(_MAMBA3_LAYER)
    missing = [name for name in MAMBA3_KERNELS if getattr(layer, name) is None]
    stand_in = "mamba_ssm" not in sys.modules and bool(missing)
    if stand_in:  # the package's module, its __init__ not run
        sys.modules["mamba_ssm"] = importlib.util.module_from_spec(importlib.util.find_spec("mamba_ssm"))
    try:
        for name in missing:
            module_name, kernel = MAMBA3_KERNELS[name]
            try:
                setattr(layer, name, getattr(importlib.import_module(module_name), kernel))
            except ImportError as error:  # no TileLang (MIMO), or a mamba_ssm older than Mamba-3
                mamba3_kernel_errors[name] = str(error)
    finally:
        if stand_in:
            del sys.modules["mamba_ssm"]
    layer.is_fast_path_available = layer.mamba3_siso_combined is not None


@patch(MAMBA_SSM)
def mamba3_backward_unpacks_saved_tensors_once() -> None:
    """Let mamba_ssm's Mamba-3 backward run under activation checkpointing.

    Upstream: its backward (SISO and MIMO, ``_Mamba3Function``) reads ``ctx.saved_tensors``
    twice, once to check it is not empty; torch's checkpointing lets each saved tensor be
    unpacked once, so full and op-level AC fail in the first backward (docs/models.md).
    flame: that backward gets a context whose saved tensors were unpacked once.
    """
    layer = importlib.import_module(_MAMBA3_LAYER)
    for name in MAMBA3_KERNELS:
        kernel = getattr(layer, name)
        if kernel is not None:  # the kernels mamba3_kernels_from_mamba_ssm found
            Target(MAMBA_SSM, kernel.__module__, "_Mamba3Function.backward", ("ctx",)).require(
                "flame.compat.mamba_ssm.mamba3_backward_unpacks_saved_tensors_once"
            )
            unpack_saved_tensors_once(sys.modules[kernel.__module__]._Mamba3Function)


def apply() -> None:
    """mamba3's kernels from the installed mamba_ssm, after fla's import (flame.compat.apply_after_fla_import)."""
    mamba3_kernels_from_mamba_ssm()
    mamba3_backward_unpacks_saved_tensors_once()


class _SavedTensorsUnpackedOnce:
    """An autograd context whose ``saved_tensors`` were unpacked once; everything else is the context's."""

    def __init__(self, ctx):
        self._ctx = ctx
        self.saved_tensors = ctx.saved_tensors

    def __getattr__(self, name):
        return getattr(self._ctx, name)


def unpack_saved_tensors_once(function: type[torch.autograd.Function]) -> None:
    """Make ``function``'s backward see saved tensors unpacked once, however often it reads them."""
    backward = function.backward
    if getattr(backward, "unpacks_once", False):
        return

    def backward_unpacking_once(ctx, *grads):
        return backward(_SavedTensorsUnpackedOnce(ctx), *grads)

    backward_unpacking_once.unpacks_once = True
    function.backward = staticmethod(backward_unpacking_once)
