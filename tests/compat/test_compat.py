"""flame's changes to other libraries (flame.compat): guarded, applied once, listed, never applied by an import."""

import subprocess
import sys

import pytest

from flame import compat

from flame.base import device

from flame.launch import preflight
from flame.compat import guard
from flame.base.errors import ConfigError
from flame.models import registry
from tests.conftest import ROOT, base_args, check, flame_env, torchrun


def _refusal(patch_or_check) -> str:
    with pytest.raises(ConfigError) as error:
        patch_or_check()
    message = str(error.value)
    assert "\n" not in message
    return message


def test_a_missing_target_is_refused_with_the_version_and_the_fix(monkeypatch):
    import torchtitan.tools.utils

    monkeypatch.delattr(torchtitan.tools.utils, "get_peak_flops")
    message = _refusal(compat.torchtitan.cpu_without_accelerator.check)
    assert message == (
        "flame.compat.torchtitan.cpu_without_accelerator was written for torchtitan 0.2.2, and the torchtitan "
        "installed here (0.2.2) has no torchtitan.tools.utils.get_peak_flops: install torchtitan==0.2.2 "
        "(3rdparty/requirements.txt), or adapt flame.compat.torchtitan.cpu_without_accelerator to 0.2.2"
    )


def test_a_target_whose_signature_changed_is_refused(monkeypatch):
    import torchtitan.distributed.utils

    monkeypatch.setattr(torchtitan.distributed.utils, "maybe_enable_amp", lambda parallel_dims, dtype: None)
    message = _refusal(compat.torchtitan.cpu_without_accelerator.check)
    assert "has a torchtitan.distributed.utils.maybe_enable_amp taking (parallel_dims, dtype), not " \
           "(parallel_dims, mixed_precision_param, device_type)" in message


def test_a_missing_private_torchtitan_name_stops_the_launch(monkeypatch, capsys):
    from torchtitan.components.checkpoint import CheckpointManager

    monkeypatch.delattr(CheckpointManager, "_purge_stale_checkpoints")
    monkeypatch.setenv("WORLD_SIZE", "1")  # flame.launch.preflight sets it; restored after the test
    code = preflight.main(["--world-size", "1", "--", "--model.config=configs/llama_4M.json",
                        "--model.tokenizer_path=builtin:python-stdlib-bpe", "--training.dataset=builtin:python-stdlib"])
    error = capsys.readouterr().err
    assert code == 2 and error.count("\n") == 1
    assert error.startswith("flame: error: flame's use of torchtitan's "
                            "torchtitan.components.checkpoint.CheckpointManager._purge_stale_checkpoints was written for")


def test_fla_targets_are_checked_before_fla_is_changed(monkeypatch):
    registry.import_fla()
    from fla.layers import log_linear_mamba2

    monkeypatch.delattr(log_linear_mamba2, "chunk_log_linear_attn")
    message = _refusal(compat.fla.level_scales_in_query_dtype.check)
    assert "fla-core 0.6.0" in message and "has no fla.layers.log_linear_mamba2.chunk_log_linear_attn" in message


def test_another_version_with_every_target_present_is_a_warning(caplog):
    library = guard.Library("torchtitan", "torchtitan", "0.1.0")
    guard.Target(library, "torchtitan.tools.utils", "get_peak_flops", ("device_name",)).require("a test")
    assert "torchtitan 0.2.2 is installed; flame's changes to it (flame.compat.torchtitan) were written for 0.1.0" \
           in caplog.text


def test_a_patch_is_applied_once(monkeypatch):
    monkeypatch.setattr(guard, "_applied", {})
    calls = []
    library = guard.Library("torchtitan", "torchtitan", "0.2.2")

    @guard.patch(library, guard.Target(library, "torchtitan.tools.utils", "get_peak_flops"))
    def count(value):
        """A change that counts its applications."""
        calls.append(value)

    count(1)
    count(2)
    assert calls == [1] and guard.applied() == ["torchtitan.count"] and count.__doc__.startswith("A change")


def test_applying_flames_changes_to_fla_again_changes_nothing():
    from triton.runtime.autotuner import Autotuner

    registry.import_fla()
    from fla.layers import log_linear_mamba2, mamba2, mamba3, moba

    from flame.models import kernels
    from fla.ops.deltaformer import parallel

    def state():
        keys = [list(kernel.keys) for kernel in vars(parallel).values() if isinstance(kernel, Autotuner)]
        return (log_linear_mamba2.chunk_log_linear_attn, moba.parallel_moba, mamba3.RMSNormGated, mamba2.Mamba2.forward,
                keys)

    changed, applied = state(), guard.applied()
    compat.apply_after_fla_import(registry.FLASH_ATTN, kernels.mamba.mamba_mix, kernels.mamba2.forward_keeping_documents_apart)
    for patch in (compat.fla.level_scales_in_query_dtype, compat.fla.outside_compiled_graphs):
        patch()
    compat.fla_mamba.mamba2_keeps_documents_apart(kernels.mamba2.forward_keeping_documents_apart)
    assert state() == changed
    assert guard.applied() == applied and len(set(applied)) == len(applied)


IMPORT_EVERYTHING = """
import pkgutil, sys, importlib
import flame
for module in pkgutil.walk_packages(flame.__path__, "flame."):
    if not module.name.endswith("__main__"):
        importlib.import_module(module.name)
import torchtitan.tools.utils
from transformers import AttentionInterface
from flame.compat import guard
print(guard.applied(), "fla" in sys.modules, torchtitan.tools.utils.device_type, "flame" in AttentionInterface())
"""


def test_importing_flame_changes_no_library():
    result = check(subprocess.run([sys.executable, "-c", IMPORT_EVERYTHING], cwd=ROOT, env=flame_env(),
                                  capture_output=True, text=True, timeout=300))
    # torchtitan picks "cuda" without an accelerator until flame.compat.apply says otherwise
    assert result.stdout.split("\n")[-2] == "[] False cuda False"


def test_the_startup_log_lists_the_changes_in_one_line(tmp_path, tiny_model, corpus):
    result = check(torchrun(base_args(tiny_model, corpus, tmp_path / "run", steps=1)))
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "flame.compat" in line]
    on_cpu = [] if device.CUDA else ["torchtitan.cpu_without_accelerator"]
    # the attention first: prepare reads the model config (resolving its type) before the Trainer starts
    changes = ["transformers.scikit_learn_imported_when_used", "transformers.attention_implementation",
               "torchtitan.checkpoints_with_manifests", "torchtitan.ends_without_sleep", "torchtitan.readable_log", *on_cpu, "transformers.fused_rotary(llama)"]
    assert len(lines) == 1
    assert lines[0].endswith(f"Changes to other libraries (flame.compat): {', '.join(changes)}")
    # and the model's fused kernels, one line (flame.models.kernels.fused)
    assert "Fused kernels for eager code (compiled blocks run HF's own): 5 LlamaRMSNorm -> torch's rms_norm; " \
           "2 LlamaMLP -> fla's swiglu_linear" in result.stdout + result.stderr


SCIKIT_LEARN_WHEN_USED = """
import sys
from flame.compat.transformers import scikit_learn_imported_when_used
scikit_learn_imported_when_used()
from transformers import LlamaForCausalLM
from transformers.generation import candidate_generator
print("sklearn" in sys.modules, candidate_generator.is_sklearn_available())
labels, scores = [0, 0, 1, 1, 0, 1], [0.1, 0.4, 0.35, 0.8, 0.7, 0.2]
print(*candidate_generator.roc_curve(labels, scores)[2], "sklearn" in sys.modules)
from sklearn.metrics import roc_curve
print(*roc_curve(labels, scores)[2], True)
"""


def test_model_classes_load_without_scikit_learn_and_assisted_generation_still_gets_it():
    result = check(subprocess.run([sys.executable, "-c", SCIKIT_LEARN_WHEN_USED], cwd=ROOT, env=flame_env(),
                                  capture_output=True, text=True, timeout=300))
    loaded, deferred, real = result.stdout.splitlines()[-3:]
    # transformers' model classes came without scikit-learn, and its availability check still says it is there
    assert loaded == "False True"
    # assisted generation's ROC thresholds: scikit-learn's own, imported on the first call
    assert deferred == real and deferred.endswith(" True")


def test_the_changes_are_written_for_the_pinned_versions():
    # a new pin in 3rdparty/requirements.txt asks for the changes to be checked against it
    pins = dict(line.split("==") for line in (ROOT / "3rdparty" / "requirements.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    for library in (compat.torchtitan.TORCHTITAN, compat.fla.FLA, compat.triton.TRITON, compat.transformers.TRANSFORMERS,
                    compat.peft.PEFT):
        assert pins[library.distribution] == library.written_for, library


def test_install_sh_installs_mamba_ssm_as_the_hint_says():
    # 3rdparty/install.sh installs mamba_ssm outside requirements.txt (no CUDA build, none of its dependencies)
    install_sh = (ROOT / "3rdparty" / "install.sh").read_text()
    environment, command = compat.mamba_ssm.INSTALL.split(" pip install ")
    assert f'{environment} "${{pip[@]}}" {command}' in install_sh


RANKS_ENDING_TOGETHER = """
import os, signal, sys, tempfile, time
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
from flame.compat import torchrun
from flame.launch import summary

def rank(index):
    if index == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # the out-of-memory killer
    time.sleep(0.5)  # its peer fails on the broken connection a moment later
    sys.exit(1)

if sys.argv[1] == "flame":
    torchrun.every_ended_rank_reported()
ranks = start_processes("ranks", rank, args={0: (0,), 1: (1,)}, envs={0: {}, 1: {}}, start_method="fork",
                        logs_specs=DefaultLogsSpecs(log_dir=tempfile.mkdtemp()))
time.sleep(2)  # both have ended before the agent's next poll
result = ranks.wait(0)
print(sorted(result.failures), summary.failed(result.failures, "logs"))
"""


@pytest.mark.parametrize("changed", [False, True])
def test_a_killed_rank_is_named_even_when_its_peer_ended_in_the_same_poll(changed):
    result = check(subprocess.run([sys.executable, "-c", RANKS_ENDING_TOGETHER, "flame" if changed else "upstream"],
                                  cwd=ROOT, env=flame_env(), capture_output=True, text=True, timeout=300))
    ranks, line = result.stdout.strip().splitlines()[-1].split("] ", 1)
    if changed:
        assert ranks == "[0, 1" and line.startswith("training failed: rank 1 was killed by SIGKILL"), result.stdout
    else:  # upstream reports the one its wait listed first: the peer (why flame adds the rest)
        assert ranks == "[0", result.stdout


A_RANK_THAT_IGNORES_SIGTERM = """
import signal, sys, tempfile, time
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
from flame.compat import torchrun

def rank(index):
    if index == 0:
        time.sleep(0.5)
        sys.exit(1)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # hung where no signal handler runs
    time.sleep(300)

torchrun.failed_runs_end_sooner()
ranks = start_processes("ranks", rank, args={0: (0,), 1: (1,)}, envs={0: {}, 1: {}}, start_method="fork",
                        logs_specs=DefaultLogsSpecs(log_dir=tempfile.mkdtemp()))
started = time.monotonic()
while (result := ranks.wait(1)) is None:
    pass
print(sorted(result.failures), round(time.monotonic() - started))
"""


def test_a_failed_runs_hung_rank_is_killed_within_seconds():
    # upstream waits 30 s after its SIGTERM; flame: 5 s to end alone, 5 s after SIGTERM, then SIGKILL
    result = check(subprocess.run([sys.executable, "-c", A_RANK_THAT_IGNORES_SIGTERM], cwd=ROOT, env=flame_env(),
                                  capture_output=True, text=True, timeout=120))
    failed, seconds = result.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    assert failed == "[0]" and 9 <= int(seconds) <= 20, result.stdout
