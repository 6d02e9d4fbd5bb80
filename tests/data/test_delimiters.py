"""Document delimiters, document columns and pretokenized data."""

import re

import datasets
import pytest

from flame.data.packing import (
    TokenizedSource,
)
from flame.data.shards import DataPlan
from flame.data.sources import SourceSpec, document_column
from flame.data.tokenizer import Delimiters, document_delimiters, load_tokenizer
from flame.base.errors import ConfigError
from tests.conftest import TOKENIZER
from tests.data.conftest import (
    EOS_TEXT,
    ListStream,
    batch_tokens,
    batches,
    make_loader,
    random_texts,
    save_token_dataset,
    saved_tokenizer,
    word_tokenizer,
    write_jsonl,
)


def test_builtin_tokenizer_ends_every_document_with_eos(tokenizer):
    delimiters = document_delimiters(tokenizer)
    assert delimiters == Delimiters(bos=None, eos=0)
    assert tokenizer.convert_ids_to_tokens(0) == EOS_TEXT
    assert delimiters.wrap([5, 6, 7]) == [5, 6, 7, 0]
    assert delimiters.wrap([]) == [0]


def test_tokenized_source_wraps_each_document_in_the_delimiters(tokenizer):
    texts = ["def f():\n    return 1\n", "class A:\n    pass\n"]
    tokenize = lambda batch: tokenizer(batch, add_special_tokens=False)["input_ids"]  # noqa: E731
    source = TokenizedSource(ListStream(texts), tokenize, document_delimiters(tokenizer))
    for text in texts:
        assert source.next_document().tolist() == tokenizer(text, add_special_tokens=False)["input_ids"] + [0]


def test_tokenizer_with_distinct_bos_and_eos_gets_both():
    tok = word_tokenizer(bos="<s>", eos="</s>")
    delimiters = document_delimiters(tok)
    assert delimiters == Delimiters(bos=1, eos=2)
    assert delimiters.wrap([7, 8]) == [1, 7, 8, 2]


def test_tokenizer_whose_bos_is_its_eos_gets_it_once():
    tok = word_tokenizer(bos="<|endoftext|>", eos="<|endoftext|>")
    delimiters = document_delimiters(tok)
    assert delimiters.wrap([7, 8]) == [7, 8, 3]


def test_tokenizer_with_only_bos_gets_bos():
    delimiters = document_delimiters(word_tokenizer(bos="<s>", eos=None))
    assert delimiters.wrap([7, 8]) == [1, 7, 8]


def test_tokenizer_without_bos_or_eos_is_a_config_error():
    with pytest.raises(ConfigError, match="neither BOS nor EOS"):
        document_delimiters(word_tokenizer(bos=None, eos=None))


@pytest.mark.parametrize(
    "mode, expected", [("auto", [1, 7, 2]), ("eos", [7, 2]), ("bos", [1, 7]), ("bos+eos", [1, 7, 2])]
)
def test_delimiter_modes_choose_which_of_bos_and_eos_wrap_documents(mode, expected):
    assert document_delimiters(word_tokenizer(bos="<s>", eos="</s>"), mode).wrap([7]) == expected


def test_bos_and_eos_mode_on_a_tokenizer_whose_bos_is_its_eos_gives_both():
    tok = word_tokenizer(bos="<|endoftext|>", eos="<|endoftext|>")
    assert document_delimiters(tok, "bos+eos").wrap([7]) == [3, 7, 3]


@pytest.mark.parametrize("mode", ["bos", "bos+eos"])
def test_mode_needing_a_bos_the_tokenizer_lacks_is_a_config_error_naming_the_fix(mode):
    message = rf"--training.delimiters {re.escape(mode)} needs a BOS.*use --training.delimiters eos"
    with pytest.raises(ConfigError, match=message):
        document_delimiters(word_tokenizer(bos=None, eos="</s>"), mode)


def test_eos_mode_on_a_tokenizer_without_eos_is_a_config_error():
    with pytest.raises(ConfigError, match=r"needs a EOS token.*--training.separator_token"):
        document_delimiters(word_tokenizer(bos="<s>", eos=None), "eos")


def test_separator_token_ends_documents_of_a_tokenizer_with_neither_bos_nor_eos():
    delimiters = document_delimiters(word_tokenizer(bos=None, eos=None), separator="<|endoftext|>")
    assert delimiters == Delimiters(bos=None, eos=3)
    assert delimiters.wrap([7, 8]) == [7, 8, 3]


def test_unknown_separator_token_is_a_config_error():
    with pytest.raises(ConfigError, match=r"--training.separator_token '<sep>' is not a token"):
        document_delimiters(word_tokenizer(bos=None, eos=None), separator="<sep>")


def test_wrap_does_not_double_delimiters_already_at_the_ends():
    delimiters = Delimiters(bos=1, eos=2)
    assert delimiters.wrap([1, 7, 2]) == [1, 7, 2]
    assert delimiters.wrap([7, 2]) == [1, 7, 2]
    assert delimiters.wrap([1, 7]) == [1, 7, 2]
    assert delimiters.wrap([7, 1, 2, 8]) == [1, 7, 1, 2, 8, 2]  # only the ends count


def documents_of(stream: list[int], eos: int) -> list[list[int]]:
    """``stream`` cut after every ``eos``; the unfinished tail is dropped."""
    documents, current = [], []
    for token in stream:
        current.append(token)
        if token == eos:
            documents.append(current)
            current = []
    return documents


def test_separator_token_flag_ends_every_document_in_the_batches(tmp_path, make_config):
    tok = word_tokenizer(bos=None, eos=None)
    data = write_jsonl(tmp_path / "words.jsonl", random_texts(40, max_words=6))
    config = make_config(
        data,
        "--model.tokenizer_path", saved_tokenizer(tmp_path / "tok", tok),
        "--training.separator_token", "<|endoftext|>",
        "--training.data_shards", "1",
        seq_len=32,
    )
    stream = batch_tokens(batches(make_loader(config, tok), 6))
    documents = documents_of(stream, 3)
    assert len(documents) > 20
    doc = tok.convert_tokens_to_ids("doc")
    for ids in documents:  # one shard: the first row starts with a document
        assert ids[0] == doc and ids.count(doc) == 1 and ids.count(3) == 1, f"badly delimited document {ids}"


def test_delimiters_flag_sets_the_delimiters_the_data_plan_uses(tmp_path, make_config):
    tok = word_tokenizer(bos="<s>", eos="</s>")
    data = write_jsonl(tmp_path / "words.jsonl", random_texts(40, max_words=6))
    tok_dir = saved_tokenizer(tmp_path / "tok", tok)
    for mode, bos, eos in (("bos+eos", 1, 2), ("eos", None, 2), ("bos", 1, None)):
        config = make_config(data, "--model.tokenizer_path", tok_dir, "--training.delimiters", mode)
        assert DataPlan.from_config(config, tok).delimiters == Delimiters(bos=bos, eos=eos)


def test_specials_the_tokenizer_adds_itself_are_not_doubled(tmp_path, make_config):
    tok = word_tokenizer(bos="<s>", eos="</s>", add_specials=True)
    assert tok("alpha")["input_ids"] == [1, tok.convert_tokens_to_ids("alpha"), 2]  # it would add them itself
    data = write_jsonl(tmp_path / "words.jsonl", random_texts(40, max_words=6))
    config = make_config(
        data, "--model.tokenizer_path", saved_tokenizer(tmp_path / "tok", tok), "--training.data_shards", "1",
        seq_len=32,
    )
    stream = batch_tokens(batches(make_loader(config, tok), 6))
    stream = stream[stream.index(1) :]  # from the first document start on
    documents = documents_of(stream, 2)
    assert len(documents) > 20
    for ids in documents:
        assert ids[0] == 1 and ids.count(1) == 1 and ids.count(2) == 1, f"badly delimited document {ids}"
        assert ids[1] == tok.convert_tokens_to_ids("doc")




@pytest.mark.parametrize(
    "columns, expected",
    [
        ({"text": ["a"], "content": ["b"], "input_ids": [[1]]}, ("text", False)),
        ({"content": ["b"], "input_ids": [[1]]}, ("content", False)),
        ({"input_ids": [[1, 2]], "other": ["x"]}, ("input_ids", True)),
    ],
    ids=["text-first", "then-content", "then-input_ids"],
)
def test_document_column_is_text_then_content_then_input_ids(columns, expected):
    dataset = datasets.Dataset.from_dict(columns)
    assert document_column(dataset, SourceSpec(path="x"), None) == expected


def test_chosen_column_of_token_ids_is_read_as_token_ids():
    dataset = datasets.Dataset.from_dict({"text": ["a"], "tokens": [[4, 5]]})
    assert document_column(dataset, SourceSpec(path="x"), "tokens") == ("tokens", True)


def test_column_of_neither_text_nor_token_ids_is_a_config_error():
    dataset = datasets.Dataset.from_dict({"input_ids": [[0.5, 1.5]]})
    with pytest.raises(ConfigError, match=r"column 'input_ids' .* holds list values"):
        document_column(dataset, SourceSpec(path="x"), None)


class NoTokenizing:
    """The builtin tokenizer's special tokens, but it must not be called: pretokenized data needs none."""

    def __init__(self):
        self._real = load_tokenizer(TOKENIZER)

    def __getattr__(self, name):
        return getattr(self._real, name)

    def __len__(self) -> int:  # given ids are checked against the vocabulary's size
        return len(self._real)

    def __call__(self, *args, **kwargs):
        raise AssertionError("pretokenized data was tokenized")


def pretokenized_documents() -> list[list[int]]:
    """Documents of distinct ids (never 0, the builtin EOS); every third already ends in EOS."""
    documents, next_id = [], 1
    for i in range(30):
        length = 2 + i % 6
        document = list(range(next_id, next_id + length))
        next_id += length
        documents.append(document + [0] if i % 3 == 0 else document)
    return documents


def write_pretokenized_jsonl(path, documents: list[list[int]]) -> str:
    return write_jsonl(path.with_suffix(".jsonl"), documents, column="input_ids")


@pytest.mark.parametrize("writer", [save_token_dataset, write_pretokenized_jsonl], ids=["saved", "jsonl"])
def test_pretokenized_input_ids_are_trained_on_as_given_plus_delimiters(tmp_path, make_config, writer):
    documents = pretokenized_documents()
    path = writer(tmp_path / "tokens", documents)
    config = make_config(path, "--training.data_shards", "1", seq_len=16, batch_size=2)
    loader = make_loader(config, NoTokenizing())
    epoch_tokens = sum(len(d) + (d[-1] != 0) for d in documents)
    stream = batch_tokens(batches(loader, -(-epoch_tokens // 32)))[:epoch_tokens]
    got = documents_of(stream, 0)
    want = [d if d[-1] == 0 else d + [0] for d in documents]
    assert sorted(got) == sorted(want), "rows are not exactly the given ids with one EOS after each document"
