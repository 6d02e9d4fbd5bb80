"""The optimizer records (flame.optim.record): one per --optimizer.name, the facts every consumer reads.

Outside the records no module of flame/ tells optimizers apart by name: a scan of every module's
syntax fails on a comparison with an optimizer's name, a table keyed by the names, or a list of them.
"""

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
import torch
from torchtitan.config.job_config import Optimizer as TorchtitanOptimizer

from flame.base.errors import ConfigError
from flame.config import job
from flame.config.merge import merge_configs
from flame.optim import record as records
from flame.optim.adamw import ADAM, ADAMW
from flame.optim.builder import build_optimizers
from flame.optim.muon import MUON, MuonWithAdamW, split_parameters
from flame.optim.record import OPTIMIZERS, optimizer_record

FLAME = Path(__file__).resolve().parents[2] / "flame"
Optimizer = merge_configs(TorchtitanOptimizer, job.Optimizer)  # the job's optimizer section, as parsed


def record_files() -> set[Path]:
    """The modules allowed to name optimizers: the registry's, and each record's own (where its build lives)."""
    return {Path(records.__file__)} | {Path(inspect.getfile(record.build)) for record in OPTIMIZERS.values()}


def names_used(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each place ``source`` tells optimizers apart by one of ``names``."""

    def named(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and node.value in names

    def listed(node: ast.AST) -> bool:  # a name, or a literal collection holding one
        return named(node) or (isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(map(named, node.elts)))

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(map(listed, [node.left, *node.comparators])):
            found.append((node.lineno, "compares with an optimizer's name"))
        elif isinstance(node, ast.Dict) and any(named(key) for key in node.keys if key is not None):
            found.append((node.lineno, "a table keyed by optimizer names"))
        elif isinstance(node, ast.Subscript) and named(node.slice):
            found.append((node.lineno, "looks an optimizer's name up"))
        elif isinstance(node, ast.Call) and any(map(named, node.args)) and getattr(node.func, "attr", "") == "get":
            found.append((node.lineno, "looks an optimizer's name up"))
        elif isinstance(node, ast.MatchValue) and named(node.value):
            found.append((node.lineno, "matches an optimizer's name"))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and sum(map(named, node.elts)) > 1:
            found.append((node.lineno, "lists optimizer names"))
    return sorted(set(found))


def test_no_module_outside_the_records_tells_optimizers_apart_by_name():
    allowed = record_files()
    wrong = [f"{path.relative_to(FLAME.parent)}:{line}: {what}" for path in sorted(FLAME.rglob("*.py"))
             if path not in allowed for line, what in names_used(path.read_text(), set(OPTIMIZERS))]
    assert not wrong, "ask the optimizer's record (flame.optim.record) instead:\n" + "\n".join(wrong)


def test_the_name_scan_catches_each_way_of_naming_an_optimizer():
    names = {"AdamW", "Muon"}
    planted = {
        'if config.optimizer.name == "Muon": pass': "compares",
        'x = name != "AdamW"': "compares",
        'x = name in ("Adam", "AdamW")': "compares",
        'x = {"Muon": 4, "AdamW": 8}[name]': "table",
        'x = STATE["Muon"]': "looks",
        'x = STATE.get("Muon", 8)': "looks",
        'match name:\n    case "Muon":\n        pass': "matches",
        'CHOICES = ("AdamW", "Muon")': "lists",
    }
    for source, what in planted.items():
        found = names_used(source, names)
        assert found and what in found[0][1], source
    # a default value, or a message, names an optimizer without telling optimizers apart
    assert names_used('name: str = "AdamW"\nraise ValueError(f"use {name}, e.g. AdamW")', names) == []


def test_the_registry_names_every_optimizer_and_refuses_others_with_the_choices():
    assert list(OPTIMIZERS) == ["AdamW", "Adam", "Muon"]  # AdamW first: the default, and what refusals suggest
    assert optimizer_record("Muon") is MUON and optimizer_record("AdamW") is ADAMW
    with pytest.raises(ConfigError, match=r"--optimizer.name Lion: flame trains with Adam, AdamW, Muon; choose one"):
        optimizer_record("Lion")
    assert job.Optimizer().name in OPTIMIZERS  # the config's default has a record


def test_a_second_record_under_a_taken_name_is_refused():
    with pytest.raises(ValueError, match="two optimizers are registered as Muon"):
        records.register(dataclasses.replace(MUON))


def test_state_bytes_are_two_fp32_moments_for_adam_and_one_momentum_for_muons_matrices():
    assert ADAMW.state_of(1000, 600) == ADAM.state_of(1000, 600) == 8 * 1000
    assert MUON.state_of(1000, 600) == 4 * 600 + 8 * 400  # AdamW's two moments for the other 400
    assert MUON.state_of(1000, 0) == 8 * 1000


def test_muon_steps_only_on_the_gpu_and_adam_anywhere():
    assert ADAMW.steps_on_host and ADAM.steps_on_host and ADAMW.offloads and ADAM.offloads
    assert not MUON.steps_on_host and not MUON.offloads and "on the GPU" in MUON.on_gpu_only
    assert ADAMW.decoupled and not ADAM.decoupled  # the host's step takes AdamW's or Adam's rule by it


def test_only_fused_adam_off_the_host_skips_on_the_gpu():
    def section(name: str, implementation: str, on_host: bool = False) -> Optimizer:
        return Optimizer(name=name, implementation=implementation, on_host=on_host)

    assert ADAMW.skips_on_gpu(section("AdamW", "fused")) and ADAM.skips_on_gpu(section("Adam", "fused"))
    assert not ADAMW.skips_on_gpu(section("AdamW", "foreach"))
    assert not ADAMW.skips_on_gpu(section("AdamW", "fused", on_host=True))  # the host's step reads no found_inf
    assert not MUON.skips_on_gpu(section("Muon", "fused"))


def test_each_owned_field_is_a_config_field_of_one_optimizer():
    fields = {f"optimizer.{field.name}" for field in dataclasses.fields(job.Optimizer)}
    owned = [name for record in OPTIMIZERS.values() for name in record.owns]
    assert set(owned) <= fields and len(owned) == len(set(owned))
    assert set(MUON.owns) == {name for name in fields if name.startswith("optimizer.muon_")}


def test_muon_refuses_its_own_settings_out_of_range():
    MUON.check(Optimizer(name="Muon"))  # the defaults pass
    for change, message in [({"muon_momentum": 1.0}, r"--optimizer.muon_momentum must be a number in \[0, 1\)"),
                            ({"muon_ns_steps": 0}, r"--optimizer.muon_ns_steps must be a number in \[1, 99\]"),
                            ({"muon_lr": float("nan")}, "--optimizer.muon_lr must be a number at least 0"),
                            ({"muon_weight_decay": -0.1}, "--optimizer.muon_weight_decay must be a number at least 0")]:
        with pytest.raises(ConfigError, match=message):
            MUON.check(Optimizer(name="Muon", **change))


def _tiny_model() -> torch.nn.Module:
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)])
    return model


@pytest.mark.parametrize("name, kind", [("AdamW", torch.optim.AdamW), ("Adam", torch.optim.Adam),
                                        ("Muon", MuonWithAdamW)])
def test_each_record_builds_one_optimizer_per_model_part_over_every_parameter(name, kind):
    built = build_optimizers([_tiny_model(), _tiny_model()], Optimizer(name=name, implementation="for-loop"), None)
    assert [type(optimizer) for optimizer in built.optimizers] == [kind, kind]
    assert sum(len(group["params"]) for group in built.optimizers[0].param_groups) == 4  # each parameter once


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    model = _tiny_model()
    muon, adamw = split_parameters(model)
    assert [p.shape for p in muon] == [(8, 8)] and len(adamw) == 3  # the Linear's bias, the norm's weight and bias
