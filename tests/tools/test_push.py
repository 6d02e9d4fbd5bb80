"""`flame push`: a run's export checked whole and described without the network; the hub's refusals in one line."""

import http.server
import json
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM

from flame.tools import push
from tests.conftest import TOKENIZER, flame_env


@pytest.fixture(scope="module")
def dump(tmp_path_factory, tiny_model) -> str:
    """A fine-tuning run's dump folder with its real export (hf/): the tiny llama's weights as step 0, exported as
    train.sh exports a run, card included."""
    from flame.checkpoint import export
    from flame.models import load_model_config
    from flame.utils import convert_hf_to_dcp

    root = tmp_path_factory.mktemp("push")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(load_model_config(tiny_model)).save_pretrained(root / "weights")
    folder = root / "run"
    assert convert_hf_to_dcp.main(["--model", str(root / "weights"), "--checkpoint", str(folder / "checkpoint" / "step-0")]) == 0
    (folder / "job_config.json").write_text(json.dumps({"model": {"config": tiny_model, "tokenizer_path": TOKENIZER,
                                                                  "init_from": "HuggingFaceTB/SmolLM2-135M"},
                                                        "training": {"dataset": f"HuggingFaceFW/fineweb-edu,{root}/c.jsonl"}}))
    assert export.main(["--path", str(folder), "--step", "0"]) == 0
    return str(folder)


def flame_push(*args: str, cwd, env: dict | None = None) -> subprocess.CompletedProcess:
    """`flame push` as a user runs it, in a fresh process: no stored login, the hub unreachable unless ``env`` says."""
    base = flame_env() | {"HF_HOME": str(cwd / "hf_home"), "HF_ENDPOINT": "http://127.0.0.1:9"}
    base.pop("HF_TOKEN", None)
    return subprocess.run([sys.executable, "-m", "flame.tools.push", *args], cwd=cwd, env=base | (env or {}),
                          capture_output=True, text=True, timeout=120)


def test_help_names_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        push.main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith("usage: flame push ")
    for flag in ("--repo_id", "--private", "--revision", "--commit_message", "--license", "--dry_run", "FLAME_HUB_REPO",
                 "HF_TOKEN"):
        assert flag in out, flag


def test_dry_run_from_another_directory_lists_the_files_and_the_card_without_network_or_token(dump, tmp_path):
    result = flame_push(os.path.relpath(dump, tmp_path), "--repo-id", "me/tiny", "--dry-run", "--private", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    export = os.path.join(dump, "hf")
    assert out.splitlines()[0] == (f"would push {os.path.relpath(export, tmp_path)} to me/tiny "
                                   "(http://127.0.0.1:9/me/tiny), revision main")
    assert "visibility: private if the push creates the repo" in out
    names = sorted(name for name in os.listdir(export) if not name.startswith("."))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"} <= set(names)
    listed = [line.split() for line in out.splitlines() if line.startswith("  ") and line.split()[0] in names]
    assert [row[0] for row in listed] == names
    assert dict((row[0], row[1:]) for row in listed)["config.json"] == [str(os.path.getsize(os.path.join(export, "config.json"))), "B"]
    assert f"  {len(names)} files, " in out
    card = out[out.index("card metadata:"):]
    for line in ("base_model: HuggingFaceTB/SmolLM2-135M", "- HuggingFaceFW/fineweb-edu", "library_name: transformers",
                 "pipeline_tag: text-generation"):
        assert line in card, line
    assert "c.jsonl" not in card and out.rstrip().endswith("token: none; log in with `hf auth login` or set HF_TOKEN before pushing")


def test_the_dump_folder_and_its_export_plan_the_same_upload(dump):
    by_dump, by_export = push.plan(dump, "me/tiny"), push.plan(os.path.join(dump, "hf"), "me/tiny")
    assert by_dump.folder == by_export.folder and by_dump.files == by_export.files
    assert dict(by_dump.files)["README.md"] == len(str(by_dump.card).encode())


def test_license_sets_the_uploaded_cards_license_and_leaves_the_export_alone(dump):
    readme = os.path.join(dump, "hf", "README.md")
    before = open(readme).read()
    upload = push.plan(dump, "me/tiny", license="apache-2.0")
    assert ModelCard(str(upload.card)).data.license == "apache-2.0" and "license: apache-2.0" in push.describe(upload)
    assert open(readme).read() == before and ModelCard.load(readme).data.license is None


def test_a_dump_folder_without_an_export_is_refused_with_the_command_that_makes_it(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "job_config.json").write_text("{}")
    assert push.main([str(tmp_path / "run"), "--repo_id", "me/tiny", "--dry_run"]) == 2
    assert capsys.readouterr().err == (f"flame push: error: {tmp_path / 'run'} holds no HF export (hf/); make it first: "
                                       f"python -m flame.checkpoint.export --path {tmp_path / 'run'}\n")


def test_an_incomplete_export_names_what_it_lacks(dump, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(dump, run, ignore=shutil.ignore_patterns("checkpoint"))
    (run / "hf" / "tokenizer.json").unlink()
    (run / "hf" / "model.safetensors").unlink()
    assert push.main([str(run), "--repo_id", "me/tiny"]) == 2
    err = capsys.readouterr().err
    assert err == (f"flame push: error: {run / 'hf'} is not a complete HF export: it lacks model.safetensors, "
                   f"tokenizer.json; export the run again: python -m flame.checkpoint.export --path {run}\n")


def test_a_card_naming_this_machines_paths_is_refused(dump, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(dump, run, ignore=shutil.ignore_patterns("checkpoint"))
    readme = run / "hf" / "README.md"
    readme.write_text(readme.read_text() + f"\nstep 0 of the run in `{run}`\n")  # as earlier flame's cards said
    assert push.main([str(run), "--repo_id", "me/tiny", "--dry_run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flame push: error: {readme} names this machine's path {run}; export again") and err.count("\n") == 1


def test_the_repo_id_comes_from_the_flag_or_the_environment(dump, monkeypatch, capsys):
    monkeypatch.delenv(push.REPO_ENV, raising=False)
    assert push.main([dump, "--dry_run"]) == 2
    assert capsys.readouterr().err == ("flame push: error: no repo to push to: pass --repo_id owner/name or set "
                                       "FLAME_HUB_REPO\n")
    monkeypatch.setenv(push.REPO_ENV, "team/from-env")
    assert push.main([dump, "--dry_run"]) == 0 and " to team/from-env (" in capsys.readouterr().out
    assert push.main([dump, "--repo_id", "no-owner", "--dry_run"]) == 2
    assert "--repo_id no-owner is not owner/name" in capsys.readouterr().err
    monkeypatch.setenv(push.REPO_ENV, "team/bad name")
    assert push.main([dump, "--dry_run"]) == 2
    assert capsys.readouterr().err.startswith("flame push: error: FLAME_HUB_REPO team/bad name is not a hub repo id (")


def test_a_push_without_a_token_stops_before_the_network(dump, tmp_path):
    result = flame_push(dump, "--repo_id", "me/tiny", cwd=tmp_path)
    assert (result.returncode, result.stderr) == (2, "flame push: error: no Hugging Face token: log in with "
                                                     "`hf auth login` or set HF_TOKEN\n")


def test_an_unreachable_hub_is_one_line(dump, tmp_path):
    result = flame_push(dump, "--repo_id", "me/tiny", cwd=tmp_path, env={"HF_TOKEN": "hf_test"})
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("flame push: error: cannot reach the hub at http://127.0.0.1:9 (")


class Refusing(http.server.BaseHTTPRequestHandler):
    """A stand-in for the hub that answers every request with the status its server was made for."""

    def answer(self):
        self.send_response(self.server.status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "refused"}')

    do_GET = do_POST = do_PUT = answer

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status, said", [
    (401, "the hub refused the token (401 Unauthorized): log in with `hf auth login` or set HF_TOKEN to a write token"),
    (403, "the token may not write to me/tiny (403 Forbidden): use one with write access to me"),
    (404, "the hub has no me/tiny at revision main that this token can reach (404): check --repo_id"),
])
def test_the_hubs_refusals_are_one_line_with_the_fix(dump, tmp_path, status, said):
    server = http.server.HTTPServer(("127.0.0.1", 0), Refusing)
    server.status = status
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        result = flame_push(dump, "--repo_id", "me/tiny", cwd=tmp_path,
                            env={"HF_TOKEN": "hf_test", "HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}"})
    finally:
        server.shutdown()
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"flame push: error: {said}"), result.stderr

