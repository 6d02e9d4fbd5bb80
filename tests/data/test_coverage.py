"""Every document is read once per epoch, across shards, ranks and workers; stopping at the end of data."""


import datasets
import numpy as np
import pytest

from flame.data.shards import DataPlan, DataShard
from flame.data.streams import IterStream, MapStream, SourceExhausted
from tests.data.conftest import (
    EOS_TEXT,
    SHARDS_4,
    batch_tokens,
    batches,
    make_loader,
    random_texts,
    save_token_dataset,
    write_jsonl,
)


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
