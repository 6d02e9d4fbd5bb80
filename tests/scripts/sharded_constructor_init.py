"""Under torchrun, CPU ranks (gloo): fla models sharded by FSDP2 on the meta device, materialized and initialized
through the DTensor path GPUs take (on CPUs flame initializes a full copy instead): every rank's shards hold the
constructor's values. Prints one line per model."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

import flame
from flame.models import constructor_init, load_model_config
from flame.models.builder import reinitialize
from flame.models.registry import decoder_layers, meta_model

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
flame.register()
for name, keys in (("rwkv7", ("model.layers.1.attn.x_r", "model.layers.1.attn.k_k", "model.layers.1.attn.g_norm.weight")),
                   ("hgrn2", ("model.lower_bounds",))):
    config = load_model_config(f"configs/tiny/{name}.json")
    reference = dict(AutoModelForCausalLM.from_config(config).named_parameters())
    model = meta_model(config)
    for block in decoder_layers(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    constructor_init.poison(model)
    torch.manual_seed(0)
    reinitialize(model)
    full = {key: parameter.full_tensor() for key, parameter in model.named_parameters()}
    left = [key for key, tensor in full.items() if tensor.isnan().any()]
    differ = [key for key in keys if not torch.equal(full[key], reference[key])]
    print(f"{name} rank {dist.get_rank()}: left {left} differ {differ}", flush=True)
    if left or differ:
        sys.exit(1)
dist.destroy_process_group()
