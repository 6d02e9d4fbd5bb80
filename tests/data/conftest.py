"""Shared helpers and fixtures of the data pipeline tests."""

import collections
import json
import pickle
import random

import datasets
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from flame.prepare import settled
from flame.data.loader import FlameDataLoader
from flame.data.packing import (
    Packer,
)
from flame.data.shards import DataPlan, DataShard
from flame.data.tokenizer import load_tokenizer
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
        return settled(
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
        for key, value in inputs_a.items():
            same = torch.equal(value, inputs_b[key]) if torch.is_tensor(value) else value == inputs_b[key]
            assert same, f"{key} differs at batch {step}"


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


@pytest.fixture
def two_sources(tmp_path) -> tuple[str, str]:
    a = write_jsonl(tmp_path / "a.jsonl", random_texts(90, prefix="AAA", seed=1))
    b = write_jsonl(tmp_path / "b.jsonl", random_texts(70, prefix="BBB", seed=2))
    return a, b
