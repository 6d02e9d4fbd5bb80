"""Every default a message names is the default: each claim in flame's strings (errors, help, docstrings) that
an option's default is a value ("--memory.plan off, the default", "'headtail' (the default)",
"``--x.y v`` (default)", a field's help "off (default ...") is checked against the merged JobConfig."""

import ast
import re
from operator import attrgetter

import pytest
from torchtitan.config import JobConfig

from flame.config import job as flame_config
from flame.config.merge import dotted_fields, merge_configs
from flame.config.spellings import ALIASES
from tests.conftest import ROOT

CONFIG = merge_configs(JobConfig, flame_config.JobConfig)
FIELDS = set(dotted_fields(CONFIG))
DEFAULTS = CONFIG()

FLAG = re.compile(r"(?:--|`)(?P<flag>[a-z][a-z_0-9]*(?:\.[a-z][a-z_0-9]*)+)(?![\w.])`?")
# a value, then a mark that says it is the default; "(default: ...)" and "(default 5GB)" give the value after
CLAIM = re.compile(
    r"(?P<value>'[^'\s]+'|``[^`\s]+``|`[^`\s]+`|[\w.+-]+)(?:``|`)?"
    r"(?:,\s*the default\b|\s*\(the default\)|\s*\(default\)|\s*\(default(?=\s+[a-z]))"
)


def text_of(node: ast.AST) -> str | None:
    """A string constant's text; an f-string's with '{}' for each placeholder."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)
    return None


def field_help(tree: ast.Module) -> dict[int, str]:
    """id of each field docstring of flame.config.job -> its field's dotted name ('memory.plan')."""
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    if "JobConfig" not in classes:
        return {}
    sections = {statement.target.id: ast.unparse(statement.annotation) for statement in classes["JobConfig"].body
                if isinstance(statement, ast.AnnAssign)}
    owners = {}
    for section, class_name in sections.items():
        body = classes[class_name].body
        for statement, following in zip(body, body[1:]):
            if isinstance(statement, ast.AnnAssign) and isinstance(following, ast.Expr):
                owners[id(following.value)] = f"{section}.{statement.target.id}"
    return owners


def claims(source: str, path: str = "<source>") -> list[tuple[str, str, str]]:
    """(where, option, value) for each claim of ``source`` that an option's default is a value. The option: the
    last one named before the value in the same string, or (a field's help) the field itself."""
    tree = ast.parse(source)
    owners = field_help(tree)
    in_fstrings = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    found = []
    for node in ast.walk(tree):
        if id(node) in in_fstrings or (text := text_of(node)) is None:
            continue  # an f-string's parts are read with it
        for claim in CLAIM.finditer(text):
            value = claim.group("value").strip("'`")
            named = list(FLAG.finditer(text, 0, claim.start("value")))
            adjacent = bool(named) and re.fullmatch(r"[\s=`']*", text[named[-1].end():claim.start("value")]) is not None
            if named and (adjacent or claim.group("value")[0] in "'`"):
                option = named[-1].group("flag")
            elif not named and id(node) in owners:
                option = owners[id(node)]
            else:
                continue  # a value of no option (a file name, "FSDP (the default)")
            found.append((f"{path}:{getattr(node, 'lineno', '?')}", option, value))
    return found


def wrong(found: list[tuple[str, str, str]]) -> list[str]:
    """The claims whose value is not the option's default (or whose option does not exist)."""
    mistakes = []
    for where, option, value in found:
        field = ALIASES.get(option, option)
        if field not in FIELDS:
            mistakes.append(f"{where}: --{option} is no option")
            continue
        default = attrgetter(field)(DEFAULTS)
        if isinstance(default, bool):
            right = value.lower() == str(default).lower()
        elif isinstance(default, (int, float)):
            right = re.fullmatch(r"-?[\d.e+-]+", value) is not None and float(value) == default
        else:
            right = value == str(default)
        if not right:
            mistakes.append(f"{where}: --{option} {value} is named the default, but the default is {default!r}")
    return mistakes


def flame_claims() -> list[tuple[str, str, str]]:
    found = []
    for path in sorted((ROOT / "flame").rglob("*.py")):
        found.extend(claims(path.read_text(), str(path.relative_to(ROOT))))
    return found


def test_every_default_a_message_of_flame_names_is_the_default():
    found = flame_claims()
    assert found  # the scan reads claims at all (the tests below show it reads each form)
    assert wrong(found) == []


@pytest.mark.parametrize(
    ("source", "claim"),
    [
        ('raise E("flame plans memory (--memory.plan auto, the default) first")', ("memory.plan", "auto")),
        ('raise E(f"--parallelism.context_parallel_load_balancer {x}: use \'none\' (the default)")',
         ("parallelism.context_parallel_load_balancer", "none")),
        ('"""with ``--optimizer.muon_adjust_lr original`` (default) a matrix"""', ("optimizer.muon_adjust_lr", "original")),
        ('raise E("--training.batch_size 3 (default) rows")', ("training.batch_size", "3")),
        ('raise E("--training.steps=5, the default")', ("training.steps", "5")),
    ],
)
def test_a_wrong_default_in_a_message_is_found(source, claim):
    found = claims(source)
    assert [(option, value) for _, option, value in found] == [claim]
    assert len(wrong(found)) == 1


def test_a_wrong_default_in_a_fields_help_is_found():
    source = (
        "class Memory:\n"
        "    plan: str = 'off'\n"
        '    """auto (default until the estimates are checked) = plan the memory"""\n'
        "class JobConfig:\n"
        "    memory: Memory\n"
    )
    found = claims(source)
    assert [(option, value) for _, option, value in found] == [("memory.plan", "auto")]
    assert wrong(found) == ["<source>:3: --memory.plan auto is named the default, but the default is 'off'"]


def test_values_of_no_option_and_defaults_described_in_words_are_no_claims():
    source = ('raise E("FSDP (the default) shards weights; --training.dataset_split: the split (default: train); '
              'shard size (default 5GB)")')
    assert claims(source) == []
