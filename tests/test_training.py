"""Training runs end to end on CPU: real data, real processes, real checkpoints."""

import json
import math
import os
import subprocess
import sys

from tests.conftest import ROOT, base_args, check, flame_env, losses, metrics, torchrun, torchrun_two_at_a_time


def test_single_process_loss_falls(tmp_path, tiny_model, corpus):
    dump = tmp_path / "run"
    check(torchrun(base_args(tiny_model, corpus, dump, steps=30)))
    curve = losses(dump)
    assert sorted(curve) == list(range(1, 31))
    first, last = curve[1], sum(curve[s] for s in range(26, 31)) / 5
    assert first > 8.0  # ~ln(4096) at init
    assert last < first - 1.0, curve
    assert (dump / "checkpoint" / "step-30" / ".metadata").is_file()


def _resume_args(model, data, dump, steps, workers=0):
    # the LR schedule spans 12 steps whatever training.steps says, so a short first run and
    # its resumption follow the same schedule as the uninterrupted run
    return base_args(model, data, dump, steps=steps) + [
        "--lr_scheduler.total_steps=12", "--checkpoint.interval=4", f"--training.num_workers={workers}",
    ]


def test_resume_is_bit_identical_and_skips_an_interrupted_save(tmp_path, tiny_model, corpus):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    check(torchrun(_resume_args(tiny_model, corpus, straight, 12)))
    check(torchrun(_resume_args(tiny_model, corpus, resumed, 8)))
    # DCP writes .metadata last (atomically): a save that died midway has none, and the
    # resume must come from the step-4 checkpoint before it
    os.remove(resumed / "checkpoint" / "step-8" / ".metadata")
    result = check(torchrun(_resume_args(tiny_model, corpus, resumed, 12)))
    assert "Training starts at step 5" in result.stdout + result.stderr
    expected, got = losses(straight), losses(resumed)
    assert [got[s] for s in range(5, 13)] == [expected[s] for s in range(5, 13)]
    assert metrics(resumed)[12]["lr"] == metrics(straight)[12]["lr"]


def test_resume_is_bit_identical_with_dataloader_workers(tmp_path, tiny_model, corpus):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    check(torchrun(_resume_args(tiny_model, corpus, straight, 12, workers=2)))
    check(torchrun(_resume_args(tiny_model, corpus, resumed, 4, workers=2)))
    check(torchrun(_resume_args(tiny_model, corpus, resumed, 12, workers=2)))
    expected, got = losses(straight), losses(resumed)
    assert [got[s] for s in range(5, 13)] == [expected[s] for s in range(5, 13)]


def _run_with_bad_steps(tmp_path, tiny_model, corpus, extra):
    dump = tmp_path / "run"
    os.environ["FLAME_TEST_BAD_STEPS"] = "3,5"
    try:
        result = torchrun(base_args(tiny_model, corpus, dump, steps=8) + extra,
                          module=str(ROOT / "tests" / "scripts" / "inject_nonfinite.py"))
    finally:
        del os.environ["FLAME_TEST_BAD_STEPS"]
    return dump, result


def test_skip_nan_inf_skips_the_update_and_continues(tmp_path, tiny_model, corpus):
    dump, result = _run_with_bad_steps(tmp_path, tiny_model, corpus, ["--training.skip_nan_inf"])
    check(result)
    rows = metrics(dump)
    assert [rows[s]["skipped_steps"] for s in range(1, 9)] == [0, 0, 1, 1, 2, 2, 2, 2]
    assert math.isinf(rows[3]["grad_norm"]) and math.isfinite(rows[4]["grad_norm"])
    assert all(math.isfinite(rows[s]["loss_metrics/global_avg_loss"]) for s in range(1, 9))
    assert "step 3: gradient norm is inf; update skipped" in result.stdout + result.stderr


def test_non_finite_gradient_stops_the_run_naming_the_step(tmp_path, tiny_model, corpus):
    dump, result = _run_with_bad_steps(tmp_path, tiny_model, corpus, ["--checkpoint.interval=2"])
    assert result.returncode != 0
    assert "step 3: gradient norm is inf" in result.stdout + result.stderr
    assert "--training.skip_nan_inf" in result.stdout + result.stderr
    assert (dump / "checkpoint" / "step-2" / ".metadata").is_file()
    assert not (dump / "checkpoint" / "step-4").exists()


def test_gradient_accumulation_matches_a_larger_batch(tmp_path, tiny_model, corpus):
    # the packer hands out rows in order, so 2 micro-batches of 1 row hold the rows of 1 batch of 2
    big, accumulated = tmp_path / "big", tmp_path / "accumulated"
    for result in torchrun_two_at_a_time({
        "big": base_args(tiny_model, corpus, big, steps=5),
        "accumulated": base_args(tiny_model, corpus, accumulated, steps=5)
        + ["--training.batch_size=1", "--training.gradient_accumulation_steps=2"],
    }).values():
        check(result)
    expected, got = losses(big), losses(accumulated)
    for step in range(1, 6):
        assert math.isclose(got[step], expected[step], rel_tol=1e-5), (step, got[step], expected[step])


def test_keep_latest_k_and_load_step(tmp_path, tiny_model, corpus):
    dump = tmp_path / "run"
    check(torchrun(_resume_args(tiny_model, corpus, dump, 12) + ["--checkpoint.interval=2", "--checkpoint.keep_latest_k=3"]))
    kept = sorted(int(p.name.split("-")[1]) for p in (dump / "checkpoint").iterdir())
    assert kept == [8, 10, 12]
    straight = losses(dump)
    result = check(torchrun(_resume_args(tiny_model, corpus, dump, 12) + ["--checkpoint.load_step=8"]))
    assert "Training starts at step 9" in result.stdout + result.stderr
    assert [losses(dump)[s] for s in (9, 10, 11, 12)] == [straight[s] for s in (9, 10, 11, 12)]


def test_tensorboard_and_offline_wandb_logging(tmp_path, tiny_model, corpus):
    dump = tmp_path / "run"
    os.environ["WANDB_DIR"] = str(tmp_path)
    os.environ["HOME"], home = str(tmp_path), os.environ["HOME"]  # no ~/.netrc: no W&B credentials
    try:
        result = check(torchrun(base_args(tiny_model, corpus, dump, steps=3)
                                + ["--metrics.enable_tensorboard", "--metrics.enable_wandb"]))
    finally:
        os.environ["HOME"] = home
        del os.environ["WANDB_DIR"]
    assert "W&B: no credentials found, logging offline" in result.stdout + result.stderr
    assert list((dump / "tb").rglob("events.out.tfevents.*"))
    assert list((dump / "tb").rglob("offline-run-*")), "a W&B offline run directory"


def test_compile_and_activation_checkpointing_keep_the_loss_curve(tmp_path, tiny_model, corpus, single_process_run):
    """Compiled blocks and every activation-checkpointing mode train the eager run's curve."""
    expected = losses(single_process_run)
    selective = "Applied selective activation checkpointing to 2 blocks"
    variants = {  # name: (flags, what the log must say)
        # aot_eager traces and partitions each block like inductor does, without a C++ toolchain
        "compiled": (["--training.compile", "--compile.backend=aot_eager"], "Compiling each of the 2 decoder blocks"),
        "full": (["--activation_checkpoint.mode=full"], "Applied full activation checkpointing to 2 blocks"),
        "selective_op": (["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=op"],
                         selective),
        "selective_every_2": (["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=2"],
                              selective),
    }
    runs = torchrun_two_at_a_time({name: base_args(tiny_model, corpus, tmp_path / name, steps=4) + flags
                                   for name, (flags, _) in variants.items()})
    for name, (_, log_line) in variants.items():
        result = check(runs[name])
        assert log_line in result.stdout + result.stderr, name
        got = losses(tmp_path / name)
        for step in range(1, 5):
            assert math.isclose(got[step], expected[step], rel_tol=1e-4), (name, step)


def test_compiled_varlen_run_never_recompiles(tmp_path, tiny_model, corpus):
    """Document counts and lengths change every step; the compiled blocks must not recompile."""
    args = base_args(tiny_model, corpus, tmp_path, steps=8) + [
        "--training.varlen", "--training.batch_size=1", "--training.seq_len=256", "--training.context_len=64",
        "--training.compile", "--compile.backend=aot_eager",
    ]
    env = flame_env() | {"TORCH_LOGS": "recompiles"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "flame.train"]
    result = check(subprocess.run([*command, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600))
    output = result.stdout + result.stderr
    assert "Compiling each of the 2 decoder blocks" in output
    assert "Recompiling function" not in output, output[output.index("Recompiling function"):][:2000]
    assert losses(tmp_path)[8] < losses(tmp_path)[1]


def test_varlen_run_packs_one_row_and_trains(tmp_path, tiny_model, corpus):
    dump = tmp_path / "varlen"
    args = base_args(tiny_model, corpus, dump, steps=20) + [
        "--training.varlen", "--training.batch_size=1", "--training.seq_len=256", "--training.context_len=64",
    ]
    check(torchrun(args))
    rows = metrics(dump)
    assert rows[20]["n_tokens_seen"] == 20 * 256
    assert rows[20]["loss_metrics/global_avg_loss"] < rows[1]["loss_metrics/global_avg_loss"] - 0.5


def test_elastic_resume_on_fewer_ranks_continues_the_data(tmp_path, tiny_model, corpus):
    dump = tmp_path / "run"
    check(torchrun(_resume_args(tiny_model, corpus, dump, 6) + ["--checkpoint.interval=3"], nproc=2))
    result = check(torchrun(_resume_args(tiny_model, corpus, dump, 12) + ["--checkpoint.interval=3"]))
    output = result.stdout + result.stderr
    assert "Training starts at step 7" in output
    assert "resuming 64 data shards saved by 2 ranks x 1 workers on 1 ranks x 1 workers" in output
    rows = metrics(dump)
    assert rows[12]["n_tokens_seen"] > 0 and math.isfinite(rows[12]["loss_metrics/global_avg_loss"])


def test_running_out_of_data_stops_every_rank_and_saves(tmp_path, tiny_model):
    data = tmp_path / "small.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " + "word " * 30}) + "\n" for i in range(24)))
    dump = tmp_path / "run"
    args = base_args(tiny_model, str(data), dump, steps=1000) + [
        "--training.source_exhausted=stop", "--training.data_shards=4", "--checkpoint.interval=1000",
    ]
    result = check(torchrun(args, nproc=2, timeout=300))
    assert "Ran out of data" in result.stdout + result.stderr
    last = max(metrics(dump))
    assert 1 <= last < 1000
    assert (dump / "checkpoint" / f"step-{last}" / ".metadata").is_file()


def test_per_source_counts_are_logged_and_add_up_to_the_tokens_seen(tmp_path, tiny_model, corpus):
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"text": f"other document {i} " * 20}) + "\n" for i in range(200)))
    dump = tmp_path / "run"
    args = base_args(tiny_model, f"{corpus},{other}", dump, steps=8) + [
        "--training.data_probs=0.5,0.5", "--training.mix_unit=tokens",
    ]
    result = check(torchrun(args, nproc=2))
    row = metrics(dump)[8]
    by_source = {key: value for key, value in row.items() if key.startswith("data/") and key.endswith("/tokens")}
    assert len(by_source) == 2 and all(value > 0 for value in by_source.values())
    assert sum(by_source.values()) == row["n_tokens_seen"]
    assert " mix " in result.stdout + result.stderr
