"""How a module planned for tensor parallelism runs: DTensor storage, local compute.

The vocabulary of the plans in flame.distributed.tensor_parallel (parameter layouts and ``Local``)
and the hooks that carry it out. Parameters are DTensors on the TP mesh, so FSDP, the
optimizer, gradient clipping and DCP checkpoints see ordinary sharded tensors; but the modules
compute on plain local tensors (fla's Triton kernels take no DTensor): while a planned module
runs, its parameters are swapped for their local shards and the size attributes the plan names
(``num_heads``, ``key_dim``, ...) hold the local values. Both are restored when it returns, so
weight init, state dicts and exports always see the full model.
"""

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

# How a parameter is laid out over the TP ranks.
COLUMNS = Shard(0)  # output features, channels or heads: whole heads on each rank
ROWS = Shard(1)  # input features of an output projection: the result is a partial sum
REPLICATED = Replicate()  # the same on every rank; gradients summed over the ranks


@dataclass(frozen=True)
class Once:
    """Replicated, used by the first rank only: a bias added to a partial sum before it is reduced."""


ONCE = Once()


@dataclass(frozen=True)
class Pieces:
    """Replicated storage; each rank computes with its pieces (ranges of dim 0) of the whole tensor.

    For projections whose output interleaves per-head and shared blocks (mamba2's in_proj:
    z | x | B | C | dt), which no single DTensor shard can express. Compute is split; the
    parameter's memory is not.
    """

    ranges: Callable[[nn.Module, int, int], list[tuple[int, int]]]  # (planned module, tp, rank) -> ranges


Layout = Shard | Replicate | Once | Pieces


@dataclass(frozen=True)
class Local:
    """How one module of a block runs under TP.

    ``params``: fnmatch pattern of a parameter name (relative to the module) -> layout; every
    parameter must match one. ``sizes``: submodule path ("" = the module itself) -> attributes
    that hold the local value (divided by tp) while the module runs; an absent submodule is
    skipped. ``local_sizes``: other attributes' local values, ``{"path.attr": value}`` from
    (module, tp). ``sharded``: a sub-layer that gathers its input (first positional argument,
    else ``hidden_states``) from sequence shards; its ``output`` (first element if a tuple) is
    then ``partial`` (reduce-scattered) or already ``sequence`` shards. ``to_sequence``:
    submodules whose tensor arguments move from head shards (last dim) to sequence shards (one
    all-to-all each) before they run: a norm over all heads at once, and what follows it.
    """

    params: dict[str, Layout]
    sizes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    local_sizes: Callable[[nn.Module, int], dict[str, int]] | None = None
    sharded: bool = True
    output: Literal["partial", "sequence"] = "partial"
    to_sequence: tuple[str, ...] = ()


NORM = Local(params={"*": REPLICATED}, sharded=False)  # runs on this rank's tokens


def submodule(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


class _ReplicatedGrad(torch.autograd.Function):
    """A replicated DTensor as a local tensor whose gradient is summed over its mesh."""

    @staticmethod
    def forward(ctx, param):
        ctx.mesh = param.device_mesh
        local = param.to_local()
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        return DTensor.from_local(grad, ctx.mesh, [Partial()], run_check=False).redistribute(ctx.mesh, [Replicate()])


def _local_view(param: DTensor, layout: Layout, ranges, first: bool) -> torch.Tensor:
    if isinstance(layout, Shard):
        return param.to_local()
    full = _ReplicatedGrad.apply(param)
    if isinstance(layout, Pieces):
        return torch.cat([full[start:stop] for start, stop in ranges])
    if isinstance(layout, Once) and not first:
        return full * 0
    return full


def _settled(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


class _Settle(torch.autograd.Function):
    """Identity that waits for a pending collective's result, in forward and in backward.

    DTensor redistributions hand out AsyncCollectiveTensors, which wait when a torch op first
    reads them, but not on view ops; fla's Triton kernels take the raw pointer of such a wrapper
    after a ``reshape``, reading memory the collective has not written yet (an illegal-address
    crash in fla's norm backward under TP). Every tensor crossing a TP collective, either way,
    passes here before fla sees it.
    """

    @staticmethod
    def forward(ctx, x):
        return _settled(x).view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _settled(grad)


def _gather_sequence(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sequence shards -> whole rows; the gradient (a partial sum per rank) is reduce-scattered back."""
    gathered = DTensor.from_local(_Settle.apply(x), mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()])
    return _Settle.apply(gathered.to_local(grad_placements=[Partial()]))


def _scatter_sequence(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Partial sums of whole rows -> sequence shards of the sum."""
    partial = DTensor.from_local(_Settle.apply(x), mesh, [Partial()], run_check=False)
    return _Settle.apply(partial.redistribute(mesh, [Shard(1)]).to_local())


def heads_to_sequence(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's heads (last dim) of whole rows -> all heads of this rank's sequence shard (all-to-all)."""
    heads = DTensor.from_local(_Settle.apply(x), mesh, [Shard(x.ndim - 1)], run_check=False)
    return _Settle.apply(heads.redistribute(mesh, [Shard(1)]).to_local())


class LocalRun:
    """Distributes a planned module's parameters and hooks it to run on local tensors."""

    def __init__(self, module: nn.Module, local: Local, params: dict[str, Layout], mesh: DeviceMesh):
        tp, rank = mesh.size(), mesh.get_local_rank()
        self.mesh, self.local, self.first, self.saved = mesh, local, rank == 0, []
        self.params = []
        for name, layout in params.items():
            owner_path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_path)
            param = owner._parameters[leaf]
            placement = layout if isinstance(layout, Shard) else Replicate()
            owner.register_parameter(
                leaf, nn.Parameter(distribute_tensor(param, mesh, [placement]), requires_grad=param.requires_grad)
            )
            ranges = layout.ranges(module, tp, rank) if isinstance(layout, Pieces) else None
            self.params.append((owner, leaf, layout, ranges))
        self.sizes = [
            (owner, attr, getattr(owner, attr) // tp)
            for path, attrs in local.sizes.items()
            if (owner := submodule(module, path)) is not None
            for attr in attrs
        ]
        for name, value in (local.local_sizes(module, tp) if local.local_sizes else {}).items():
            path, _, attr = name.rpartition(".")
            self.sizes.append((module.get_submodule(path), attr, value))
        # no always_call: it makes dynamo guard on each hook's id, recompiling every block
        module.register_forward_pre_hook(self.enter, with_kwargs=True)
        module.register_forward_hook(self.exit, with_kwargs=True)
        for path in local.to_sequence:
            module.get_submodule(path).register_forward_pre_hook(
                lambda _, args: tuple(heads_to_sequence(a, mesh) if torch.is_tensor(a) else a for a in args)
            )

    def enter(self, module, args, kwargs):
        params = [owner._parameters[leaf] for owner, leaf, _, _ in self.params]  # FSDP may have swapped them
        self.saved.append((params, [getattr(owner, attr) for owner, attr, _ in self.sizes]))
        for (owner, leaf, layout, ranges), param in zip(self.params, params):
            owner._parameters[leaf] = _local_view(param, layout, ranges, self.first)
        for owner, attr, value in self.sizes:
            setattr(owner, attr, value)
        if self.local.sharded:
            if args:
                args = (_gather_sequence(args[0], self.mesh), *args[1:])
            else:
                kwargs = {**kwargs, "hidden_states": _gather_sequence(kwargs["hidden_states"], self.mesh)}
        return args, kwargs

    def exit(self, module, args, kwargs, output):
        params, sizes = self.saved.pop()
        for (owner, leaf, _, _), param in zip(self.params, params):
            owner._parameters[leaf] = param
        for (owner, attr, _), value in zip(self.sizes, sizes):
            setattr(owner, attr, value)
        if not (self.local.sharded and self.local.output == "partial"):
            return output
        if isinstance(output, tuple):
            return (_scatter_sequence(output[0], self.mesh), *output[1:])
        return _scatter_sequence(output, self.mesh)


class HeadParallel(ColwiseParallel):
    """lm_head: vocabulary rows sharded, input gathered from sequence shards; logits sharded over
    the vocabulary (loss_parallel) or gathered. A LossHead's summed loss passes through."""

    def __init__(self, loss_parallel: bool):
        super().__init__(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                         use_local_output=not loss_parallel)

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        # the final norm's output gradient comes back through this gather: settle it for fla's norm
        return ColwiseParallel._prepare_input_fn(
            input_layouts, desired_input_layouts, mod, (_Settle.apply(inputs[0]), *inputs[1:]), device_mesh
        )

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if not isinstance(outputs, DTensor):
            return outputs
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


class EmbeddingParallel(RowwiseParallel):
    """Embedding: vocabulary rows sharded; output reduce-scattered to sequence shards.

    Synchronously: torch's RowwiseParallel hands out an AsyncCollectiveTensor, and when a
    compiled block consumes one, the gradient comes back without its DTensor wrapper (torch 2.13).
    """

    def __init__(self):
        super().__init__(input_layouts=Replicate(), output_layouts=Shard(1))

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return _Settle.apply(outputs.redistribute(placements=output_layouts).to_local())


def maybe_enable_async_tp(job_config, mesh: DeviceMesh) -> None:
    """--parallelism.enable_async_tensor_parallel: inductor overlaps compiled blocks' TP collectives with matmuls."""
    from torchtitan.distributed.tensor_parallel import (
        maybe_enable_async_tp as torchtitan_switch,
    )

    torchtitan_switch(job_config, mesh)  # turns on inductor's micro-pipeline TP pass
    if job_config.parallelism.enable_async_tensor_parallel:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        # deprecated, but the pass of torch 2.11-2.13 still fuses only the groups registered here
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable_symm_mem_for_group(mesh.get_group().group_name)
