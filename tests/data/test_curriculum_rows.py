"""The rows of each step follow the curriculum (flame.config.curriculum): the context ramp cuts documents to the step's
span, a data phase draws its documents from its mixture (a source at 0 never again), and resuming from a shard's
state makes the same rows."""

import json

import numpy as np

from flame.data.loader import PackedDataset
from flame.data.packing import DocumentMixer
from flame.data.shards import DataPlan
from tests.data.conftest import SHARDS_4, random_texts, write_jsonl

CURRICULUM = ("--training.batch_ramp", "1: 2, 3: 4", "--training.context_ramp", "1: 8, 3: 64",
              "--training.data_probs", "1,1", "--training.data_phases", "3: 0,1", *SHARDS_4)


def _batches(tmp_path, make_config, tokenizer, count: int) -> list[tuple]:
    first = write_jsonl(tmp_path / "first.jsonl", random_texts(200, prefix="first", max_words=120))
    second = write_jsonl(tmp_path / "second.jsonl", random_texts(200, prefix="second", seed=1, max_words=120))
    config = make_config(f"{first},{second}", *CURRICULUM)
    assert (config.training.local_batch_size, config.training.gradient_accumulation_steps) == (2, 2)
    dataset = PackedDataset(DataPlan.from_config(config, tokenizer), 0, 1)
    return [batch for batch, _ in zip(dataset, range(count))]


def test_rows_follow_the_context_ramp_and_the_data_phase_of_their_step(tmp_path, make_config, tokenizer):
    # 2 rows a micro-batch: step 1 and 2 one micro-batch each (2 rows), steps 3 on two (4 rows)
    batches = _batches(tmp_path, make_config, tokenizer, 6)
    longest = [int(inputs["cu_seqlens"].diff().max()) for inputs, _, _ in batches]
    assert max(longest[:2]) <= 8  # steps 1 and 2: documents cut to 8 tokens
    assert max(longest[2:]) > 8  # step 3 on: up to 64
    started = [progress["counts"]["documents"] for _, _, progress in batches]
    assert sum(count[0] for count in started[:2]) > 0  # both sources before the phase
    assert all(count[0] == 0 for count in started[2:])  # from step 3 no document of the first source starts


def test_a_mixer_never_draws_a_source_at_zero_and_its_phase_shares_count_from_the_phase_start():
    class Source:
        def __init__(self, length):
            self.length = length

        def next_document(self):
            return np.zeros(self.length, dtype=np.int64)

    for unit in ("documents", "tokens"):
        mixer = DocumentMixer([Source(3), Source(5)], [1, 1], seed=0, unit=unit, phases=[[0, 1], [3, 1]])
        mixer.set_phase(1)
        assert {mixer.next_document()[0] for _ in range(50)} == {1}
        mixer.set_phase(2)
        drawn = [mixer.next_document()[0] for _ in range(400)]
        tokens = np.bincount(drawn, minlength=2) * [3, 5]
        assert abs(tokens[0] / tokens.sum() - 0.75) < (0.01 if unit == "tokens" else 0.2)
        assert mixer.phase == 2


def test_a_shard_resumed_inside_the_ramp_and_across_the_phase_makes_the_same_rows(tmp_path, make_config, tokenizer):
    first = write_jsonl(tmp_path / "first.jsonl", random_texts(200, prefix="first", max_words=120))
    second = write_jsonl(tmp_path / "second.jsonl", random_texts(200, prefix="second", seed=1, max_words=120))
    # one shard: its windows of 3 rows open in every step, some used across a save
    config = make_config(f"{first},{second}", *CURRICULUM, "--training.row_shuffle_buffer", "3",
                         "--training.data_shards", "1")
    plan = DataPlan.from_config(config, tokenizer)
    rows = lambda batches: [(inputs["input"], inputs["cu_seqlens"]) for inputs, _, _ in batches]  # noqa: E731
    expected = rows(batch for batch, _ in zip(PackedDataset(plan, 0, 1), range(8)))
    for stop in range(1, 7):  # batches 0-1: steps 1-2 (ramp), 2-3: step 3 (the phase's first), 4-5: step 4
        states, cursor = {}, 0
        for (_, _, progress), _ in zip(PackedDataset(plan, 0, 1), range(stop)):
            states.update({int(k): v for k, v in json.loads(progress["shard_states"]).items()})
            cursor = progress["cursor"]
        resumed = PackedDataset(plan, 0, 1)
        resumed.shard_states, resumed.cursors = states, {0: cursor}
        got = rows(batch for batch, _ in zip(resumed, range(8 - stop)))
        assert all((a == b).all() and (c == d).all() for (a, c), (b, d) in zip(got, expected[stop:])), stop
