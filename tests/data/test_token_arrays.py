"""Token files other tools wrote (--training.data_format megatron / numpy): Megatron .bin/.idx pairs and flat
token arrays read back as the tokenized documents, found by their files, mixed, resumed exactly, trained and
resumed exactly, and refused in one line when they cannot be read."""

import json
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from flame.data.formats import data_format
from flame.data.formats.text import TEXT
from flame.data.formats.tokens import MEGATRON, NUMPY, open_numpy
from flame.data.loader import build_dataloader
from flame.data.shards import DataPlan
from flame.data.sources import SourceSpec
from flame.data.token_arrays import TokenArray, flat_files, megatron_files
from flame.data.tokenizer import document_delimiters, load_tokenizer
from flame.data.validation import ValidationSet
from flame.launch import preflight as launch_preflight
from scripts.chaos.bad_inputs import one_line_error
from tests.conftest import TOKENIZER, base_args, check, losses, metrics, torchrun
from tests.data.conftest import (
    SHARDS_4,
    ListStream,
    assert_same_batches,
    batches,
    checkpointed,
    make_loader,
    save_token_dataset,
    take,
)

MEGATRON_CODES = {np.uint16: 8, np.int32: 4}  # Megatron-LM's dtype codes of the index header
EOS = 0  # the builtin tokenizer's EOS id


# --------------------------------------------------------------- writers, as the other tools write


def corpus_documents(corpus: str, tokenizer, count: int = 120) -> list[list[int]]:
    """The first ``count`` documents of the corpus, tokenized, each ended by EOS (as the tools append it)."""
    texts = [json.loads(line)["text"] for line in Path(corpus).read_text().splitlines()[:count]]
    return [ids + [EOS] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def write_megatron(prefix: Path, documents: list[list[int]], dtype=np.uint16, version: int = 1,
                   magic: bytes = b"MMIDIDX\x00\x00") -> str:
    """A Megatron-LM indexed dataset: every third document in two sequences, as sentence splitting writes."""
    sequences, starts = [], [0]
    for index, document in enumerate(documents):
        half = len(document) // 2
        sequences.extend([document[:half], document[half:]] if index % 3 == 1 and half else [document])
        starts.append(len(sequences))
    lengths = np.array([len(sequence) for sequence in sequences], dtype=np.int32)
    pointers = (np.cumsum(lengths, dtype=np.int64) - lengths) * np.dtype(dtype).itemsize
    Path(f"{prefix}.bin").write_bytes(np.array([t for s in sequences for t in s], dtype=dtype).tobytes())
    header = magic + struct.pack("<QBQQ", version, MEGATRON_CODES[dtype], len(sequences), len(starts))
    Path(f"{prefix}.idx").write_bytes(header + lengths.tobytes() + pointers.tobytes()
                                      + np.array(starts, dtype=np.int64).tobytes())
    return str(prefix)


def write_flat(path: Path, documents: list[list[int]], dtype=np.uint16) -> str:
    """nanoGPT's train.bin: the documents' ids end to end, raw."""
    np.concatenate(documents).astype(dtype).tofile(path)
    return str(path)


def write_llmc(path: Path, documents: list[list[int]]) -> str:
    """llm.c's .bin: 256 int32s of header (magic, version, token count), then uint16 ids."""
    ids = np.concatenate(documents).astype(np.uint16)
    header = np.zeros(256, dtype=np.int32)
    header[:3] = 20240520, 1, len(ids)
    path.write_bytes(header.tobytes() + ids.tobytes())
    return str(path)


def read_back(array: TokenArray) -> list[list[int]]:
    return [array[index]["input_ids"] for index in range(len(array))]


@pytest.fixture(scope="module")
def documents(corpus, tokenizer) -> list[list[int]]:
    return corpus_documents(corpus, tokenizer)


# --------------------------------------------------------------- documents read back


def test_megatron_documents_read_back_as_the_tokenized_documents(tmp_path, documents):
    array = TokenArray(megatron_files(write_megatron(tmp_path / "corpus_text_document", documents)))
    assert read_back(array) == documents
    assert array[[4, 1]]["input_ids"] == [documents[4], documents[1]]  # document 1 is two sequences


def test_int32_megatron_documents_read_back_too(tmp_path, documents):
    prefix = write_megatron(tmp_path / "wide", documents, dtype=np.int32)
    assert read_back(TokenArray(megatron_files(prefix + ".idx"))) == documents


@pytest.mark.parametrize("layout", ["raw-uint16", "npy-uint32", "npy-uint16", "llm.c"])
def test_flat_documents_end_after_each_eos(layout, tmp_path, documents):
    if layout == "raw-uint16":
        path = write_flat(tmp_path / "train.bin", documents)
    elif layout == "llm.c":
        path = write_llmc(tmp_path / "fineweb_train_000001.bin", documents)
    else:
        path = str(tmp_path / "tokens.npy")
        np.save(path, np.concatenate(documents).astype(layout.removeprefix("npy-")))
    assert read_back(TokenArray(flat_files(path, None, "uint16", EOS))) == documents


def test_a_flat_file_not_ending_in_eos_ends_in_a_last_document_flame_delimits(tmp_path, make_config, tokenizer):
    path = write_flat(tmp_path / "train.bin", [[5, 6, EOS], [7, 8, 9]])
    assert read_back(TokenArray(flat_files(path, None, "uint16", EOS))) == [[5, 6, EOS], [7, 8, 9]]
    plan = DataPlan.from_config(make_config(path, "--training.data_shards", "1"), tokenizer)
    source = plan.encoders[0].documents(ListStream(plan.datasets[0][[0, 1]]["input_ids"]), 2)
    assert [source.next_document().tolist() for _ in range(2)] == [[5, 6, EOS], [7, 8, 9, EOS]]


def test_a_raw_file_is_uint32_for_a_vocabulary_beyond_65536_ids(tmp_path):
    vocab = {"<|endoftext|>": 0, **{f"w{index}": index for index in range(1, 70_000)}}
    wide = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w1")),
                                   eos_token="<|endoftext|>")
    documents = [[69_999, 5, EOS], [66_000, EOS]]
    path = write_flat(tmp_path / "train.bin", documents, np.uint32)
    array = open_numpy(SourceSpec(path=path), SimpleNamespace(token_dtype="auto"), wide, document_delimiters(wide))
    assert read_back(array) == documents


def test_a_separator_token_ends_the_documents_of_a_flat_file(tmp_path, make_config, tokenizer):
    separator = tokenizer.convert_tokens_to_ids("def")
    path = write_flat(tmp_path / "train.bin", [[5, separator], [7, EOS, 8, separator]])
    plan = DataPlan.from_config(make_config(path, "--training.separator_token", "def"), tokenizer)
    assert read_back(plan.datasets[0]) == [[5, separator], [7, EOS, 8, separator]]


def test_a_glob_is_one_source_over_its_files_in_sorted_order(tmp_path, documents):
    for part in range(3):
        write_flat(tmp_path / f"part-{part}.npy", documents[part * 40 : (part + 1) * 40])
    write_megatron(tmp_path / "b_text_document", documents[60:])
    write_megatron(tmp_path / "a_text_document", documents[:60])
    assert read_back(TokenArray(flat_files(str(tmp_path / "part-*.npy"), None, "uint16", EOS))) == documents
    assert read_back(TokenArray(megatron_files(str(tmp_path / "*_text_document.idx")))) == documents


def test_the_files_tell_their_format(tmp_path, documents):
    prefix = write_megatron(tmp_path / "corpus_text_document", documents)
    flat = write_flat(tmp_path / "train.bin", documents)
    npy = str(tmp_path / "tokens.npy")
    np.save(npy, np.concatenate(documents))
    for path in (prefix, prefix + ".bin", prefix + ".idx", str(tmp_path / "*_document.idx")):
        assert data_format(None, path) is MEGATRON and data_format("text", path) is MEGATRON, path
    for path in (flat, npy, str(tmp_path / "*.npy")):
        assert data_format("", path) is NUMPY, path
    assert data_format(None, str(tmp_path / "docs.jsonl")) is TEXT
    assert data_format(None, "builtin:python-stdlib") is TEXT
    assert data_format("numpy", prefix + ".bin") is NUMPY  # an explicit entry wins


def test_numpy_reads_any_file_name_when_named(tmp_path, make_config, tokenizer, documents):
    path = write_flat(tmp_path / "corpus.u16", documents)
    plan = DataPlan.from_config(make_config(path, "--training.data_format", "numpy"), tokenizer)
    assert plan.formats == [NUMPY] and read_back(plan.datasets[0]) == documents


# --------------------------------------------------------------- the loader: as pretokenized data, resumed exactly


@pytest.mark.parametrize("kind", ["megatron", "numpy"])
def test_token_files_give_the_batches_of_the_same_documents_pretokenized(kind, tmp_path, make_config, tokenizer,
                                                                         documents):
    path = (write_megatron(tmp_path / "corpus", documents) if kind == "megatron"
            else write_flat(tmp_path / "train.bin", documents))
    pretokenized = save_token_dataset(tmp_path / "pretokenized", documents)
    flags = ["--training.context_len", "24", *SHARDS_4]
    assert_same_batches(batches(make_loader(make_config(pretokenized, *flags), tokenizer), 12),
                        batches(make_loader(make_config(path, *flags), tokenizer), 12))


@pytest.fixture
def sources(tmp_path, corpus, documents) -> dict[str, str]:
    return {"megatron": write_megatron(tmp_path / "corpus_text_document", documents[:70]),
            "numpy": write_flat(tmp_path / "train.bin", documents[70:]), "text": corpus}


RESUME_CASES = {
    "megatron": lambda s: [s["megatron"], *SHARDS_4],
    "numpy": lambda s: [s["numpy"], "--training.token_dtype", "uint16", *SHARDS_4],
    "mixed": lambda s: [f"{s['megatron']},{s['numpy']},{s['text']}", "--training.data_probs", "0.5,0.3,0.2", *SHARDS_4],
    "mixed-by-tokens": lambda s: [f"{s['megatron']},{s['text']}", "--training.data_probs", "0.5,0.5",
                                  "--training.mix_unit", "tokens", *SHARDS_4],
    "mixed-with-a-stream": lambda s: [f"{s['text']},{s['numpy']}", "--training.streaming", *SHARDS_4],
    "row-shuffle-buffer": lambda s: [s["numpy"], "--training.row_shuffle_buffer", "5", *SHARDS_4],
}


@pytest.mark.parametrize("batches_before", [3, 40])  # 40 batches: past the end of the first epoch
@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_token_sources_resume_with_exactly_the_next_batches(case, batches_before, sources, make_config, tokenizer):
    config = make_config(*RESUME_CASES[case](sources))
    plan = DataPlan.from_config(config, tokenizer)
    first = make_loader(config, tokenizer, plan=plan)
    iterator = iter(first)
    take(iterator, batches_before)
    state = checkpointed(first.state_dict())
    expected = take(iterator, 8)
    resumed = make_loader(config, tokenizer, plan=DataPlan.from_config(config, tokenizer))
    resumed.load_state_dict(state)
    assert_same_batches(expected, batches(resumed, 8))


def test_token_sources_in_worker_processes_resume_with_exactly_the_next_batches(sources, make_config, tokenizer):
    config = make_config(f"{sources['megatron']},{sources['numpy']}", "--training.num_workers", "2", *SHARDS_4)
    first = build_dataloader(1, 0, tokenizer, config)  # the plan goes to the workers: its files map anew there
    iterator = iter(first)
    take(iterator, 7)
    state = checkpointed(first.state_dict())
    expected = take(iterator, 6)
    del iterator
    resumed = build_dataloader(1, 0, tokenizer, config)
    resumed.load_state_dict(state)
    assert_same_batches(expected, batches(resumed, 6))


def test_held_out_documents_of_a_token_source_are_its_first(tmp_path, make_config, tokenizer, documents):
    path = write_flat(tmp_path / "train.bin", documents)
    config = make_config(path, "--validation.enable", "--validation.holdout_documents", "5", *SHARDS_4)
    held_out = ValidationSet.build(config, tokenizer, 0, 1)
    assert held_out.tokens.tolist() == [sum(len(document) - 1 for document in documents[:5])]  # a target per token


# --------------------------------------------------------------- refused before training, in one line


def preflight(tmp_path, capfd, tiny_model, dataset: str, *extra: str) -> str | None:
    """train.sh's preflight on a job over ``dataset``: its one-line error, or None when it is not one."""
    args = ["--model.config", tiny_model, "--model.tokenizer_path", TOKENIZER, "--training.dataset", dataset,
            "--training.seq_len", "64", "--job.dump_folder", str(tmp_path / "dump"), *extra]
    code = launch_preflight.main(["--world-size", "1", "--", *args])
    return one_line_error(code, capfd.readouterr().err)


def _without(path: str) -> str:
    Path(path).unlink()
    return path


def _megatron_header(tmp_path, documents, **header) -> str:
    return write_megatron(tmp_path / "corpus_text_document", documents, **header)


def _ids_beyond(tmp_path, documents) -> list[list[int]]:
    return [documents[0], [*documents[1][:-1], 4096 + 7, EOS], *documents[2:]]


# case -> (writes the source and returns (dataset, extra flags), the file the line names, what else it says)
BAD_SOURCES = {
    "megatron-idx-missing": (lambda t, d: (_without(_megatron_header(t, d) + ".idx").removesuffix(".idx"), []),
                             "corpus_text_document.idx", "does not exist; give the prefix of a .bin/.idx pair"),
    "megatron-bin-missing": (lambda t, d: (_without(_megatron_header(t, d) + ".bin").removesuffix(".bin"), []),
                             "corpus_text_document.bin", "does not exist; give the prefix of a .bin/.idx pair"),
    "megatron-bad-magic": (lambda t, d: (_megatron_header(t, d, magic=b"NOTANIDX\x00"), []),
                           "corpus_text_document.idx", "is not a Megatron index (no MMIDIDX header)"),
    "megatron-bad-version": (lambda t, d: (_megatron_header(t, d, version=2), []),
                             "corpus_text_document.idx", "Megatron index version 2; flame reads version 1"),
    "megatron-dtype-mismatch": (lambda t, d: (_int32_bin_under_a_uint16_index(t, d), []),
                                "corpus_text_document.bin", "bytes of uint16 ids: the two files are not one pair"),
    "megatron-ids-beyond-the-vocabulary": (lambda t, d: (_megatron_header(t, _ids_beyond(t, d)), []),
                                           "corpus_text_document.bin", "token id 4103 (in a sample of"),
    "megatron-empty": (lambda t, d: (_megatron_header(t, []), []), "corpus_text_document", "holds no documents"),
    "numpy-missing": (lambda t, d: (str(t / "train.bin"), []), "train.bin", "does not exist"),
    "numpy-empty": (lambda t, d: (write_flat(t / "train.bin", [[]]), []), "train.bin", "holds no token ids"),
    "numpy-uint32-read-as-uint16": (lambda t, d: (write_flat(t / "train.bin", d, np.uint32), []), "train.bin",
                                    "as when uint32 ids are read as uint16: set --training.token_dtype uint32"),
    "numpy-bytes-no-whole-number-of-ids": (lambda t, d: (_odd_bytes(t, d), []),
                                           "train.bin", "not a whole number of uint16 ids"),
    "numpy-header-dtype-mismatch": (lambda t, d: (_npy(t, d, np.uint32), ["--training.token_dtype=uint16"]),
                                    "tokens.npy", "holds uint32 ids (its .npy header says so), not uint16"),
    "numpy-ids-beyond-the-vocabulary": (lambda t, d: (write_flat(t / "train.bin", _ids_beyond(t, d)), []),
                                        "train.bin", "token id 4103 (in a sample of"),
    "numpy-floats": (lambda t, d: (_npy(t, d, np.float32), []), "tokens.npy", "holds a float32 array, not token ids"),
}


def _int32_bin_under_a_uint16_index(tmp_path, documents) -> str:
    prefix = _megatron_header(tmp_path, documents)
    Path(prefix + ".bin").write_bytes(np.concatenate(documents).astype(np.int32).tobytes())
    return prefix


def _odd_bytes(tmp_path, documents) -> str:
    path = write_flat(tmp_path / "train.bin", documents)
    Path(path).write_bytes(Path(path).read_bytes() + b"\x00")
    return path


def _npy(tmp_path, documents, dtype) -> str:
    path = str(tmp_path / "tokens.npy")
    np.save(path, np.concatenate(documents).astype(dtype))
    return path


@pytest.mark.parametrize("case", list(BAD_SOURCES))
def test_a_token_file_that_cannot_be_read_is_refused_in_one_line_naming_it(case, tmp_path, capfd, tiny_model,
                                                                           documents):
    write, names, says = BAD_SOURCES[case]
    dataset, flags = write(tmp_path, documents)
    line = preflight(tmp_path, capfd, tiny_model, dataset, *flags)
    assert line is not None and says in line, line
    assert str(tmp_path / names) in line, line
    assert not (tmp_path / "dump").exists()


def test_token_dtype_without_a_numpy_source_is_refused(tmp_path, capfd, tiny_model, corpus, documents):
    line = preflight(tmp_path, capfd, tiny_model, corpus, "--training.token_dtype=uint32")
    assert line and "--training.token_dtype uint32 applies to numpy sources, and no dataset is one" in line, line
    prefix = write_megatron(tmp_path / "corpus_text_document", documents)
    assert preflight(tmp_path, capfd, tiny_model, prefix, "--training.token_dtype=uint32") is not None
    flat = write_flat(tmp_path / "train.bin", documents)  # the file tells its format: the flag applies
    assert preflight(tmp_path, capfd, tiny_model, flat, "--training.token_dtype=uint16") is None


# --------------------------------------------------------------- training and resuming


def _token_args(kind: str, model: str, corpus: str, dump: Path, inputs: Path) -> list[str]:
    """base_args' 8 steps on a token source written (once) into ``inputs`` from the corpus; numpy's mixed with text."""
    prefix, flat = inputs / "corpus_text_document", inputs / "train.bin"
    if not flat.exists():
        tokenized = corpus_documents(corpus, load_tokenizer(TOKENIZER), count=400)
        write_megatron(prefix, tokenized)
        write_flat(flat, tokenized)
    data, flags = (str(prefix), []) if kind == "megatron" else (f"{flat},{corpus}", ["--training.data_probs=0.6,0.4"])
    return base_args(model, data, dump, steps=8) + flags + ["--checkpoint.interval=4", "--training.data_shards=4"]


def _token_job(kind: str):
    return lambda dump, model, corpus: torchrun(_token_args(kind, model, corpus, dump, dump.parent))


@pytest.mark.background_runs(megatron=_token_job("megatron"), numpy=_token_job("numpy"))
@pytest.mark.parametrize("kind", ["megatron", "numpy"])
def test_a_token_source_trains_and_resumes_exactly(kind, background_runs, tiny_model, corpus, tmp_path):
    straight = background_runs[kind].dump
    check(background_runs[kind].result)
    curve = losses(straight)
    assert curve[8] < curve[1], curve
    resumed = tmp_path / "resumed"  # the run as it stood after step 4
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoint" / "step-8")
    result = check(torchrun(_token_args(kind, tiny_model, corpus, resumed, straight.parent)))
    assert "Training starts at step 5" in result.stdout + result.stderr
    got = losses(resumed)
    assert [got[step] for step in range(5, 9)] == [curve[step] for step in range(5, 9)]
    data = {key: value for key, value in metrics(straight)[8].items() if key.startswith("data/")}
    assert data and {k: v for k, v in metrics(resumed)[8].items() if k.startswith("data/")} == data
