"""Exact resume (same layout) and elastic resume (another layout) of the data loader."""

import json

import pytest

from flame.data.loader import build_dataloader
from flame.data.shards import DataPlan
from tests.data.conftest import (
    SHARDS_4,
    ShardStreams,
    assert_same_batches,
    batches,
    checkpointed,
    delivered_rows,
    make_loader,
    random_texts,
    take,
    write_jsonl,
)

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
    assert list(state) == ["state"] and json.loads(state["state"])["shards"] == 4  # JSON, never a pickle
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
    total = sum(loader.counts["tokens"] for loader in before)
    assert total.tolist() == [2 * 3 * 3 * 32]
    after = rank_loaders(config, tokenizer, plan, 4, checkpoint_of(before))
    assert sum(loader.counts["tokens"] for loader in after).tolist() == total.tolist()
    documents = sum(loader.counts["documents"] for loader in before)
    assert sum(loader.counts["documents"] for loader in after).tolist() == documents.tolist()
