"""Bad records: the preflight check names the first one, wherever it is; one it could not read fails in the rank
that reads it, in one line naming it (through a data-loader worker too); a stream whose file goes away is named."""

import gzip
import json

import pytest

from flame.base.errors import ConfigError, DataError, worker_message
from flame.data.records import check_records
from flame.data.shards import DataPlan
from flame.data.sources import SourceSpec, load_source, record_location
from flame.data.streams import IterStream
from tests.data.conftest import batches, make_loader, random_texts

BAD = 300  # past every "first records" sample a cheaper check would read


def write_records(path, records: list, raw: dict[int, bytes] | None = None) -> str:
    with open(path, "wb") as file:
        for index, record in enumerate(records):
            file.write((raw or {}).get(index) or (json.dumps(record) + "\n").encode())
    return str(path)


def texts_with(bad_value, count: int = 400) -> list[dict]:
    return [{"text": text if index != BAD else bad_value} for index, text in enumerate(random_texts(count))]


def ids_with(bad_ids: list, count: int = 400) -> list[dict]:
    return [{"input_ids": list(range(5, 60)) if index != BAD else bad_ids} for index in range(count)]


@pytest.mark.parametrize("records, raw, message", [
    (texts_with(None), None, r"has no value \(null\)"),
    (texts_with(12), None, "holds int 12, not text"),
    (texts_with("x"), {BAD: b'{"text": "abc \xff\xfe def"}\n'}, "is not valid UTF-8 text: re-encode the file"),
    (ids_with([5, 10**7]), None, r"holds token id 10000000, outside the vocabulary .* \(ids 0 to \d+\)"),
    (ids_with([5, -3]), None, "holds token id -3: token ids are never negative"),
    (ids_with([5, None]), None, "holds a null token id"),
], ids=["null-text", "number-as-text", "invalid-utf8", "id-past-the-vocabulary", "negative-id", "null-id"])
def test_the_preflight_check_names_a_bad_record_deep_in_the_file_by_its_line(tmp_path, make_config, tokenizer,
                                                                              records, raw, message):
    path = write_records(tmp_path / "data.jsonl", records, raw)
    plan = DataPlan.from_config(make_config(path), tokenizer)
    with pytest.raises(DataError, match=rf"record {BAD} \(line {BAD + 1} of .*data\.jsonl\) of column '\w+' {message}"):
        check_records(plan)


def test_good_records_pass_the_check(tmp_path, make_config, tokenizer):
    check_records(DataPlan.from_config(make_config(write_records(tmp_path / "t.jsonl", texts_with("fine"))), tokenizer))
    check_records(DataPlan.from_config(make_config(write_records(tmp_path / "i.jsonl", ids_with([7]))), tokenizer))


def test_a_record_is_located_in_the_file_of_a_glob_that_holds_it_skipping_blank_lines(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n\n{"text": "b"}\n')
    (tmp_path / "b.jsonl").write_text('{"text": "c"}\n{"text": "d"}\n')
    assert record_location(str(tmp_path / "*.jsonl"), 1) == f"record 1 (line 3 of {tmp_path / 'a.jsonl'})"
    assert record_location(str(tmp_path / "*.jsonl"), 3) == f"record 3 (line 2 of {tmp_path / 'b.jsonl'})"
    assert record_location("some/hub-dataset", 3) == "record 3"


def test_a_gz_file_that_is_not_gzip_is_refused_in_one_line(tmp_path):
    path = tmp_path / "data.jsonl.gz"
    path.write_text('{"text": "plain"}\n')
    with pytest.raises(ConfigError, match=r"Not a gzipped file .*\(BadGzipFile\); fix or remove the file \(a \.gz "):
        load_source(SourceSpec(str(path)), streaming=False)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_bad_record_past_the_streamed_sample_stops_the_rank_in_one_line_naming_it(tmp_path, make_config, tokenizer,
                                                                                   workers):
    records = [{"text": text if index != 1500 else None} for index, text in enumerate(random_texts(1600))]
    config = make_config(write_records(tmp_path / "late.jsonl", records), "--training.streaming",
                         "--training.num_workers", str(workers), "--training.data_shards", "1", seq_len=512)
    plan = DataPlan.from_config(config, tokenizer)
    check_records(plan)  # a streamed source: its first records only
    with pytest.raises(DataError) as raised:
        batches(make_loader(config, tokenizer, plan=plan), 400)
    line = worker_message(raised.value)
    assert line.startswith("dataset ") and "\n" not in line, line
    assert "a record streamed to data shard 0 in epoch 0 (None) has no value (null): fix or remove that record" in line


def test_a_streamed_file_cut_while_the_run_reads_it_is_named(tmp_path, make_config, tokenizer):
    path = tmp_path / "data.jsonl.gz"
    with gzip.open(path, "wt") as file:
        file.writelines(json.dumps({"text": text}) + "\n" for text in random_texts(200))
    config = make_config(str(path), "--training.streaming")
    stream = IterStream(load_source(SourceSpec(str(path)), streaming=True), "text", 0, 1, str(path))
    assert len(stream.read(8)) == 8
    path.write_bytes(path.read_bytes()[:100])  # cut short under the stream
    stream._batches = None  # the next epoch re-opens the file
    with pytest.raises(DataError, match=rf"dataset {path}: reading its stream failed \(data shard 0, epoch 0\): .*"
                                        "a streamed file must stay as it was while the run reads it: restore it"):
        for _ in range(50):
            stream.read(8)
    assert config.training.streaming
