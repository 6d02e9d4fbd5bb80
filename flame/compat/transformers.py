"""transformers' seam: flame's attention in transformers' attention registry, fused rotary embeddings,
MoE experts' grouped GEMM in the autocast dtype, scikit-learn imported only where assisted generation uses it.

Written for transformers 5.17.0 (3rdparty/requirements.txt).
"""

import functools
import importlib
import sys
from collections.abc import Callable

import torch
from transformers import AttentionInterface

from flame.compat.guard import Library, Patch, Target, patch

TRANSFORMERS = Library("transformers", "transformers", "5.17.0")
ROTARY = "apply_rotary_pos_emb"  # the modeling modules' function that rotates queries and keys


@patch(TRANSFORMERS, Target(TRANSFORMERS, "transformers", "AttentionInterface.register", ("key", "value")))
def attention_implementation(name: str, function: Callable) -> None:
    """Register ``function`` as the attention implementation ``name`` of every transformers model.

    Upstream: a model built with ``attn_implementation=name`` looks its attention function up in
    ``AttentionInterface``'s process-wide registry, which holds eager, sdpa, flash and flex.
    flame: adds its document-masked attention ("flame": flame.models.kernels.attention), which keeps
    packed documents apart using the ``cu_seq_lens_q`` flame passes with each batch. Applied when
    flame first resolves a model type (flame.models.registry.ensure_model_type), before any model
    is built.
    """
    AttentionInterface.register(name, function)


def rotary_target(module_name: str) -> Target:
    """The rotary function of a modeling module, as flame's fused rotary replaces it."""
    return Target(TRANSFORMERS, module_name, ROTARY, ("q", "k", "cos", "sin"))


def _fused_rotary(module_name: str, fuse: Callable[[Callable], Callable]) -> None:
    """Make the attention of ``module_name`` rotate its queries and keys with ``fuse(its apply_rotary_pos_emb)``.

    Upstream: a decoder's attention calls its modeling module's ``apply_rotary_pos_emb(q, k, cos,
    sin)``, which rotates q and k through ``rotate_half`` (two slices, a negation, a concatenation,
    two products and a sum: about six kernels per tensor each way in eager code). The attention
    looks the function up in its module at every call, so it can only be replaced there, for
    every model of that module in the process. flame: the replacement (flame.models.kernels.fused) runs
    the same rotation in one fla kernel per tensor on CUDA, and calls the original everywhere
    else (CPU, inside compiled graphs, arguments it does not take). Applied once per modeling
    module by flame.models.kernels.fused.use_fused_kernels, only where the module's function computes the
    rotation fla's kernel computes (checked on a probe first).
    """
    module = importlib.import_module(module_name)
    setattr(module, ROTARY, fuse(getattr(module, ROTARY)))


@functools.cache
def fused_rotary(module_name: str) -> Patch:
    """The change putting a fused rotary function in ``module_name`` (one per module, each applied once)."""
    change = functools.partial(_fused_rotary, module_name)
    change.__name__ = f"fused_rotary({module_name.rpartition('.')[2].removeprefix('modeling_')})"
    change.__doc__ = _fused_rotary.__doc__
    return Patch(TRANSFORMERS, change, (rotary_target(module_name),))


GROUPED_EXPERTS = "transformers.integrations.moe"  # the experts of MoE layers as one grouped GEMM


@patch(TRANSFORMERS, Target(TRANSFORMERS, GROUPED_EXPERTS, "_grouped_mm", ("input", "weight", "offs")))
def experts_in_the_autocast_dtype() -> None:
    """Run a MoE layer's grouped GEMM in the autocast dtype, as autocast runs an nn.Linear.

    Upstream: the experts of a MoE layer (``experts_implementation`` "grouped_mm", the default) multiply
    through ``_grouped_mm``, which torch does not autocast: it casts the tokens to the weights' dtype.
    Under autocast with float32 weights (flame's one-GPU runs and the memory plan's layouts) that is a
    float32 grouped GEMM, which torch's CUDA kernel does not take, so transformers falls back to its
    loop over the experts in float32: slower than its own loop of bf16 matmuls. flame: under autocast,
    the tokens and the experts' weights are cast to the autocast dtype first (the gradient reaches the
    float32 weights through the cast, as for an nn.Linear). Without autocast (bf16 weights under FSDP,
    CPU runs) nothing changes. Applied when flame builds a MoE model (flame.models.builder).
    """
    module = importlib.import_module(GROUPED_EXPERTS)
    original = module._grouped_mm

    @functools.wraps(original)
    def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        kind = input.device.type
        if torch.is_autocast_enabled(kind):
            dtype = torch.get_autocast_dtype(kind)
            input, weight = input.to(dtype), weight.to(dtype)
        return original(input, weight, offs)

    module._grouped_mm = grouped_mm


CANDIDATE_GENERATOR = "transformers.generation.candidate_generator"


@patch(TRANSFORMERS, Target(TRANSFORMERS, "transformers.utils", "is_sklearn_available", ()))
def scikit_learn_imported_when_used() -> None:
    """Import scikit-learn when assisted generation first needs it, not with every model class.

    Upstream: every model class imports ``transformers.generation``, whose candidate generator
    imports ``sklearn.metrics.roc_curve`` at import time wherever scikit-learn is installed
    (lm-eval needs it, so flame's environment has it): 1-2 s of CPU (scikit-learn and the scipy
    it loads) in each process, every rank of every run, for a function only assisted
    generation with a dynamic confidence threshold calls. flame: imports the candidate
    generator with scikit-learn reported missing, then gives it back the real availability
    check and a ``roc_curve`` that imports scikit-learn's on first call, so generation behaves
    as upstream. Applied first thing in train.sh's preflight, each rank and the HF export
    (flame.launch.preflight, flame.train, flame.launch.supervise, flame.checkpoint.export); where the
    module was imported already, there is nothing left to defer.
    """
    if CANDIDATE_GENERATOR in sys.modules:
        return
    utils = importlib.import_module("transformers.utils")
    available = utils.is_sklearn_available
    utils.is_sklearn_available = lambda: False
    try:
        module = importlib.import_module(CANDIDATE_GENERATOR)
    finally:
        utils.is_sklearn_available = available
    module.is_sklearn_available = available

    def roc_curve(*args, **kwargs):
        from sklearn.metrics import roc_curve

        return roc_curve(*args, **kwargs)

    module.roc_curve = roc_curve
