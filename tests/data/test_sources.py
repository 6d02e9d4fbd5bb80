"""Tokenized sources, document mixing and its units."""

import random

import numpy as np
import pytest

from flame.data.packing import (
    DOCUMENTS_PER_READ,
    DocumentMixer,
    TokenizedSource,
)
from flame.data.tokenizer import Delimiters
from tests.data.conftest import (
    SHARDS_4,
    WORDS,
    ListStream,
    batch_tokens,
    batches,
    checkpointed,
    make_loader,
    save_token_dataset,
    write_jsonl,
)


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
    assert loader.counts["tokens"].tolist() == [from_a, from_b], "the per-source token counters are not what was packed"


def test_a_source_with_probability_far_below_one_is_still_read(tmp_path, make_config, tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", [f"AAA {i}" for i in range(50)])
    b = write_jsonl(tmp_path / "b.jsonl", [f"BBB {i}" for i in range(50)])
    config = make_config(f"{a},{b}", "--training.data_probs", "99,1", *SHARDS_4, seq_len=256, batch_size=4)
    text = tokenizer.decode(batch_tokens(batches(make_loader(config, tokenizer), 10)))
    assert 0 < text.count("BBB ") < 0.05 * text.count("AAA ")
