"""Damaged checkpoints are found, named and set aside before anything of them is read.

One real run (2 processes, a checkpoint every 2 steps) is made once; each test damages a copy
of it the way a crash, a full disk or a stranger would, and checks what preflight, the ranks
and the export do with it.
"""

import json
import os
import pickle
import shutil
import socket
import subprocess
import sys

import pytest

from tests.conftest import ROOT, base_args, check, flame_env, losses, torchrun

STEPS = 6


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model, corpus):
    """6 steps of the tiny llama on 2 processes (FSDP), saved at steps 2, 4 and 6."""
    dump = tmp_path_factory.mktemp("integrity") / "run"
    check(torchrun(args(tiny_model, corpus, dump), nproc=2))
    return dump


def args(tiny_model, corpus, dump, *flags):
    return [*base_args(tiny_model, corpus, dump, steps=STEPS), "--checkpoint.interval=2", *flags]


@pytest.fixture
def copy(run, tmp_path):
    """A copy of the run's dump folder, to damage."""
    return shutil.copytree(run, tmp_path / "run")


def preflight(tiny_model, corpus, dump, capsys, *flags) -> tuple[int, str]:
    """train.sh's preflight (flame.launch.preflight) of resuming ``dump``: its exit status and stderr."""
    from flame.launch import preflight

    code = preflight.main(["--world-size", "2", "--",
                        *args(tiny_model, corpus, dump, *flags)])
    return code, capsys.readouterr().err


def manifest_of(step_folder):
    return json.loads((step_folder / "manifest.json").read_text())["files"]


def test_every_saved_step_has_a_manifest_of_all_its_files(run):
    for step in (2, 4, 6):
        folder = run / "checkpoint" / f"step-{step}"
        files = manifest_of(folder)
        on_disk = sorted(name for name in os.listdir(folder) if name != "manifest.json")
        assert sorted(files) == on_disk and {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(files)
        assert all(files[name]["size"] == (folder / name).stat().st_size for name in on_disk)


def test_a_resume_sets_damaged_and_incomplete_steps_aside_and_matches_an_uninterrupted_run(run, copy, tiny_model, corpus):
    checkpoint = copy / "checkpoint"
    written = (checkpoint / "step-4" / "__1_0.distcp").stat().st_size
    with open(checkpoint / "step-4" / "__1_0.distcp", "r+b") as f:
        f.truncate(written // 2)
    for name in (".metadata", "manifest.json"):  # step 6 as a save killed midway leaves it
        (checkpoint / "step-6" / name).unlink(missing_ok=True)
    left = {path.name: path.read_bytes() for path in (checkpoint / "step-6").iterdir()}

    # the ranks check on their own (a bare torchrun launch); async saves and keep_latest_k on the way
    result = check(torchrun(args(tiny_model, corpus, copy, "--checkpoint.async_mode=async",
                                 "--checkpoint.keep_latest_k=2"), nproc=2))
    output = result.stdout + result.stderr
    assert "Training starts at step 3" in output
    assert (f"checkpoint {checkpoint / 'step-4'} is damaged: __1_0.distcp has {written // 2} bytes, not the {written} it "
            "was written with") in output
    assert f"checkpoint {checkpoint / 'step-6'} is incomplete: it has no .metadata" in output
    expected, got = losses(run), losses(copy)
    assert [got[s] for s in range(3, STEPS + 1)] == [expected[s] for s in range(3, STEPS + 1)]
    # nothing set aside is written over or purged; the new steps are complete
    assert sorted(os.listdir(checkpoint)) == ["step-4", "step-4.damaged", "step-6", "step-6.incomplete"]
    assert {path.name: path.read_bytes() for path in (checkpoint / "step-6.incomplete").iterdir()} == left
    assert (checkpoint / "step-4.damaged" / "__1_0.distcp").stat().st_size == written // 2
    for step in (4, 6):
        assert set(manifest_of(checkpoint / f"step-{step}")) == set(manifest_of(run / "checkpoint" / f"step-{step}"))


def test_preflight_sets_a_truncated_latest_step_aside_naming_the_file(copy, tiny_model, corpus, capsys):
    checkpoint = copy / "checkpoint"
    with open(checkpoint / "step-6" / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    code, err = preflight(tiny_model, corpus, copy, capsys)
    assert code == 0, err
    warning = next(line for line in err.splitlines() if line.startswith("flame: warning: "))
    assert f"{checkpoint / 'step-6'} is damaged: __0_0.distcp has 100 bytes" in warning
    assert f"moved it to {checkpoint / 'step-6.damaged'}" in warning and f"loads {checkpoint / 'step-4'}" in warning
    assert sorted(os.listdir(checkpoint)) == ["step-2", "step-4", "step-6.damaged"]


def test_metadata_that_is_not_the_one_written_is_never_unpickled(copy, tiny_model, corpus, capsys, tmp_path):
    marker = tmp_path / "unpickled"

    class RunsCode:  # what a stranger's .metadata can do when unpickled
        def __reduce__(self):
            return os.mkdir, (str(marker),)

    (copy / "checkpoint" / "step-6" / ".metadata").write_bytes(pickle.dumps(RunsCode()))
    code, err = preflight(tiny_model, corpus, copy, capsys)
    assert code == 0, err
    assert "step-6 is damaged: .metadata has" in err and not marker.exists()
    # same size, other bytes: the checksum finds it
    metadata = copy / "checkpoint" / "step-4" / ".metadata"
    metadata.write_bytes(os.urandom(metadata.stat().st_size))
    code, err = preflight(tiny_model, corpus, copy, capsys)
    assert code == 0, err
    assert "step-4 is damaged: .metadata is not the file that was written (its checksum differs)" in err
    assert "loads" in err and str(copy / "checkpoint" / "step-2") in err


def test_an_explicit_load_step_that_is_damaged_is_one_line_and_moves_nothing(copy, tiny_model, corpus, capsys):
    (copy / "checkpoint" / "step-4" / "__0_0.distcp").unlink()
    code, err = preflight(tiny_model, corpus, copy, capsys, "--checkpoint.load_step=4")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"flame: error: --checkpoint.load_step 4: {copy / 'checkpoint' / 'step-4'} is damaged: "
                               "__0_0.distcp is missing"), lines[0]
    assert sorted(os.listdir(copy / "checkpoint")) == ["step-2", "step-4", "step-6"]


def test_a_checkpoint_from_elsewhere_without_manifest_loads_once_it_is_recorded(run, tmp_path, tiny_model, corpus, capsys):
    elsewhere = shutil.copytree(run / "checkpoint" / "step-2", tmp_path / "elsewhere")
    (elsewhere / "manifest.json").unlink(missing_ok=True)
    dump = tmp_path / "new"
    code, err = preflight(tiny_model, corpus, dump, capsys, f"--checkpoint.initial_load_path={elsewhere}")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "has no manifest.json" in lines[0] and ".metadata is a pickle" in lines[0]
    assert f"python -m flame.checkpoint.manifest {elsewhere}" in lines[0]
    check(subprocess.run([sys.executable, "-m", "flame.checkpoint.manifest", str(elsewhere)], cwd=ROOT, env=flame_env(),
                         capture_output=True, text=True))
    code, err = preflight(tiny_model, corpus, dump, capsys, f"--checkpoint.initial_load_path={elsewhere}")
    assert code == 0, err


def test_the_export_checks_its_step_and_removes_what_killed_exports_left(copy):
    from flame.checkpoint import export

    host = socket.gethostname()
    finished = subprocess.Popen(["true"])
    finished.wait()
    stale = [copy / f".hf-{host}-{finished.pid}-abcd1234", copy / ".hf-x9k2m_0q"]  # a killed export; an older flame's
    alive = copy / f".hf-{host}-{os.getpid()}-efgh5678"  # an export running now
    for folder in [*stale, alive]:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"partial")
    with open(copy / "checkpoint" / "step-6" / "__1_0.distcp", "r+b") as f:
        f.seek(10)
        f.write(b"\0\1\2\3")  # same size, other bytes
    assert export.main(["--path", str(copy)]) == 2
    assert not (copy / "hf").exists()
    assert export.main(["--path", str(copy), "--step", "4"]) == 0
    assert (copy / "hf" / "model.safetensors").is_file()
    assert not any(folder.exists() for folder in stale) and alive.is_dir()
