"""Parameter groups (flame.optim.groups): every parameter's kind, no decay on embeddings, norms and biases by default,
lr multiples that the schedule scales, name patterns, the optimizers that take them, and one-line refusals."""

import json
from types import SimpleNamespace

import pytest
import torch

from flame.base.errors import ConfigError
from flame.models import load_model_config
from flame.models.registry import meta_model
from flame.optim import groups
from flame.optim.builder import build_lr_schedulers, build_optimizers
from tests.conftest import TINY_DECODER


def section(name: str = "AdamW", param_groups: str = "", decay_everything: bool = False, on_host: bool = False,
            **more) -> SimpleNamespace:
    return SimpleNamespace(name=name, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                           implementation="for-loop", on_host=on_host, gpu_blocks=0, param_groups=param_groups,
                           decay_everything=decay_everything, muon_lr=None, muon_momentum=0.95, muon_weight_decay=None,
                           muon_nesterov=True, muon_ns_steps=5, muon_adjust_lr="match_rms_adamw", **more)


def model_of(tmp_path, config: dict) -> torch.nn.Module:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return meta_model(load_model_config(str(path)))


def test_every_parameter_of_a_llama_has_its_kind(tmp_path):
    model = model_of(tmp_path, {"model_type": "qwen2", **TINY_DECODER, "vocab_size": 4096,
                                "max_position_embeddings": 512, "tie_word_embeddings": False})
    kinds = {name: kind for name, (_, kind) in groups.kinds_of(model).items()}
    assert set(kinds) == {name for name, _ in model.named_parameters()}
    assert kinds["model.embed_tokens.weight"] == "embeddings" and kinds["lm_head.weight"] == "head"
    assert kinds["model.norm.weight"] == kinds["model.layers.0.input_layernorm.weight"] == "norms"
    assert kinds["model.layers.1.self_attn.q_proj.bias"] == "biases"  # qwen2's q/k/v biases
    hidden = {name for name, kind in kinds.items() if kind == "hidden"}
    assert hidden == {f"model.layers.{i}.{block}.{proj}_proj.weight" for i in range(2)
                      for block, projs in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down"))) for proj in projs}


def test_every_parameter_of_a_gla_has_its_kind(tmp_path):
    model = model_of(tmp_path, {"model_type": "gla", "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2,
                                "vocab_size": 4096, "tie_word_embeddings": True})
    kinds = {name: kind for name, (_, kind) in groups.kinds_of(model).items()}
    assert set(kinds) == {name for name, _ in model.named_parameters()}
    assert kinds["model.embeddings.weight"] == "embeddings" and "lm_head.weight" not in kinds  # tied: one tensor
    norms = {name for name, kind in kinds.items() if kind == "norms"}
    assert "model.norm.weight" in norms and any(".attn.g_norm" in name for name in norms), sorted(norms)
    assert {kind for kind in kinds.values()} <= {"embeddings", "norms", "hidden", "biases"}
    assert any(".attn.q_proj.weight" in name and kind == "hidden" for name, kind in kinds.items())


def test_a_parameter_the_model_marks_is_exempt_from_decay():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model.register_parameter("A_log", torch.nn.Parameter(torch.zeros(4)))
    model.A_log._no_weight_decay = True
    decays = {group.label: group.weight_decay for group in groups.groups_of(model, section())}
    assert decays == {"hidden": 0.1, "biases": 0.0, "exempt": 0.0}


def tiny(tmp_path) -> torch.nn.Module:
    model = model_of(tmp_path, {"model_type": "llama", **TINY_DECODER, "vocab_size": 256,
                                "max_position_embeddings": 64, "tie_word_embeddings": False})
    return model.to_empty(device="cpu").apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)


@pytest.mark.parametrize("name", ["AdamW", "Muon"])
def test_with_zero_gradients_only_the_decayed_parameters_shrink(tmp_path, name):
    model = tiny(tmp_path)
    for p in model.parameters():
        torch.nn.init.normal_(p)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizers = build_optimizers([model], section(name), None)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizers.step()
    kinds = {n: kind for n, (_, kind) in groups.kinds_of(model).items()}
    for n, p in model.named_parameters():
        if kinds[n] in ("embeddings", "norms"):
            assert torch.equal(p, before[n]), n
        elif kinds[n] in ("head", "hidden"):
            assert torch.allclose(p, before[n] * (1 - 1e-2 * 0.1)), n  # decoupled decay: lr x weight_decay
    everything = tiny(tmp_path)
    for p in everything.parameters():
        torch.nn.init.normal_(p)
        p.grad = torch.zeros_like(p)
    embedding = everything.model.embed_tokens.weight.detach().clone()
    build_optimizers([everything], section(name, decay_everything=True), None).step()
    assert torch.allclose(everything.model.embed_tokens.weight, embedding * (1 - 1e-2 * 0.1))


def test_lr_multiples_follow_the_schedule_and_patterns_win_in_order(tmp_path):
    model = tiny(tmp_path)
    o = section(param_groups="embeddings: lr=0.5; head: lr=2, weight_decay=0; re:.*\\.mlp\\..*: lr=3; "
                             "re:.*\\.mlp\\.down_proj\\..*: weight_decay=0.5")
    optimizers = build_optimizers([model], o, None)
    schedule = SimpleNamespace(warmup_steps=4, total_steps=None, decay_ratio=None, decay_type="linear", min_lr_factor=0.0)
    schedulers = build_lr_schedulers(optimizers, schedule, 10)
    for _ in range(2):
        optimizers.step()
        schedulers.step()
    factor = schedulers.schedulers[0].lr_lambdas[0](2)
    found = {}
    for group in optimizers.optimizers[0].param_groups:
        names = {n for n, p in model.named_parameters() if any(p is q for q in group["params"])}
        for n in names:
            found[n] = (group["lr"] / (1e-2 * factor), group["weight_decay"])
    assert found["model.embed_tokens.weight"] == (pytest.approx(0.5), 0.0)
    assert found["lm_head.weight"] == (pytest.approx(2), 0.0)
    assert found["model.layers.0.mlp.up_proj.weight"] == (pytest.approx(3), 0.1)
    assert found["model.layers.0.mlp.down_proj.weight"] == (pytest.approx(3), 0.5)  # both patterns: the later's decay
    assert found["model.layers.0.self_attn.q_proj.weight"] == (pytest.approx(1), 0.1)
    assert optimizers.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2 * factor)  # the logged lr: a x1 group


def test_the_host_optimizer_takes_the_groups(tmp_path):
    model = tiny(tmp_path)
    optimizers = build_optimizers([model], section(on_host=True, param_groups="embeddings: lr=0.5"), None)
    settings = {(g["lr"], g["weight_decay"]) for g in optimizers.optimizers[0].param_groups}
    assert (5e-3, 0.0) in settings and (1e-2, 0.1) in settings and (1e-2, 0.0) in settings  # embeddings, hidden, norms


@pytest.mark.parametrize("spec, message", [
    ("embeddings lr=0.5", "write <kind or re:pattern>: lr=<multiple>"),
    ("embedings: lr=0.5", "selects 'embedings': a kind (embeddings, head"),
    ("head: lr=0", "lr must be a finite number above 0"),
    ("head: momentum=0.5", "'momentum=0.5' is not lr=<multiple> or weight_decay=<value>"),
    ("re:model.(: lr=2", "is not a regular expression"),
    ("head: weight_decay=-1", "weight_decay must be a finite number at least 0"),
])
def test_a_bad_entry_is_refused_in_one_line(spec, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        groups.parse_rules(spec)


def test_a_pattern_that_selects_nothing_is_refused_naming_the_model_s_names(tmp_path):
    model = model_of(tmp_path, {"model_type": "llama", **TINY_DECODER, "vocab_size": 256,
                                "max_position_embeddings": 64, "tie_word_embeddings": True})
    with pytest.raises(ConfigError, match=r"'re:.*\\.ffn\\..*', which matches no trainable parameter .* look like "
                                          r"model\.embed_tokens\.weight"):
        groups.check_rules_select(model, r"re:.*\.ffn\..*: lr=2")
    with pytest.raises(ConfigError, match="selects 'head', which matches no trainable parameter"):  # tied
        groups.check_rules_select(model, "head: lr=2")
