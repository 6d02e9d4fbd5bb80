"""A resume is the same run: every checkpoint step records the run's identity, and preflight refuses a
resume that differs from it in one line naming each field and the flag that accepts it; an accepted
change applies from the resumed step on.

One real run (scripts/chaos/bad_inputs.py's finished run: its base job, 2 steps, a checkpoint at each)
is made once; preflight (train.sh's, in this process) then checks resumes of it, and a copy of it is
resumed for real where a test needs the ranks.
"""

import json
import shutil

import pytest

from flame.checkpoint import identity, manifest
from flame.data.tokenizer import load_tokenizer
from flame.launch import preflight as launch_preflight
from scripts.chaos.bad_inputs import RESUME_CASES, Case, base_job, fingerprint, one_line_error, prepare
from tests.conftest import TOKENIZER, check, metrics, torchrun

SAVED_LR = 0.0008  # torchtitan's default --optimizer.lr, which the base job keeps


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """The finished run of bad_inputs (its base job for 2 steps, saved at steps 1 and 2), without the HF export."""
    work = tmp_path_factory.mktemp("identity")
    dump = work / "finished"
    check(torchrun(["--job.config_file", str(base_job(work)), "--job.dump_folder", str(dump), "--training.steps", "2",
                    "--checkpoint.enable", "--checkpoint.interval", "1"]))
    return dump


def resume_args(tmp_path, finished, *flags: str) -> list[str]:
    """The base job resuming ``finished`` with ``flags`` (a case's folder of its own under ``tmp_path``)."""
    return prepare(Case("resume", ("--job.dump_folder", str(finished), "--checkpoint.enable", *flags), ()),
                   tmp_path / "case", finished)


def preflight(args: list[str], capfd) -> tuple[int, str, str]:
    """train.sh's preflight of ``args`` on one process: exit status, stdout, stderr."""
    code = launch_preflight.main(["--world-size", "1", "--", *args])
    out, err = capfd.readouterr()
    return code, out, err


def test_every_step_records_the_identity_of_its_run(finished):
    for step in (1, 2):
        saved = manifest.read_identity(str(finished / "checkpoint" / f"step-{step}"))
        assert set(saved) == {*identity.NAMES, "steps"}
        assert saved["lr"] == {"optimizer.lr": SAVED_LR} and saved["seq_len"] == {"training.seq_len": 64}
        assert saved["batch"] == {"rows": 2} and saved["steps"] == 2
        assert saved["model"]["hidden_act"] == "silu" and len(saved["tokenizer"]["fingerprint"]) == 16


def test_the_same_run_with_more_steps_resumes_and_notes_its_recomputed_schedule(tmp_path, finished, capfd):
    # the base job trains 4 steps: the saved run's warmup (torchtitan's 200, cut to its 2 steps) now spans 4
    code, out, err = preflight(resume_args(tmp_path, finished), capfd)
    assert code == 0, err
    assert "error" not in err and "accept" not in out
    assert "--training.steps 4 (the saved run's: 2): the LR schedule is recomputed for the new total" in out
    assert "step 3 trains at 0.75 x --optimizer.lr, where the saved run's schedule had 1 x" in out


@pytest.mark.parametrize("case", RESUME_CASES, ids=lambda case: case.name)
def test_another_run_is_refused_in_one_line_naming_the_field_and_its_flag(case, tmp_path, finished, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = prepare(case, tmp_path / "case", finished)
    before = fingerprint(finished)
    code, _, err = preflight(args, capfd)
    line = one_line_error(code, err)
    assert line is not None, f"exit {code}, stderr:\n{err}"
    for fragment in case.expect:
        assert fragment in line, line
    assert fingerprint(finished) == before


def test_accepted_changes_pass_and_are_printed_once(tmp_path, finished, capfd):
    code, out, err = preflight(resume_args(tmp_path, finished, "--debug.seed", "7", "--training.batch_size", "4",
                                           "--checkpoint.accept_changes", "seed,batch"), capfd)
    assert code == 0, err
    [line] = [line for line in out.splitlines() if "accept" in line]
    assert "seed (--debug.seed 42 -> 7); batch (" in line and "they apply from step 3 on" in line


def test_a_refusal_names_the_accepted_fields_too(tmp_path, finished, capfd):
    code, _, err = preflight(resume_args(tmp_path, finished, "--debug.seed", "7", "--optimizer.lr", "1e-4",
                                         "--checkpoint.accept_changes", "seed"), capfd)
    line = one_line_error(code, err)
    assert line is not None and "lr (--optimizer.lr" in line and "seed (" not in line
    assert "--checkpoint.accept_changes seed,lr " in line


def test_another_tokenizer_of_the_same_size_is_refused(tmp_path, finished, capfd):
    folder = tmp_path / "tokenizer"
    load_tokenizer(TOKENIZER).save_pretrained(folder)
    backend = json.loads((folder / "tokenizer.json").read_text())
    vocab = backend["model"]["vocab"]
    first, second = list(vocab)[100:102]  # two tokens swap their ids: as many ids, another text for each
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (folder / "tokenizer.json").write_text(json.dumps(backend))
    code, _, err = preflight(resume_args(tmp_path, finished, "--model.tokenizer_path", str(folder)), capfd)
    line = one_line_error(code, err)
    assert line is not None, err
    assert "tokenizer (--model.tokenizer_path's vocabulary, merges or special tokens" in line
    assert "--checkpoint.accept_changes tokenizer" in line


def test_a_step_saved_without_an_identity_resumes_with_a_note(tmp_path, finished, capfd):
    dump = shutil.copytree(finished, tmp_path / "older")
    for step in (1, 2):  # as an earlier flame wrote them: the files alone
        folder = str(dump / "checkpoint" / f"step-{step}")
        manifest.write(folder, manifest.read(folder))
    code, out, err = preflight(resume_args(tmp_path, dump, "--optimizer.lr", "1e-4"), capfd)
    assert code == 0, err
    assert "records no run identity" in out and "not compared" in out


def test_an_accepted_lr_and_weight_decay_apply_from_the_resumed_step(tmp_path, finished, capfd):
    dump = shutil.copytree(finished, tmp_path / "resumed")
    flags = ["--optimizer.lr", "1e-4", "--optimizer.weight_decay", "0", "--checkpoint.accept_changes", "optimizer,lr"]
    args = resume_args(tmp_path, dump, "--checkpoint.interval", "1", *flags)
    code, _, err = preflight(args, capfd)
    assert code == 0, err
    result = check(torchrun(args))
    lrs = {step: row["lr"] for step, row in metrics(dump).items()}
    # the base job's schedule for 4 steps: warmup over all 4 (torchtitan cuts its 200 to the run's length)
    assert lrs[2] == pytest.approx(SAVED_LR) and lrs[3] == pytest.approx(1e-4 * 3 / 4) and lrs[4] == pytest.approx(1e-4)
    assert "weight_decay 0.1 -> 0.0, lr 0.0008 -> 0.0001" in result.stdout + result.stderr
    saved = manifest.read_identity(str(dump / "checkpoint" / "step-4"))  # the run goes on as the new run
    assert saved["lr"] == {"optimizer.lr": 1e-4} and saved["optimizer"]["optimizer.weight_decay"] == 0
    code, _, err = preflight(resume_args(tmp_path, dump, "--training.steps", "6", *flags[:4]), capfd)
    assert code == 0, err  # resumed as itself now, without the flag
