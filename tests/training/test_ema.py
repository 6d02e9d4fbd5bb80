"""The weights' exponential moving average (--training.ema_decay): the hand-computed average, in the checkpoint
and resumed exactly, started from the loaded weights when a checkpoint has none, validated beside the live weights,
and exported (convert_dcp_to_hf --ema)."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from flame.checkpoint import export, manifest
from flame.training.ema import WeightAverage
from tests.conftest import check, metrics, train_job

EMA = ("--training.ema_decay=0.9", "--checkpoint.interval=3")


def test_the_average_is_the_hand_computed_one_over_five_steps_and_swaps_back_exactly():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    average = WeightAverage([model], decay=0.8)
    expected = [p.detach().clone() for p in model.parameters()]
    for _ in range(5):
        model(torch.randn(2, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        average.update()
        expected = [0.8 * e + 0.2 * p.detach() for e, p in zip(expected, model.parameters())]
    for got, want in zip(average.state_dict().values(), expected):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    live = [p.detach().clone() for p in model.parameters()]
    with average.swapped_in():
        assert all(torch.equal(p, a) for p, a in zip(model.parameters(), average.state_dict().values()))
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), live))
    assert list(average.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias"]


def averages(step_folder) -> dict[str, torch.Tensor]:
    metadata = dcp.FileSystemReader(str(step_folder)).read_metadata()
    names = [name for name in metadata.state_dict_metadata if name.startswith("ema.")]
    state = {"ema": {name[4:]: torch.empty(metadata.state_dict_metadata[name].size) for name in names}}
    dcp.load(state, checkpoint_id=str(step_folder))
    return state["ema"]


@pytest.mark.background_runs(
    whole=train_job(6, *EMA, "--validation.enable", "--validation.holdout_documents=8", "--validation.freq=3"),
    without=train_job(3, "--checkpoint.interval=3"),
)
def test_the_average_is_saved_resumed_exactly_validated_and_exported(background_runs, tiny_model, corpus, tmp_path):
    whole, without = background_runs["whole"], background_runs["without"]
    check(whole.result)
    logged = metrics(whole.dump)
    for step in (3, 6):  # scored beside the live weights
        assert logged[step]["validation/ema_loss"] > 0 and logged[step]["validation/loss"] > 0
        assert logged[step]["validation/ema_loss"] != logged[step]["validation/loss"]
    resumed = tmp_path / "resumed"  # from step 3 of the same run: the average goes on as if never stopped
    check(train_job(6, *EMA, f"--checkpoint.initial_load_path={whole.dump / 'checkpoint' / 'step-3'}",
                    "--checkpoint.no-initial_load_model_only", "--validation.enable",
                    "--validation.holdout_documents=8", "--validation.freq=3")(resumed, tiny_model, corpus))
    want = averages(whole.dump / "checkpoint" / "step-6")
    got = averages(resumed / "checkpoint" / "step-6")
    assert want and all(torch.equal(got[name], want[name]) for name in want)
    assert manifest.read_identity(str(resumed / "checkpoint" / "step-6"))["ema_decay"] == 0.9  # its manifest says so

    check(without.result)  # a checkpoint without an average: it starts at the loaded weights
    later = tmp_path / "later"
    result = check(train_job(4, *EMA, f"--checkpoint.initial_load_path={without.dump / 'checkpoint' / 'step-3'}",
                             "--checkpoint.no-initial_load_model_only")(later, tiny_model, corpus))
    assert "holds no average of the weights; it starts at the loaded weights" in result.stdout + result.stderr

    out = tmp_path / "hf-ema"
    assert export.main([str(whole.dump), "--ema", "--out", str(out)]) == 0
    exported = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(exported[name], want[name]) for name in want if name in exported)
    assert "model.embed_tokens.weight" in exported
    assert export.main([str(without.dump), "--ema", "--out", str(tmp_path / "none")]) == 2  # no average: refused
