"""A global batch that does not depend on the GPU count (--training.global_batch_size, global_batch_tokens): the
accumulation is derived for the ranks, 2 ranks x 4 rows train the curve of 1 rank x 8 rows, and a run stopped on 2
ranks and resumed on 1 (or the other way) continues that curve."""

import pytest

from flame.base.errors import ConfigError
from flame.prepare import settled
from tests.conftest import assert_same_curve, check, metrics, train_job, two_at_a_time

GLOBAL_8 = ("--training.global_batch_size=8", "--checkpoint.interval=3")
EXACT = 1e-5  # the same rows each step; only the order of the gradient's sums differs


@pytest.mark.parametrize("world, flags, local, accumulation", [
    (1, ["--training.global_batch_size=8", "--training.batch_size=2"], 2, 4),
    (2, ["--training.global_batch_size=8", "--training.batch_size=2"], 2, 2),
    (4, ["--training.global_batch_size=8"], 2, 1),  # batch_size not given: the largest default-sized divisor
    (2, ["--training.global_batch_tokens=1024", "--training.seq_len=64"], 8, 1),
])
def test_the_accumulation_follows_from_the_global_batch(tiny_model, world, flags, local, accumulation):
    t = settled(["--model.config", tiny_model, "--training.dataset", "builtin:python-stdlib",
                 "--model.tokenizer_path", "builtin:python-stdlib", *flags], world).training
    assert (t.local_batch_size, t.gradient_accumulation_steps, t.global_batch_size) == (local, accumulation,
                                                                                      local * accumulation * world)


@pytest.mark.parametrize("world, flags, message", [
    (2, ["--training.global_batch_size=9"], "does not divide among 2 data-parallel ranks"),
    (2, ["--training.global_batch_size=8", "--training.batch_size=3"], "--training.batch_size 3 does not divide"),
    (1, ["--training.global_batch_tokens=1000", "--training.seq_len=64"], "is not a whole number of rows"),
    (1, ["--training.global_batch_size=8", "--training.gradient_accumulation_steps=3", "--training.batch_size=2"],
     "takes 4 micro-batches a step, and --training.gradient_accumulation_steps says 3"),
    (1, ["--training.global_batch_size=8", "--training.global_batch_tokens=512"], "both fix the global batch"),
])
def test_a_global_batch_that_cannot_divide_is_refused_in_one_line(tiny_model, world, flags, message):
    with pytest.raises(ConfigError, match=message):
        settled(["--model.config", tiny_model, "--training.dataset", "builtin:python-stdlib",
                 "--model.tokenizer_path", "builtin:python-stdlib", *flags], world)


@pytest.mark.background_runs(
    one=train_job(6, *GLOBAL_8, "--training.batch_size=8"),
    two=train_job(6, *GLOBAL_8, "--training.batch_size=4", nproc=2),
)
def test_two_ranks_train_the_curve_of_one_and_a_resume_on_the_other_count_continues_it(background_runs, tiny_model,
                                                                                       corpus):
    one, two = background_runs["one"], background_runs["two"]
    check(one.result)
    check(two.result)
    expected = metrics(one.dump)
    assert_same_curve(metrics(two.dump), expected, rel=EXACT)

    def resume(run, where: str, nproc: int, flags: list[str]):  # step 3 of ``run`` under another GPU count
        load = [f"--checkpoint.initial_load_path={run.dump / 'checkpoint' / 'step-3'}",
                "--checkpoint.no-initial_load_model_only"]
        job = train_job(6, *GLOBAL_8, *flags, *load, nproc=nproc)
        return lambda: check(job(two.dump.parent / where, tiny_model, corpus))

    # 2 ranks -> 1 rank of 8 rows; 1 rank -> 2 ranks of 2 rows accumulated twice
    results = two_at_a_time(resume(two, "on-one", 1, ["--training.batch_size=8"]),
                            resume(one, "on-two", 2, ["--training.batch_size=2"]))
    for where, result in zip(("on-one", "on-two"), results):
        assert "each step the rows an uninterrupted run would have" in result.stdout + result.stderr, where
        assert_same_curve(metrics(two.dump.parent / where), expected, rel=EXACT, steps=[4, 5, 6])
