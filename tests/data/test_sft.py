"""Instruction and chat data (--training.data_format sft): record shapes, label masks, packing,
long conversations, resume, bad input, and a real training run mixed with a text source."""

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from torchtitan.components.loss import IGNORE_INDEX

from flame.launch import preflight as launch_preflight
from flame.prepare import settled
from flame.data.loader import FlameDataLoader
from flame.data.sft import ChatEncoder, conversation
from flame.data.shards import DataPlan, DataShard
from flame.data.tokenizer import document_delimiters, load_tokenizer
from flame.base.errors import ConfigError, DataError
from scripts.chaos.bad_inputs import one_line_error
from tests.conftest import TOKENIZER, base_args, check, losses, metrics, torchrun
from tests.data.conftest import (
    ShardStreams,
    assert_same_batches,
    batches,
    checkpointed,
    delivered_rows,
    random_texts,
    take,
    write_jsonl,
)

CHAT = str(Path(__file__).parent / "chat.jsonl")  # 240 synthetic chats, some multi-turn, some with system
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 plus 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3 plus 3?"},
    {"role": "assistant", "content": "6."},
]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
NO_SYSTEM = ("{% for message in messages %}{% if message['role'] == 'system' %}{{ raise_exception('System role not "
             "supported') }}{% endif %}{{ message['content'] }}{% endfor %}")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TOKENIZER)


def encoder(tokenizer, columns=("messages",), context_len: int = 512, **options) -> ChatEncoder:
    return ChatEncoder(tokenizer, document_delimiters(tokenizer), columns, "chat", context_len, **options)


def encode(tokenizer, records: list[dict], **options):
    return encoder(tokenizer, tuple(records[0]), **options).encode(records, lambda index: f"record {index}")


def target_runs(tokenizer, document) -> list[str]:
    """The decoded runs of consecutive targets (labels that are not IGNORE_INDEX)."""
    runs, run = [], []
    for label in [*document.labels.tolist(), IGNORE_INDEX]:
        if label != IGNORE_INDEX:
            run.append(label)
        elif run:
            runs.append(tokenizer.decode(run))
            run = []
    return runs


def assert_labels_are_next_tokens(document) -> None:
    kept = document.labels[:-1] != IGNORE_INDEX
    assert (document.labels[:-1][kept] == document.tokens[1:][kept]).all()
    assert document.labels[-1] == IGNORE_INDEX


def test_default_template_trains_exactly_on_the_assistant_turns(tokenizer):
    assert tokenizer.chat_template is None  # the builtin tokenizer: flame's default template
    (document,), dropped = encode(tokenizer, [{"messages": CONVERSATION}])
    assert tokenizer.decode(document.tokens.tolist()) == (
        "<|system|>\nBe brief.\n<|user|>\nWhat is 2 plus 2?\n<|assistant|>\n4.<|endoftext|>\n"
        "<|user|>\nAnd 3 plus 3?\n<|assistant|>\n6.<|endoftext|>"
    )
    assert target_runs(tokenizer, document) == ["4.<|endoftext|>", "6.<|endoftext|>"]
    assert_labels_are_next_tokens(document)
    assert dropped == 0


def test_the_tokenizers_chat_template_marks_its_own_assistant_turns(tokenizer):
    chatml = copy.deepcopy(tokenizer)
    chatml.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    chatml.chat_template = CHATML
    (document,), _ = encode(chatml, [{"messages": CONVERSATION}])
    # the reply and the template's end-of-turn marker; flame's EOS ends the conversation
    assert target_runs(chatml, document) == ["4.<|im_end|>\n", "6.<|im_end|>\n<|endoftext|>"]
    assert_labels_are_next_tokens(document)


def test_loss_on_prompt_and_completion_trains_every_token_but_the_first(tokenizer):
    (document,), _ = encode(tokenizer, [{"messages": CONVERSATION}], loss_on="prompt+completion")
    assert (document.labels[:-1] == document.tokens[1:]).all()


def test_the_three_record_shapes_become_the_same_conversation(tokenizer):
    turns = [{"role": "user", "content": "Name a color.\n\nOne word."}, {"role": "assistant", "content": "Blue."}]
    shapes = [{"messages": turns}, {"prompt": "Name a color.\n\nOne word.", "completion": "Blue."},
              {"instruction": "Name a color.", "input": "One word.", "output": "Blue."}]
    assert all(conversation(record) == turns for record in shapes)
    documents = [encode(tokenizer, [record])[0][0] for record in shapes]
    for document in documents[1:]:
        assert np.array_equal(document.tokens, documents[0].tokens)
        assert np.array_equal(document.labels, documents[0].labels)
    assert conversation({"instruction": "Say hi.", "input": "", "output": "Hi."})[0]["content"] == "Say hi."


def test_the_three_record_shapes_train_on_the_same_batches(tmp_path, make_config, tokenizer):
    chats = [json.loads(line)["messages"] for line in open(CHAT)]
    single = [(turns[-2]["content"], turns[-1]["content"]) for turns in chats if len(turns) == 2]
    files = {
        "messages": [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]}
                     for p, c in single],
        "prompt": [{"prompt": p, "completion": c} for p, c in single],
        "alpaca": [{"instruction": p, "input": None, "output": c} for p, c in single],
    }
    got = []
    for name, records in files.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(record) + "\n" for record in records))
        got.append(batches(make_loader(make_config(str(path), "--training.data_format", "sft")), 3))
    assert_same_batches(got[0], got[1])
    assert_same_batches(got[0], got[2])


# ------------------------------------------------------------------ packing and length


@pytest.fixture
def make_config(monkeypatch, tiny_model):
    monkeypatch.setenv("WORLD_SIZE", "1")

    def make(dataset: str, *extra: str, seq_len: int = 64, batch_size: int = 2):
        return settled([
            "--model.config", tiny_model, "--model.tokenizer_path", TOKENIZER, "--training.dataset", dataset,
            "--training.seq_len", str(seq_len), "--training.batch_size", str(batch_size),
            "--training.data_shards", "4", *extra,
        ])

    return make


def make_loader(config, dp_rank: int = 0, dp_world_size: int = 1, plan=None) -> FlameDataLoader:
    plan = plan or DataPlan.from_config(config, load_tokenizer(TOKENIZER))
    return FlameDataLoader(plan, dp_rank, dp_world_size, config.training.dataloader)


@pytest.fixture
def mixed(tmp_path) -> list[str]:
    text = write_jsonl(tmp_path / "text.jsonl", random_texts(80, seed=4))
    return [f"{CHAT},{text}", "--training.data_format", "sft,text", "--training.data_probs", "0.6,0.4"]


def test_packed_conversations_are_whole_isolated_documents(mixed, make_config, tokenizer):
    config = make_config(*mixed, seq_len=128)
    plan = DataPlan.from_config(config, tokenizer)
    records = [json.loads(line) for line in open(CHAT)]
    whole = {tuple(d.tokens.tolist()) for d in plan.encoders[0].encode(records, str)[0]}
    loader = make_loader(config, plan=plan)
    conversations = 0
    for inputs, labels in batches(loader, 20):
        for row in range(inputs["input"].shape[0]):
            tokens, targets = inputs["input"][row].numpy(), labels[row].numpy()
            positions = inputs["position_ids"][row].numpy()
            starts = list(np.flatnonzero(positions == 0)) + [len(tokens)]
            for start, end in zip(starts, starts[1:]):
                assert (positions[start:end] == np.arange(end - start)).all()
                segment = tuple(tokens[start:end].tolist())
                if segment in whole:  # a whole conversation: every target inside it, none after its end
                    conversations += 1
                    assert targets[end - 1] == IGNORE_INDEX
                    kept = targets[start:end - 1] != IGNORE_INDEX
                    assert (targets[start:end - 1][kept] == tokens[start + 1:end][kept]).all()
                else:  # text, or padding: never a piece of a conversation
                    assert "<|assistant|>" not in tokenizer.decode(list(segment))
    assert conversations == loader.counts["documents"][0] > 20
    assert loader.counts["padding"][0] > 0 and loader.counts["padding"][1] == 0


def long_and_short(tmp_path) -> str:
    """40 conversations; every 5th has a reply of 200 words (longer than a 64-token row)."""
    records = []
    for i in range(40):
        reply = " ".join(["words"] * 200) if i % 5 == 0 else f"Reply {i}."
        records.append({"prompt": f"Question {i}?", "completion": reply})
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def test_long_conversations_are_dropped_and_counted(tmp_path, make_config):
    config = make_config(long_and_short(tmp_path), "--training.data_format", "sft", "--training.data_shards", "1")
    loader = make_loader(config)
    rows = [row for inputs, _ in batches(loader, 1) for row in inputs["input"].tolist()]
    assert loader.counts["dropped"].tolist() == [8]  # one read holds the shard's whole epoch: 8 too long
    assert loader.counts["truncated"].tolist() == [0]
    assert all(load_tokenizer(TOKENIZER).decode(row).count("words") == 0 for row in rows)


def test_long_conversations_are_truncated_to_context_len_with_truncate_long(tmp_path, make_config, tokenizer):
    path = long_and_short(tmp_path)
    records = [json.loads(line) for line in open(path)]
    full, _ = encode(tokenizer, records, context_len=10_000)
    cut, dropped = encode(tokenizer, records, context_len=48, truncate_long=True)
    assert dropped == 0 and sum(d.truncated for d in cut) == 8
    for before, after in zip(full, cut):
        assert np.array_equal(after.tokens, before.tokens[: len(after)]) and len(after) <= 48
    config = make_config(path, "--training.data_format", "sft", "--training.truncate_long",
                         "--training.context_len", "48", "--training.data_shards", "1")
    loader = make_loader(config)
    for inputs, _ in batches(loader, 12):
        assert max(np.diff(inputs["cu_seqlens"].numpy())) <= 48
    assert loader.counts["truncated"].tolist() == [8] and loader.counts["dropped"].tolist() == [0]


# ------------------------------------------------------------------ resume


# 40 batches: past the first epoch of the chats
@pytest.mark.parametrize("case, batches_before", [(case, before) for case in ("map-style", "streaming-shuffled",
                         "row-shuffled") for before in (3, 40)] + [("workers", 7)])
def test_mixed_sft_loader_resumes_with_exactly_the_next_batches_and_counts(case, batches_before, mixed, make_config,
                                                                           tokenizer):
    extra = {"map-style": [], "streaming-shuffled": ["--training.streaming", "--training.shuffle_buffer", "20"],
             "row-shuffled": ["--training.row_shuffle_buffer", "5"], "workers": ["--training.num_workers", "2"]}[case]
    config = make_config(*mixed, "--training.context_len", "56", *extra)  # some chats are dropped
    plan = DataPlan.from_config(config, tokenizer)
    first = make_loader(config, plan=plan)
    iterator = iter(first)
    take(iterator, batches_before)
    state = checkpointed(first.state_dict())
    expected = take(iterator, 6)
    del iterator
    resumed = make_loader(config, plan=plan)
    resumed.load_state_dict(state)
    assert_same_batches(expected, batches(resumed, 6))
    assert {k: v.tolist() for k, v in resumed.counts.items()} == {k: v.tolist() for k, v in first.counts.items()}
    assert first.counts["dropped"][0] > 0


def test_mixed_sft_two_ranks_resumed_on_one_continue_every_shard_without_repeat_or_gap(mixed, make_config, tokenizer):
    config = make_config(*mixed, batch_size=3)
    plan = DataPlan.from_config(config, tokenizer)
    before = [make_loader(config, rank, 2, plan=plan) for rank in range(2)]
    delivered = [row for loader in before for row in delivered_rows(batches(loader, 4))]
    after = make_loader(config, plan=plan)
    after.load_state_dict(checkpointed(before[0].checkpoint_entry([loader.local_state() for loader in before])))
    delivered += delivered_rows(batches(after, 10))
    ShardStreams(plan, 4, 30).assert_continuous(delivered)


def test_a_shard_resumed_with_a_conversation_waiting_for_the_next_row_places_it_there(mixed, make_config, tokenizer):
    plan = DataPlan.from_config(make_config(*mixed), tokenizer)
    shard = DataShard(plan, 0, 4)
    for _ in range(30):
        padded = shard.next_row().source_padding.sum() > 0
        state = checkpointed(shard.state_dict())
        if padded:  # the next row starts with the conversation that did not fit
            break
    assert padded
    expected = [shard.next_row() for _ in range(4)]
    resumed = DataShard(plan, 0, 4)
    resumed.load_state_dict(state)
    for want, got in zip(expected, [resumed.next_row() for _ in range(4)]):
        assert np.array_equal(want.input_ids, got.input_ids) and np.array_equal(want.labels, got.labels)
        assert np.array_equal(want.source_documents, got.source_documents)


# ------------------------------------------------------------------ bad input


def preflight(tmp_path, capfd, tiny_model, dataset: str, *extra: str) -> str | None:
    """train.sh's preflight on a job over ``dataset``: its one-line error, or None when it is not one."""
    args = ["--model.config", tiny_model, "--model.tokenizer_path", TOKENIZER, "--training.dataset", dataset,
            "--training.seq_len", "64", "--job.dump_folder", str(tmp_path / "dump"), *extra]
    code = launch_preflight.main(["--world-size", "1", "--", *args])
    line = one_line_error(code, capfd.readouterr().err)
    assert not (tmp_path / "dump").exists()
    return line


def chats_with(tmp_path, bad: dict, at: int = 3, count: int = 10) -> str:
    records = [{"messages": [{"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": "Hello."}]}
               for i in range(count)]
    records[at] = bad
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


BAD_RECORDS = {
    "no-assistant-turn": ({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "Hi"}]},
                          ["record 3 (line 4 of", "): no assistant turn (roles: system, user)", "fix or remove the record"]),
    "unknown-role": ({"messages": [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "ok"}]},
                     ["record 3 (line 4 of", "): message 0 has the unknown role 'tool'", "roles are system, user, assistant"]),
    "content-not-text": ({"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "ok"}]},
                         ["record 3 (line 4 of", "): message 0: 'content' holds NoneType, not text"]),
}


@pytest.mark.parametrize("case", list(BAD_RECORDS))
def test_bad_record_is_refused_in_one_line_before_training(case, tmp_path, capfd, tiny_model):
    record, expected = BAD_RECORDS[case]
    line = preflight(tmp_path, capfd, tiny_model, chats_with(tmp_path, record), "--training.data_format", "sft")
    assert line is not None and all(words in line for words in expected), line


def test_records_of_no_sft_shape_are_refused_naming_the_shapes(tmp_path, capfd, tiny_model):
    path = write_jsonl(tmp_path / "qa.jsonl", ["What?"], column="question")
    line = preflight(tmp_path, capfd, tiny_model, path, "--training.data_format", "sft")
    assert line and "has no 'messages', 'prompt'+'completion' or 'instruction'+'output' columns" in line, line
    assert "its columns are: question" in line


def test_a_chat_template_that_raises_is_refused_in_one_line(tmp_path, capfd, tiny_model, tokenizer):
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = NO_SYSTEM
    strict.save_pretrained(tmp_path / "tok")
    record = {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "Hello."}]}
    line = preflight(tmp_path, capfd, tiny_model, chats_with(tmp_path, record), "--training.data_format", "sft",
                     "--model.tokenizer_path", str(tmp_path / "tok"))
    assert line and "record 3 (line 4 of" in line and "): the chat template of tokenizer" in line and "(System role not supported)" in line, line


@pytest.mark.parametrize("flags, expected", [
    (["--training.data_format", "chat"], "chat is not a format; give text, sft, megatron or numpy"),
    (["--training.data_format", "sft,text"], "--training.data_format has 2 entries for 1 datasets"),
    (["--training.data_format", "sft", "--training.no-document_mask"], "drop --training.no-document_mask"),
    (["--training.truncate_long"], "--training.truncate_long applies to SFT sources"),
    (["--training.sft_loss_on", "prompt+completion"], "--training.sft_loss_on prompt+completion applies to SFT"),
])
def test_sft_flags_that_cannot_apply_are_refused(flags, expected, tmp_path, capfd, tiny_model):
    line = preflight(tmp_path, capfd, tiny_model, CHAT, *flags)
    assert line and expected in line, line


def test_a_bad_record_met_while_training_stops_the_loader_in_one_line(tmp_path, make_config):
    path = chats_with(tmp_path, {"messages": [{"role": "user", "content": "Hi"}]}, at=150, count=200)
    config = make_config(path, "--training.data_format", "sft", "--training.data_shards", "1",
                         "--training.num_workers", "1")  # raised in a worker process: it arrives as one line
    with pytest.raises(DataError) as error:
        batches(make_loader(config), 40)
    assert str(error.value).count("\n") == 0 and "record 150 (line 151 of" in str(error.value) and "): no assistant turn" in str(error.value)
    assert isinstance(error.value, ConfigError)  # flame.train prints it as `flame: error: ...`, exit 2


# ------------------------------------------------------------------ a real run


def _sft_job(steps: int):
    flags = ["--training.data_format=sft,text", "--training.data_probs=0.7,0.3", "--training.seq_len=128",
             "--training.context_len=64", "--training.batch_size=4", "--lr_scheduler.total_steps=16",
             "--checkpoint.interval=4", "--training.data_shards=4"]
    return lambda dump, model, corpus: torchrun(base_args(model, f"{CHAT},{corpus}", dump, steps=steps) + flags)


@pytest.mark.background_runs(straight=_sft_job(16))
def test_sft_mixed_with_text_trains_and_resumes_exactly(background_runs, tiny_model, corpus, tmp_path):
    straight = background_runs["straight"].dump
    check(background_runs["straight"].result)
    curve = losses(straight)
    assert sum(curve[s] for s in range(13, 17)) / 4 < curve[1] - 1.0, curve
    last = metrics(straight)[16]
    chat = Path(CHAT).as_posix()
    assert last[f"data/{chat}/dropped"] > 0 and last[f"data/{chat}/padding"] > 0  # chats longer than 64 tokens
    assert last[f"data/{chat}/truncated"] == 0

    resumed = tmp_path / "resumed"  # the run as it stood after step 8
    shutil.copytree(straight, resumed)
    for step in (12, 16):
        shutil.rmtree(resumed / "checkpoint" / f"step-{step}")
    result = check(_sft_job(16)(resumed, tiny_model, corpus))
    assert "Training starts at step 9" in result.stdout + result.stderr
    got = losses(resumed)
    assert [got[s] for s in range(9, 17)] == [curve[s] for s in range(9, 17)]
    assert {k: v for k, v in metrics(resumed)[16].items() if k.startswith("data/")} == {
        k: v for k, v in last.items() if k.startswith("data/")}
