"""A kernel's memory on meta tensors: flame.memory measures activations by a meta forward's saved tensors, and
kernels that need real memory (flame's fused norms and MLPs, its flash-style attention) run there as this stand-in,
which keeps what the kernel keeps for its backward."""

import torch


class Keeps(torch.autograd.Function):
    """An output shaped like ``like`` whose backward would need ``kept``: a kernel's memory, on meta tensors."""

    @staticmethod
    def forward(ctx, like: torch.Tensor, *kept: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*kept)
        return torch.empty_like(like)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("a meta forward's stand-in for a kernel has no backward: it only measures memory")
