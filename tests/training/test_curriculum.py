"""Ramps and data phases (flame.config.curriculum, flame.training.curriculum): each step's rows, micro-batches and lr;
the refusals; the optimizer reset; a run stopped inside the batch ramp and before a phase boundary resumes
bit-identically; and every flag of the recipe together under FSDP on 2 ranks trains the curve of 1 rank, which a
resume on 1 rank continues."""

import copy
import math
import shutil
import types

import pytest
import torch
from torchtitan.components import lr_scheduler as torchtitan_lr_scheduler

from flame.base.errors import ConfigError
from flame.config.curriculum import Curriculum
from flame.optim.host import HostAdamW
from flame.prepare import settled
from flame.training.curriculum import StepCurriculum, reset_state
from tests.conftest import assert_same_curve, check, metrics, train_job
from tests.data.conftest import random_texts, write_jsonl
from tests.optim.test_host_optimizer import tiny_llama, train


def _training(**settings) -> types.SimpleNamespace:
    return types.SimpleNamespace(**({"batch_ramp": "", "context_ramp": "", "data_phases": ""} | settings))


def test_every_row_belongs_to_the_step_the_batch_ramp_gives_it():
    curriculum = Curriculum.of(_training(batch_ramp="1: 2, 3: 4, 6: 8"))
    row = 0
    for step in range(1, 10):
        rows = curriculum.rows(step, 0)
        assert rows == (2 if step < 3 else 4 if step < 6 else 8)
        assert [curriculum.step_of_row(row + r, 0) for r in range(rows)] == [step] * rows
        row += rows
    assert [Curriculum.of(_training(context_ramp="1: 8")).step_of_row(r, 4) for r in range(9)] == [1] * 4 + [2] * 4 + [3]


def test_a_phase_numbers_its_steps_and_keeps_its_options():
    curriculum = Curriculum.of(_training(data_phases="5: 1,0; 9: 0,1 reset_optimizer restart_lr"))
    assert [curriculum.phase(step) for step in (1, 4, 5, 8, 9, 100)] == [0, 0, 1, 1, 2, 2]
    assert curriculum.phases[1].probabilities == (0.0, 1.0)
    assert (curriculum.phases[0].reset_optimizer, curriculum.phases[1].reset_optimizer,
            curriculum.phases[1].restart_lr) == (False, True, True)


def _settled(tiny_model, world, *flags, dataset="builtin:python-stdlib"):
    return settled(["--model.config", tiny_model, "--training.dataset", dataset,
                    "--model.tokenizer_path", "builtin:python-stdlib", "--training.seq_len", "64", *flags], world)


def test_the_micro_batch_divides_every_step_of_the_ramp_and_the_accumulation_is_the_largest_steps(tiny_model):
    t = _settled(tiny_model, 2, "--training.batch_ramp", "1: 4, 3: 8, 5: 16").training
    assert (t.local_batch_size, t.gradient_accumulation_steps, t.global_batch_size) == (2, 4, 16)


@pytest.mark.parametrize("world, flags, message", [
    (1, ["--training.batch_ramp", "1: 4, 3: 8", "--training.global_batch_size", "8"], "both set the global batch"),
    (1, ["--training.batch_ramp", "2: 4"], "starts at step 2: give the rows of step 1 first"),
    (1, ["--training.batch_ramp", "1: 4, 1: 8"], "its steps must be >= 1 and rise"),
    (1, ["--training.batch_ramp", "1: four"], "is not a whole number >= 1"),
    (1, ["--training.batch_ramp", "1 4"], "is not 'step: value'"),
    (2, ["--training.batch_ramp", "1: 3, 2: 4"], "3 rows from step 1 does not divide among 2 data-parallel ranks"),
    (1, ["--training.batch_ramp", "1: 2, 2: 4", "--training.batch_size", "4"], "--training.batch_size 4 does not divide"),
    (1, ["--training.context_ramp", "1: 128"], "beyond --training.context_len 64"),
    (1, ["--training.data_phases", "3: 1,1"], "has 2 probabilities for 1 datasets"),
    (1, ["--training.data_phases", "3: 1 reset"], "'reset' at step 3 is not an option of a phase"),
    (1, ["--training.data_phases", "1: 1"], "a phase from step 1 is the run's mixture"),
    (1, ["--training.data_phases", "3: 0"], "probabilities >= 0 with a positive sum"),
    (1, ["--training.lr_follows_batch", "sqrt"], "and there is none: give --training.batch_ramp"),
])
def test_a_curriculum_that_does_not_fit_the_run_is_refused_in_one_line(tiny_model, world, flags, message):
    with pytest.raises(ConfigError, match=message) as refused:
        _settled(tiny_model, world, *flags)
    assert "\n" not in str(refused.value)


def test_a_context_ramp_is_refused_for_sft_data_whose_conversations_are_never_cut(tiny_model):
    with pytest.raises(ConfigError, match="leave the context ramp out of a run with sft data"):
        _settled(tiny_model, 1, "--training.context_ramp", "1: 16", "--training.data_format", "sft",
                 dataset="tests/data/chat.jsonl")


def test_the_lr_restarts_at_a_phase_and_follows_the_batch(tiny_model):
    config = _settled(tiny_model, 1, "--training.batch_ramp", "1: 2, 3: 8", "--training.lr_follows_batch", "sqrt",
                      "--training.data_phases", "5: 1 restart_lr", "--lr_scheduler.warmup_steps", "2",
                      "--training.steps", "10", "--optimizer.lr", "1.0")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedulers = torchtitan_lr_scheduler.build_lr_schedulers([optimizer], config.lr_scheduler, 10)
    original = schedulers.schedulers[0].lr_lambdas[0]
    StepCurriculum(config).shape_lr(schedulers)
    lrs = []
    for _ in range(10):
        lrs.append(schedulers.schedulers[0].get_last_lr()[0])
        schedulers.step()
    restarted = torchtitan_lr_scheduler.build_lr_schedulers(
        [torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)], config.lr_scheduler, 6).schedulers[0].lr_lambdas[0]
    expected = [original(n) * (math.sqrt(2 / 8) if n < 2 else 1) for n in range(4)] + [restarted(n) for n in range(6)]
    assert lrs == pytest.approx(expected)
    assert lrs[4] < lrs[3]  # the restart's warmup


@pytest.mark.parametrize("on_host", [False, True])
def test_a_reset_optimizer_steps_like_a_fresh_one(on_host):
    def build(model):
        settings = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
        return HostAdamW(model, **settings) if on_host else torch.optim.AdamW(model.parameters(), **settings)

    used = tiny_llama()
    optimizer = build(used)
    train(used, optimizer, 3)
    getattr(optimizer, "settle", lambda: None)()
    fresh = copy.deepcopy(used)
    reset_state(types.SimpleNamespace(optimizers=[optimizer]))
    fresh_optimizer = build(fresh)
    train(used, optimizer, 1)
    train(fresh, fresh_optimizer, 1)
    for stepped in (optimizer, fresh_optimizer):  # the host's updates land in the weights
        getattr(stepped, "settle", lambda: None)()
    for ours, theirs in zip(used.parameters(), fresh.parameters()):
        assert torch.equal(ours, theirs)


# ---------------------------------------------------------------- runs

RAMP_AND_PHASE = ("--training.batch_ramp=1: 4, 3: 8, 5: 16", "--training.lr_follows_batch=sqrt",
                  "--training.context_ramp=1: 16, 5: 64", "--training.data_probs=1,1",
                  "--training.data_phases=4: 0,1 reset_optimizer restart_lr", "--checkpoint.interval=3")
EVERY_FLAG = ("--optimizer.param_groups=embeddings: lr=0.5; head: weight_decay=0", "--training.z_loss=1e-4",
              "--training.logit_softcap=30", "--training.ema_decay=0.9")


def _two_sources(job):
    """``job`` on two sources: the corpus, then a second corpus of other words (data_phases moves to it)."""
    def run(dump, model, data):
        second = write_jsonl(dump.parent / f"{dump.name}-second.jsonl", random_texts(300, prefix="second", max_words=200))
        return job(dump, model, data, second)
    return run


def _job(*flags, **options):
    return _two_sources(lambda dump, model, data, second: train_job(
        8, *RAMP_AND_PHASE, *flags, f"--training.dataset={data},{second}", **options)(dump, model, data))


@pytest.mark.background_runs(
    workers=_job("--training.num_workers=2", "--training.row_shuffle_buffer=3"),
    one=_job(*EVERY_FLAG),
    two=_job(*EVERY_FLAG, nproc=2),
)
def test_a_curriculum_run_resumes_bit_identically_and_two_ranks_train_the_curve_of_one(background_runs, tiny_model, corpus):
    runs = background_runs
    for run in runs.values():
        check(run.result)
    workers = runs["workers"]
    log = workers.result.stdout + workers.result.stderr
    assert "Batch ramp: 16 rows a step from step 5 (8 micro-batches a rank)" in log
    assert "Data phase 1 from step 4: mixture [0.0, 1.0], optimizer state reset, lr schedule restarted" in log
    expected = metrics(workers.dump)
    assert [expected[step]["n_tokens_seen"] for step in (1, 2, 3, 5)] == [4 * 64, 8 * 64, 16 * 64, 40 * 64]

    # stopped at step 3 (inside the batch ramp, before the phase): steps 4-8 again, bit for bit
    for step in ("step-6", "step-8"):
        shutil.rmtree(workers.dump / "checkpoint" / step)
    second = workers.dump.parent / "workers-second.jsonl"
    result = check(train_job(8, *RAMP_AND_PHASE, "--training.num_workers=2", "--training.row_shuffle_buffer=3",
                             f"--training.dataset={corpus},{second}")(workers.dump, tiny_model, corpus))
    assert "checkpoint/step-3." in result.stdout + result.stderr
    assert_same_curve(metrics(workers.dump), expected, rel=0, steps=range(4, 9))

    one, two = metrics(runs["one"].dump), metrics(runs["two"].dump)
    _same_losses(two, one, steps=range(1, 9))
    # the 2-rank run stopped at step 3 and resumed on 1 rank continues the curve
    on_one = runs["two"].dump.parent / "two-on-one"
    second = runs["two"].dump.parent / "two-second.jsonl"
    result = check(train_job(8, *RAMP_AND_PHASE, *EVERY_FLAG, f"--training.dataset={corpus},{second}",
                             f"--checkpoint.initial_load_path={runs['two'].dump / 'checkpoint' / 'step-3'}",
                             "--checkpoint.no-initial_load_model_only")(on_one, tiny_model, corpus))
    assert "each step the rows an uninterrupted run would have" in result.stdout + result.stderr
    _same_losses(metrics(on_one), one, steps=range(4, 9))


def _same_losses(got: dict, expected: dict, steps) -> None:
    """Losses within 1e-5 and gradient norms within 1e-4 (relative): FSDP's reduce-scatter sums in another order, and
    the z-loss, softcap and EMA add sums of their own."""
    for step in steps:
        assert math.isclose(got[step]["loss_metrics/global_avg_loss"], expected[step]["loss_metrics/global_avg_loss"],
                            rel_tol=1e-5), step
        assert math.isclose(got[step]["grad_norm"], expected[step]["grad_norm"], rel_tol=1e-4), step
