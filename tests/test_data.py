"""Data pipeline: packing semantics, document delimiters, exact resume, mixing, coverage, bad input."""

import json
import pickle
import random

import datasets
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from torchtitan.components.loss import IGNORE_INDEX
from transformers import PreTrainedTokenizerFast

from flame.config_manager import ConfigError, FlameConfigManager
from flame.data.loader import PackedDataset, build_dataloader
from flame.data.packing import DOCUMENTS_PER_READ, Packer, TokenizedSource, collate_rows
from flame.data.streams import IterStream, MapStream
from flame.data.tokenizer import Delimiters, document_delimiters, load_tokenizer
from tests.conftest import TOKENIZER

WORDS = ["alpha", "beta", "gamma", "delta", "kappa", "lambda", "omega", "sigma", "theta", "zeta"]


# --------------------------------------------------------------------------- helpers


class ListDocuments:
    """A document source over hand-made documents: document i holds distinct, increasing token ids."""

    def __init__(self, lengths: list[int]):
        self.documents, start = [], 1
        for length in lengths:
            self.documents.append(np.arange(start, start + length, dtype=np.int64))
            start += length
        self.index = 0

    def next_document(self) -> np.ndarray:
        document = self.documents[self.index]
        self.index += 1
        return document

    def state_dict(self) -> dict:
        return {"index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.index = state["index"]


class ListStream:
    """A text stream with read(count)/state_dict/load_state_dict, cycling over ``texts``."""

    def __init__(self, texts: list[str]):
        self.texts, self.position = texts, 0

    def read(self, count: int) -> list[str]:
        out = [self.texts[(self.position + i) % len(self.texts)] for i in range(count)]
        self.position += count
        return out

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


# Lengths include 1-token documents, documents longer than a row and than context_len.
LENGTHS = [3, 20, 1, 7, 16, 40, 2, 5, 1, 9, 33, 4, 16, 1, 12, 6, 50, 3, 8, 15] * 3
SEQ_LEN = 16


def document_stream(lengths: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, document index of each token, whether each token ends its document)."""
    documents = ListDocuments(lengths).documents
    tokens = np.concatenate(documents)
    owner = np.concatenate([np.full(len(d), i) for i, d in enumerate(documents)])
    last = np.concatenate([np.arange(len(d)) == len(d) - 1 for d in documents])
    return tokens, owner, last


def pack(rows: int, context_len: int = SEQ_LEN, lengths: list[int] = LENGTHS) -> list:
    packer = Packer(ListDocuments(lengths), SEQ_LEN, context_len)
    return [packer.next_row() for _ in range(rows)]


def segment_starts(row) -> list[int]:
    return list(np.cumsum([0] + row[3][:-1]))


def write_jsonl(path, texts: list[str], column: str = "text") -> str:
    path.write_text("".join(json.dumps({column: text}) + "\n" for text in texts))
    return str(path)


def random_texts(count: int, prefix: str = "doc", seed: int = 0, max_words: int = 60) -> list[str]:
    rng = random.Random(seed)
    return [
        f"{prefix} {i} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, max_words))) for i in range(count)
    ]


def word_tokenizer(bos: str | None, eos: str | None, add_specials: bool = False) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over WORDS (+ digits), optionally with BOS/EOS defined."""
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "<|endoftext|>": 3}
    for word in WORDS + ["doc"] + [str(i) for i in range(200)]:
        vocab[word] = len(vocab)
    model = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    if add_specials:
        model.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A {eos}", special_tokens=[(bos, vocab[bos]), (eos, vocab[eos])]
        )
    special = {name: token for name, token in (("bos_token", bos), ("eos_token", eos)) if token is not None}
    return PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]", **special)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TOKENIZER)


@pytest.fixture
def make_config(monkeypatch, tiny_model):
    monkeypatch.setenv("WORLD_SIZE", "1")

    def make(dataset: str, *extra: str, seq_len: int = 64, batch_size: int = 2):
        return FlameConfigManager().parse_args(
            [
                "--model.config", tiny_model,
                "--model.tokenizer_path", TOKENIZER,
                "--training.dataset", dataset,
                "--training.seq_len", str(seq_len),
                "--training.batch_size", str(batch_size),
                *extra,
            ]
        )

    return make


def batches(dataset: PackedDataset, count: int) -> list:
    iterator = iter(dataset)
    return [next(iterator) for _ in range(count)]


def assert_same_batches(expected: list, actual: list) -> None:
    assert len(expected) == len(actual)
    for step, ((inputs_a, labels_a), (inputs_b, labels_b)) in enumerate(zip(expected, actual)):
        assert torch.equal(labels_a, labels_b), f"labels differ at batch {step}"
        assert inputs_a.keys() == inputs_b.keys()
        for key in inputs_a:
            assert torch.equal(inputs_a[key], inputs_b[key]), f"{key} differs at batch {step}"


# --------------------------------------------------------------------------- packing


def test_rows_are_seq_len_consecutive_tokens_of_the_document_stream():
    rows = pack(20)
    tokens, _, _ = document_stream(LENGTHS)
    for inputs, labels, positions, segments in rows:
        assert len(inputs) == len(labels) == len(positions) == sum(segments) == SEQ_LEN
    np.testing.assert_array_equal(np.concatenate([row[0] for row in rows]), tokens[: 20 * SEQ_LEN])


@pytest.mark.parametrize("context_len", [SEQ_LEN, 5])
def test_label_inside_a_document_is_its_next_token_even_across_rows_and_segments(context_len):
    rows = pack(20, context_len)
    tokens, _, last = document_stream(LENGTHS)
    labels = np.concatenate([row[1] for row in rows])
    inner = np.flatnonzero(~last[: len(labels)])
    np.testing.assert_array_equal(labels[inner], tokens[inner + 1])


@pytest.mark.parametrize("context_len", [SEQ_LEN, 5])
def test_last_token_of_every_document_has_ignore_label(context_len):
    rows = pack(20, context_len)
    _, _, last = document_stream(LENGTHS)
    labels = np.concatenate([row[1] for row in rows])
    ends = np.flatnonzero(last[: len(labels)])
    assert len(ends) > 10
    assert (labels[ends] == IGNORE_INDEX).all()
    assert (labels[np.flatnonzero(~last[: len(labels)])] != IGNORE_INDEX).all()


@pytest.mark.parametrize("context_len", [SEQ_LEN, 5])
def test_no_segment_spans_a_document_boundary(context_len):
    _, owner, _ = document_stream(LENGTHS)
    for index, row in enumerate(pack(20, context_len)):
        for start, length in zip(segment_starts(row), row[3]):
            begin = index * SEQ_LEN + start
            assert len(set(owner[begin : begin + length])) == 1, f"row {index}: segment at {start} mixes documents"


@pytest.mark.parametrize("context_len", [SEQ_LEN, 5])
def test_position_ids_restart_at_zero_in_each_segment(context_len):
    for inputs, labels, positions, segments in pack(20, context_len):
        np.testing.assert_array_equal(positions, np.concatenate([np.arange(length) for length in segments]))


@pytest.mark.parametrize("context_len", [SEQ_LEN, 7, 5, 1])
def test_segments_never_exceed_context_len(context_len):
    rows = pack(20, context_len)
    assert all(0 < length <= context_len for row in rows for length in row[3])
    assert max(length for row in rows for length in row[3]) == context_len


def test_segments_are_cut_only_at_document_ends_row_ends_or_context_len():
    _, _, last = document_stream(LENGTHS)
    context_len = 5
    for index, row in enumerate(pack(20, context_len)):
        for start, length in zip(segment_starts(row), row[3]):
            end = start + length  # exclusive, within the row
            if length < context_len:
                at_document_end = last[index * SEQ_LEN + end - 1]
                assert end == SEQ_LEN or at_document_end, f"row {index}: segment {start}:{end} cut early"


def test_a_whole_document_inside_one_row_has_positions_from_zero_to_its_length():
    # Stream offsets: doc0 0-2, doc1 3-22, doc2 23, doc3 24-30, doc4 31-46; docs 2 and 3 lie inside row 1.
    lengths = [3, 20, 1, 7, 16]
    rows = pack(2, lengths=lengths)
    positions = rows[1][2]
    # row 1 covers stream tokens 16..31: doc 1 tokens 13..19 (7), doc 2 (1), doc 3 (7), doc 4 first token (1)
    np.testing.assert_array_equal(positions, [0, 1, 2, 3, 4, 5, 6, 0, 0, 1, 2, 3, 4, 5, 6, 0])
    assert rows[1][3] == [7, 1, 7, 1]


@pytest.mark.parametrize("context_len", [SEQ_LEN, 5])
def test_collate_rows_cu_seqlens_mark_the_segments_of_all_rows(context_len):
    rows = pack(4, context_len)
    inputs, labels = collate_rows(rows)
    lengths = [length for row in rows for length in row[3]]
    assert inputs["input"].shape == labels.shape == inputs["position_ids"].shape == (4, SEQ_LEN)
    assert torch.equal(inputs["input"], torch.from_numpy(np.stack([row[0] for row in rows])))
    assert torch.equal(labels, torch.from_numpy(np.stack([row[1] for row in rows])))
    assert inputs["cu_seqlens"].dtype == torch.int32
    assert inputs["cu_seqlens"].tolist() == list(np.cumsum([0] + lengths))
    assert inputs["cu_seqlens"][-1] == 4 * SEQ_LEN
    assert {r * SEQ_LEN for r in range(5)} <= set(inputs["cu_seqlens"].tolist()), "a segment crosses a row end"
    assert int(inputs["max_seqlen"]) == max(lengths)


def test_collate_rows_positions_are_zero_exactly_at_cu_seqlens():
    inputs, _ = collate_rows(pack(4, 5))
    flat = inputs["position_ids"].flatten()
    starts = inputs["cu_seqlens"][:-1].long()
    assert torch.equal(torch.nonzero(flat == 0).flatten(), starts)


@pytest.mark.parametrize("rows_before", [0, 1, 2, 3, 5, 8])
def test_packer_resumes_exactly_from_its_state(rows_before):
    packer = Packer(ListDocuments(LENGTHS), SEQ_LEN, 5)
    for _ in range(rows_before):
        packer.next_row()
    state = pickle.loads(pickle.dumps(packer.state_dict()))
    expected = [packer.next_row() for _ in range(6)]
    resumed = Packer(ListDocuments(LENGTHS), SEQ_LEN, 5)
    resumed.load_state_dict(state)
    for want, got in zip(expected, [resumed.next_row() for _ in range(6)]):
        for a, b in zip(want[:3], got[:3]):
            np.testing.assert_array_equal(a, b)
        assert want[3] == got[3]


def test_tokenized_source_resumes_in_the_middle_of_a_read():
    texts = [" ".join(str(t) for t in range(i, i + i % 5)) for i in range(150)]
    tokenize = lambda batch: [[int(word) for word in text.split()] for text in batch]  # noqa: E731
    source = TokenizedSource(ListStream(texts), tokenize, Delimiters(bos=None, eos=999))
    for _ in range(DOCUMENTS_PER_READ + 6):
        source.next_document()
    state = pickle.loads(pickle.dumps(source.state_dict()))
    expected = [source.next_document() for _ in range(DOCUMENTS_PER_READ)]
    resumed = TokenizedSource(ListStream(texts), tokenize, Delimiters(bos=None, eos=999))
    resumed.load_state_dict(state)
    for want, got in zip(expected, [resumed.next_document() for _ in range(DOCUMENTS_PER_READ)]):
        np.testing.assert_array_equal(want, got)
    np.testing.assert_array_equal(expected[0], tokenize([texts[DOCUMENTS_PER_READ + 6]])[0] + [999])


# --------------------------------------------------------------------------- delimiters


def test_builtin_tokenizer_ends_every_document_with_eos(tokenizer):
    delimiters = document_delimiters(tokenizer)
    assert delimiters == Delimiters(bos=None, eos=0)
    assert tokenizer.convert_ids_to_tokens(0) == "<|endoftext|>"
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


def test_specials_the_tokenizer_adds_itself_are_not_doubled(tmp_path, make_config):
    tok = word_tokenizer(bos="<s>", eos="</s>", add_specials=True)
    assert tok("alpha")["input_ids"] == [1, tok.convert_tokens_to_ids("alpha"), 2]  # it would add them itself
    data = write_jsonl(tmp_path / "words.jsonl", random_texts(40, max_words=6))
    dataset = PackedDataset(make_config(data, seq_len=32), tok, dp_rank=0, dp_world_size=1)
    stream = torch.cat([inputs["input"].flatten() for inputs, _ in batches(dataset, 6)]).tolist()
    stream = stream[stream.index(1) :]  # from the first document start on
    documents, current = [], []
    for token in stream:
        current.append(token)
        if token == 2:  # EOS closes a document
            documents.append(current)
            current = []
    assert len(documents) > 20
    for ids in documents:
        assert ids[0] == 1 and ids.count(1) == 1 and ids.count(2) == 1, f"badly delimited document {ids}"
        assert ids[1] == tok.convert_tokens_to_ids("doc")


# --------------------------------------------------------------------------- exact resume


@pytest.fixture
def two_sources(tmp_path) -> tuple[str, str]:
    a = write_jsonl(tmp_path / "a.jsonl", random_texts(90, prefix="AAA", seed=1))
    b = write_jsonl(tmp_path / "b.jsonl", random_texts(70, prefix="BBB", seed=2))
    return a, b


RESUME_CASES = {
    "map-style": lambda a, b: [a],
    "map-style-context-len": lambda a, b: [a, "--training.context_len", "24"],
    "streaming": lambda a, b: [a, "--training.streaming"],
    "mixed": lambda a, b: [f"{a},{b}", "--training.data_probs", "0.7,0.3"],
    "mixed-streaming": lambda a, b: [f"{a},{b}", "--training.data_probs", "0.7,0.3", "--training.streaming"],
}


@pytest.mark.parametrize("batches_before", [3, 40])  # 40 batches: past the end of the first epoch
@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_loader_resumes_with_exactly_the_next_batches(case, batches_before, two_sources, make_config, tokenizer):
    config = make_config(*RESUME_CASES[case](*two_sources))
    first = PackedDataset(config, tokenizer, dp_rank=0, dp_world_size=1)
    iterator = iter(first)
    for _ in range(batches_before):
        next(iterator)
    state = pickle.loads(pickle.dumps(first.state_dict()))  # as a checkpoint stores it
    expected = [next(iterator) for _ in range(8)]

    resumed = PackedDataset(config, tokenizer, dp_rank=0, dp_world_size=1)
    resumed.load_state_dict(state)
    assert_same_batches(expected, batches(resumed, 8))


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_with_workers_resumes_with_exactly_the_next_batches(workers, two_sources, make_config, tokenizer):
    config = make_config(two_sources[0], "--training.num_workers", str(workers))
    first = build_dataloader(1, 0, tokenizer, config)
    iterator = iter(first)
    for _ in range(7):
        next(iterator)
    state = first.state_dict()
    expected = [next(iterator) for _ in range(6)]
    del iterator

    resumed = build_dataloader(1, 0, tokenizer, config)
    resumed.load_state_dict(state)
    iterator = iter(resumed)
    assert_same_batches(expected, [next(iterator) for _ in range(6)])


def test_dataloader_state_of_another_data_parallel_size_is_a_config_error(two_sources, make_config, tokenizer):
    config = make_config(two_sources[0])
    first = build_dataloader(2, 0, tokenizer, config)
    next(iter(first))
    with pytest.raises(ConfigError, match="2 data-parallel ranks, this run has 4"):
        build_dataloader(4, 0, tokenizer, config).load_state_dict(first.state_dict())


def test_loader_state_before_the_first_batch_resumes_at_the_start(two_sources, make_config, tokenizer):
    config = make_config(two_sources[0])
    first = PackedDataset(config, tokenizer, dp_rank=0, dp_world_size=1)
    state = pickle.loads(pickle.dumps(first.state_dict()))
    expected = batches(first, 3)
    resumed = PackedDataset(config, tokenizer, dp_rank=0, dp_world_size=1)
    resumed.load_state_dict(state)
    assert_same_batches(expected, batches(resumed, 3))


def test_loader_state_from_another_reader_layout_is_a_config_error(two_sources, make_config, tokenizer):
    config = make_config(two_sources[0])
    first = PackedDataset(config, tokenizer, dp_rank=0, dp_world_size=1)
    batches(first, 2)
    state = first.state_dict()
    resumed = PackedDataset(config, tokenizer, dp_rank=0, dp_world_size=2)
    resumed.load_state_dict(state)
    with pytest.raises(ConfigError, match="reader 0 of 1"):
        batches(resumed, 1)


# --------------------------------------------------------------------------- mixing


def test_data_probs_are_the_fraction_of_documents_drawn_from_each_source(tmp_path, make_config, tokenizer):
    # A's documents are ~4x longer than B's: a token-weighted mix would be far from 0.8.
    a = write_jsonl(tmp_path / "a.jsonl", [f"AAA {i} " + " ".join(WORDS) for i in range(150)])
    b = write_jsonl(tmp_path / "b.jsonl", [f"BBB {i}" for i in range(150)])
    config = make_config(f"{a},{b}", "--training.data_probs", "0.8,0.2", seq_len=256, batch_size=4)
    dataset = PackedDataset(config, tokenizer, dp_rank=0, dp_world_size=1)
    ids = torch.cat([inputs["input"].flatten() for inputs, _ in batches(dataset, 30)]).tolist()
    text = tokenizer.decode(ids)
    from_a, from_b = text.count("AAA "), text.count("BBB ")
    assert from_a + from_b >= 1000
    assert from_a / (from_a + from_b) == pytest.approx(0.8, abs=0.04)


def test_a_source_with_probability_far_below_one_is_still_read(tmp_path, make_config, tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", [f"AAA {i}" for i in range(50)])
    b = write_jsonl(tmp_path / "b.jsonl", [f"BBB {i}" for i in range(50)])
    config = make_config(f"{a},{b}", "--training.data_probs", "99,1", seq_len=256, batch_size=4)
    dataset = PackedDataset(config, tokenizer, dp_rank=0, dp_world_size=1)
    text = tokenizer.decode(torch.cat([inputs["input"].flatten() for inputs, _ in batches(dataset, 10)]).tolist())
    assert 0 < text.count("BBB ") < 0.05 * text.count("AAA ")


# --------------------------------------------------------------------------- coverage


def read_epochs(stream, epochs: int, count: int = 7) -> list[list[str]]:
    """Documents the stream returns in each of its first ``epochs`` epochs, in order."""
    out = [[] for _ in range(epochs)]
    while True:
        texts = stream.read(count)
        epoch = stream.state_dict()["epoch"]
        if epoch >= epochs:
            return out
        out[epoch].extend(texts)


def doc_ids(texts: list[str]) -> list[int]:
    return [int(text.split()[1]) for text in texts]


def test_map_readers_cover_every_document_once_per_epoch():
    n = 103
    dataset = datasets.Dataset.from_dict({"text": [f"doc {i} body" for i in range(n)], "other": list(range(n))})
    shares = [doc_ids(read_epochs(MapStream(dataset, "text", c, 4, seed=5, name="t"), 2)[0]) for c in range(4)]
    assert sum(len(share) for share in shares) == n, "a document was read twice or never"
    assert set().union(*map(set, shares)) == set(range(n))
    assert all(abs(len(share) - n / 4) < 1 for share in shares)


def test_map_readers_cover_every_document_again_in_the_second_epoch_in_a_new_order():
    n = 103
    dataset = datasets.Dataset.from_dict({"text": [f"doc {i} body" for i in range(n)]})
    epochs = [read_epochs(MapStream(dataset, "text", c, 4, seed=5, name="t"), 2) for c in range(4)]
    first = [doc_ids(reader[0]) for reader in epochs]
    second = [doc_ids(reader[1]) for reader in epochs]
    assert sorted(sum(second, [])) == list(range(n))
    assert first != second, "the second epoch repeats the first one's order"
    assert sum(first, []) != list(range(n)), "the first epoch is not shuffled"


def test_map_readers_with_another_seed_read_another_order():
    dataset = datasets.Dataset.from_dict({"text": [f"doc {i}" for i in range(50)]})
    one = doc_ids(read_epochs(MapStream(dataset, "text", 0, 2, seed=1, name="t"), 1)[0])
    two = doc_ids(read_epochs(MapStream(dataset, "text", 0, 2, seed=2, name="t"), 1)[0])
    assert one != two


def test_streaming_readers_cover_every_document_once_per_epoch(tmp_path):
    n = 41
    path = write_jsonl(tmp_path / "s.jsonl", [f"doc {i} body" for i in range(n)])
    dataset = datasets.load_dataset("json", data_files=[path], split="train", streaming=True)
    shares = [doc_ids(read_epochs(IterStream(dataset, "text", c, 4, name="s"), 1)[0]) for c in range(4)]
    assert sum(len(share) for share in shares) == n
    assert set().union(*map(set, shares)) == set(range(n))


def test_data_parallel_ranks_read_disjoint_documents(tmp_path, make_config, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [f"doc {i} x" for i in range(64)])
    config = make_config(path, seq_len=32, batch_size=1)
    texts = []
    for rank in range(2):
        dataset = PackedDataset(config, tokenizer, dp_rank=rank, dp_world_size=2)
        ids = torch.cat([inputs["input"].flatten() for inputs, _ in batches(dataset, 4)]).tolist()
        texts.append(set(tokenizer.decode(ids).split("<|endoftext|>")[1:-1]))  # complete documents only
    assert len(texts[0]) > 5 and len(texts[1]) > 5
    assert not texts[0] & texts[1]


# --------------------------------------------------------------------------- bad input


def test_missing_text_column_is_a_config_error_listing_the_columns(tmp_path, make_config, tokenizer):
    path = tmp_path / "no_text.jsonl"
    path.write_text("".join(json.dumps({"body": f"doc {i}", "id": i}) + "\n" for i in range(10)))
    with pytest.raises(ConfigError, match=r"'text'.*columns are: body, id"):
        PackedDataset(make_config(str(path)), tokenizer, dp_rank=0, dp_world_size=1)


def test_missing_chosen_text_column_is_a_config_error_naming_it(tmp_path, make_config, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", ["a", "b"])
    with pytest.raises(ConfigError, match=r"column 'body'.*columns are: text"):
        PackedDataset(make_config(path, "--training.text_column", "body"), tokenizer, dp_rank=0, dp_world_size=1)


def test_glob_matching_no_files_is_a_config_error(tmp_path, make_config, tokenizer):
    pattern = str(tmp_path / "missing-*.jsonl")
    with pytest.raises(ConfigError, match="matches no files"):
        PackedDataset(make_config(pattern), tokenizer, dp_rank=0, dp_world_size=1)


def test_unknown_file_extension_is_a_config_error(tmp_path, make_config, tokenizer):
    path = tmp_path / "data.xyz"
    path.write_text('{"text": "a"}\n')
    with pytest.raises(ConfigError, match=r"cannot tell the format of .*data\.xyz"):
        PackedDataset(make_config(str(path)), tokenizer, dp_rank=0, dp_world_size=1)


def test_unknown_split_of_a_saved_dataset_dict_is_a_config_error(tmp_path, make_config, tokenizer):
    saved = tmp_path / "saved"
    documents = datasets.Dataset.from_dict({"text": ["a", "b", "c"]})
    datasets.DatasetDict({"train": documents, "test": documents}).save_to_disk(str(saved))
    config = make_config(str(saved), "--training.dataset_split", "validation")
    with pytest.raises(ConfigError, match=r"no split 'validation'; it has: train, test"):
        PackedDataset(config, tokenizer, dp_rank=0, dp_world_size=1)


def test_known_split_of_a_saved_dataset_dict_is_read(tmp_path, make_config, tokenizer):
    saved = tmp_path / "saved"
    train = datasets.Dataset.from_dict({"text": ["AAA"] * 5})
    test = datasets.Dataset.from_dict({"text": ["BBB"] * 5})
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(saved))
    config = make_config(str(saved), "--training.dataset_split", "test", seq_len=16, batch_size=1)
    dataset = PackedDataset(config, tokenizer, dp_rank=0, dp_world_size=1)
    text = tokenizer.decode(batches(dataset, 1)[0][0]["input"][0].tolist())
    assert "BBB" in text and "AAA" not in text


def empty_jsonl(tmp_path) -> str:
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    return str(path)


def empty_saved_dataset(tmp_path) -> str:
    path = tmp_path / "empty_saved"
    datasets.Dataset.from_dict({"text": []}, features=datasets.Features({"text": datasets.Value("string")})).save_to_disk(
        str(path)
    )
    return str(path)


@pytest.mark.parametrize(
    "make_empty, streaming",
    [(empty_jsonl, False), (empty_jsonl, True), (empty_saved_dataset, False)],
    ids=["jsonl", "jsonl-streaming", "saved-to-disk"],
)
def test_empty_dataset_is_a_config_error(tmp_path, make_config, tokenizer, make_empty, streaming):
    config = make_config(make_empty(tmp_path), *(["--training.streaming"] if streaming else []))
    with pytest.raises(ConfigError, match="empty"):
        PackedDataset(config, tokenizer, dp_rank=0, dp_world_size=1)


def test_dataset_with_columns_but_no_rows_is_a_config_error_before_the_first_batch(tmp_path, make_config, tokenizer):
    path = tmp_path / "empty.parquet"
    datasets.Dataset.from_dict({"text": []}, features=datasets.Features({"text": datasets.Value("string")})).to_parquet(
        str(path)
    )
    with pytest.raises(ConfigError, match=r"empty|0 documents"):
        batches(PackedDataset(make_config(str(path)), tokenizer, dp_rank=0, dp_world_size=1), 1)


def test_fewer_documents_than_readers_is_a_config_error():
    dataset = datasets.Dataset.from_dict({"text": ["a", "b", "c"]})
    with pytest.raises(ConfigError, match="3 documents, fewer than the 4 data readers"):
        MapStream(dataset, "text", 0, 4, seed=0, name="tiny")


@pytest.mark.parametrize(
    "streaming, message",
    [(False, "3 documents, fewer than the 4 data readers"), (True, "gives reader 3 no documents")],
    ids=["map-style", "streaming"],
)
def test_fewer_documents_than_data_parallel_ranks_is_a_config_error(
    tmp_path, make_config, tokenizer, streaming, message
):
    path = write_jsonl(tmp_path / "three.jsonl", ["a", "b", "c"])
    config = make_config(path, *(["--training.streaming"] if streaming else []))
    dataset = PackedDataset(config, tokenizer, dp_rank=3, dp_world_size=4)
    with pytest.raises(ConfigError, match=message):
        batches(dataset, 1)


def test_a_directory_of_jsonl_shards_is_one_dataset(tmp_path):
    from flame.data.sources import SourceSpec, load_source

    for shard in range(3):
        (tmp_path / f"part-{shard}.jsonl").write_text("".join(f'{{"text": "doc {shard}-{i}"}}\n' for i in range(5)))
    dataset = load_source(SourceSpec(path=str(tmp_path)), streaming=False)
    assert sorted(dataset["text"]) == sorted(f"doc {s}-{i}" for s in range(3) for i in range(5))


def test_the_builtin_corpus_loads_as_a_dataset():
    from flame.data.sources import SourceSpec, load_source, text_column

    spec = SourceSpec(path="builtin:python-stdlib")
    dataset = load_source(spec, streaming=True)
    assert text_column(dataset, spec, None) == "text"
    assert "def " in "".join(row["text"] for row in dataset.take(20))


def test_dataset_name_and_data_files_select_inside_a_local_dataset(tmp_path):
    from flame.data.sources import SourceSpec, load_source

    for name in ("alpha", "beta"):
        (tmp_path / name).mkdir()
        for part in range(2):
            rows = "".join(f'{{"text": "{name} {part}-{i}"}}\n' for i in range(3))
            (tmp_path / name / f"part-{part}.jsonl").write_text(rows)
    (tmp_path / "README.md").write_text(
        "---\nconfigs:\n- config_name: alpha\n  data_files: alpha/*.jsonl\n"
        "- config_name: beta\n  data_files: beta/*.jsonl\n---\n"
    )
    beta = load_source(SourceSpec(path=str(tmp_path), name="beta"), streaming=False)
    assert sorted(beta["text"]) == sorted(f"beta {p}-{i}" for p in range(2) for i in range(3))
    one_file = load_source(SourceSpec(path=str(tmp_path), data_files="alpha/part-1.jsonl"), streaming=False)
    assert sorted(one_file["text"]) == [f"alpha 1-{i}" for i in range(3)]
