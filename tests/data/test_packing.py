"""Packing: rows, segments, labels, positions, balanced splitting, plain concatenation."""

import itertools

import numpy as np
import pytest
import torch
from torchtitan.components.loss import IGNORE_INDEX

from flame.data.packing import (
    Packer,
    balanced_pieces,
    collate_rows,
)
from tests.data.conftest import (
    LENGTHS,
    SEQ_LEN,
    ListDocuments,
    batches,
    checkpointed,
    document_stream,
    make_loader,
    pack,
    random_texts,
    segment_starts,
    write_jsonl,
)


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
    assert inputs["max_seqlen"] == max(lengths)


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


def test_a_batch_carries_its_longest_segment_as_a_python_int(tmp_path, make_config, tokenizer):
    # a tensor would go to the GPU with the batch, and every attention call would read it back: a host wait per layer
    data = write_jsonl(tmp_path / "d.jsonl", random_texts(40, max_words=30))
    config = make_config(data, "--training.context_len", "16", seq_len=64, batch_size=3)
    for inputs, _ in batches(make_loader(config, tokenizer), 3):
        assert type(inputs["max_seqlen"]) is int
        assert inputs["max_seqlen"] == int(inputs["cu_seqlens"].diff().max()) <= 16
