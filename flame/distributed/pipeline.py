"""Pipeline parallelism for any HF/fla causal LM: its decoder blocks split into stages.

Each pipeline rank keeps a copy of the model holding only its stages' modules: the first
stage the input embedding, the last the final norm and the lm_head, every stage its run of
decoder blocks. Blocks keep the names they have in the whole model (``model.layers.7`` stays
``model.layers.7``), so a checkpoint saved under one layout loads under any other, and the
HF export reassembles the whole model from it.

A stage runs the model's own forward: the first from token ids, the others from the hidden
states the previous stage sent (``inputs_embeds``); on all but the last stage the final norm
and lm_head are identities, so the "logits" a stage returns are its hidden states. What a
stage needs besides its activations (position ids, the labels for the last stage's fused
loss) reaches every stage as keyword inputs that torch's schedule splits into microbatches;
each stage derives the microbatch's documents from its position ids (they restart at every
attention segment) on the CPU, so nothing waits for the GPU.

With tensor parallelism, each stage is sharded by the model type's TP plan like a whole model
(flame.distributed.tensor_parallel); between stages every TP rank passes its sequence shard.

Stage inputs and outputs are declared up front (their shapes follow from the microbatch
size, seq_len and hidden size), because torch's shape inference would run the stage on meta
tensors, which neither document bookkeeping nor fla's Triton kernels can take. On CUDA, Triton's
autotuning waits for its own stream only, so that stages autotuning at once do not wait for each
other's receives (flame.compat.triton, applied at startup).
"""

import copy
import functools
import itertools
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    get_schedule_class,
)
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.pipeline_parallel import build_pipeline_schedule
from torchtitan.tools.logging import logger

from flame.base import batch_context, device
from flame.base.batch_context import BatchContext
from flame.models import moe
from flame.models.loss import LossHead
from flame.base.errors import ConfigError
from flame.models.inputs import document_kwargs, flattens_rows, segments_from_positions
from flame.models.registry import decoder_layers


class StageLayers(nn.ModuleList):
    """One stage's decoder blocks, each under its index in the whole model."""

    def __init__(self, blocks: dict[int, nn.Module]):
        super().__init__()
        for index, block in blocks.items():
            self.add_module(str(index), block)

    def _name(self, position: int) -> str:
        return list(self._modules)[position]

    def __getitem__(self, position):
        if isinstance(position, slice):  # e.g. HF's `self.layers[: config.num_hidden_layers]`
            return nn.ModuleList(list(self._modules.values())[position])
        return self._modules[self._name(position)]

    def __setitem__(self, position: int, block: nn.Module) -> None:
        setattr(self, self._name(position), block)


@dataclass(frozen=True)
class StageSpec:
    index: int
    count: int
    layers: tuple[int, ...]

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def stage_layers(num_layers: int, num_stages: int, job_config) -> list[tuple[int, ...]]:
    """The decoder blocks of each stage: explicit split points, or a balanced split.

    The balanced split counts the embedding and the lm_head as
    ``pipeline_parallel_{first,last}_stage_less_layers`` blocks each.
    """
    parallelism = job_config.parallelism
    points = [p for p in parallelism.pipeline_parallel_split_points.split(",") if p.strip()]
    if points:
        try:
            starts = [int(p) for p in points]
        except ValueError:
            raise ConfigError(
                f"--parallelism.pipeline_parallel_split_points {parallelism.pipeline_parallel_split_points!r}: "
                "give the index of the first decoder block of every stage after the first, e.g. 4,8,12"
            ) from None
        if len(starts) != num_stages - 1 or starts != sorted(set(starts)) or starts[0] < 1 or starts[-1] >= num_layers:
            raise ConfigError(
                f"--parallelism.pipeline_parallel_split_points {','.join(map(str, starts))}: {num_stages} stages need "
                f"{num_stages - 1} increasing block indices between 1 and {num_layers - 1} (the model has {num_layers} blocks)"
            )
        bounds = [0, *starts, num_layers]
        return [tuple(range(a, b)) for a, b in itertools.pairwise(bounds)]
    first, last = parallelism.pipeline_parallel_first_stage_less_layers, parallelism.pipeline_parallel_last_stage_less_layers
    units = num_layers + first + last
    bounds = [round(s * units / num_stages) for s in range(num_stages + 1)]
    stages = [tuple(i for i in range(num_layers) if bounds[s] <= first + i < bounds[s + 1]) for s in range(num_stages)]
    if any(not layers for layers in stages):
        raise ConfigError(
            f"--parallelism.pipeline_parallel_degree: {num_stages} pipeline stages for {num_layers} decoder blocks leave a "
            "stage without blocks; use fewer stages (degree, or a single-stage schedule such as 1F1B) or set "
            "--parallelism.pipeline_parallel_split_points"
        )
    return stages


# schedules that place a rank's two stages as a V (r and 2 * degree - 1 - r)
V_SCHEDULES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def stages_per_rank(job_config) -> int:
    schedule = get_schedule_class(job_config.parallelism.pipeline_parallel_schedule)
    return 1 if issubclass(schedule, PipelineScheduleSingle) else 2


def check_pipeline_parallel(config, job_config) -> None:
    """Refuse a pipeline layout this model cannot take, before any process group exists."""
    parallelism = job_config.parallelism
    pp = parallelism.pipeline_parallel_degree
    if pp <= 1:
        return
    if moe.is_moe(config):
        raise ConfigError(f"--parallelism.pipeline_parallel_degree {pp}: {config.model_type} is a mixture of experts, "
                          "whose load-balancing loss sums the routers of every layer, which pipeline stages hold apart; "
                          "train it with FSDP (and expert parallelism) instead")
    schedule = parallelism.pipeline_parallel_schedule
    try:
        per_rank = stages_per_rank(job_config)
    except ValueError as error:
        raise ConfigError(f"--parallelism.pipeline_parallel_schedule: {error}") from None
    if get_schedule_class(schedule).__name__ in V_SCHEDULES:
        raise ConfigError(
            f"--parallelism.pipeline_parallel_schedule {schedule}: flame places stages in loops (rank r holds stages "
            "r, r + degree, ...), not in the V this schedule needs; use 1F1B, GPipe, Interleaved1F1B, LoopedBFS or "
            "InterleavedZeroBubble"
        )
    num_layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    if num_layers is None:
        raise ConfigError(f"--parallelism.pipeline_parallel_degree: {config.model_type} has no num_hidden_layers to split")
    stage_layers(num_layers, pp * per_rank, job_config)
    if getattr(config, "tie_word_embeddings", False):
        raise ConfigError(
            f"--parallelism.pipeline_parallel_degree {pp}: {config.model_type} ties its lm_head to the input embedding, "
            "which live on different pipeline stages; set tie_word_embeddings to false in the model config"
        )
    if parallelism.context_parallel_degree > 1:
        raise ConfigError(
            "--parallelism.pipeline_parallel_degree combines with FSDP/HSDP and TP in flame, not with context "
            "parallelism; set context_parallel_degree to 1"
        )
    microbatch = parallelism.pipeline_parallel_microbatch_size
    if job_config.training.local_batch_size % microbatch:
        raise ConfigError(
            f"--training.batch_size {job_config.training.local_batch_size} is not a multiple of "
            f"--parallelism.pipeline_parallel_microbatch_size {microbatch}"
        )


def _parent(model: nn.Module, module: nn.Module) -> tuple[nn.Module, str]:
    for name, candidate in model.named_modules():
        if candidate is module:
            parent_name, _, attribute = name.rpartition(".")
            return model.get_submodule(parent_name), attribute
    raise ValueError(f"{type(module).__name__} is not part of the model")


def _prune(model: nn.Module, spec: StageSpec) -> nn.Module:
    """``model`` (a copy) reduced to the modules of stage ``spec``."""
    layers = decoder_layers(model)
    trunk, layers_name = _parent(model, layers)
    embeddings = model.get_input_embeddings()
    # the final norm: what the trunk holds besides the blocks and the embedding (rotary tables hold no parameters)
    finals = [
        name for name, child in trunk.named_children()
        if child is not layers and child is not embeddings and any(True for _ in child.parameters())
    ]
    setattr(trunk, layers_name, StageLayers({i: layers[i] for i in spec.layers}))
    if not spec.first:
        parent, name = _parent(model, embeddings)
        setattr(parent, name, None)
    if not spec.last:
        for name in finals:
            setattr(trunk, name, nn.Identity())
        parent, name = _parent(model, model.get_output_embeddings())
        setattr(parent, name, nn.Identity())
    return model


class PipelineStageModel:
    """Mixin: the forward of one pipeline stage (see the module docstring)."""

    stage: StageSpec  # which stage this model is: set when it is made one (pipeline_model)
    holds_part_of_model = True  # its weights are initialized as part of the whole model's (flame.models.builder)

    def forward(self, activations: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # the schedule passes the position ids on the CPU, so finding the documents needs no sync; under
        # PP x FSDP, FSDP's root has already copied them to the GPU (a copy that waits for the stream)
        cu_seqlens, longest = segments_from_positions(position_ids.cpu())
        batch = {"position_ids": position_ids.to(self.device), "cu_seqlens": cu_seqlens.to(self.device), "max_seqlen": longest}
        kwargs = document_kwargs(self, batch)
        flatten = flattens_rows(self)
        fused_loss = self.stage.last and isinstance(self.get_output_embeddings(), LossHead)
        # this microbatch's documents and targets, inside the step's context (its loss normalization)
        microbatch = (batch_context.current() or BatchContext()).replace(
            cu_seqlens=batch["cu_seqlens"],
            cu_seqlens_host=cu_seqlens.tolist(),
            max_seqlen=longest,
            targets=(labels.reshape(1, -1) if flatten else labels) if fused_loss else None,
        )
        with batch_context.computing(microbatch):
            if self.stage.first:
                output = super().forward(activations.reshape(1, -1) if flatten else activations, **kwargs)
            else:
                output = super().forward(inputs_embeds=activations, **kwargs)
        return output.logits


@functools.cache
def _stage_class(model_class: type) -> type:
    return type(model_class.__name__, (PipelineStageModel, model_class), {"__module__": model_class.__module__})


def _stage_metadata(model: nn.Module, spec: StageSpec, job_config, parallel_dims: ParallelDims, fused_loss: bool):
    """Example (meta) tensors of a stage's input and output for one microbatch."""
    microbatch, seq_len = job_config.parallelism.pipeline_parallel_microbatch_size, job_config.training.seq_len
    tokens = (1, microbatch * seq_len) if flattens_rows(model) else (microbatch, seq_len)
    # FSDP casts parameters to the compute dtype; without it a pipeline stage computes in fp32 (torchtitan)
    dtype = device.compute_dtype(job_config) if parallel_dims.fsdp_enabled else torch.float32
    # under TP, stages pass sequence shards: each TP rank sends and receives its part of every row
    shard = (*tokens[:-1], tokens[-1] // parallel_dims.tp)
    # requires_grad: the gradient of a received activation is sent back to the stage before
    hidden = torch.empty(*shard, model.config.hidden_size, dtype=dtype, device="meta", requires_grad=True)
    inputs = torch.empty(*tokens, dtype=torch.long, device="meta") if spec.first else hidden
    if not spec.last:
        return inputs, hidden
    if fused_loss:
        return inputs, torch.empty((), dtype=torch.float32, device="meta", requires_grad=True)
    vocab = model.get_output_embeddings().out_features
    return inputs, torch.empty(*tokens, vocab, dtype=dtype, device="meta", requires_grad=True)


class TokenNormalizedLoss:
    """The schedule's loss: each microbatch's summed loss over the step's global target count.

    The count comes from the step's context (flame.base.batch_context), which the trainer makes
    around the schedule's step.
    """

    def __init__(self, loss_fn):
        self.loss_fn = loss_fn

    def __call__(self, output, labels):
        return self.loss_fn(output, labels) / batch_context.current().global_valid_tokens


def pipeline_model(model, parallel_dims: ParallelDims, job_config, device_, model_args, parallelize_fn, loss_fn):
    """torchtitan TrainSpec ``pipelining_fn``: (schedule, this rank's model parts, has first stage, has last stage)."""
    mesh = parallel_dims.get_mesh("pp")
    pp, rank = mesh.size(), mesh.get_local_rank()
    per_rank = stages_per_rank(job_config)
    count = pp * per_rank
    layers = stage_layers(len(decoder_layers(model)), count, job_config)
    # looped schedules give rank r the stages r, r + pp, ...
    specs = [StageSpec(index, count, layers[index]) for index in range(rank, count, pp)]
    fused_loss = isinstance(model.get_output_embeddings(), LossHead)
    stages, parts = [], []
    for spec in specs:
        part = _prune(copy.deepcopy(model), spec)
        part.__class__ = _stage_class(type(part))  # the stage's forward, on the same modules and names
        part.stage = spec
        inputs, outputs = _stage_metadata(part, spec, job_config, parallel_dims, fused_loss)
        part = parallelize_fn(part, parallel_dims, job_config)
        stages.append(
            PipelineStage(part, spec.index, count, device_, input_args=inputs, output_args=outputs, group=mesh.get_group())
        )
        parts.append(part)
        logger.info(f"Pipeline stage {spec.index} of {count}: decoder blocks {spec.layers[0]}-{spec.layers[-1]}")
    schedule = build_pipeline_schedule(job_config, stages, TokenNormalizedLoss(loss_fn))
    return schedule, parts, any(s.first for s in specs), any(s.last for s in specs)
