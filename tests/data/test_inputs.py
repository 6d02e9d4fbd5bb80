"""Source formats and bad input."""

import json
import pickle

import datasets
import pytest

from flame.data.shards import DataPlan
from flame.data.sources import SourceSpec, document_column, load_source
from flame.data.streams import MapStream
from flame.base.errors import ConfigError
from tests.conftest import TOKENIZER
from tests.data.conftest import (
    SHARDS_4,
    assert_same_batches,
    batches,
    checkpointed,
    make_loader,
    random_texts,
    write_jsonl,
)


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
    with pytest.raises(ConfigError, match="3 documents to train on, fewer than the 4 data shards.*--training.data_shards"):
        MapStream(dataset, "text", 0, 4, seed=0, name="tiny")


@pytest.mark.parametrize(
    "streaming, message",
    [(False, "3 documents to train on, fewer than the 4 data shards"), (True, "gives data shard 3 no documents")],
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
        {"state": "not JSON"},
        {"state": json.dumps({"version": 99})},
        {"state": json.dumps([1, 2])},
        {"world_size": 2, "dp_rank_1": pickle.dumps({})},  # the layout flame wrote before logical shards
        {"state": pickle.dumps({"version": 1})},  # a pickle is never loaded
    ],
    ids=["not-json", "other-version", "not-a-dict", "old-format", "pickle"],
)
def test_corrupt_loader_state_is_a_config_error_naming_the_data_parallel_rank(
    state, two_sources, make_config, tokenizer
):
    loader = make_loader(make_config(two_sources[0], *SHARDS_4), tokenizer, 1, 2)
    with pytest.raises(ConfigError, match=r"unreadable on data-parallel rank 1.*--checkpoint.exclude_from_loading"):
        loader.load_state_dict(state)




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
