"""The recipes (configs/recipes/): each prepares on every GPU count its header promises, to a global batch of 0.5M
tokens at the steps and tokens its name says, and its header's commands name the file itself."""

import re
from pathlib import Path

import pytest

from flame.config.curriculum import Curriculum
from flame.prepare import settled

RECIPES = sorted((Path(__file__).resolve().parents[2] / "configs" / "recipes").glob("*.toml"))
TOKENS_A_STEP = 524288  # 0.5M, the papers' batch


def test_the_recipes_are_found():
    assert {path.stem for path in RECIPES} >= {"gla_340M_15B", "delta_net_1.3B_100B"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.stem)
def test_a_recipe_takes_its_tokens_in_the_same_steps_on_every_gpu_count(recipe, monkeypatch):
    text = recipe.read_text()
    assert f"--job.config_file configs/recipes/{recipe.name}" in text  # its train.sh and sbatch lines
    counts = re.search(r"divides among ([\d, ]+) or (\d+) GPUs", text)
    every = [int(n) for n in counts.group(1).split(",")] + [int(counts.group(2))]
    for gpus in every:
        monkeypatch.setenv("WORLD_SIZE", str(gpus))
        t = settled(["--job.config_file", str(recipe)], gpus).training
        curriculum = Curriculum.of(t)
        assert t.global_batch_size * t.seq_len == TOKENS_A_STEP
        assert t.global_batch_size == t.local_batch_size * gpus * t.gradient_accumulation_steps
        assert curriculum.rows(t.steps, t.global_batch_size) == t.global_batch_size
    billions = float(re.search(r"_(\d+)B$", recipe.stem).group(1))
    assert t.steps * TOKENS_A_STEP == pytest.approx(billions * 1e9, rel=1e-4)
    with pytest.raises(Exception, match="does not divide among"):
        settled(["--job.config_file", str(recipe)], every[-1] * 2)
