"""Bad input fails in one line, naming the setting and the fix, before any training process starts.

The cases are scripts/chaos/bad_inputs.py's (its tally runs each through `bash train.sh`). Here
each runs train.sh's preflight (``python -m flame.launch.preflight``) in this process: exit 2, one line on
stderr holding the case's expected words, nothing written into the case's dump folder, and no
file of a finished run changed. The cases of train.sh's environment, and those where a library
logs on its own, run train.sh itself (``FLAME_DRY_RUN=1``: nothing would start even if one were
accepted).
"""

import os
import subprocess

import pytest

from flame.launch import preflight as launch_preflight

from flame.checkpoint import manifest
from scripts.chaos.bad_inputs import (
    CASES,
    Case,
    fingerprint,
    one_line_error,
    prepare,
    world_size,
)
from tests.conftest import ROOT, flame_env


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished run's dump folder as preflight sees it: complete checkpoints, its config, its export."""
    dump = tmp_path_factory.mktemp("finished") / "run"
    for step in (1, 2):  # DCP writes .metadata last: these steps are complete
        (dump / "checkpoint" / f"step-{step}").mkdir(parents=True)
        (dump / "checkpoint" / f"step-{step}" / ".metadata").write_bytes(b"")
        (dump / "checkpoint" / f"step-{step}" / "__0_0.distcp").write_bytes(b"weights")
        manifest.record(str(dump / "checkpoint" / f"step-{step}"))  # flame's last word on a complete step
    (dump / "job_config.json").write_text('{"checkpoint": {"export_dtype": "float32"}}')
    (dump / "hf").mkdir()
    (dump / "hf" / "model.safetensors").write_bytes(b"exported")
    return dump


def preflight(args: list[str], world: int, tmp_path, capfd) -> tuple[int, str]:
    code = launch_preflight.main(["--world-size", str(world), "--", *args])
    return code, capfd.readouterr().err  # the file descriptor: library loggers write there too


def test_the_valid_base_job_passes(tmp_path, capfd, finished):
    args = prepare(Case("valid", (), ()), tmp_path / "case", finished)
    code, err = preflight(args, 1, tmp_path, capfd)
    assert code == 0, err


@pytest.mark.parametrize("case", [case for case in CASES if not case.shell], ids=lambda case: case.name)
def test_bad_input_is_refused_in_one_line(case, tmp_path, capfd, finished, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative path a case might write lands here
    args = prepare(case, tmp_path / "case", finished)
    before = fingerprint(finished)
    run = tmp_path / "case" / "run"
    made = fingerprint(run) if run.exists() else None  # what the case put in its dump folder itself
    code, err = preflight(args, world_size(case), tmp_path, capfd)
    line = one_line_error(code, err)
    assert line is not None, f"exit {code}, stderr:\n{err}"
    for fragment in case.expect:
        assert fragment in line, line
    assert (fingerprint(run) if run.exists() else None) == made  # nothing written
    assert fingerprint(finished) == before


# cases where transformers or datasets log on their own before flame refuses: their loggers hold the
# stream pytest gave them at import, so only a process of its own shows what a user sees
LIBRARIES_SPEAK = ("rows-longer-than-learned-positions", "dataset-file-not-json")


@pytest.mark.parametrize("case", [case for case in CASES if case.shell or case.name in LIBRARIES_SPEAK],
                         ids=lambda case: case.name)
def test_train_sh_refuses_in_one_line(case, tmp_path):
    args = prepare(case, tmp_path / "case", tmp_path / "finished")
    env = {**flame_env(), "FLAME_DRY_RUN": "1", "NGPU": "1", **case.env}
    for name in ("NNODE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "LOG_RANK", "FLAME_DUMP_STACKS_AFTER", "SLURM_JOB_ID"):
        if name not in case.env:
            env.pop(name, None)
    result = subprocess.run(["bash", "train.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    line = one_line_error(result.returncode, result.stderr)
    assert line is not None, f"exit {result.returncode}, stderr:\n{result.stderr}"
    for fragment in case.expect:
        assert fragment in line, line


def test_a_dataset_file_whose_name_holds_a_comma_is_read_whole(tmp_path, capfd, finished):
    # --training.dataset is a comma list; an entry that exists with its comma is one path, not two
    (tmp_path / "a,b.jsonl").write_text('{"text": "def f():\\n    return 1\\n"}\n' * 8)
    args = prepare(Case("comma", ("--training.dataset", f"{tmp_path}/a,b.jsonl,{tmp_path}/a,b.jsonl"), ()),
                   tmp_path / "case", finished)
    code, err = preflight(args, 1, tmp_path, capfd)
    assert code == 0, err


def test_a_load_step_that_is_not_there_names_the_steps_that_are(tmp_path, capfd, finished):
    (finished / "checkpoint" / "step-3").mkdir()  # a save that did not finish
    try:
        args = prepare(Case("load", ("--job.dump_folder", "{finished}", "--checkpoint.enable",
                                     "--checkpoint.load_step", "3"), ()), tmp_path / "case", finished)
        code, err = preflight(args, 1, tmp_path, capfd)
    finally:
        (finished / "checkpoint" / "step-3").rmdir()
    assert code == 2 and "step-3 is incomplete: it has no .metadata" in err, err
    assert "its complete steps are 1, 2" in err, err


def test_a_dump_folder_this_user_cannot_write_is_refused(tmp_path, capfd, finished, monkeypatch):
    (tmp_path / "locked").mkdir()
    locked = str(tmp_path / "locked")
    real_access = os.access
    # as the kernel answers a user without write permission (root, which runs CI, may write anywhere)
    monkeypatch.setattr(os, "access", lambda path, mode: path != locked and real_access(path, mode))
    args = prepare(Case("locked", ("--job.dump_folder", f"{locked}/run"), ()), tmp_path / "case", finished)
    code, err = preflight(args, 1, tmp_path, capfd)
    assert one_line_error(code, err) and f"{locked} is not writable by this user" in err, err
