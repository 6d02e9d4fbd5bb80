"""Models built as flame builds them (on the meta device, materialized, then initialized) get every tensor their
constructor sets, as transformers' own build gives them (flame.models.constructor_init)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import flame
from flame.base.errors import ConfigError
from flame.models import constructor_init, load_model_config
from flame.models.builder import reinitialize
from flame.models.registry import meta_model
from tests.conftest import ROOT, SCRIPTS, torchrun

TINY_CONFIGS = sorted(path.stem for path in (ROOT / "configs" / "tiny").glob("*.json"))


def _built_as_flame_builds(name: str, seed: int = 0) -> torch.nn.Module:
    """Meta build, memory holding NaN where nothing writes (to_empty's memory is whatever was there), the init."""
    model = meta_model(load_model_config(str(ROOT / "configs" / "tiny" / f"{name}.json")))
    model.to_empty(device="cpu")
    constructor_init.poison(model)
    torch.manual_seed(seed)
    reinitialize(model)
    return model


@pytest.fixture(scope="module", autouse=True)
def registered():
    flame.register()


@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_every_tensor_of_every_tiny_model_is_initialized(name):
    # before the fix 14 of fla's types kept leftover memory in tensors their constructors alone set (rwkv7 53 of them)
    model = _built_as_flame_builds(name)
    left = [key for key, tensor in [*model.named_parameters(), *model.named_buffers()]
            if tensor.is_floating_point() and tensor.isnan().any()]
    assert not left


def test_rwkv7_gets_its_constructors_values_where_hf_init_would_have_given_its_own():
    reference = AutoModelForCausalLM.from_config(load_model_config(str(ROOT / "configs" / "tiny" / "rwkv7.json")))
    model = _built_as_flame_builds("rwkv7")
    ours, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
    # set by the constructor from the layer's index alone: the same numbers
    for key in ("model.layers.1.attn.x_r", "model.layers.1.attn.k_k", "model.layers.1.attn.w_lora.lora.2.bias",
                "model.layers.1.attn.g_norm.weight", "model.layers.0.attn.x_g"):
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0, msg=key)
    # orthogonal in the constructor, in a module it marks initialized: HF's normal init would not be orthogonal
    weight = ours["model.layers.1.attn.r_proj.weight"].float()
    torch.testing.assert_close(weight @ weight.T, torch.eye(weight.shape[0]), rtol=0, atol=1e-4)
    assert ours["model.layers.1.attn.o_proj.weight"].abs().max() == 0  # zeroed there


def test_a_tensor_outside_the_blocks_comes_from_its_module_built_without_them():
    reference = AutoModelForCausalLM.from_config(load_model_config(str(ROOT / "configs" / "tiny" / "hgrn2.json")))
    model = _built_as_flame_builds("hgrn2")
    torch.testing.assert_close(model.model.lower_bounds, reference.model.lower_bounds, rtol=0, atol=0)


def test_the_same_seed_gives_the_same_weights():
    first, second = _built_as_flame_builds("samba", seed=3), _built_as_flame_builds("samba", seed=3)
    for (key, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=key)


def test_a_tensor_no_build_can_give_stops_with_its_name():
    model = meta_model(load_model_config(str(ROOT / "configs" / "tiny" / "llama.json")))
    model.to_empty(device="cpu")
    reinitialize(model)
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))  # as if no init wrote it; a norm module cannot be built alone
    named = r"llama: 1 tensors \(model\.norm\.weight\) are initialized by the model.s constructor alone.*_init_weights"
    with pytest.raises(ConfigError, match=named):
        constructor_init.repeat_constructor_init(model)


def test_on_the_meta_device_fla_layers_skip_their_own_init(monkeypatch):
    # rwkv7's walks the hidden size element by element: 10 s a meta build of the 340M, for no values at all
    import fla.layers.rwkv7  # noqa: F401  (imported by the build below anyway)

    calls, constant = [], torch.nn.init.constant_

    def spy(tensor, *args, **kwargs):
        value = args[0] if args else kwargs.get("val")
        if value == 1.02:  # rwkv7's k_a, set in its layers' init
            calls.append(tensor.device.type)
        return constant(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.nn.init, "constant_", spy)
    meta_model(load_model_config(str(ROOT / "configs" / "tiny" / "rwkv7.json")))
    assert calls == []
    _built_as_flame_builds("rwkv7")
    assert calls and set(calls) == {"cpu"}  # built again for real, where the values are computed


def test_sharded_models_get_the_constructors_values_in_every_ranks_shards():
    # FSDP2's DTensors, initialized in place as on GPUs (on CPUs flame initializes a full copy and shards it)
    result = torchrun([], nproc=2, module=str(SCRIPTS / "sharded_constructor_init.py"), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    for name in ("rwkv7", "hgrn2"):
        for rank in (0, 1):
            assert f"{name} rank {rank}: left [] differ []" in result.stdout
