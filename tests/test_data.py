"""Data pipeline: packing semantics, document delimiters, exact and elastic resume, mixing, coverage, bad input."""

import collections
import itertools
import json
import pickle
import random
import re

import datasets
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from torchtitan.components.loss import IGNORE_INDEX
from transformers import PreTrainedTokenizerFast

from flame.config_manager import ConfigError, FlameConfigManager
from flame.data.loader import FlameDataLoader, build_dataloader
from flame.data.packing import (
    DOCUMENTS_PER_READ,
    DocumentMixer,
    Packer,
    TokenizedSource,
    balanced_pieces,
    collate_rows,
)
from flame.data.shards import DataPlan, DataShard
from flame.data.sources import SourceSpec, document_column, load_source
from flame.data.streams import IterStream, MapStream, SourceExhausted
from flame.data.tokenizer import Delimiters, document_delimiters, load_tokenizer
from tests.conftest import TOKENIZER

WORDS = ["alpha", "beta", "gamma", "delta", "kappa", "lambda", "omega", "sigma", "theta", "zeta"]
EOS_TEXT = "<|endoftext|>"  # the builtin tokenizer's EOS (id 0), its only delimiter
SHARDS_4 = ["--training.data_shards", "4"]  # few logical shards keep small test datasets fast


# --------------------------------------------------------------------------- helpers


class ListDocuments:
    """A one-source document stream over hand-made documents: document i holds distinct, increasing token ids."""

    def __init__(self, lengths: list[int]):
        self.sources = [self]
        self.documents, start = [], 1
        for length in lengths:
            self.documents.append(np.arange(start, start + length, dtype=np.int64))
            start += length
        self.index = 0

    def next_document(self) -> tuple[int, np.ndarray]:
        document = self.documents[self.index]
        self.index += 1
        return 0, document

    def state_dict(self) -> dict:
        return {"index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.index = state["index"]


class ListStream:
    """A text stream with read(count)/state_dict/load_state_dict, cycling over ``texts``."""

    def __init__(self, texts: list):
        self.texts, self.position = texts, 0

    def read(self, count: int) -> list:
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


def pack(rows: int, context_len: int = SEQ_LEN, lengths: list[int] = LENGTHS, document_mask: bool = True) -> list:
    packer = Packer(ListDocuments(lengths), SEQ_LEN, context_len, document_mask)
    return [packer.next_row() for _ in range(rows)]


def segment_starts(row) -> list[int]:
    return list(np.cumsum([0] + row.segments[:-1]))


def write_jsonl(path, texts: list, column: str = "text") -> str:
    path.write_text("".join(json.dumps({column: text}) + "\n" for text in texts))
    return str(path)


def random_texts(count: int, prefix: str = "doc", seed: int = 0, max_words: int = 60) -> list[str]:
    rng = random.Random(seed)
    return [
        f"{prefix} {i} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, max_words))) for i in range(count)
    ]


def save_token_dataset(path, documents: list[list[int]]) -> str:
    datasets.Dataset.from_dict({"input_ids": documents}).save_to_disk(str(path))
    return str(path)


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


def saved_tokenizer(path, tok: PreTrainedTokenizerFast) -> str:
    """``tok`` saved as a tokenizer directory, for --model.tokenizer_path."""
    tok.save_pretrained(str(path))
    return str(path)


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


def make_loader(config, tokenizer, dp_rank: int = 0, dp_world_size: int = 1, plan: DataPlan | None = None):
    plan = plan if plan is not None else DataPlan.from_config(config, tokenizer)
    return FlameDataLoader(plan, dp_rank, dp_world_size, config.training.dataloader)


def take(iterator, count: int) -> list:
    return [next(iterator) for _ in range(count)]


def batches(loader, count: int) -> list:
    return take(iter(loader), count)


def checkpointed(state: dict) -> dict:
    return pickle.loads(pickle.dumps(state))  # as a checkpoint stores and reloads it


def assert_same_batches(expected: list, actual: list) -> None:
    assert len(expected) == len(actual)
    for step, ((inputs_a, labels_a), (inputs_b, labels_b)) in enumerate(zip(expected, actual)):
        assert torch.equal(labels_a, labels_b), f"labels differ at batch {step}"
        assert inputs_a.keys() == inputs_b.keys()
        for key in inputs_a:
            assert torch.equal(inputs_a[key], inputs_b[key]), f"{key} differs at batch {step}"


def batch_tokens(batch_list: list) -> list[int]:
    return torch.cat([inputs["input"].flatten() for inputs, _ in batch_list]).tolist()


def row_key(input_ids) -> bytes:
    return np.asarray(input_ids, dtype=np.int64).tobytes()


def delivered_rows(batch_list: list) -> list[bytes]:
    return [row_key(row) for inputs, _ in batch_list for row in inputs["input"].numpy()]


class ShardStreams:
    """The rows every logical shard produces when run alone and uninterrupted: the resume oracle."""

    def __init__(self, plan: DataPlan, shards: int, rows_per_shard: int):
        self.shards = shards
        self.rows = []
        for shard in range(shards):
            pipeline = DataShard(plan, shard, shards)
            self.rows.append([pipeline.next_row().input_ids for _ in range(rows_per_shard)])

    def assert_continuous(self, delivered: list[bytes]) -> list[int]:
        """The delivered rows are exactly a prefix of every shard's stream: none repeated, none skipped.

        Returns how many rows of each shard were delivered. (Rows are matched by content; two
        rows can be equal, e.g. the same document tail in two epochs, so they are counted.)
        """
        left = collections.Counter(delivered)
        consumed = []
        for rows in self.rows:
            count = 0
            while count < len(rows) and left[row_key(rows[count])] > 0:
                left[row_key(rows[count])] -= 1
                count += 1
            assert count < len(rows), "the oracle is too short"
            consumed.append(count)
        unmatched = sum(left.values())
        assert unmatched == 0, (
            f"{unmatched} delivered rows are repeats or come after a skipped row "
            f"(prefixes matched per shard: {consumed})"
        )
        return consumed

    def assert_first_epoch_covered(self, tokenizer, consumed: list[int], documents: int) -> None:
        """Decoded, the consumed rows hold each document id exactly once in the first epoch of all shards."""
        seen = []
        for shard, ids in enumerate(self.consumed_documents(tokenizer, consumed)):
            share = len(range(shard, documents, self.shards))  # shard s reads every S-th document of an epoch
            assert len(ids) >= share, f"shard {shard} did not finish its first epoch ({len(ids)} < {share})"
            seen.extend(ids[:share])
        assert sorted(seen) == list(range(documents)), "a document was read twice or never in the first epoch"

    def consumed_documents(self, tokenizer, consumed: list[int]) -> list[list[int]]:
        out = []
        for shard, count in enumerate(consumed):
            text = tokenizer.decode(np.concatenate(self.rows[shard][:count]).tolist()) if count else ""
            out.append([int(doc.split()[1]) for doc in text.split(EOS_TEXT)[:-1]])  # complete documents
        return out


# --------------------------------------------------------------------------- packing


def test_rows_are_seq_len_consecutive_tokens_of_the_document_stream():
    rows = pack(20)
    tokens, _, _ = document_stream(LENGTHS)
    for row in rows:
        assert len(row.input_ids) == len(row.labels) == len(row.position_ids) == sum(row.segments) == SEQ_LEN
    np.testing.assert_array_equal(np.concatenate([row.input_ids for row in rows]), tokens[: 20 * SEQ_LEN])


@pytest.mark.parametrize("context_len", [SEQ_LEN, 5])
def test_label_inside_a_document_is_its_next_token_even_across_rows_and_segments(context_len):
    rows = pack(20, context_len)
    tokens, _, last = document_stream(LENGTHS)
    labels = np.concatenate([row.labels for row in rows])
    inner = np.flatnonzero(~last[: len(labels)])
    np.testing.assert_array_equal(labels[inner], tokens[inner + 1])


@pytest.mark.parametrize("context_len", [SEQ_LEN, 5])
def test_last_token_of_every_document_has_ignore_label(context_len):
    rows = pack(20, context_len)
    _, _, last = document_stream(LENGTHS)
    labels = np.concatenate([row.labels for row in rows])
    ends = np.flatnonzero(last[: len(labels)])
    assert len(ends) > 10
    assert (labels[ends] == IGNORE_INDEX).all()
    assert (labels[np.flatnonzero(~last[: len(labels)])] != IGNORE_INDEX).all()


@pytest.mark.parametrize("context_len", [SEQ_LEN, 5])
def test_no_segment_spans_a_document_boundary(context_len):
    _, owner, _ = document_stream(LENGTHS)
    for index, row in enumerate(pack(20, context_len)):
        for start, length in zip(segment_starts(row), row.segments):
            begin = index * SEQ_LEN + start
            assert len(set(owner[begin : begin + length])) == 1, f"row {index}: segment at {start} mixes documents"


@pytest.mark.parametrize("context_len", [SEQ_LEN, 5])
def test_position_ids_restart_at_zero_in_each_segment(context_len):
    for row in pack(20, context_len):
        np.testing.assert_array_equal(row.position_ids, np.concatenate([np.arange(length) for length in row.segments]))


@pytest.mark.parametrize("context_len", [SEQ_LEN, 7, 5, 1])
def test_segments_never_exceed_context_len(context_len):
    rows = pack(20, context_len)
    assert all(0 < length <= context_len for row in rows for length in row.segments)
    # ... and reach it: a document of exactly context_len at a row start is one segment.
    assert pack(1, context_len, lengths=[context_len] + LENGTHS)[0].segments[0] == context_len


def near_equal_splits(length: int, context_len: int) -> list[set[int]]:
    """Every way to cut ``length`` tokens into the fewest pieces of at most context_len, sizes differing by <= 1."""
    count = -(-length // context_len)
    small, extra = divmod(length, count)
    ways = []
    for big in itertools.combinations(range(count), extra):
        sizes = [small + (i in big) for i in range(count)]
        ways.append(set(np.cumsum(sizes)[:-1].tolist()))
    return ways


@pytest.mark.parametrize("context_len", [SEQ_LEN, 7, 5, 3])
def test_segments_are_cut_only_at_row_ends_document_ends_and_near_equal_piece_ends(context_len):
    rows = pack(20, context_len)
    cuts = {index * SEQ_LEN + int(start) for index, row in enumerate(rows) for start in segment_starts(row)}
    cuts.add(len(rows) * SEQ_LEN)
    row_ends = set(range(0, len(rows) * SEQ_LEN + 1, SEQ_LEN))
    start = 0
    for length in LENGTHS:
        end = start + length
        if end > len(rows) * SEQ_LEN:
            break
        assert start in cuts and end in cuts, "a document boundary is not a segment boundary"
        inside = {cut - start for cut in cuts if start < cut < end}
        rows_inside = {row_end - start for row_end in row_ends if start < row_end < end}
        assert any(inside == pieces | rows_inside for pieces in near_equal_splits(length, context_len)), (
            f"document of {length} tokens at {start} is cut at {sorted(inside)}: not its row ends plus the ends "
            "of the fewest near-equal pieces"
        )
        start = end


@pytest.mark.parametrize("context_len, halves", [(5, [3, 3]), (8, [5, 4]), (3, [2, 2])])
def test_a_document_one_token_longer_than_context_len_splits_into_two_halves(context_len, halves):
    # Row 0 holds a 1-token document, then a context_len+1 document, then filler.
    rows = pack(1, context_len, lengths=[1, context_len + 1, 30])
    assert rows[0].segments[0] == 1
    assert sorted(rows[0].segments[1:3], reverse=True) == halves, "splitting left a short fragment"


@pytest.mark.parametrize("context_len", range(3, 17))
def test_splitting_a_document_never_leaves_a_one_token_piece(context_len):
    for length in range(1, 6 * context_len):
        pieces = balanced_pieces(length, context_len)
        assert sum(pieces) == length and max(pieces) <= context_len
        assert len(pieces) == -(-length // context_len), "not the fewest pieces"
        assert max(pieces) - min(pieces) <= 1, "pieces are not near-equal"
        assert length == 1 or min(pieces) >= 2, f"{length} tokens, context {context_len}: pieces {pieces}"


def test_a_whole_document_inside_one_row_has_positions_from_zero_to_its_length():
    # Stream offsets: doc0 0-2, doc1 3-22, doc2 23, doc3 24-30, doc4 31-46; docs 2 and 3 lie inside row 1.
    lengths = [3, 20, 1, 7, 16]
    rows = pack(2, lengths=lengths)
    # row 1 covers stream tokens 16..31: doc 1 tokens 13..19 (7), doc 2 (1), doc 3 (7), doc 4 first token (1)
    np.testing.assert_array_equal(rows[1].position_ids, [0, 1, 2, 3, 4, 5, 6, 0, 0, 1, 2, 3, 4, 5, 6, 0])
    assert rows[1].segments == [7, 1, 7, 1]


def test_row_counts_the_tokens_and_the_documents_starting_in_it():
    rows = pack(2, lengths=[3, 20, 1, 7, 16])
    assert [row.source_tokens.tolist() for row in rows] == [[SEQ_LEN], [SEQ_LEN]]
    assert [row.source_documents.tolist() for row in rows] == [[2], [3]]  # doc 1 started in row 0


@pytest.mark.parametrize("context_len", [SEQ_LEN, 5])
def test_collate_rows_cu_seqlens_mark_the_segments_of_all_rows(context_len):
    rows = pack(4, context_len)
    inputs, labels = collate_rows(rows)
    lengths = [length for row in rows for length in row.segments]
    assert inputs["input"].shape == labels.shape == inputs["position_ids"].shape == (4, SEQ_LEN)
    assert torch.equal(inputs["input"], torch.from_numpy(np.stack([row.input_ids for row in rows])))
    assert torch.equal(labels, torch.from_numpy(np.stack([row.labels for row in rows])))
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


@pytest.mark.parametrize("document_mask", [True, False])
@pytest.mark.parametrize("rows_before", [0, 1, 2, 3, 5, 8])
def test_packer_resumes_exactly_from_its_state(rows_before, document_mask):
    packer = Packer(ListDocuments(LENGTHS), SEQ_LEN, 5, document_mask)
    for _ in range(rows_before):
        packer.next_row()
    state = checkpointed(packer.state_dict())
    expected = [packer.next_row() for _ in range(6)]
    resumed = Packer(ListDocuments(LENGTHS), SEQ_LEN, 5, document_mask)
    resumed.load_state_dict(state)
    for want, got in zip(expected, [resumed.next_row() for _ in range(6)]):
        for field in ("input_ids", "labels", "position_ids", "source_tokens", "source_documents"):
            np.testing.assert_array_equal(getattr(want, field), getattr(got, field))
        assert want.segments == got.segments


# --------------------------------------------------------------------------- document_mask off


def test_without_document_mask_positions_run_over_the_whole_row():
    for row in pack(20, document_mask=False):
        np.testing.assert_array_equal(row.position_ids, np.arange(SEQ_LEN))
        assert row.segments == [SEQ_LEN]


@pytest.mark.parametrize("context_len", [7, 5, 4])
def test_without_document_mask_segments_are_the_same_in_every_row_whatever_the_documents(context_len):
    rows = pack(20, context_len, document_mask=False)
    segments = rows[0].segments
    assert all(row.segments == segments for row in rows)
    assert sum(segments) == SEQ_LEN and max(segments) <= context_len
    assert len(segments) == -(-SEQ_LEN // context_len)
    for row in rows:
        np.testing.assert_array_equal(row.position_ids, np.concatenate([np.arange(n) for n in segments]))


@pytest.mark.parametrize("context_len", [SEQ_LEN, 5])
def test_without_document_mask_labels_still_stop_at_document_ends(context_len):
    rows = pack(20, context_len, document_mask=False)
    tokens, _, last = document_stream(LENGTHS)
    np.testing.assert_array_equal(np.concatenate([row.input_ids for row in rows]), tokens[: 20 * SEQ_LEN])
    labels = np.concatenate([row.labels for row in rows])
    ends = np.flatnonzero(last[: len(labels)])
    assert len(ends) > 10 and (labels[ends] == IGNORE_INDEX).all()
    inner = np.flatnonzero(~last[: len(labels)])
    np.testing.assert_array_equal(labels[inner], tokens[inner + 1])


def test_no_document_mask_flag_gives_batches_one_segment_per_row(tmp_path, make_config, tokenizer):
    data = write_jsonl(tmp_path / "d.jsonl", random_texts(40, max_words=8))
    config = make_config(data, "--training.no-document_mask", "--training.data_shards", "4", seq_len=32, batch_size=3)
    inputs, labels = batches(make_loader(config, tokenizer), 1)[0]
    assert torch.equal(inputs["position_ids"], torch.arange(32).repeat(3, 1))
    assert inputs["cu_seqlens"].tolist() == [0, 32, 64, 96]
    assert (labels[inputs["input"] == 0] == IGNORE_INDEX).all(), "an EOS has a target in the next document"


# --------------------------------------------------------------------------- tokenized sources and mixing


def number_texts(count: int) -> list[str]:
    return [" ".join(str(t) for t in range(i, i + 1 + i % 5)) for i in range(count)]


def parse_numbers(batch: list[str]) -> list[list[int]]:
    return [[int(word) for word in text.split()] for text in batch]


def test_tokenized_source_resumes_in_the_middle_of_a_read():
    texts = number_texts(150)
    source = TokenizedSource(ListStream(texts), parse_numbers, Delimiters(bos=None, eos=999))
    for _ in range(DOCUMENTS_PER_READ + 6):
        source.next_document()
    state = checkpointed(source.state_dict())
    assert state["reads"] == 1
    expected = [source.next_document() for _ in range(DOCUMENTS_PER_READ)]
    resumed = TokenizedSource(ListStream(texts), parse_numbers, Delimiters(bos=None, eos=999))
    resumed.load_state_dict(state)
    for want, got in zip(expected, [resumed.next_document() for _ in range(DOCUMENTS_PER_READ)]):
        np.testing.assert_array_equal(want, got)
    np.testing.assert_array_equal(expected[0], parse_numbers([texts[DOCUMENTS_PER_READ + 6]])[0] + [999])


def test_shuffled_tokenized_source_permutes_each_read_and_resumes_exactly():
    texts = number_texts(60)
    window = 10

    def source():
        return TokenizedSource(ListStream(texts), parse_numbers, Delimiters(bos=None, eos=999), window, (3, 1))

    shuffled = source()
    documents = [shuffled.next_document().tolist() for _ in range(6 * window)]
    in_order = [ids + [999] for ids in parse_numbers(texts[: 6 * window])]
    for read in range(6):
        got, want = documents[read * window : (read + 1) * window], in_order[read * window : (read + 1) * window]
        assert sorted(got) == sorted(want), f"read {read} is not a permutation of the stream's documents"
    assert documents != in_order
    assert documents[:window] != [documents[window + i] for i in range(window)]
    for before in (0, 3, window, 2 * window + 7):
        first = source()
        for _ in range(before):
            first.next_document()
        state = checkpointed(first.state_dict())
        resumed = source()
        resumed.load_state_dict(state)
        assert [resumed.next_document().tolist() for _ in range(15)] == documents[before : before + 15]


def fixed_source(token: int, lengths: list[int]) -> TokenizedSource:
    """A source whose documents are runs of ``token`` with these lengths (cycling), no delimiters added."""
    return TokenizedSource(ListStream([[token] * n for n in lengths]), None, Delimiters(bos=None, eos=None))


def test_token_mixing_keeps_every_source_within_one_document_of_its_share():
    long, short = [150, 260, 90, 300], [2, 7, 3, 11, 5]
    mixer = DocumentMixer([fixed_source(1, long), fixed_source(2, short)], [0.7, 0.3], seed=0, unit="tokens")
    for _ in range(3000):
        index, document = mixer.next_document()
        assert set(document.tolist()) == {index + 1}
        total = sum(mixer.tokens)
        assert abs(mixer.tokens[0] - 0.7 * total) <= max(long), f"source 0 drifted: {mixer.tokens}"
    assert mixer.tokens[0] / sum(mixer.tokens) == pytest.approx(0.7, abs=0.005)


def test_document_mixing_draws_documents_with_the_probabilities_and_counts_tokens():
    mixer = DocumentMixer([fixed_source(1, [100]), fixed_source(2, [3])], [0.8, 0.2], seed=4, unit="documents")
    picks = [mixer.next_document()[0] for _ in range(4000)]
    assert picks.count(0) / len(picks) == pytest.approx(0.8, abs=0.03)
    assert mixer.tokens == [100 * picks.count(0), 3 * picks.count(1)]


@pytest.mark.parametrize("unit", ["documents", "tokens"])
def test_mixer_resumes_exactly_from_its_state(unit):
    def mixer():
        return DocumentMixer([fixed_source(1, [9, 4, 30]), fixed_source(2, [2, 5])], [0.6, 0.4], seed=7, unit=unit)

    first = mixer()
    for _ in range(77):
        first.next_document()
    state = checkpointed(first.state_dict())
    expected = [first.next_document() for _ in range(50)]
    resumed = mixer()
    resumed.load_state_dict(state)
    got = [resumed.next_document() for _ in range(50)]
    assert [(i, d.tolist()) for i, d in got] == [(i, d.tolist()) for i, d in expected]
    assert resumed.tokens == first.tokens


# --------------------------------------------------------------------------- delimiters


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


# --------------------------------------------------------------------------- columns and pretokenized data


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


# --------------------------------------------------------------------------- exact resume (same layout)


@pytest.fixture
def two_sources(tmp_path) -> tuple[str, str]:
    a = write_jsonl(tmp_path / "a.jsonl", random_texts(90, prefix="AAA", seed=1))
    b = write_jsonl(tmp_path / "b.jsonl", random_texts(70, prefix="BBB", seed=2))
    return a, b


RESUME_CASES = {
    "map-style-64-shards": lambda a, b: [a],
    "map-style-context-len": lambda a, b: [a, "--training.context_len", "24", *SHARDS_4],
    "streaming": lambda a, b: [a, "--training.streaming", *SHARDS_4],
    "mixed": lambda a, b: [f"{a},{b}", "--training.data_probs", "0.7,0.3", *SHARDS_4],
    "mixed-streaming": lambda a, b: [f"{a},{b}", "--training.data_probs", "0.7,0.3", "--training.streaming", *SHARDS_4],
    "streaming-shuffle-buffer": lambda a, b: [a, "--training.streaming", "--training.shuffle_buffer", "20", *SHARDS_4],
    "row-shuffle-buffer": lambda a, b: [a, "--training.row_shuffle_buffer", "5", *SHARDS_4],
    "mix-unit-tokens": lambda a, b: [f"{a},{b}", "--training.data_probs", "0.7,0.3", "--training.mix_unit", "tokens",
                                     *SHARDS_4],
    "no-document-mask": lambda a, b: [a, "--training.no-document_mask", "--training.context_len", "24", *SHARDS_4],
}


@pytest.mark.parametrize("batches_before", [3, 40])  # 40 batches: past the end of the first epoch
@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_loader_resumes_with_exactly_the_next_batches(case, batches_before, two_sources, make_config, tokenizer):
    config = make_config(*RESUME_CASES[case](*two_sources))
    plan = DataPlan.from_config(config, tokenizer)
    first = make_loader(config, tokenizer, plan=plan)
    iterator = iter(first)
    take(iterator, batches_before)
    state = checkpointed(first.state_dict())
    expected = take(iterator, 8)

    resumed = make_loader(config, tokenizer, plan=plan)
    resumed.load_state_dict(state)
    assert_same_batches(expected, batches(resumed, 8))


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_with_workers_resumes_with_exactly_the_next_batches(workers, two_sources, make_config, tokenizer):
    config = make_config(two_sources[0], "--training.num_workers", str(workers), *SHARDS_4)
    first = build_dataloader(1, 0, tokenizer, config)
    iterator = iter(first)
    take(iterator, 7)  # odd: the next batch comes from the second worker
    state = checkpointed(first.state_dict())
    expected = take(iterator, 6)
    del iterator

    resumed = build_dataloader(1, 0, tokenizer, config)
    resumed.load_state_dict(state)
    assert_same_batches(expected, batches(resumed, 6))


def test_loader_state_before_the_first_batch_resumes_at_the_start(two_sources, make_config, tokenizer):
    config = make_config(two_sources[0], *SHARDS_4)
    first = make_loader(config, tokenizer)
    state = checkpointed(first.state_dict())
    assert list(state) == ["state"] and isinstance(state["state"], bytes)
    expected = batches(first, 3)
    resumed = make_loader(config, tokenizer)
    resumed.load_state_dict(state)
    assert_same_batches(expected, batches(resumed, 3))


def rank_loaders(config, tokenizer, plan, ranks: int, state: dict | None = None) -> list:
    loaders = [make_loader(config, tokenizer, rank, ranks, plan=plan) for rank in range(ranks)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(checkpointed(state))
    return loaders


def checkpoint_of(loaders: list) -> dict:
    """The checkpoint entry every rank would write, made in one process."""
    return checkpointed(loaders[0].checkpoint_entry([loader.local_state() for loader in loaders]))


@pytest.mark.parametrize("resumes", [1, 2])
def test_several_ranks_resume_with_exactly_the_next_batches_every_time(resumes, two_sources, make_config, tokenizer):
    config = make_config(two_sources[0], *SHARDS_4, batch_size=3)
    plan = DataPlan.from_config(config, tokenizer)
    legs = [2, 3, 4][: resumes + 1]
    uninterrupted = [batches(loader, sum(legs)) for loader in rank_loaders(config, tokenizer, plan, 2)]

    state, done = None, 0
    for leg in legs:
        loaders = rank_loaders(config, tokenizer, plan, 2, state)
        for rank, loader in enumerate(loaders):
            assert_same_batches(uninterrupted[rank][done : done + leg], batches(loader, leg))
        state, done = checkpoint_of(loaders), done + leg


def test_data_shards_zero_on_resume_takes_the_checkpoints_count(two_sources, make_config, tokenizer):
    first_config = make_config(two_sources[0], *SHARDS_4)
    first = make_loader(first_config, tokenizer)
    iterator = iter(first)
    take(iterator, 5)
    state = checkpointed(first.state_dict())
    expected = take(iterator, 4)
    resumed = make_loader(make_config(two_sources[0]), tokenizer)  # data_shards 0
    resumed.load_state_dict(state)
    assert_same_batches(expected, batches(resumed, 4))
    assert resumed.dataset.shards == 4


def test_default_data_shards_is_64_or_the_number_of_readers(two_sources, make_config, tokenizer):
    config = make_config(two_sources[0])
    plan = DataPlan.from_config(config, tokenizer)
    assert make_loader(config, tokenizer, 0, 2, plan=plan).dataset.shards == 64
    assert make_loader(config, tokenizer, 0, 80, plan=plan).dataset.shards == 80


# --------------------------------------------------------------------------- elastic resume (another layout)


@pytest.fixture
def numbered(tmp_path) -> tuple[str, int]:
    """48 documents 'doc <i> ...' of varied length."""
    count = 48
    return write_jsonl(tmp_path / "numbered.jsonl", random_texts(count, max_words=14, seed=3)), count


def elastic_config(make_config, path: str, *extra: str):
    return make_config(path, "--training.data_shards", "4", *extra, seq_len=32, batch_size=3)


def test_two_ranks_resumed_on_one_continue_every_shard_without_repeat_or_gap(numbered, make_config, tokenizer):
    path, count = numbered
    config = elastic_config(make_config, path)
    plan = DataPlan.from_config(config, tokenizer)
    before = rank_loaders(config, tokenizer, plan, 2)
    delivered = [row for loader in before for row in delivered_rows(batches(loader, 3))]

    after = make_loader(config, tokenizer, plan=plan)
    after.load_state_dict(checkpoint_of(before))
    delivered += delivered_rows(batches(after, 12))

    oracle = ShardStreams(plan, 4, 30)
    consumed = oracle.assert_continuous(delivered)
    assert sum(consumed) == 2 * 3 * 3 + 12 * 3
    oracle.assert_first_epoch_covered(tokenizer, consumed, count)


def test_one_rank_resumed_on_two_continues_every_shard_without_repeat_or_gap(numbered, make_config, tokenizer):
    path, count = numbered
    config = elastic_config(make_config, path)
    plan = DataPlan.from_config(config, tokenizer)
    before = make_loader(config, tokenizer, plan=plan)
    delivered = delivered_rows(batches(before, 5))

    for loader in rank_loaders(config, tokenizer, plan, 2, checkpointed(before.state_dict())):
        delivered += delivered_rows(batches(loader, 7))

    oracle = ShardStreams(plan, 4, 30)
    consumed = oracle.assert_continuous(delivered)
    assert sum(consumed) == 5 * 3 + 2 * 7 * 3
    oracle.assert_first_epoch_covered(tokenizer, consumed, count)


@pytest.mark.parametrize("workers_before, workers_after", [(2, 0), (1, 2)])
def test_another_worker_count_continues_every_shard_without_repeat_or_gap(
    workers_before, workers_after, numbered, make_config, tokenizer
):
    path, count = numbered
    config = elastic_config(make_config, path, "--training.num_workers", str(workers_before))
    before = build_dataloader(1, 0, tokenizer, config)
    delivered = delivered_rows(batches(before, 5))
    state = checkpointed(before.state_dict())

    config = elastic_config(make_config, path, "--training.num_workers", str(workers_after))
    after = build_dataloader(1, 0, tokenizer, config)
    after.load_state_dict(state)
    delivered += delivered_rows(batches(after, 12))

    oracle = ShardStreams(DataPlan.from_config(config, tokenizer), 4, 30)
    consumed = oracle.assert_continuous(delivered)
    assert sum(consumed) == 17 * 3
    oracle.assert_first_epoch_covered(tokenizer, consumed, count)


def test_a_chain_of_elastic_resumes_continues_every_shard_without_repeat_or_gap(numbered, make_config, tokenizer):
    path, count = numbered
    config = elastic_config(make_config, path)
    plan = DataPlan.from_config(config, tokenizer)
    state, delivered = None, []
    for ranks, steps in ((1, 3), (2, 3), (1, 6)):
        loaders = rank_loaders(config, tokenizer, plan, ranks, state)
        delivered += [row for loader in loaders for row in delivered_rows(batches(loader, steps))]
        state = checkpoint_of(loaders)

    oracle = ShardStreams(plan, 4, 30)
    consumed = oracle.assert_continuous(delivered)
    assert sum(consumed) == (3 + 2 * 3 + 6) * 3
    oracle.assert_first_epoch_covered(tokenizer, consumed, count)


def test_elastic_resume_keeps_the_runs_per_source_counts(numbered, make_config, tokenizer):
    path, _ = numbered
    config = elastic_config(make_config, path)
    plan = DataPlan.from_config(config, tokenizer)
    before = rank_loaders(config, tokenizer, plan, 2)
    for loader in before:
        batches(loader, 3)
    total = sum(loader.source_tokens for loader in before)
    assert total.tolist() == [2 * 3 * 3 * 32]
    after = rank_loaders(config, tokenizer, plan, 4, checkpoint_of(before))
    assert sum(loader.source_tokens for loader in after).tolist() == total.tolist()
    documents = sum(loader.source_documents for loader in before)
    assert sum(loader.source_documents for loader in after).tolist() == documents.tolist()


# --------------------------------------------------------------------------- mixing


def test_data_probs_are_the_fraction_of_documents_drawn_from_each_source(tmp_path, make_config, tokenizer):
    # A's documents are ~4x longer than B's: a token-weighted mix would be far from 0.8.
    a = write_jsonl(tmp_path / "a.jsonl", [f"AAA {i} " + " ".join(WORDS) for i in range(150)])
    b = write_jsonl(tmp_path / "b.jsonl", [f"BBB {i}" for i in range(150)])
    config = make_config(f"{a},{b}", "--training.data_probs", "0.8,0.2", seq_len=256, batch_size=4)
    text = tokenizer.decode(batch_tokens(batches(make_loader(config, tokenizer), 30)))
    from_a, from_b = text.count("AAA "), text.count("BBB ")
    assert from_a + from_b >= 1000
    assert from_a / (from_a + from_b) == pytest.approx(0.8, abs=0.04)


def test_mix_unit_tokens_makes_data_probs_the_fraction_of_tokens_from_each_source(tmp_path, make_config, tokenizer):
    # A's documents are ~50x longer than B's: a document-weighted mix would give A ~99% of the tokens.
    rng = random.Random(0)
    a = save_token_dataset(tmp_path / "a", [[1] * rng.randint(150, 250) for _ in range(100)])
    b = save_token_dataset(tmp_path / "b", [[2] * rng.randint(2, 8) for _ in range(100)])
    config = make_config(
        f"{a},{b}", "--training.data_probs", "0.7,0.3", "--training.mix_unit", "tokens", "--training.data_shards", "1",
        seq_len=64, batch_size=8,
    )
    loader = make_loader(config, tokenizer)
    tokens = np.asarray(batch_tokens(batches(loader, 625)))  # 5000 rows, in stream order (one shard)
    source = np.where(tokens == 0, 0, tokens)  # an EOS belongs to the document it ends
    for i in np.flatnonzero(source == 0):
        source[i] = source[i - 1]
    from_a, from_b = int((source == 1).sum()), int((source == 2).sum())
    assert from_a + from_b == 5000 * 64
    assert from_a / (from_a + from_b) == pytest.approx(0.7, abs=0.02)
    assert loader.source_tokens.tolist() == [from_a, from_b], "the per-source token counters are not what was packed"


def test_a_source_with_probability_far_below_one_is_still_read(tmp_path, make_config, tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", [f"AAA {i}" for i in range(50)])
    b = write_jsonl(tmp_path / "b.jsonl", [f"BBB {i}" for i in range(50)])
    config = make_config(f"{a},{b}", "--training.data_probs", "99,1", *SHARDS_4, seq_len=256, batch_size=4)
    text = tokenizer.decode(batch_tokens(batches(make_loader(config, tokenizer), 10)))
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


def test_map_shards_cover_every_document_once_per_epoch():
    n = 103
    dataset = datasets.Dataset.from_dict({"text": [f"doc {i} body" for i in range(n)], "other": list(range(n))})
    shares = [doc_ids(read_epochs(MapStream(dataset, "text", c, 4, seed=5, name="t"), 2)[0]) for c in range(4)]
    assert sum(len(share) for share in shares) == n, "a document was read twice or never"
    assert set().union(*map(set, shares)) == set(range(n))
    assert all(abs(len(share) - n / 4) < 1 for share in shares)


def test_map_shards_cover_every_document_again_in_the_second_epoch_in_a_new_order():
    n = 103
    dataset = datasets.Dataset.from_dict({"text": [f"doc {i} body" for i in range(n)]})
    epochs = [read_epochs(MapStream(dataset, "text", c, 4, seed=5, name="t"), 2) for c in range(4)]
    first = [doc_ids(reader[0]) for reader in epochs]
    second = [doc_ids(reader[1]) for reader in epochs]
    assert sorted(sum(second, [])) == list(range(n))
    assert first != second, "the second epoch repeats the first one's order"
    assert sum(first, []) != list(range(n)), "the first epoch is not shuffled"


def test_map_shards_with_another_seed_read_another_order():
    dataset = datasets.Dataset.from_dict({"text": [f"doc {i}" for i in range(50)]})
    one = doc_ids(read_epochs(MapStream(dataset, "text", 0, 2, seed=1, name="t"), 1)[0])
    two = doc_ids(read_epochs(MapStream(dataset, "text", 0, 2, seed=2, name="t"), 1)[0])
    assert one != two


def test_streaming_shards_cover_every_document_once_per_epoch(tmp_path):
    n = 41
    path = write_jsonl(tmp_path / "s.jsonl", [f"doc {i} body" for i in range(n)])
    dataset = datasets.load_dataset("json", data_files=[path], split="train", streaming=True)
    shares = [doc_ids(read_epochs(IterStream(dataset, "text", c, 4, name="s"), 1)[0]) for c in range(4)]
    assert sum(len(share) for share in shares) == n
    assert set().union(*map(set, shares)) == set(range(n))


@pytest.mark.parametrize("stream", [MapStream, IterStream])
def test_stream_that_stops_at_its_end_raises_source_exhausted_after_its_share(tmp_path, stream):
    path = write_jsonl(tmp_path / "s.jsonl", [f"doc {i}" for i in range(10)])
    dataset = datasets.load_dataset("json", data_files=[path], split="train", streaming=stream is IterStream)
    extra = {"seed": 0} if stream is MapStream else {}
    reader = stream(dataset, "text", 1, 3, name="tiny-source", stop_at_end=True, **extra)
    texts = []
    with pytest.raises(SourceExhausted, match="tiny-source"):
        for _ in range(10):
            texts += reader.read(2)
    assert len(texts) == 3 and len(set(texts)) == 3


@pytest.mark.parametrize("shuffle_buffer", [0, 100])
def test_streaming_source_with_fewer_files_than_data_shards_yields_every_document_once(
    tmp_path, make_config, tokenizer, shuffle_buffer
):
    n = 75
    texts = random_texts(n, max_words=5, seed=4)
    files = [write_jsonl(tmp_path / f"part-{f}.jsonl", texts[f::3]) for f in range(3)]
    config = make_config(
        str(tmp_path / "part-*.jsonl"), "--training.streaming", "--training.data_shards", "8",
        "--training.shuffle_buffer", str(shuffle_buffer), "--training.source_exhausted", "stop",
    )
    plan = DataPlan.from_config(config, tokenizer)
    assert plan.datasets[0].num_shards == len(files) < 8
    read = []
    for shard in range(8):
        mixer = DataShard(plan, shard, 8).packer.documents
        share = []
        with pytest.raises(SourceExhausted):
            while len(share) <= n:
                share.append(mixer.next_document()[1])
        assert share, f"data shard {shard} got no documents"
        read += [tokenizer.decode(document.tolist()) for document in share]
    assert sorted(doc_ids(read)) == list(range(n)), "a document was read twice or never"


def test_data_parallel_ranks_read_disjoint_documents(tmp_path, make_config, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [f"doc {i} x" for i in range(64)])
    config = make_config(path, *SHARDS_4, seq_len=32, batch_size=1)
    plan = DataPlan.from_config(config, tokenizer)
    texts = []
    for rank in range(2):
        loader = make_loader(config, tokenizer, rank, 2, plan=plan)
        rows = [inputs["input"][0].tolist() for inputs, _ in batches(loader, 4)]
        texts.append({doc for row in rows for doc in tokenizer.decode(row).split(EOS_TEXT)[1:-1]})  # whole documents
    assert len(texts[0]) > 5 and len(texts[1]) > 5
    assert not texts[0] & texts[1]


@pytest.mark.parametrize("workers", [0, 2])
def test_source_exhausted_stop_ends_iteration_after_reading_each_document_at_most_once(
    tmp_path, make_config, tokenizer, workers
):
    lengths = [3 + i % 7 for i in range(40)]
    path = save_token_dataset(tmp_path / "tokens", [[100 + i] * length for i, length in enumerate(lengths)])
    config = make_config(
        path, "--training.source_exhausted", "stop", "--training.num_workers", str(workers), *SHARDS_4,
        seq_len=16, batch_size=2,
    )
    delivered = []
    for count, batch in enumerate(make_loader(config, tokenizer)):
        assert count < 100, "the loader did not stop at the end of the data"
        delivered.append(batch)
    tokens = np.asarray(batch_tokens(delivered))
    seen = np.bincount(tokens[tokens >= 100] - 100, minlength=len(lengths))
    assert (seen <= lengths).all(), "a document was trained on twice"
    assert (seen == lengths).sum() >= len(lengths) // 2, "the loader stopped long before the end of the data"


# --------------------------------------------------------------------------- bad input


def test_missing_text_column_is_a_config_error_listing_the_columns(tmp_path, make_config, tokenizer):
    path = tmp_path / "no_text.jsonl"
    path.write_text("".join(json.dumps({"body": f"doc {i}", "id": i}) + "\n" for i in range(10)))
    with pytest.raises(ConfigError, match=r"'text', 'content' or 'input_ids'.*columns are: body, id"):
        DataPlan.from_config(make_config(str(path)), tokenizer)


def test_missing_chosen_text_column_is_a_config_error_naming_it(tmp_path, make_config, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", ["a", "b"])
    with pytest.raises(ConfigError, match=r"column 'body'.*columns are: text"):
        DataPlan.from_config(make_config(path, "--training.text_column", "body"), tokenizer)


def test_glob_matching_no_files_is_a_config_error(tmp_path, make_config, tokenizer):
    pattern = str(tmp_path / "missing-*.jsonl")
    with pytest.raises(ConfigError, match="matches no files"):
        DataPlan.from_config(make_config(pattern), tokenizer)


def test_unknown_file_extension_is_a_config_error(tmp_path, make_config, tokenizer):
    path = tmp_path / "data.xyz"
    path.write_text('{"text": "a"}\n')
    with pytest.raises(ConfigError, match=r"cannot tell the format of .*data\.xyz"):
        DataPlan.from_config(make_config(str(path)), tokenizer)


def test_unknown_split_of_a_saved_dataset_dict_is_a_config_error(tmp_path, make_config, tokenizer):
    saved = tmp_path / "saved"
    documents = datasets.Dataset.from_dict({"text": ["a", "b", "c"]})
    datasets.DatasetDict({"train": documents, "test": documents}).save_to_disk(str(saved))
    config = make_config(str(saved), "--training.dataset_split", "validation")
    with pytest.raises(ConfigError, match=r"no split 'validation'; it has: train, test"):
        DataPlan.from_config(config, tokenizer)


def test_known_split_of_a_saved_dataset_dict_is_read(tmp_path, make_config, tokenizer):
    saved = tmp_path / "saved"
    train = datasets.Dataset.from_dict({"text": ["AAA"] * 5})
    test = datasets.Dataset.from_dict({"text": ["BBB"] * 5})
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(saved))
    config = make_config(str(saved), "--training.dataset_split", "test", "--training.data_shards", "1",
                         seq_len=16, batch_size=1)
    text = tokenizer.decode(batches(make_loader(config, tokenizer), 1)[0][0]["input"][0].tolist())
    assert "BBB" in text and "AAA" not in text


# File names do not say "empty": the error message must.
def empty_jsonl(tmp_path) -> str:
    path = tmp_path / "data.jsonl"
    path.write_text("")
    return str(path)


def empty_saved_dataset(tmp_path) -> str:
    path = tmp_path / "saved"
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
    with pytest.raises(ConfigError, match="empty|no documents"):
        DataPlan.from_config(config, tokenizer)


def test_dataset_with_columns_but_no_rows_is_a_config_error_before_the_first_batch(tmp_path, make_config, tokenizer):
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_dict({"text": []}, features=datasets.Features({"text": datasets.Value("string")})).to_parquet(
        str(path)
    )
    with pytest.raises(ConfigError, match=r"empty|no documents"):
        batches(make_loader(make_config(str(path)), tokenizer), 1)


def test_fewer_documents_than_data_shards_is_a_config_error():
    dataset = datasets.Dataset.from_dict({"text": ["a", "b", "c"]})
    with pytest.raises(ConfigError, match="3 documents, fewer than the 4 data shards.*--training.data_shards"):
        MapStream(dataset, "text", 0, 4, seed=0, name="tiny")


@pytest.mark.parametrize(
    "streaming, message",
    [(False, "3 documents, fewer than the 4 data shards"), (True, "gives data shard 3 no documents")],
    ids=["map-style", "streaming"],
)
def test_fewer_documents_than_data_shards_is_a_config_error_before_the_first_batch(
    tmp_path, make_config, tokenizer, streaming, message
):
    path = write_jsonl(tmp_path / "three.jsonl", ["a", "b", "c"])
    config = make_config(path, *SHARDS_4, *(["--training.streaming"] if streaming else []))
    with pytest.raises(ConfigError, match=message):
        batches(make_loader(config, tokenizer, 3, 4), 1)


def test_more_readers_than_data_shards_is_a_config_error(two_sources, make_config, tokenizer):
    config = make_config(two_sources[0], "--training.data_shards", "3", "--training.num_workers", "2")
    with pytest.raises(ConfigError, match=r"4 data readers .* only 3 data shards"):
        batches(make_loader(config, tokenizer, 0, 2), 1)


def test_resuming_more_readers_than_the_checkpoints_data_shards_is_a_config_error(
    two_sources, make_config, tokenizer
):
    first = make_loader(make_config(two_sources[0], "--training.data_shards", "2"), tokenizer)
    batches(first, 2)
    config = make_config(two_sources[0])  # data_shards 0: the checkpoint's 2
    resumed = make_loader(config, tokenizer, 0, 4)
    resumed.load_state_dict(checkpointed(first.state_dict()))
    with pytest.raises(ConfigError, match=r"4 data readers .* only 2 data shards"):
        batches(resumed, 1)


def test_data_shards_unlike_the_checkpoints_is_a_config_error(two_sources, make_config, tokenizer):
    first = make_loader(make_config(two_sources[0], *SHARDS_4), tokenizer)
    batches(first, 2)
    resumed = make_loader(make_config(two_sources[0], "--training.data_shards", "8"), tokenizer)
    with pytest.raises(ConfigError, match=r"--training.data_shards 8 but the run was started with 4"):
        resumed.load_state_dict(checkpointed(first.state_dict()))


def test_checkpoint_of_other_sources_is_a_config_error_naming_exclude_from_loading(two_sources, make_config, tokenizer):
    a, b = two_sources
    first = make_loader(make_config(a, *SHARDS_4), tokenizer)
    batches(first, 2)
    resumed = make_loader(make_config(f"{a},{b}", *SHARDS_4), tokenizer)
    with pytest.raises(ConfigError, match=r"data sources.*--checkpoint.exclude_from_loading dataloader"):
        resumed.load_state_dict(checkpointed(first.state_dict()))


@pytest.mark.parametrize(
    "state",
    [
        {"state": b"not a pickle"},
        {"state": pickle.dumps({"version": 99})},
        {"state": pickle.dumps([1, 2])},
        {"world_size": 2, "dp_rank_1": pickle.dumps({})},  # the layout flame wrote before logical shards
    ],
    ids=["not-a-pickle", "other-version", "not-a-dict", "old-format"],
)
def test_corrupt_loader_state_is_a_config_error_naming_the_data_parallel_rank(
    state, two_sources, make_config, tokenizer
):
    loader = make_loader(make_config(two_sources[0], *SHARDS_4), tokenizer, 1, 2)
    with pytest.raises(ConfigError, match=r"unreadable on data-parallel rank 1.*--checkpoint.exclude_from_loading"):
        loader.load_state_dict(state)


# --------------------------------------------------------------------------- sources


def test_a_directory_of_jsonl_shards_is_one_dataset(tmp_path):
    for shard in range(3):
        (tmp_path / f"part-{shard}.jsonl").write_text("".join(f'{{"text": "doc {shard}-{i}"}}\n' for i in range(5)))
    dataset = load_source(SourceSpec(path=str(tmp_path)), streaming=False)
    assert sorted(dataset["text"]) == sorted(f"doc {s}-{i}" for s in range(3) for i in range(5))


def test_the_builtin_corpus_loads_as_a_dataset():
    spec = SourceSpec(path="builtin:python-stdlib")
    dataset = load_source(spec, streaming=True)
    assert document_column(dataset, spec, None) == ("text", False)
    assert "def " in "".join(row["text"] for row in dataset.take(20))


def test_dataset_name_and_data_files_select_inside_a_local_dataset(tmp_path):
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


@pytest.mark.parametrize("streaming", [False, True])
def test_parquet_files_are_read_map_style_and_streaming(tmp_path, streaming):
    from flame.data.sources import SourceSpec, load_source

    for part in range(2):
        rows = {"text": [f"parquet {part}-{i}" for i in range(4)], "score": list(range(4))}
        datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / f"part-{part}.parquet"))
    dataset = load_source(SourceSpec(path=str(tmp_path / "*.parquet")), streaming=streaming)
    texts = [row["text"] for row in dataset]
    assert sorted(texts) == sorted(f"parquet {p}-{i}" for p in range(2) for i in range(4))


def test_preprocessed_corpus_trains_on_exactly_the_online_token_stream(tmp_path, make_config, tokenizer):
    import subprocess
    import sys

    from tests.conftest import ROOT, flame_env

    texts = write_jsonl(tmp_path / "corpus.jsonl", random_texts(40, seed=3))
    out = tmp_path / "tokenized"
    result = subprocess.run(
        [sys.executable, "-m", "flame.utils.preprocess", "--dataset", texts, "--tokenizer", TOKENIZER,
         "--out", str(out), "--num_proc", "1"],
        cwd=ROOT, env=flame_env(), capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "wrote 40 documents" in result.stdout
    online = make_config(texts, "--training.data_shards", "1", seq_len=32, batch_size=2)
    offline = make_config(str(out), "--training.data_shards", "1", seq_len=32, batch_size=2)
    # the same documents in the same order (one shard, same seed) -> the same batches
    assert_same_batches(batches(make_loader(online, tokenizer), 12), batches(make_loader(offline, tokenizer), 12))


def test_preprocess_refuses_an_existing_output(tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT, flame_env

    out = tmp_path / "exists"
    out.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "flame.utils.preprocess", "--dataset", "x.jsonl", "--tokenizer", TOKENIZER,
         "--out", str(out)], cwd=ROOT, env=flame_env(), capture_output=True, text=True,
    )
    assert result.returncode == 2 and "exists" in result.stderr
