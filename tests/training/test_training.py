"""Training runs end to end on CPU: real data, real processes, real checkpoints.

The runs a test needs before its first step are declared above it with
@pytest.mark.background_runs: they start when the module does, two at a time, and each test waits
only for its own (conftest's background_runs fixture).
"""

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from flame.optim.builder import build_optimizers
from flame.training.spikes import SpikeWindow
from flame.optim.record import optimizer_record
from flame.models.builder import load_model_config
from flame.checkpoint.export import load_hf_model_from_dcp
from tests.conftest import (
    SCRIPTS,
    BackgroundRun,
    base_args,
    check,
    losses,
    metrics,
    torchrun,
    train_job,
)


def succeeded(runs: dict[str, BackgroundRun]) -> dict[str, Path]:
    """The dump folders of a test's background runs, each of which must have succeeded."""
    for _, result in runs.values():
        check(result)
    return {name: dump for name, (dump, _) in runs.items()}


@pytest.mark.background_runs(run=train_job(30))
def test_single_process_loss_falls(background_runs):
    dump = succeeded(background_runs)["run"]
    curve = losses(dump)
    assert sorted(curve) == list(range(1, 31))
    first, last = curve[1], sum(curve[s] for s in range(26, 31)) / 5
    assert first > 8.0  # ~ln(4096) at init
    assert last < first - 1.0, curve
    assert (dump / "checkpoint" / "step-30" / ".metadata").is_file()


def _resume_flags(workers=0):
    # the LR schedule spans 12 steps whatever training.steps says, so a short first run and
    # its resumption follow the same schedule as the uninterrupted run
    return ["--lr_scheduler.total_steps=12", "--checkpoint.interval=4", f"--training.num_workers={workers}"]


def _resume_args(model, data, dump, steps, workers=0):
    return base_args(model, data, dump, steps=steps) + _resume_flags(workers)


@pytest.mark.background_runs(straight=train_job(12, *_resume_flags()),
                              resumed=train_job(8, *_resume_flags()))
def test_resume_is_bit_identical_and_skips_an_interrupted_save(background_runs, tiny_model, corpus):
    dumps = succeeded(background_runs)
    straight, resumed = dumps["straight"], dumps["resumed"]
    # DCP writes .metadata last (atomically): a save that died midway has none, and the
    # resume must come from the step-4 checkpoint before it
    os.remove(resumed / "checkpoint" / "step-8" / ".metadata")
    result = check(torchrun(_resume_args(tiny_model, corpus, resumed, 12)))
    assert "Training starts at step 5" in result.stdout + result.stderr
    expected, got = losses(straight), losses(resumed)
    assert [got[s] for s in range(5, 13)] == [expected[s] for s in range(5, 13)]
    assert metrics(resumed)[12]["lr"] == metrics(straight)[12]["lr"]


@pytest.mark.background_runs(straight=train_job(12, *_resume_flags(workers=2)),
                              resumed=train_job(4, *_resume_flags(workers=2)))
def test_resume_is_bit_identical_with_dataloader_workers(background_runs, tiny_model, corpus):
    dumps = succeeded(background_runs)
    straight, resumed = dumps["straight"], dumps["resumed"]
    check(torchrun(_resume_args(tiny_model, corpus, resumed, 12, workers=2)))
    expected, got = losses(straight), losses(resumed)
    assert [got[s] for s in range(5, 13)] == [expected[s] for s in range(5, 13)]


def _bad_steps_job(*flags, bad_steps: str = "3,5", nproc: int = 1):
    return train_job(8, *flags, module=str(SCRIPTS / "inject_nonfinite.py"), env={"FLAME_TEST_BAD_STEPS": bad_steps},
                     nproc=nproc)


@pytest.mark.background_runs(run=_bad_steps_job("--training.skip_nan_inf"))
def test_skip_nan_inf_skips_the_update_and_continues(background_runs):
    dump, result = background_runs["run"]
    check(result)
    rows = metrics(dump)
    assert [rows[s]["skipped_steps"] for s in range(1, 9)] == [0, 0, 1, 1, 2, 2, 2, 2]
    assert math.isinf(rows[3]["grad_norm"]) and math.isfinite(rows[4]["grad_norm"])
    assert all(math.isfinite(rows[s]["loss_metrics/global_avg_loss"]) for s in range(1, 9))
    assert "step 3: gradient norm is inf; update skipped" in result.stdout + result.stderr


@pytest.mark.background_runs(run=_bad_steps_job("--training.skip_nan_inf", "--metrics.log_freq=4",
                                                "--checkpoint.interval=1", bad_steps="3,5", nproc=2))
def test_fused_adamw_skips_a_non_finite_update_on_the_gpu_and_the_skips_are_counted_later(background_runs, tiny_model):
    # fused AdamW skips the update itself (here on FSDP's sharded weights, over 2 ranks); the norms are read
    # at the log steps and before every save
    dump, result = background_runs["run"]
    check(result)
    output = result.stdout + result.stderr
    assert "step 3: gradient norm is inf; update skipped (non-finite; 1 skipped so far)" in output
    assert "step 5: gradient norm is inf; update skipped (non-finite; 2 skipped so far)" in output
    rows = metrics(dump)
    assert rows[4]["skipped_steps"] == 1 and rows[8]["skipped_steps"] == 2
    weights = {step: _weights(dump, step, tiny_model) for step in range(2, 7)}
    assert _same_weights(weights[2], weights[3]) and _same_weights(weights[4], weights[5])
    assert not _same_weights(weights[3], weights[4]) and not _same_weights(weights[5], weights[6])
    # each save's train state counts the skips up to its own step
    for step, skips in ((3, 1), (4, 1), (5, 2)):
        saved = dump / f"train_state_{step}.pt"
        dcp_to_torch_save(dump / "checkpoint" / f"step-{step}", saved)
        assert torch.load(saved, weights_only=False)["train_state"]["skipped_steps"] == skips, step


# logged only at step 8: the check of step 3's norm comes with step 4's save, which it stops
@pytest.mark.background_runs(run=_bad_steps_job("--checkpoint.interval=2", "--metrics.log_freq=8"))
def test_non_finite_gradient_stops_the_run_naming_the_step(background_runs):
    dump, result = background_runs["run"]
    assert result.returncode != 0
    assert "step 3: gradient norm is inf" in result.stdout + result.stderr
    assert "--training.skip_nan_inf" in result.stdout + result.stderr
    assert "step-2, the last checkpoint, is intact" in result.stdout + result.stderr
    assert (dump / "checkpoint" / "step-2" / ".metadata").is_file()
    assert not (dump / "checkpoint" / "step-4").exists()


@pytest.mark.background_runs(run=_bad_steps_job("--training.skip_nan_inf", "--training.max_skipped_steps=2",
                                                bad_steps="3,4,5,6"))
def test_skipping_stops_when_too_many_updates_in_a_row_fail(background_runs):
    dump, result = background_runs["run"]
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "step 4: gradient norm is inf; update skipped (non-finite; 2 skipped so far)" in output  # steps 3, 4
    assert "step 5: gradient norm is inf; 3 updates in a row could not be taken" in output
    assert "--training.max_skipped_steps 2" in output
    assert "no checkpoint was saved" in output  # the run's only checkpoint would have been at step 8
    assert not (dump / "checkpoint").exists() or not list((dump / "checkpoint").iterdir())


# the packer hands out rows in order, so 2 micro-batches of 1 row hold the rows of 1 batch of 2
@pytest.mark.background_runs(big=train_job(5),
                              accumulated=train_job(5, "--training.batch_size=1",
                                                    "--training.gradient_accumulation_steps=2"))
def test_gradient_accumulation_matches_a_larger_batch(background_runs):
    dumps = succeeded(background_runs)
    expected, got = losses(dumps["big"]), losses(dumps["accumulated"])
    for step in range(1, 6):
        assert math.isclose(got[step], expected[step], rel_tol=1e-5), (step, got[step], expected[step])


@pytest.mark.background_runs(run=train_job(12, *_resume_flags(), "--checkpoint.interval=2",
                                           "--checkpoint.keep_latest_k=3"))
def test_keep_latest_k_and_load_step(background_runs, tiny_model, corpus):
    dump = succeeded(background_runs)["run"]
    kept = sorted(int(p.name.split("-")[1]) for p in (dump / "checkpoint").iterdir())
    assert kept == [8, 10, 12]
    straight = losses(dump)
    result = check(torchrun(_resume_args(tiny_model, corpus, dump, 12) + ["--checkpoint.load_step=8"]))
    assert "Training starts at step 9" in result.stdout + result.stderr
    assert [losses(dump)[s] for s in (9, 10, 11, 12)] == [straight[s] for s in (9, 10, 11, 12)]


def _logging_run(dump, model, data):
    # W&B writes under the test's folder, which is also HOME: no ~/.netrc, no W&B credentials
    home = str(dump.parent)
    return torchrun(base_args(model, data, dump, steps=3) + ["--metrics.enable_tensorboard", "--metrics.enable_wandb"],
                    env={"WANDB_DIR": home, "HOME": home})


@pytest.mark.background_runs(run=_logging_run)
def test_tensorboard_and_offline_wandb_logging(background_runs):
    dump, result = background_runs["run"]
    check(result)
    assert "W&B: no credentials found, logging offline" in result.stdout + result.stderr
    assert list((dump / "tb").rglob("events.out.tfevents.*"))
    assert list((dump / "tb").rglob("offline-run-*")), "a W&B offline run directory"


SELECTIVE = "Applied selective activation checkpointing to 2 blocks"
COMPILE_AND_CHECKPOINTING = {  # name: (flags, what the log must say)
    # aot_eager traces and partitions each block like inductor does, without a C++ toolchain
    "compiled": (["--training.compile", "--compile.backend=aot_eager"], "Compiling each of the 2 decoder blocks"),
    "full": (["--activation_checkpoint.mode=full"], "Applied full activation checkpointing to 2 blocks"),
    "selective_op": (["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=op"],
                     SELECTIVE),
    "selective_every_2": (["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=2"],
                          SELECTIVE),
}


@pytest.mark.background_runs(**{name: train_job(4, *flags) for name, (flags, _) in COMPILE_AND_CHECKPOINTING.items()})
def test_compile_and_activation_checkpointing_keep_the_loss_curve(background_runs, single_process_run):
    """Compiled blocks and every activation-checkpointing mode train the eager run's curve."""
    expected = losses(single_process_run)
    for name, (_, log_line) in COMPILE_AND_CHECKPOINTING.items():
        dump, result = background_runs[name]
        check(result)
        assert log_line in result.stdout + result.stderr, name
        got = losses(dump)
        for step in range(1, 5):
            assert math.isclose(got[step], expected[step], rel_tol=1e-4), (name, step)


VARLEN = ["--training.varlen", "--training.batch_size=1", "--training.seq_len=256", "--training.context_len=64"]


@pytest.mark.background_runs(run=train_job(8, *VARLEN, "--training.compile", "--compile.backend=aot_eager",
                                           env={"TORCH_LOGS": "recompiles"}))
def test_compiled_varlen_run_never_recompiles(background_runs):
    """Document counts and lengths change every step; the compiled blocks must not recompile."""
    dump, result = background_runs["run"]
    output = check(result).stdout + result.stderr
    assert "Compiling each of the 2 decoder blocks" in output
    assert "Recompiling function" not in output, output[output.index("Recompiling function"):][:2000]
    assert losses(dump)[8] < losses(dump)[1]


@pytest.mark.background_runs(varlen=train_job(20, *VARLEN))
def test_varlen_run_packs_one_row_and_trains(background_runs):
    rows = metrics(succeeded(background_runs)["varlen"])
    assert rows[20]["n_tokens_seen"] == 20 * 256
    assert rows[20]["loss_metrics/global_avg_loss"] < rows[1]["loss_metrics/global_avg_loss"] - 0.5


@pytest.mark.background_runs(run=train_job(6, *_resume_flags(), "--checkpoint.interval=3", nproc=2))
def test_elastic_resume_on_fewer_ranks_continues_the_data(background_runs, tiny_model, corpus):
    dump = succeeded(background_runs)["run"]
    result = check(torchrun(_resume_args(tiny_model, corpus, dump, 12) + ["--checkpoint.interval=3"]))
    output = result.stdout + result.stderr
    assert "Training starts at step 7" in output
    assert "resuming 64 data shards saved by 2 ranks x 1 workers on 1 ranks x 1 workers" in output
    rows = metrics(dump)
    assert rows[12]["n_tokens_seen"] > 0 and math.isfinite(rows[12]["loss_metrics/global_avg_loss"])


def _small_data_run(dump, model, _):
    data = dump.parent / "small.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " + "word " * 30}) + "\n" for i in range(24)))
    args = base_args(model, str(data), dump, steps=1000) + [
        "--training.source_exhausted=stop", "--training.data_shards=4", "--checkpoint.interval=1000",
    ]
    return torchrun(args, nproc=2, timeout=300)


@pytest.mark.background_runs(run=_small_data_run)
def test_running_out_of_data_stops_every_rank_and_saves(background_runs):
    dump, result = background_runs["run"]
    check(result)
    assert "Ran out of data" in result.stdout + result.stderr
    last = max(metrics(dump))
    assert 1 <= last < 1000
    assert (dump / "checkpoint" / f"step-{last}" / "manifest.json").is_file()  # complete


def _two_source_run(dump, model, corpus):
    other = dump.parent / "other.jsonl"
    other.write_text("".join(json.dumps({"text": f"other document {i} " * 20}) + "\n" for i in range(200)))
    args = base_args(model, f"{corpus},{other}", dump, steps=8) + [
        "--training.data_probs=0.5,0.5", "--training.mix_unit=tokens",
    ]
    return torchrun(args, nproc=2)


@pytest.mark.background_runs(run=_two_source_run)
def test_per_source_counts_are_logged_and_add_up_to_the_tokens_seen(background_runs):
    dump, result = background_runs["run"]
    check(result)
    row = metrics(dump)[8]
    by_source = {key: value for key, value in row.items() if key.startswith("data/") and key.endswith("/tokens")}
    assert len(by_source) == 2 and all(value > 0 for value in by_source.values())
    assert sum(by_source.values()) == row["n_tokens_seen"]
    assert " mix " in result.stdout + result.stderr



# A spike is judged against the 6 steps before it, once 3 are there; the schedule spans 10 steps
# whatever training.steps says, so a short run and its resumption follow the uninterrupted run.
SPIKE_FLAGS = ["--training.spike_sigma=6", "--training.spike_window=6", "--training.spike_min_steps=3",
               "--lr_scheduler.total_steps=10", "--checkpoint.keep_latest_k=0"]


def _spike_env(grad: str, loss: str = "") -> dict[str, str]:
    return {"FLAME_TEST_GRAD_SPIKES": grad, "FLAME_TEST_LOSS_SPIKES": loss}


def _spike_job(steps, *flags, grad="6", loss="8"):
    return train_job(steps, *SPIKE_FLAGS, *flags, module=str(SCRIPTS / "inject_spikes.py"), env=_spike_env(grad, loss))


def _weights(dump: Path, step: int, model_config: str) -> dict:
    return load_hf_model_from_dcp(str(dump / "checkpoint" / f"step-{step}"), load_model_config(model_config)).state_dict()


def _same_weights(a: dict, b: dict) -> bool:
    return all(torch.equal(a[name], b[name]) for name in a)


SPIKE_METRICS = ["spike_skips", "skipped_steps", "spike/loss_mean", "spike/loss_std", "spike/grad_norm_mean",
                 "spike/grad_norm_std", "loss_metrics/global_avg_loss", "grad_norm"]


@pytest.mark.background_runs(straight=_spike_job(10, "--checkpoint.interval=1"), resumed=_spike_job(4))
def test_a_loss_or_gradient_spike_skips_its_update_and_a_resume_judges_alike(background_runs, tiny_model, corpus):
    dumps = succeeded(background_runs)
    straight, resumed = dumps["straight"], dumps["resumed"]
    rows = metrics(straight)
    # step 6's gradient norm and step 8's loss are spikes; the steps around them are not
    assert [rows[s]["spike_skips"] for s in range(1, 11)] == [0, 0, 0, 0, 0, 1, 1, 2, 2, 2]
    assert [rows[s]["skipped_steps"] for s in range(1, 11)] == [rows[s]["spike_skips"] for s in range(1, 11)]
    output = background_runs["straight"].result.stdout + background_runs["straight"].result.stderr
    assert "step 6: gradient norm" in output and "step 8: loss" in output and "update skipped (spike" in output
    # a skipped update leaves the weights as they were; a taken one changes them
    weights = {step: _weights(straight, step, tiny_model) for step in (5, 6, 7, 8)}
    assert _same_weights(weights[5], weights[6]) and _same_weights(weights[7], weights[8])
    assert not _same_weights(weights[6], weights[7])
    # the window holds the last 6 steps, the skipped ones too (a lasting shift is absorbed)
    window = [rows[s]["loss_metrics/global_avg_loss"] for s in range(5, 11)]
    assert math.isclose(rows[10]["spike/loss_mean"], sum(window) / 6, rel_tol=1e-6)
    # resumed after step 4, the run judges steps 5-10 against the window it saved: as the straight run
    check(torchrun(base_args(tiny_model, corpus, resumed, steps=10) + SPIKE_FLAGS,
                   module=str(SCRIPTS / "inject_spikes.py"), env=_spike_env("6", "8")))
    got = metrics(resumed)
    for step in range(5, 11):
        assert {k: got[step][k] for k in SPIKE_METRICS} == {k: rows[step][k] for k in SPIKE_METRICS}, step


@pytest.mark.background_runs(run=_spike_job(10, "--checkpoint.interval=2", "--training.max_skipped_steps=2",
                                            grad="5,6,7", loss=""))
def test_a_run_that_keeps_spiking_stops_in_one_line(background_runs):
    dump, result = background_runs["run"]
    assert result.returncode == 1
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "flame: error:" in line]
    assert len(errors) == 1, errors
    assert "step 7: gradient norm" in errors[0] and "3 updates in a row could not be taken" in errors[0]
    assert "--training.max_skipped_steps 2" in errors[0] and "step-6, the last checkpoint, is intact" in errors[0]
    assert metrics(dump)[6]["spike_skips"] == 2


def test_the_spike_window_absorbs_a_lasting_shift():
    window = SpikeWindow(sigma=3, size=4, min_steps=3)
    judged = [window.judge(loss, 1.0) for loss in (2.0, 2.1, 2.0, 2.1, 5.0, 5.0, 5.1, 5.0, 5.0, 5.1)]
    assert judged[:4] == [None] * 4
    assert judged[4] is not None and "loss 5 is" in judged[4]  # the shift is a spike at first ...
    assert judged[-1] is None  # ... and the new level once the window holds mostly it
    restored = SpikeWindow(sigma=3, size=4, min_steps=3)
    restored.load_state_dict(window.state_dict())
    assert restored.judge(9.0, 1.0) == window.judge(9.0, 1.0) is not None


@pytest.mark.parametrize("name, implementation, on_host, on_device", [
    ("AdamW", "fused", False, True), ("Adam", "fused", False, True), ("AdamW", "foreach", False, False),
    ("AdamW", "for-loop", False, False), ("Muon", "fused", False, False), ("AdamW", "fused", True, False),
])
def test_only_fused_adam_skips_a_non_finite_update_on_the_device(name, implementation, on_host, on_device):
    # the others cannot skip by themselves: the trainer then checks every step's norm before the update
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8)])
    config = SimpleNamespace(name=name, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                             implementation=implementation, early_step_in_backward=False, on_host=on_host,
                             gpu_blocks=0, muon_lr=None, muon_momentum=0.95, muon_weight_decay=None,
                             muon_nesterov=True, muon_ns_steps=5, muon_adjust_lr="match_rms_adamw", param_groups="",
                             decay_everything=False)
    optimizers = build_optimizers([model], config, None)
    assert optimizer_record(name).skips_on_gpu(config) is on_device
    # what the record says, the optimizers built do: torch's fused Adam and AdamW read found_inf in their step
    assert all(isinstance(optimizer, torch.optim.Adam) and all(group.get("fused") for group in optimizer.param_groups)
               for optimizer in optimizers.optimizers) is on_device
