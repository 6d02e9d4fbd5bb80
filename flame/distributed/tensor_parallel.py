"""Tensor parallelism with sequence parallelism: the plans in PLANS below, named by the model types' records.

How a model runs on a TP mesh of ``tp`` ranks (Megatron's layout):

- Between sub-layers the activations are sequence shards: every rank holds ``L / tp`` tokens
  of each row (dim 1). Norms run on those tokens; their weights are replicated.
- A *sharded sub-layer* (attention / token mixer / MLP) all-gathers its input over the
  sequence, computes with its part of the heads (column shards of the q/k/v/gate projections,
  head shards of per-head parameters, channel shards of short convolutions), and its output
  projection (a row shard) gives a partial sum that is reduce-scattered back to sequence
  shards. Attention and recurrences therefore always see whole rows (and the batch's
  ``cu_seqlens``); the rotary tables HF models compute once from the full ``position_ids``
  match the gathered rows.
- Parameters are DTensors; modules compute on their local shards, with the size attributes the
  plan names (``num_heads``, ...) holding local values while they run (flame.distributed.tp_local).
  Replicated parameters get their gradients summed over the ranks (each rank's gradient covers
  its own tokens or heads); a bias added after a row-sharded projection is added by the first
  rank only (``ONCE``), so the reduce-scatter sums it once.
- Embedding: vocabulary rows sharded, output reduce-scattered to sequence shards. lm_head:
  vocabulary rows sharded; its logits stay sharded over the vocabulary for torch's
  ``loss_parallel`` (gathered with --parallelism.disable_loss_parallel); a fused LossHead
  computes a vocabulary-parallel chunked cross entropy (flame.models.loss).

Adding a model type: write its ``Plan`` (where the decoder blocks and the final norm are, and
for each module of a block how it runs, as a ``Local``), add it to PLANS, and name it in the
type's record (``tensor_parallel_plan`` in flame/models/support.py). ``plan_layout``
refuses a plan that misses a parameter or names a module the model lacks, and a degree that
does not divide a sharded size; tests/distributed/test_tensor_parallel.py checks every plan on a tiny config.
"""

import fnmatch
import functools
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import parallelize_module
from torchtitan.tools.logging import logger
from transformers import PretrainedConfig

from flame import compat
from flame.distributed.tp_local import (
    COLUMNS,
    NORM,
    ONCE,
    REPLICATED,
    ROWS,
    EmbeddingParallel,
    HeadParallel,
    Layout,
    Local,
    LocalRun,
    Pieces,
    heads_to_sequence,
    maybe_enable_async_tp,
    submodule,
)
from flame.base.errors import ConfigError
from flame.models.registry import meta_model
from flame.models.support import model_types_where, support_for


@dataclass(frozen=True)
class Plan:
    layers: str  # the ModuleList of decoder blocks
    norm: str  # the final norm
    block: dict[str, Local]  # module path within a block -> how it runs
    heads: Callable[[PretrainedConfig], dict[str, int]]  # head/group counts the TP degree must divide
    refuse: Callable[[PretrainedConfig], str | None] = lambda config: None  # a setting the plan cannot shard
    install: Callable[[DeviceMesh], None] | None = None  # process-wide setup the plan needs (gsa)


def _linear(*names: str) -> dict[str, Layout]:
    return {f"{name}.*": COLUMNS for name in names}


CONV_SIZES = ("hidden_size", "in_channels", "out_channels", "groups")  # fla's ShortConvolution

# HF decoders (transformers 5): attention reshapes q/k/v with -1 heads and keeps the head
# counts in the shared config, which the model reads for rotary/masks (not per rank); the
# q/kv group ratio (num_key_value_groups) is the same on every rank.
_HF_ATTENTION = Local(params={**_linear("q_proj", "k_proj", "v_proj"), "o_proj.weight": ROWS, "o_proj.bias": ONCE,
                              "q_norm.weight": REPLICATED, "k_norm.weight": REPLICATED})
_HF_MLP = Local(params={**_linear("gate_proj", "up_proj"), "down_proj.weight": ROWS, "down_proj.bias": ONCE},
                sizes={"": ("intermediate_size",)})
_HF_DECODER = {"input_layernorm": NORM, "self_attn": _HF_ATTENTION, "post_attention_layernorm": NORM, "mlp": _HF_MLP}


def _hf_heads(config) -> dict[str, int]:
    return {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads}


_HF_PLAN = Plan(layers="model.layers", norm="model.norm", block=_HF_DECODER, heads=_hf_heads)


# custom_models/example_lm: qkv_proj is laid out head by head ([q k v] of head 0, then head 1, ...),
# so a column shard holds whole heads
_EXAMPLE_LM = Plan(
    layers="model.layers",
    norm="model.norm",
    block={
        "attn_norm": NORM,
        "attn": Local(params={"qkv_proj.weight": COLUMNS, "o_proj.weight": ROWS}, sizes={"": ("num_heads",)}),
        "mlp_norm": NORM,
        "mlp": Local(params={**_linear("gate_proj", "up_proj"), "down_proj.weight": ROWS}),
    },
    heads=lambda config: {"num_attention_heads": config.num_attention_heads},
)


# fla: blocks of attn_norm / attn / mlp_norm / mlp (GatedMLP: its fused swiglu_linear reads
# down_proj.weight directly, which is why modules run on local tensors rather than on hooks of
# each Linear)
_FLA_MLP = Local(params={**_linear("gate_proj", "up_proj"), "down_proj.weight": ROWS, "down_proj.bias": ONCE},
                 sizes={"": ("intermediate_size",)})
_SHORT_CONVS = {f"{name}_conv1d.*": COLUMNS for name in "qkv"}
_CONV_SIZES = {f"{name}_conv1d": CONV_SIZES for name in "qkv"}


def _fla_plan(attn: Local, heads: Callable[[PretrainedConfig], dict[str, int]], install=None) -> Plan:
    block = {"attn_norm": NORM, "attn": attn, "mlp_norm": NORM, "mlp": _FLA_MLP}
    return Plan(layers="model.layers", norm="model.norm", block=block, heads=heads, install=install)


def _heads(*names: str) -> Callable[[PretrainedConfig], dict[str, int]]:
    return lambda config: {name: getattr(config, name) for name in names if getattr(config, name, None)}


_TRANSFORMER = Local(
    params={**_linear("q_proj", "k_proj", "v_proj"), "o_proj.weight": ROWS,
            "q_norm.weight": REPLICATED, "k_norm.weight": REPLICATED},
    sizes={"": ("num_heads", "num_kv_heads", "kv_dim")},
)
_GLA = Local(
    params={**_linear("q_proj", "k_proj", "v_proj", "g_proj", "gk_proj.1"), **_SHORT_CONVS,
            "gk_proj.0.weight": REPLICATED,  # low-rank input projection, applied to every token on every rank
            "o_proj.weight": ROWS, "g_norm*.weight": REPLICATED, "g_norm*.bias": REPLICATED},
    sizes={"": ("num_heads", "num_kv_heads", "key_dim", "value_dim", "key_dim_per_group", "value_dim_per_group"),
           **_CONV_SIZES},
)
_DELTA_NET = Local(
    params={**_linear("q_proj", "k_proj", "v_proj", "b_proj", "g_proj"), **_SHORT_CONVS,
            "o_proj.weight": ROWS, "o_norm.weight": REPLICATED, "o_norm.bias": REPLICATED},
    sizes={"": ("num_heads", "key_dim", "value_dim"), **_CONV_SIZES},
)
_GATED_DELTANET = Local(
    params={**_linear("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj"), **_SHORT_CONVS,
            "A_log": COLUMNS, "dt_bias": COLUMNS, "o_proj.weight": ROWS,
            "o_norm.weight": REPLICATED, "o_norm.bias": REPLICATED},
    sizes={"": ("num_heads", "num_v_heads", "key_dim", "value_dim"), **_CONV_SIZES},
)
# GSA normalizes its output over all heads at once (g_norm spans value_dim) in a kernel fused
# with o_proj: flame moves the output from head shards to sequence shards (one all-to-all)
# before that kernel, so g_norm and o_proj are replicated and run on this rank's tokens.
_GSA = Local(
    params={**_linear("q_proj", "k_proj", "v_proj", "f_proj"), **_SHORT_CONVS, "feature_map.*": REPLICATED,
            "g_norm.*": REPLICATED, "o_proj.*": REPLICATED},
    sizes={"": ("num_heads", "num_kv_heads", "key_dim", "value_dim", "key_dim_per_group", "value_dim_per_group"),
           **_CONV_SIZES},
    output="sequence",
)


def _install_gsa(mesh: DeviceMesh) -> None:
    compat.fla.gsa_norm_gathers_heads(functools.partial(heads_to_sequence, mesh=mesh))


def _mamba2_in_proj(mixer, tp: int, rank: int) -> list[tuple[int, int]]:
    # rows z | x | B | C | dt: this rank's heads of z, x and dt, and all of B and C
    inner, groups, heads = mixer.intermediate_size, mixer.n_groups * mixer.ssm_state_size, mixer.num_heads
    i, h = inner // tp, heads // tp
    return [(rank * i, (rank + 1) * i), (inner + rank * i, inner + (rank + 1) * i), (2 * inner, 2 * inner + 2 * groups),
            (2 * inner + 2 * groups + rank * h, 2 * inner + 2 * groups + (rank + 1) * h)]


def _mamba2_conv(mixer, tp: int, rank: int) -> list[tuple[int, int]]:
    # channels x | B | C: this rank's heads of x, and all of B and C
    inner, i = mixer.intermediate_size, mixer.intermediate_size // tp
    return [(rank * i, (rank + 1) * i), (inner, mixer.conv_dim)]


def _mamba2_sizes(mixer, tp: int) -> dict[str, int]:
    channels = mixer.intermediate_size // tp + 2 * mixer.n_groups * mixer.ssm_state_size
    return {"conv_dim": channels, **{f"conv1d.{attr}": channels for attr in ("in_channels", "out_channels", "groups")}}


def _mamba2_refusal(config) -> str | None:
    if not config.rmsnorm:
        return "rmsnorm false: flame's plan moves the output to sequence shards at the gated norm; set rmsnorm to true"
    return None


# Mamba2 (flame's forward, flame.models.kernels.mamba2, whatever is installed): x, z, dt and the scan split
# by heads; B and C (n_groups groups shared by heads h, h + n_groups, ...) computed whole on
# every rank, so each rank's heads (a multiple of n_groups) meet their groups. The gated norm
# spans the heads of a group, so the scan output moves to sequence shards first (all-to-all) and
# the norm and out_proj run replicated on this rank's tokens. n_groups stays global.
_MAMBA2 = Plan(
    layers="backbone.layers",
    norm="backbone.norm_f",
    block={
        "norm": NORM,
        "mixer": Local(
            params={"in_proj.*": Pieces(_mamba2_in_proj), "conv1d.*": Pieces(_mamba2_conv), "dt_bias": COLUMNS,
                    "A_log": COLUMNS, "D": COLUMNS, "norm.weight": REPLICATED, "out_proj.*": REPLICATED},
            sizes={"": ("num_heads", "intermediate_size")},
            local_sizes=_mamba2_sizes,
            output="sequence",
            to_sequence=("norm",),
        ),
    },
    heads=lambda config: {"num_heads": config.num_heads, "num_heads / n_groups": config.num_heads // config.n_groups},
    refuse=_mamba2_refusal,
)

# plan name (a record's tensor_parallel_plan, flame.models.support) -> plan
PLANS: dict[str, Plan] = {
    "hf_decoder": _HF_PLAN,
    "example_lm": _EXAMPLE_LM,
    "fla_transformer": _fla_plan(_TRANSFORMER, _heads("num_heads", "num_kv_heads")),
    "gla": _fla_plan(_GLA, _heads("num_heads", "num_kv_heads")),
    "gsa": _fla_plan(_GSA, _heads("num_heads", "num_kv_heads"), install=_install_gsa),
    "delta_net": _fla_plan(_DELTA_NET, _heads("num_heads")),
    "gated_deltanet": _fla_plan(_GATED_DELTANET, _heads("num_heads", "num_v_heads")),
    "mamba2": _MAMBA2,
}


def plan_for(model_type: str) -> Plan:
    """The plan that ``model_type``'s record names."""
    name = support_for(model_type).tensor_parallel_plan
    if name is None:
        raise ConfigError(
            f"--parallelism.tensor_parallel_degree: no tensor-parallel plan for model_type '{model_type}'; plans exist "
            f"for {', '.join(model_types_where(lambda support: support.tensor_parallel_plan))}. Add one to PLANS in "
            "flame/distributed/tensor_parallel.py and name it in the type's record (flame/models/support.py), "
            "or use FSDP alone"
        )
    return PLANS[name]


def plan_layout(model: nn.Module, plan: Plan, tp: int) -> dict[str, tuple[Local, dict[str, Layout]]]:
    """module path -> (how it runs, its parameters' layouts), for ``model`` not yet parallelized.

    ConfigError unless every parameter outside the embedding and lm_head is placed by the
    module that owns it, every module the plan names exists in every block, and ``tp`` divides
    every sharded dimension and size attribute (and gives every rank as many pieces).
    """
    problems: list[str] = []
    entries = {plan.norm: (NORM, {})}
    # blocks by name: a pipeline stage holds some of them, under their whole-model indices
    for index, block in model.get_submodule(plan.layers).named_children():
        for path, local in plan.block.items():
            entry_path, module = f"{plan.layers}.{index}.{path}", submodule(block, path)
            if module is None:
                problems.append(f"{entry_path} does not exist")
                continue
            entries[entry_path] = (local, {})
            problems += [f"{entry_path}.{p} does not exist" for p in local.to_sequence if submodule(module, p) is None]
            for attr_path, attrs in local.sizes.items():
                owner = submodule(module, attr_path)
                for attr in attrs if owner is not None else ():
                    value = getattr(owner, attr, None)
                    if not isinstance(value, int) or value % tp:
                        problems.append(f"{entry_path}{'.' + attr_path if attr_path else ''}.{attr} = {value}")
    vocabulary = {id(model.get_input_embeddings()), id(model.get_output_embeddings())}
    for name, param in model.named_parameters():
        module_path = name.rpartition(".")[0]
        if id(model.get_submodule(module_path)) in vocabulary:
            if param.shape[0] % tp:
                problems.append(f"{name} has {param.shape[0]} vocabulary rows")
            continue
        owner = next((path for path in entries if module_path == path or module_path.startswith(path + ".")), None)
        relative = name[len(owner) + 1 :] if owner else name
        local, layouts = entries.get(owner, (Local(params={}), {}))
        layout = next((layout for pattern, layout in local.params.items() if fnmatch.fnmatchcase(relative, pattern)), None)
        if layout is None:
            problems.append(f"{name} is not placed by the plan")
            continue
        layouts[relative] = layout
        if isinstance(layout, Shard) and param.shape[layout.dim] % tp:
            problems.append(f"{name} dim {layout.dim} = {param.shape[layout.dim]}")
        if isinstance(layout, Pieces):
            ranges = [layout.ranges(model.get_submodule(owner), tp, rank) for rank in range(tp)]
            inside = all(0 <= start < stop <= param.shape[0] for pieces in ranges for start, stop in pieces)
            if not inside or len({sum(stop - start for start, stop in pieces) for pieces in ranges}) != 1:
                problems.append(f"{name}: its pieces do not give every rank as many of its {param.shape[0]} rows")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(
            f"--parallelism.tensor_parallel_degree {tp} cannot shard this {model.config.model_type}: {problems[0]}{more}; "
            "choose a degree that divides the model's heads and sizes (or fix its plan in flame/distributed/tensor_parallel.py)"
        )
    return entries


def check_tensor_parallel(config: PretrainedConfig, job_config, meta: Callable[[], nn.Module] | None = None) -> None:
    """Refuse a tensor-parallel layout this model cannot take, before any process group exists.

    ``meta``: the model on the meta device, built once by the caller for all its checks (default: built here).
    """
    parallelism = job_config.parallelism
    tp = parallelism.tensor_parallel_degree
    if parallelism.enable_async_tensor_parallel:
        if tp <= 1:
            raise ConfigError("--parallelism.enable_async_tensor_parallel needs --parallelism.tensor_parallel_degree > 1")
        if not (job_config.compile.enable and "model" in job_config.compile.components):
            raise ConfigError(
                "--parallelism.enable_async_tensor_parallel overlaps TP communication in compiled blocks: "
                "add --training.compile (with 'model' in --compile.components)"
            )
        support = support_for(config)
        if support.stays_eager:
            raise ConfigError(
                f"--parallelism.enable_async_tensor_parallel overlaps TP communication in compiled blocks, and "
                f"{support.name}'s stay eager under --training.compile ({support.stays_eager}); leave it off"
            )
    if tp <= 1:
        return
    plan = plan_for(config.model_type)
    refusal = plan.refuse(config)
    if refusal:
        raise ConfigError(f"--parallelism.tensor_parallel_degree {tp} with {config.model_type}: {refusal}")
    if getattr(config, "attnres_block_size", None) is not None:
        raise ConfigError(
            f"--parallelism.tensor_parallel_degree {tp}: {config.model_type}'s attention residuals (attnres_block_size) "
            "mix weights across modules, which the plan does not shard; set attnres_block_size to null"
        )
    for name, count in plan.heads(config).items():
        if count % tp:
            raise ConfigError(
                f"--parallelism.tensor_parallel_degree {tp} does not divide {config.model_type}'s {name} ({count}): "
                f"choose a degree that divides it"
            )
    seq_len = job_config.training.seq_len
    if seq_len % tp:
        raise ConfigError(
            f"--training.seq_len {seq_len} is not divisible by --parallelism.tensor_parallel_degree {tp} "
            "(sequence parallelism splits every row's tokens over the TP ranks)"
        )
    plan_layout(meta() if meta is not None else meta_model(config), plan, tp)


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, job_config) -> None:
    """Shard ``model`` (on the meta device, before AC, compile and FSDP) over the 1-D TP ``mesh``."""
    plan = plan_for(model.config.model_type)
    entries = plan_layout(model, plan, mesh.size())
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    names = {id(module): name for name, module in model.named_modules()}
    loss_parallel = not job_config.parallelism.disable_loss_parallel
    # a pipeline stage may hold neither (no embedding after the first stage, an identity head before the last)
    styles = {names[id(embedding)]: EmbeddingParallel()} if isinstance(embedding, nn.Embedding) else {}
    if isinstance(head, nn.Linear):
        styles[names[id(head)]] = HeadParallel(loss_parallel)
    tied = isinstance(embedding, nn.Embedding) and isinstance(head, nn.Linear) and head.weight is embedding.weight
    parallelize_module(model, mesh, styles)
    if tied:
        head.weight = embedding.weight  # both are vocabulary-row shards
    for path, (local, layouts) in entries.items():
        LocalRun(model.get_submodule(path), local, layouts, mesh)
    if plan.install is not None:
        plan.install(mesh)
    maybe_enable_async_tp(job_config, mesh)
    logger.info(
        f"Applied tensor parallelism over {mesh.size()} ranks with sequence parallelism to "
        f"{len(model.get_submodule(plan.layers))} blocks ({'loss parallel' if loss_parallel else 'logits gathered'})"
    )
