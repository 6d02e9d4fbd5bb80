"""The weights streamed from the host (--memory.stream_weights): the GPU holds a block's weights only while it runs.

Why: under mixed precision a parameter costs 16 bytes (fp32 weight and gradient, AdamW's two moments), 112 GB for
a 7B model. FSDP2's CPU offload keeps them on the host but copies every fp32 weight up for each pass and adds
each fp32 gradient on the way down; the optimizer on the host alone leaves the fp32 weights and gradients on the
GPU. Here the GPU holds, beside the activations, two blocks' weights in the compute dtype and one block's
gradients at a time:
- the model's parameters stay float32 on the host (the *masters*: what checkpoints save, exports read and the
  optimizer steps), each unit's in one pinned buffer;
- a decoder block's forward finds its weights in one GPU buffer in the compute dtype: its masters copied up on a
  side stream while the block before it runs, and cast there; the buffer is freed after the block; its backward
  has it copied again a block ahead (with activation checkpointing, before the block's recompute). Float32 moves
  twice the bytes of a compute-dtype copy on the host, which would cost 2 bytes a parameter of host memory (14 GB
  for a 7B, where the host's memory is what bounds the layout) to save link time the passes hide;
- a block's gradients go down to pinned host memory on a second stream as soon as its backward has made them (their
  squared norm summed on the GPU on the way, for clipping), and their GPU memory is freed;
- the optimizer step (AdamW on the host, unit by unit in the forward's order, on a host thread) runs beside the
  next forward, which waits, before each block, for that block's step alone.
The embeddings, the final norm and the head (the *resident* unit) keep their buffer on the GPU; they are stepped and
copied up the same way. With micro-batches, each pass's gradients are added on the host thread into a float32 sum
while the GPU goes on (their norm taken there). The forward computes in the compute dtype throughout (no autocast,
as under FSDP's mixed precision). On a CPU run the host is the device: the same steps, with copies for transfers.

Over several processes (data parallel only) each holds a shard of every master: its shard goes up, an all-gather
on the copy stream makes the block's weights, and the gradients leave through a reduce-scatter on the other stream,
each rank landing and stepping its own chunks (flame.optim.stream_shards). The optimizer's state is AdamW's own (per
master parameter): a checkpoint resumes with streaming on or off, on any number of processes.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from flame.models.registry import decoder_layers
from flame.optim.host_worker import HostWorker
from flame.optim.pinned import HostArena, chunk_bytes_for, least_wasting_chunk
from flame.optim.record import host_step_refusal
from flame.optim.stream_shards import Shards
from flame.optim.stream_units import Unit, innermost


def refusal(config, world_size: int) -> str | None:
    """Why --memory.stream_weights cannot run the job, as a one-line remedy (flame.prepare refuses it with it, the
    memory plan does not offer streaming there); None where it can."""
    flag = "--memory.stream_weights"
    degrees = ("tensor_parallel", "pipeline_parallel", "context_parallel", "data_parallel_replicate", "expert_parallel")
    if given := [f"--parallelism.{name}_degree {getattr(config.parallelism, f'{name}_degree')}" for name in degrees
                 if getattr(config.parallelism, f"{name}_degree") > 1]:
        return (f"{flag} shards the weights over all {world_size} processes, each streaming its shard (data "
                f"parallel, as FSDP), and does not combine with {given[0]}: set it to 1, or drop {flag}")
    if (refused := host_step_refusal(config.optimizer.name, flag)) is not None:
        return refused
    others = {
        "--training.enable_cpu_offload": config.training.enable_cpu_offload,
        "--optimizer.on_host": config.optimizer.on_host,
        "--parallelism.fsdp_one_rank": config.parallelism.fsdp_one_rank,
        "--training.ema_decay": config.training.ema_decay > 0,
        "--float8.recipe_name": config.float8.recipe_name != "off",
        "--compile.enable (--training.compile)": config.compile.enable,
    }
    if given := [name for name, on in others.items() if on]:
        return (f"{flag} does not combine with {given[0]} yet: the weights live on the host as the model's float32 "
                "parameters and only visit the GPU; drop one of the two")
    return None


class WeightStream:
    """The hooks and copies that stream ``model``'s weights to ``device`` and its gradients back."""

    def __init__(self, model: nn.Module, compute_dtype: torch.dtype, device: torch.device, mesh=None,
                 reduce_dtype: torch.dtype = torch.float32):
        """``mesh``: the data-parallel processes sharing the weights (None or one: this process holds them all);
        their gradients are summed in ``reduce_dtype``."""
        self.model, self.dtype, self.device = model, compute_dtype, device
        self.cuda = device.type == "cuda"
        self.shards = Shards(mesh, reduce_dtype) if mesh is not None and mesh.size() > 1 else None
        blocks = [innermost(block) for block in decoder_layers(model)]
        self.blocks = [self._unit(f"block {index}", block) for index, block in enumerate(blocks)]
        in_blocks = {id(p) for unit in self.blocks for p in unit.masters}
        self.resident = self._unit("embeddings and head", model, skip=in_blocks, resident=True)
        self.units = [self.resident, *self.blocks]  # the forward's order
        ranks, rank = (self.shards.ranks, self.shards.rank) if self.shards is not None else (1, 0)
        for unit in self.units:
            if self.shards is not None:
                self.shards.check(unit)
            unit.layout(ranks, rank)
        # each unit's masters (by dtype) and landing, as float32 elements of the pinned arena's chunks
        buffers = [-(-dtype.itemsize * (end - start) // 4) for unit in self.units for dtype, start, end in unit.groups()]
        buffers += [-(-compute_dtype.itemsize * unit.grad_numel // 4) for unit in self.units]
        self.arena = HostArena(pin=self.cuda, chunk_bytes=min(chunk_bytes_for(4 * sum(buffers)),
                                                              least_wasting_chunk(buffers)))
        if self.cuda:
            self.up, self.down = torch.cuda.Stream(device), torch.cuda.Stream(device)
        for unit in self.units:
            self._build(unit)
        for module in model.modules():  # materialized on the host with the weights: they live where the forward runs
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = buffer.to(device)
        self.squares = torch.zeros((), dtype=torch.float32, device=device)  # this step's gradients, GPU-summed
        self.passes_expected = 1
        self.stale = False  # the masters changed outside a step (a checkpoint loaded): the resident buffer to redo
        self.waited = 0.0  # seconds the forward waited for the host's step, all steps together
        self.graded: set[int] = set()  # the masters whose leaves have had a gradient (LoRA's first-step check)
        self.host = HostWorker(on_error=self._unblock)
        self._backward_queued = False
        self._hooks(blocks)
        model.register_load_state_dict_post_hook(lambda module, keys: self.mark_stale())

    def _unit(self, name: str, module: nn.Module, skip: set[int] = frozenset(), resident: bool = False) -> Unit:
        seen: dict[int, int] = {}
        masters, places = [], []
        for owner in module.modules():
            for attr, param in owner.named_parameters(recurse=False):
                if id(param) in skip:
                    continue
                if id(param) not in seen:
                    seen[id(param)] = len(masters)
                    masters.append(param)
                    places.append([])
                places[seen[id(param)]].append((owner, attr))
        return Unit(name, masters, places, resident=resident)

    def _build(self, unit: Unit) -> None:
        """The unit's masters moved into pinned buffers (one a dtype), its landing, its GPU buffer and the leaves in
        it."""
        unit.flats = [(start, end, self.arena.take(torch.Size([end - start]), dtype))
                      for dtype, start, end in unit.groups()]
        unit.landing = self.arena.take(torch.Size([unit.grad_numel]), self.dtype)
        with torch.no_grad():
            for index, (master, view) in enumerate(zip(unit.masters, unit.host_views())):
                if self.shards is not None:
                    self.shards.take(unit, index, view)
                    continue
                view.copy_(master)
                master.data = view  # the same Parameter: the optimizer, checkpoints and exports see no change
        unit.stepped.set()
        unit.added.set()
        unit.storage = torch.empty(unit.numel, dtype=self.dtype, device=self.device).untyped_storage()
        for master, offset in zip(unit.masters, unit.offsets):
            leaf = torch.empty(0, dtype=self.dtype, device=self.device).set_(unit.storage, offset, master.shape)
            leaf.requires_grad_(master.requires_grad)
            if leaf.requires_grad:
                leaf.register_post_accumulate_grad_hook(
                    lambda _, unit=unit, master=master: self._gradient_made(unit, master))
            unit.leaves.append(leaf)
        if unit.resident:
            self._copy_up(unit)
        else:
            unit.storage.resize_(0)

    def _hooks(self, blocks: list[nn.Module]) -> None:
        self.model.register_forward_pre_hook(lambda module, args: self._model_starts())
        self.model.register_forward_hook(lambda module, args, output: self._swap(self.resident, into=False))
        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda module, args, index=index: self._block_starts(index))
            block.register_forward_hook(lambda module, args, output, index=index: self._block_ends(index, output))

    # the forward and the backward

    def _model_starts(self) -> None:
        if self.stale:
            self._reload_resident()
        self._ensure(self.resident)
        self._swap(self.resident, into=True)
        if self.blocks:
            self._fetch(self.blocks[0])

    def _block_starts(self, index: int) -> None:
        unit = self.blocks[index]
        self._ensure(unit)
        self._swap(unit, into=True)
        if not unit.in_backward and index + 1 < len(self.blocks):
            self._fetch(self.blocks[index + 1])  # copied while this block runs

    def _block_ends(self, index: int, output) -> None:
        unit = self.blocks[index]
        self._swap(unit, into=False)
        if unit.in_backward:  # activation checkpointing's recompute: the block's backward follows at once
            return
        out = output[0] if isinstance(output, tuple) else output
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad, index=index: self._backward_reaches(index))
            if index == len(self.blocks) - 1:
                return  # the backward starts with this block: its weights stay
        self._release(unit)

    def _backward_reaches(self, index: int) -> None:
        """Block ``index``'s output has its gradient: the block's backward (and recompute) comes next, and the
        backward is done with the block after it (that gradient is its input's)."""
        if not self._backward_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ends)
            self._backward_queued = True
        if index + 1 < len(self.blocks):
            self._leave(self.blocks[index + 1])
        unit = self.blocks[index]
        unit.in_backward = True
        self._ensure(unit)
        if index > 0:
            self._fetch(self.blocks[index - 1])

    def _leave(self, unit: Unit) -> None:
        """The backward is through the unit: its weights are freed (not when its gradients are made: LoRA's
        adapters have theirs before the frozen weights beside them have carried the gradient to the block's
        input)."""
        unit.in_backward = False
        self._release(unit)

    def _gradient_made(self, unit: Unit, master: torch.Tensor) -> None:
        self.graded.add(id(master))
        unit.seen += 1
        if unit.seen == unit.trainable:
            self._send_down(unit)

    def _backward_ends(self) -> None:
        """The backward's end: units whose backward made only some of their gradients (a parameter this pass did not
        use) send them down with zeros for the rest; the first block (or any the backward reached last) is left."""
        self._backward_queued = False
        for unit in self.units:
            if unit.seen:
                for leaf in unit.leaves:
                    if leaf.requires_grad and leaf.grad is None:
                        leaf.grad = torch.zeros_like(leaf)
                self._send_down(unit)
            if unit.in_backward:
                self._leave(unit)

    def _send_down(self, unit: Unit) -> None:
        """The unit's gradients to the host, their squared norm to this step's sum; their GPU memory freed (the
        host's copy stream holds it until the copy is done)."""
        grads = [leaf.grad for leaf in unit.leaves if leaf.requires_grad]
        if self.passes_expected == 1 and self.shards is None:
            norms = torch._foreach_norm(grads, 2.0, torch.float32)
            self.squares.add_(torch.stack(norms).square().sum())
        for event in (unit.added, unit.stepped):  # the host still reads the last pass's (or step's) gradients
            if not event.is_set():
                event.wait()
        self.host.check()
        if self.cuda:
            self.down.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.down):
                for grad in grads:
                    grad.record_stream(self.down)
                self._land(unit, grads)
                unit.landed = self.down.record_event()
        else:
            self._land(unit, grads)
        for leaf in unit.leaves:
            leaf.grad = None
        first, unit.passes, unit.seen = unit.passes == 0, unit.passes + 1, 0
        if self.passes_expected > 1:
            unit.added.clear()
            self.host.put(lambda: self._add(unit, first, last=unit.passes >= self.passes_expected))

    def _land(self, unit: Unit, grads: list[torch.Tensor]) -> None:
        """The unit's gradients into its landing (on the down stream of a GPU): over several processes, summed by a
        reduce-scatter that leaves each rank its chunks, whose squared norm joins this step's sum."""
        if self.shards is None:
            for view, grad in zip(unit.grad_views(unit.landing).values(), grads):  # the trainable leaves', in order
                view.copy_(grad, non_blocking=self.cuda)
            return
        summed = self.shards.reduce(unit, grads)
        if self.passes_expected == 1:
            self.squares.add_(torch.linalg.vector_norm(summed, dtype=torch.float32).square())
        unit.landing.copy_(summed.to(self.dtype), non_blocking=self.cuda)

    def _add(self, unit: Unit, first: bool, last: bool) -> None:
        """(host thread) A pass's gradients into the unit's float32 sum; at the last pass, the sum's squared norm."""
        if unit.landed is not None:
            unit.landed.synchronize()
        if unit.summed is None:
            unit.summed = torch.empty(unit.grad_numel, dtype=torch.float32)
        if first:
            unit.summed.copy_(unit.landing)
        else:
            unit.summed.add_(unit.landing)
        if last:
            unit.squares = float(torch.linalg.vector_norm(unit.summed)) ** 2
        unit.added.set()

    # the GPU buffers

    def _fetch(self, unit: Unit) -> None:
        """Start the copy of the unit's weights up (after its step, if one is running)."""
        if unit.current:
            return
        if not unit.stepped.is_set():
            start = time.perf_counter()
            unit.stepped.wait()
            self.waited += time.perf_counter() - start
        self.host.check()
        if unit.storage.nbytes() == 0:
            unit.storage.resize_(unit.numel * self.dtype.itemsize)  # on the compute stream: freed there
        self._copy_up(unit)

    def _copy_up(self, unit: Unit) -> None:
        full = torch.empty(0, dtype=self.dtype, device=self.device).set_(unit.storage, 0, (unit.numel,))
        if not self.cuda:
            self._assemble(unit, full)
            unit.current = True
            return
        # on the copy stream, after the compute stream's work so far (the buffers may reuse memory that work still
        # reads)
        self.up.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.up):
            self._assemble(unit, full)
            unit.fetched = self.up.record_event()
        unit.current = True

    def _assemble(self, unit: Unit, full: torch.Tensor) -> None:
        """The unit's weights into ``full`` (its GPU buffer): this rank's shards copied up (float32 masters cast on
        the GPU) and, over several processes, the ranks' shards all-gathered."""
        shard = full if self.shards is None else torch.empty(unit.shard_numel, dtype=self.dtype, device=self.device)
        for start, end, host in unit.flats:
            if host.dtype == self.dtype or not self.cuda:
                shard[start:end].copy_(host, non_blocking=self.cuda)
                continue
            staging = torch.empty(end - start, dtype=host.dtype, device=self.device)  # the copy stream's own
            staging.copy_(host, non_blocking=True)
            shard[start:end].copy_(staging)
        if self.shards is not None:
            self.shards.gather(unit, shard, full)

    def _ensure(self, unit: Unit) -> None:
        """The unit's weights on the GPU before the compute stream goes on."""
        self._fetch(unit)
        if unit.fetched is not None:
            torch.cuda.current_stream(self.device).wait_event(unit.fetched)
            unit.fetched = None

    def _release(self, unit: Unit) -> None:
        if unit.resident or not unit.current:
            return
        if unit.fetched is not None:  # copied up but never used: the copy must end before the memory is reused
            torch.cuda.current_stream(self.device).wait_event(unit.fetched)
            unit.fetched = None
        unit.storage.resize_(0)
        unit.current = False

    def _swap(self, unit: Unit, into: bool) -> None:
        """The unit's modules compute with the GPU leaves (``into``), or hold the masters again."""
        for master, leaf, places in zip(unit.masters, unit.leaves, unit.places):
            for owner, attr in places:
                owner._parameters[attr] = leaf if into else master

    # the host's side

    def _unblock(self) -> None:
        """The host's work failed: nothing waits for it any longer (the next check raises its error)."""
        for unit in self.units:
            unit.stepped.set()
            unit.added.set()

    def mark_stale(self) -> None:
        self.stale = True

    def _reload_resident(self) -> None:
        """The masters changed outside a step (a checkpoint loaded, weights initialized from a file): the resident
        buffer, which stays on the GPU between the passes, takes them again (a block's is copied for each pass)."""
        self.host.drain()
        self.resident.current = False
        self.stale = False

    def begin_step(self, passes: int) -> None:
        """A step of ``passes`` forward and backward passes starts (its gradients none yet). The last step's
        updates may still run: each unit's next forward waits for its own."""
        self.passes_expected = passes
        self.squares.zero_()
        for unit in self.units:
            unit.passes, unit.seen, unit.squares = 0, 0, 0.0

    def gradient_norm(self) -> torch.Tensor:
        """The step's gradient norm (all passes summed; over several processes, all ranks' chunks), on the
        device."""
        if self.passes_expected == 1:
            squares = self.squares
            if self.shards is not None and self.cuda:  # summed on the down stream
                torch.cuda.current_stream(self.device).wait_stream(self.down)
        else:
            self.host.drain()
            squares = torch.tensor(sum(unit.squares for unit in self.units), device=self.device)
        return (squares if self.shards is None else self.shards.total(squares)).sqrt()

    def gradients(self, unit: Unit, summed: bool) -> torch.Tensor:
        """(host thread) The unit's step gradients, float32 and flat; ``summed``: over micro-batches, in its float32
        sum."""
        if summed:
            return unit.summed
        if unit.landed is not None:
            unit.landed.synchronize()
        flat = self.host.scratch(unit.grad_numel)
        flat.copy_(unit.landing)
        return flat

