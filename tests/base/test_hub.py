"""Hub names are looked up in the local HF cache first: a cached one loads with the hub unreachable, an uncached one
fails in one line within seconds naming the remedy, and only a hub that answers is asked for a name."""

import http.server
import json
import os
import shutil
import subprocess
import sys
import threading

import pytest

from tests.conftest import ROOT, TOKENIZER, flame_env

UNREACHABLE = "http://127.0.0.1:9"  # the discard port: connections are refused at once, network or not
# each lookup the child is named, by a flame function as flame calls it; prints one JSON line per lookup
CHILD = """
import json, sys, time
from flame.base.errors import ConfigError
from flame.data.sources import SourceSpec, load_source
from flame.data.tokenizer import load_tokenizer
from flame.eval import tasks
from flame.models import init_from, load_model_config

lookups = {
    "tokenizer": lambda: load_tokenizer("flame-tests/no-tokenizer"),
    "dataset": lambda: load_source(SourceSpec("flame-tests/no-dataset"), False),
    "init_from": lambda: init_from.resolve("flame-tests/no-model"),
    "model_config": lambda: load_model_config("flame-tests/no-model"),
    "task": lambda: tasks.load(["piqa"], None),  # lm-eval's piqa: its data is the hub dataset baber/piqa
    "cached_tokenizer": lambda: load_tokenizer("flame-tests/tokenizer")("def main():").input_ids,
    "cached_dataset": lambda: list(load_source(SourceSpec("flame-tests/cached-data"), False)["text"]),
    "cached_streaming": lambda: [row["text"] for row in load_source(SourceSpec("flame-tests/cached-data"), True)],
    "cached_other_config": lambda: load_source(SourceSpec("flame-tests/cached-data", name="other"), False),
    "cached_init_from": lambda: sorted(__import__("os").listdir(init_from.resolve("flame-tests/model"))),
}
if "task" in sys.argv:
    tasks.task_manager(None)  # lm-eval's index of its tasks takes seconds: built before the clock starts
for name in sys.argv[1:]:
    start = time.monotonic()
    try:
        result = {"value": lookups[name]()}
    except ConfigError as error:
        result = {"error": str(error)}
    print(json.dumps({"name": name, "seconds": time.monotonic() - start, **result}), flush=True)
"""


def lookup(hf_home, endpoint: str, *names: str) -> dict[str, dict]:
    """Each named lookup in a fresh process whose HF cache is ``hf_home`` and whose hub is at ``endpoint``."""
    env = flame_env() | {"HF_HOME": str(hf_home), "HF_ENDPOINT": endpoint}
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HF_DATASETS_CACHE"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, "-c", CHILD, *names], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    found = {}
    for line in result.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            found[record.pop("name")] = record
    return found


def snapshot(hf_home, repo: str, files: dict[str, bytes]) -> None:
    """``files`` as the local HF cache holds a model repo that `hf download` fetched: a snapshot its refs/main names."""
    folder = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (folder / "snapshots" / commit).mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    for name, content in files.items():
        (folder / "snapshots" / commit / name).write_bytes(content)


def cached_dataset(hf_home, repo: str, texts: list[str], scratch) -> None:
    """A hub dataset as datasets' own cache holds one it loaded (without streaming): its Arrow files under
    <HF_HOME>/datasets/<org>___<name>/<config>/<version>/<hash>/, named for the dataset and split."""
    import datasets

    (scratch / "data.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    builder = datasets.load_dataset_builder("json", data_files=str(scratch / "data.jsonl"), cache_dir=str(scratch / "c"))
    builder.download_and_prepare()
    org, name = repo.split("/")
    folder = hf_home / "datasets" / f"{org}___{name}" / "default" / "0.0.0" / ("0" * 16)
    shutil.copytree(builder.cache_dir, folder)
    os.rename(folder / "json-train.arrow", folder / f"{name}-train.arrow")
    info = json.loads((folder / "dataset_info.json").read_text())
    (folder / "dataset_info.json").write_text(json.dumps(info | {"config_name": "default", "dataset_name": name}))


@pytest.fixture(scope="module")
def unreachable_hub(tmp_path_factory) -> dict[str, dict]:
    """Every lookup, in one process, with a cache holding a tokenizer, a model and a dataset, and the hub unreachable."""
    from safetensors.torch import save_file
    import torch

    from flame.data.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("hub")
    hf_home = root / "hf_home"
    load_tokenizer(TOKENIZER).save_pretrained(root / "tokenizer")
    tokenizer = {p.name: p.read_bytes() for p in (root / "tokenizer").iterdir()}
    snapshot(hf_home, "flame-tests/tokenizer", tokenizer | {"config.json": b'{"model_type": "llama"}'})  # a model repo's
    save_file({"weight": torch.zeros(2)}, root / "model.safetensors")
    snapshot(hf_home, "flame-tests/model", {"config.json": b'{"model_type": "llama"}',
                                            "model.safetensors": (root / "model.safetensors").read_bytes()})
    cached_dataset(hf_home, "flame-tests/cached-data", ["first document", "second document"], root)
    return lookup(hf_home, UNREACHABLE, "tokenizer", "dataset", "init_from", "model_config", "task", "cached_tokenizer",
                  "cached_dataset", "cached_streaming", "cached_other_config", "cached_init_from")


@pytest.mark.parametrize("name, remedy", [
    ("tokenizer", "download it where there is network (hf download flame-tests/no-tokenizer) into this HF_HOME"),
    ("dataset", "hf download flame-tests/no-dataset --repo-type dataset --local-dir DIR) and give --training.dataset DIR"),
    ("init_from", "download it first (hf download flame-tests/no-model)"),
    ("model_config", "download it where there is network (hf download flame-tests/no-model) into this HF_HOME"),
    ("task", "run this command once where there is network, with this HF_HOME"),
])
def test_a_name_neither_cached_nor_reachable_fails_in_one_line_within_seconds(unreachable_hub, name, remedy):
    found = unreachable_hub[name]
    assert "error" in found, found
    assert "\n" not in found["error"] and remedy in found["error"], found["error"]
    assert found["seconds"] < 15, found  # not huggingface_hub's 23 s of retries per request
    if name != "init_from":  # which looks in the cache only: it downloads nothing
        assert f"and the hub is unreachable ({UNREACHABLE}: " in found["error"], found["error"]


def test_a_task_names_its_dataset(unreachable_hub):
    assert unreachable_hub["task"]["error"].startswith("task piqa: baber/piqa is not in the local HF cache")


def test_a_cached_name_loads_with_the_hub_unreachable(unreachable_hub):
    from flame.data.tokenizer import load_tokenizer

    assert unreachable_hub["cached_tokenizer"]["value"] == load_tokenizer(TOKENIZER)("def main():").input_ids
    assert unreachable_hub["cached_dataset"]["value"] == ["first document", "second document"]
    assert unreachable_hub["cached_streaming"]["value"] == ["first document", "second document"]
    assert unreachable_hub["cached_init_from"]["value"] == ["config.json", "model.safetensors"]
    assert all(unreachable_hub[name]["seconds"] < 15 for name in ("cached_tokenizer", "cached_dataset"))


def test_a_dataset_cached_without_the_config_asked_for_says_so(unreachable_hub):
    assert unreachable_hub["cached_other_config"]["error"].startswith(
        "cannot load dataset flame-tests/cached-data: Couldn't find cache for flame-tests/cached-data for config 'other'")


class NotFound(http.server.BaseHTTPRequestHandler):
    """A hub that answers, and has nothing: every request gets 404, and is counted."""

    def _answer(self) -> None:
        self.server.requests += 1
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = _answer

    def log_message(self, *args) -> None:
        pass


def test_a_name_not_cached_is_asked_of_a_hub_that_answers(tmp_path):
    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    server.requests = 0
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        found = lookup(tmp_path / "hf_home", f"http://127.0.0.1:{server.server_port}", "tokenizer")["tokenizer"]
    finally:
        server.shutdown()
    assert server.requests > 1  # the probe, then transformers' own requests
    assert "nor a hub name in the local HF cache or on the hub" in found["error"], found
    assert "unreachable" not in found["error"]
