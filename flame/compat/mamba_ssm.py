"""mamba_ssm's seam: fla's mamba3 layer runs mamba_ssm's Mamba-3 kernels.

Written for mamba-ssm 2.3.2.post1 (the release fla 0.6's mamba3 layer calls) and fla-core 0.6.0.
mamba_ssm is optional: flame.compat.apply_after_fla_import applies these only where it is
installed; without it flame.prepare.model refuses mamba3 with the install command. A kernel that
cannot be imported from the mamba_ssm installed here is recorded in ``mamba3_kernel_errors``,
and flame.prepare.model refuses the mamba3 configs that need it with the reason.
"""

import functools
import importlib
import importlib.util
import sys

import torch

from flame.compat.fla import FLA
from flame.compat.guard import Library, Target, patch

MAMBA_SSM = Library("mamba_ssm", "mamba-ssm", "2.3.2.post1")
# its Triton files suffice (import_kernel_module loads them): no CUDA build, none of its dependencies
INSTALL = ("MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE pip install --no-build-isolation --no-deps "
           f"mamba-ssm=={MAMBA_SSM.written_for}")

# fla.layers.mamba3's names for the kernels it trains with -> (mamba_ssm module, name there)
MAMBA3_KERNELS = {
    "mamba3_siso_combined": ("mamba_ssm.ops.triton.mamba3.mamba3_siso_combined", "mamba3_siso_combined"),
    "mamba3_mimo_combined": ("mamba_ssm.ops.tilelang.mamba3.mamba3_mimo", "mamba3_mimo"),
}
# kernel name -> why it could not be imported from the installed mamba_ssm (preflight reports it)
mamba3_kernel_errors: dict[str, str] = {}

_MAMBA3_LAYER = "fla.layers.mamba3"
_SSD_MODULE = "mamba_ssm.ops.triton.ssd_combined"


def import_kernel_module(name: str):
    """Import ``mamba_ssm``'s module ``name`` without running ``mamba_ssm/__init__``.

    That ``__init__`` imports the compiled selective-scan extension, which a build without CUDA
    (the Triton files only) lacks. The kernel modules are imported under a stand-in ``mamba_ssm``
    package whose ``__init__`` is not run (its subpackages' are empty), which is then removed:
    ``import mamba_ssm`` fails afterwards as before, and fla's layers keep the paths they chose.
    """
    stand_in = "mamba_ssm" not in sys.modules
    if stand_in:
        sys.modules["mamba_ssm"] = importlib.util.module_from_spec(importlib.util.find_spec("mamba_ssm"))
    try:
        return importlib.import_module(name)
    finally:
        if stand_in:
            del sys.modules["mamba_ssm"]


@functools.cache
def ssd_scan():
    """mamba_ssm's Triton SSD scan (``mamba_chunk_scan_combined``), or None where mamba_ssm is not installed.

    flame.models.kernels.mamba2 trains Mamba-2 layers with it: scalar decays per head, B and C per
    group, documents restarting at ``seq_idx``, and a backward that keeps little (docs/perf-log.md).
    """
    if importlib.util.find_spec("mamba_ssm") is None:
        return None
    module = import_kernel_module(_SSD_MODULE)
    Target(MAMBA_SSM, _SSD_MODULE, "mamba_chunk_scan_combined",
           ("x", "dt", "A", "B", "C", "chunk_size", "D", "z", "dt_bias", "initial_states", "seq_idx")
           ).require("flame.models.kernels.mamba2")
    # outside compiled graphs, as fla's kernels are: dynamo would trace into its launches
    return torch.compiler.disable(module.mamba_chunk_scan_combined)


@patch(MAMBA_SSM, *(Target(FLA, _MAMBA3_LAYER, name) for name in (*MAMBA3_KERNELS, "is_fast_path_available")))
def mamba3_kernels_from_mamba_ssm() -> None:
    """Give fla's mamba3 layer the kernels an installed mamba_ssm has, even one that cannot be imported.

    Upstream: fla's mamba3 layer imports its scan from mamba_ssm (>= 2.3.2): Triton (SISO) or
    TileLang (MIMO) files. But ``mamba_ssm/__init__`` imports the compiled selective-scan
    extension, which Mamba-3 never calls, so a build without it (``MAMBA_SKIP_CUDA_BUILD=TRUE``:
    no nvcc, seconds instead of a long compile) fails to import and fla's layer finds no kernel.
    flame: imports the kernel modules without that ``__init__`` (``import_kernel_module``).
    """
    layer = importlib.import_module(_MAMBA3_LAYER)
    for name in [name for name in MAMBA3_KERNELS if getattr(layer, name) is None]:
        module_name, kernel = MAMBA3_KERNELS[name]
        try:
            setattr(layer, name, getattr(import_kernel_module(module_name), kernel))
        except ImportError as error:  # no TileLang (MIMO), or a mamba_ssm older than Mamba-3
            mamba3_kernel_errors[name] = str(error)
    layer.is_fast_path_available = layer.mamba3_siso_combined is not None


@patch(MAMBA_SSM)
def mamba3_backward_unpacks_saved_tensors_once() -> None:
    """Let mamba_ssm's Mamba-3 backward run under activation checkpointing.

    Upstream: its backward (SISO and MIMO, ``_Mamba3Function``) reads ``ctx.saved_tensors``
    twice, once to check it is not empty; torch's checkpointing lets each saved tensor be
    unpacked once, so full and op-level AC fail in the first backward (docs/models-verified.md).
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
