"""The data-format records (flame.data.formats): one per format, read by every consumer, no format name compared
outside them, each field read where its docstring says."""

import ast
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flame.base.errors import ConfigError
from flame.config.job import Training
from flame.data import formats
from flame.data.formats import DATA_FORMATS, DataFormat, data_format, markdown_table
from flame.data.formats.sft import SFT
from flame.data.formats.text import TEXT, TextEncoder, text_encoder
from flame.data.formats.tokens import MEGATRON, NUMPY
from flame.data.packing import ROW_COUNTERS
from flame.data.sft import ChatEncoder
from flame.data.sources import SourceSpec, load_source
from flame.data.shards import DataPlan
from flame.prepare.settings import check_data_formats
from flame.training.metrics import data_metrics
from tests.data.conftest import SHARDS_4, assert_same_batches, batches, make_loader, random_texts, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "flame" / "data" / "formats"
CHAT = str(Path(__file__).parent / "chat.jsonl")
COMPARISONS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)


# --------------------------------------------------------------- no format name compared outside the records


def _names_in(node: ast.AST) -> set[str]:
    """The string constants ``node`` is, or holds as a literal set, tuple, list or dict's keys."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    elements = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", [])
    return {element.value for element in elements
            if isinstance(element, ast.Constant) and isinstance(element.value, str)}


def _about_a_format(node: ast.AST) -> bool:
    # "text" is also a column name and a builder name: only a comparison whose other side is about a data
    # format (data_format, spec.data_format, fmt, formats, ...) asks what the records answer
    source = ast.unparse(node).lower()
    return "format" in source or "fmt" in source


def format_comparisons(source: str, names: set[str]) -> list[int]:
    """Lines of ``source`` that compare a format's name with a data format: ==, !=, in, not in, set
    differences and intersections, match cases."""
    found = []
    for node in ast.walk(ast.parse(source)):
        pairs = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            pairs = [(a, b) for op, a, b in zip(node.ops, operands, operands[1:]) if isinstance(op, COMPARISONS)]
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Sub, ast.BitAnd)):
            pairs = [(node.left, node.right)]
        elif isinstance(node, ast.Match):
            pairs = [(node.subject, case.pattern.value) for case in node.cases
                     if isinstance(case.pattern, ast.MatchValue)]
        if any(names & _names_in(a) and _about_a_format(b) or names & _names_in(b) and _about_a_format(a)
               for a, b in pairs):
            found.append(node.lineno)
    return found


@pytest.mark.parametrize("code", [
    'if spec.data_format == "sft": pass',
    'if "sft" != data_format: pass',
    'ok = fmt in {"text", "sft"}',
    'ok = "sft" in formats',
    'unknown = formats - {"text", "sft"}',
    'match spec.data_format:\n    case "text": pass',
])
def test_the_scan_catches_a_format_name_compared_with_a_format(code):
    assert format_comparisons(code, set(DATA_FORMATS)) == [1]


@pytest.mark.parametrize("code", [
    'if column == "text": pass',
    'candidates = ["text", "content"]',
    'ok = name in ("text", "content", "input_ids")',
    'record = {"text": body}',
])
def test_the_scan_leaves_the_word_text_alone_where_it_is_no_format(code):
    assert format_comparisons(code, set(DATA_FORMATS)) == []


def test_no_module_outside_the_records_compares_a_format_name():
    offenders = [f"{path.relative_to(ROOT)}:{line}"
                 for path in sorted((ROOT / "flame").rglob("*.py")) if RECORDS not in path.parents
                 for line in format_comparisons(path.read_text(), set(DATA_FORMATS))]
    assert not offenders, f"ask the format's record (flame.data.formats) instead of comparing its name: {offenders}"


# --------------------------------------------------------------- the registry


def test_each_record_is_registered_under_its_name():
    assert DATA_FORMATS == {"text": TEXT, "sft": SFT, "megatron": MEGATRON, "numpy": NUMPY}
    assert all(isinstance(record, DataFormat) for record in DATA_FORMATS.values())


def test_an_empty_entry_is_text():
    assert data_format("") is TEXT and data_format(None) is TEXT
    assert data_format("sft") is SFT


def test_an_unknown_format_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match="^chat is not a format; give text, sft, megatron or numpy per dataset$"):
        data_format("chat")


def test_a_record_logs_row_counters_only():
    assert all(set(record.counters) <= set(ROW_COUNTERS) for record in DATA_FORMATS.values())
    with pytest.raises(ValueError, match="not Row counters"):
        dataclasses.replace(TEXT, counters=("tokens", "words"))


def _field_help(cls: type, name: str) -> str:
    """The docstring under field ``name`` of flame.config.job's ``cls`` (its --help text)."""
    module = ast.parse((ROOT / "flame" / "config" / "job.py").read_text())
    body = next(node for node in module.body if isinstance(node, ast.ClassDef) and node.name == cls.__name__).body
    index = next(i for i, node in enumerate(body) if isinstance(node, ast.AnnAssign) and node.target.id == name)
    return body[index + 1].value.value


def test_a_records_options_are_training_fields_with_their_defaults_and_help():
    for record in DATA_FORMATS.values():
        for option in record.options:
            assert getattr(Training(), option.name) == option.default, (record.name, option.name)
            assert _field_help(Training, option.name).startswith(f"{record.label} sources"), option.name


def test_the_data_format_help_names_every_format():
    help_text = _field_help(Training, "data_format")
    assert all(f"{name} (" in help_text for name in DATA_FORMATS), help_text


def test_docs_data_page_holds_the_records_table():
    page = (ROOT / "docs" / "data.md").read_text()
    begin = "<!-- BEGIN formats table: flame.data.formats.markdown_table() -->\n"
    assert f"{begin}{markdown_table()}\n<!-- END formats table -->" in page, (
        f"docs/data.md's formats table is stale; put flame.data.formats.markdown_table() there:\n{markdown_table()}")


# --------------------------------------------------------------- one consumer per field


def test_the_planner_builds_each_source_with_its_formats_encoder(tmp_path, make_config, tokenizer):
    text = write_jsonl(tmp_path / "text.jsonl", random_texts(40, seed=3))
    config = make_config(f"{CHAT},{text}", "--training.data_format", "sft,", "--training.data_probs", "0.5,0.5")
    plan = DataPlan.from_config(config, tokenizer)
    assert plan.formats == [SFT, TEXT]
    assert isinstance(plan.encoders[0], ChatEncoder) and isinstance(plan.encoders[1], TextEncoder)
    assert plan.encoders[1].columns == "text" and plan.encoders[1].tokenizer is tokenizer


def test_token_ids_are_read_without_a_tokenizer(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "ids.jsonl", [[5, 6, 7], [8, 9]], column="input_ids")
    spec = SourceSpec(path=path)
    encoder = text_encoder(load_source(spec, False), spec, Training(), tokenizer, None)
    assert (encoder.columns, encoder.tokenizer) == ("input_ids", None)


def test_a_registered_format_is_read_by_the_planner(tmp_path, make_config, tokenizer, monkeypatch):
    """Adding a format is its record and one registry entry: the check, the planner and the loader take it."""
    made = []

    def shouting(*args) -> TextEncoder:
        made.append(args[1].path)
        return text_encoder(*args)

    monkeypatch.setitem(DATA_FORMATS, "shout", dataclasses.replace(TEXT, name="shout", encoder=shouting))
    text = write_jsonl(tmp_path / "text.jsonl", random_texts(40, seed=5))
    config = make_config(text, "--training.data_format", "shout", *SHARDS_4)
    plan = DataPlan.from_config(config, tokenizer)
    assert made == [text] and plan.formats[0].name == "shout"
    assert_same_batches(batches(make_loader(make_config(text, *SHARDS_4), tokenizer), 3),
                        batches(make_loader(config, tokenizer, plan=plan), 3))


def test_document_mask_refuses_plain_concatenation(monkeypatch):
    check_data_formats("--training", "text", False)
    monkeypatch.setitem(DATA_FORMATS, "text", dataclasses.replace(TEXT, document_mask="needs a test"))
    with pytest.raises(ConfigError, match=r"^--training.data_format text needs a test: drop --training.no-document_mask$"):
        check_data_formats("--training", ",text", False)


def test_options_need_a_source_of_their_format():
    training = SimpleNamespace(truncate_long=True, sft_loss_on="completion")
    check_data_formats("--training", "text,sft", True, training)
    with pytest.raises(ConfigError, match=r"^--training.truncate_long applies to SFT sources, and no dataset is one: "
                                          r"set --training.data_format sft for the chat datasets, or drop the flag$"):
        check_data_formats("--training", "text", True, training)
    training = SimpleNamespace(truncate_long=False, sft_loss_on="prompt+completion")
    with pytest.raises(ConfigError, match=r"^--training.sft_loss_on prompt\+completion applies to SFT sources"):
        check_data_formats("--training", ",", True, training)


def test_counters_decide_what_each_source_logs():
    counts = {name: np.array([index + 1, 10 * (index + 1)]) for index, name in enumerate(ROW_COUNTERS)}
    plan = SimpleNamespace(source_names=lambda: ["chat", "web"], formats=[SFT, TEXT])
    loader = SimpleNamespace(counts=counts, dataset=SimpleNamespace(plan=plan))
    metrics = data_metrics(loader, SimpleNamespace(dp_enabled=False), torch.device("cpu"))
    assert sorted(key for key in metrics if key.startswith("data/chat/")) == sorted(
        f"data/chat/{name}" for name in ROW_COUNTERS)
    assert metrics == {**{f"data/chat/{name}": index + 1 for index, name in enumerate(ROW_COUNTERS)},
                       "data/web/tokens": 10, "data/web/documents": 20}


def test_the_module_docstring_names_every_field():
    documented = formats.__doc__
    for field in dataclasses.fields(DataFormat):
        if field.name not in ("name", "summary", "label", "kind"):
            assert f"``{field.name}``" in documented, field.name
