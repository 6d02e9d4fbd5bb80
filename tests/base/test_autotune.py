"""flame.base.autotune: shipped autotune choices reach Triton's cache, and a machine's choices join them."""

import json
import os
import subprocess
import sys

from flame.base import autotune


def _choice(folder, key: str, kernel: str, config: dict) -> None:
    (folder / key).mkdir(parents=True, exist_ok=True)
    (folder / key / f"{kernel}{autotune.CHOICE_SUFFIX}").write_text(json.dumps({"key": [1], "configs_timings": [config]}))


def test_install_copies_what_the_cache_lacks_and_never_overwrites(tmp_path):
    shipped, cache = tmp_path / "shipped", tmp_path / "cache"
    _choice(shipped / "3.6.0" / "GPU-A", "KEYA", "rms_norm", {"num_warps": 4})
    _choice(shipped / "3.6.0" / "GPU-B", "KEYB", "swiglu", {"num_warps": 8})
    _choice(cache, "KEYA", "rms_norm", {"num_warps": 2})  # this machine's own measurement stays

    assert autotune.install(cache, shipped) == 1
    assert json.loads((cache / "KEYA" / "rms_norm.autotune.json").read_text())["configs_timings"] == [{"num_warps": 2}]
    assert (cache / "KEYB" / "swiglu.autotune.json").read_bytes() == (
        shipped / "3.6.0" / "GPU-B" / "KEYB" / "swiglu.autotune.json").read_bytes()
    assert autotune.install(cache, shipped) == 0
    assert not list(cache.rglob("*.partial"))


def test_collect_adds_a_machines_choices_and_replace_starts_over(tmp_path, monkeypatch):
    monkeypatch.setattr(autotune, "triton_version", lambda: "3.6.0")
    shipped, cache = tmp_path / "shipped", tmp_path / "cache"
    _choice(shipped / "3.6.0" / "GPU-A", "OLD", "rms_norm", {})
    _choice(cache, "NEW", "swiglu", {})
    (cache / "NEW" / "swiglu.cubin").write_bytes(b"compiled kernels are not shipped")

    folder = autotune.collect("GPU-A", cache, shipped)
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.json")) == [
        "NEW/swiglu.autotune.json", "OLD/rms_norm.autotune.json"]
    assert not list(folder.rglob("*.cubin"))

    autotune.collect("GPU-A", cache, shipped, replace=True)
    assert [p.relative_to(folder).as_posix() for p in folder.rglob("*.json")] == ["NEW/swiglu.autotune.json"]


def test_the_shipped_choices_install_into_tritons_cache_from_the_command_line(tmp_path):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "flame.base.autotune", "install"], env=env, capture_output=True, text=True,
                         check=True).stdout
    shipped = autotune.shipped_choices()
    assert shipped, "flame ships autotune choices for at least one GPU"
    # GPUs of one architecture (H100, H200) tune under the same keys: one choice per key is copied
    keys = {(choice.parent.name, choice.name) for choice in shipped}
    assert f"{len(keys)} shipped autotune choices copied into {tmp_path}" in out
    assert {(p.parent.name, p.name) for p in tmp_path.glob(f"*/*{autotune.CHOICE_SUFFIX}")} == keys


def test_the_pinned_cache_is_tritons_own_default_and_reaches_child_processes(tmp_path):
    # inductor moves an unset TRITON_CACHE_DIR to a folder of its own at its first kernel, away from the
    # installed choices: flame pins Triton's default first, and the folder must be the one Triton reads
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"} | {"TRITON_HOME": str(tmp_path)}
    script = ("import os, subprocess, sys; from flame.base import autotune; from triton import knobs; "
              "folder = autotune.share_triton_cache(); print(folder); print(knobs.cache.dir); "
              "print(subprocess.run([sys.executable, '-c', 'import os; print(os.environ[\"TRITON_CACHE_DIR\"])'], "
              "capture_output=True, text=True, check=True).stdout.strip())")
    pinned, tritons, childs = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                                             check=True).stdout.split()
    assert pinned == tritons == childs == str(tmp_path / ".triton" / "cache")
