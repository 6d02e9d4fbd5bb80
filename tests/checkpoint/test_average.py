"""flame average: the weighted mean of a run's last checkpoints as an HF model, scored beside each step; bad choices
refused in one line."""

import pytest
import torch
from safetensors.torch import load_file

from flame.checkpoint import average
from flame.checkpoint.export import load_hf_model_from_dcp, run_settings
from flame.models import load_model_config
from tests.conftest import check, train_job


@pytest.mark.background_runs(run=train_job(4, "--checkpoint.interval=1", "--checkpoint.keep_latest_k=0"))
def test_the_average_is_the_weighted_mean_of_the_steps_and_is_scored(background_runs, tmp_path, capsys, tiny_model,
                                                                     corpus):
    run = background_runs["run"]
    check(run.result)
    out, step = tmp_path / "avg", tmp_path / "anneal" / "checkpoint" / "step-0"
    assert average.main([str(run.dump), "--last", "3", "--weights", "1,2,3", "--out", str(out), "--documents", "4",
                         "--checkpoint", str(step)]) == 0
    printed = capsys.readouterr().out
    assert "averaged steps 2, 3, 4" in printed and "average " in printed and "step 4 (x0.5)" in printed
    config = load_model_config(run_settings(str(run.dump))["model"]["config"])
    steps = [load_hf_model_from_dcp(str(run.dump / "checkpoint" / f"step-{s}"), config).state_dict() for s in (2, 3, 4)]
    exported = load_file(str(out / "model.safetensors"))
    for name, tensor in exported.items():
        expected = (steps[0][name] + 2 * steps[1][name] + 3 * steps[2][name]) / 6
        assert torch.allclose(tensor, expected, rtol=1e-6, atol=1e-7), name
    # the average as a checkpoint step: a run whose dump folder holds it starts from it
    as_step = load_hf_model_from_dcp(str(step), config).state_dict()
    assert all(torch.equal(as_step[name], tensor) for name, tensor in exported.items())
    started = check(train_job(1)(tmp_path / "anneal", tiny_model, corpus))
    assert f"Loading the checkpoint from {step}" in started.stdout + started.stderr
    for flags, message in ((["--last", "9"], "--last 9: average 2 to 4 steps"),
                           (["--steps", "2,7"], "--steps: step 7 is not a complete checkpoint"),
                           (["--last", "2", "--weights", "1,2,3"], "--weights 1,2,3: give 2 numbers")):
        assert average.main([str(run.dump), *flags, "--out", str(tmp_path / "x"), "--documents", "0"]) == 2
        assert message in capsys.readouterr().err
    for flags, message in ((["--checkpoint", str(step)], f"--checkpoint {step} exists and is not empty"),):
        assert average.main([str(run.dump), *flags, "--out", str(tmp_path / "x"), "--documents", "0"]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_weights_are_normalized_oldest_first():
    assert average.step_weights("uniform", 4) == [0.25] * 4
    assert average.step_weights("linear", 3) == pytest.approx([1 / 6, 2 / 6, 3 / 6])
