"""flame.base.triton_kernels: a kernel recorded as a rank compiles it is compiled from its record, on a machine without
a GPU (the target is named), under the very cache key the rank's own compile of it uses; collect keeps each kernel
once with every model type that compiled it; warm compiles the job's model type's on a pool of processes, told the
type through a pipe; a record that cannot compile is left to the ranks with its reason."""

import gzip
import json
import os
import subprocess

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile, make_backend
from triton.runtime.jit import compute_cache_key, create_function_from_signature

from flame.base import triton_kernels

H100 = GPUTarget("cuda", 90, 32)


@triton.jit
def scaled_sum(x, y, out, n, scale, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = index < n
    total = tl.load(x + index, mask=mask) * scale + tl.load(y + index, mask=mask)
    tl.store(out + index, total.to(DTYPE), mask=mask)


def _as_a_rank_calls_it(hook, *args, **kwargs):
    """What JITFunction.run does up to its compile on an H100 (its binder, its arguments packed, then the
    post-compile hook), without a GPU; returns the compile's (source, options) as the rank builds them."""
    backend = make_backend(H100)
    binder = create_function_from_signature(scaled_sum.signature, scaled_sum.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    key = compute_cache_key({}, specialization, options)
    options, signature, constants, attrs = scaled_sum._pack_args(backend, kwargs, bound, specialization, options)
    scaled_sum._call_hook(hook, key, signature, 0, constants, options, [attrs], False)
    return ASTSource(scaled_sum, signature, constants, attrs), options


def _ship(folder, kernels: list[dict]) -> None:
    """A shipped list of ``kernels`` in ``folder`` (a <triton version>/<gpu> folder), as ``collect`` writes it."""
    folder.mkdir(parents=True)
    (folder / triton_kernels.KERNELS).write_bytes(gzip.compress("".join(json.dumps(k) + "\n" for k in kernels).encode()))


def _cache_entries(cache) -> set[str]:
    return {path.name for path in cache.iterdir()} if cache.exists() else set()


def _recorded(tmp_path, monkeypatch, *calls: dict) -> tuple[list[dict], list]:
    """``calls`` (keyword arguments of scaled_sum) recorded as a rank on an H100 records them, into a fresh cache
    folder (tmp_path/cache); (the records, each call's compile arguments)."""
    recorded = tmp_path / "kernels.jsonl"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(triton_kernels, "_current_target", lambda: H100)
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", None)
    triton_kernels.record_compiled_kernels(str(recorded), "gla")
    x, y, out = (torch.zeros(4096) for _ in range(3))
    compiles = [_as_a_rank_calls_it(triton.knobs.runtime.jit_post_compile_hook, x, y, out, 4096, 0.5, **call)
                for call in calls]
    return triton_kernels.read(recorded), compiles


def test_a_recorded_kernel_compiles_ahead_under_the_key_the_rank_looks_up(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    [kernel], [(source, options)] = _recorded(tmp_path, monkeypatch, dict(BLOCK=1024, DTYPE=tl.float32, num_warps=4))
    assert (kernel["module"], kernel["name"], kernel["models"], kernel["target"]) == (__name__, "scaled_sum", ["gla"], {
        "backend": "cuda", "arch": 90, "warp_size": 32})

    assert triton_kernels.compile_kernel(kernel) is None
    compiled = _cache_entries(cache)
    assert any(path.suffix == ".cubin" for path in cache.rglob("*")), "no sm_90 binary in the cache"
    compile(source, target=H100, options=options.__dict__)  # the rank's own compile finds it: no new entry
    assert _cache_entries(cache) == compiled


def test_collect_keeps_each_kernel_once_in_first_seen_order_with_its_model_types_and_no_inductor_kernel(tmp_path,
                                                                                                      monkeypatch):
    monkeypatch.setattr(triton_kernels, "triton_version", lambda: "3.6.0")
    first, second = tmp_path / "rank0.jsonl", tmp_path / "rank1.jsonl"
    a, b = ({"module": "fla.ops.x", "name": name, "spec": "{}", "models": ["gla"], "target": {}} for name in "ab")
    inductor = {"module": "torch._inductor.generated", "name": "triton_poi_0", "spec": "{}", "models": ["gla"],
                "target": {}}
    first.write_text("".join(json.dumps(k) + "\n" for k in (a, inductor, b)))
    second.write_text(json.dumps({**b, "models": ["delta_net"]}) + "\n" + json.dumps(a) + "\n")
    shipped = triton_kernels.collect([first, second], "GPU-A", root=tmp_path / "shipped")
    assert shipped == tmp_path / "shipped" / "3.6.0" / "GPU-A" / "kernels.jsonl.gz"
    both = {**b, "models": ["delta_net", "gla"]}
    assert triton_kernels.read(shipped) == [a, both]
    assert triton_kernels.read(triton_kernels.collect([second], "GPU-A", root=tmp_path / "shipped")) == [a, both]
    assert triton_kernels.for_model([a, both], "delta_net") == [both]
    assert triton_kernels.for_model([a, both], "") == [a, both]  # a job whose type could not be read: all


def test_collect_leaves_out_the_configurations_an_autotuner_timed_and_did_not_choose(tmp_path, monkeypatch):
    """A cold run's record holds every configuration its autotuners compiled to time; with their choices shipped a
    run loads only the chosen ones, so only those (and kernels with no shipped choice) are compiled ahead."""
    monkeypatch.setattr(triton_kernels, "triton_version", lambda: "3.6.0")
    chosen, lost, untimed = (dict(BLOCK=block, DTYPE=tl.float32, num_warps=4) for block in (1024, 2048, 4096))
    records, _ = _recorded(tmp_path, monkeypatch, chosen, lost, untimed)
    other = {"module": "fla.ops.x", "name": "not_tuned", "spec": "{}", "models": ["gla"], "target": {}}
    recorded = tmp_path / "recorded.jsonl"
    recorded.write_text("".join(json.dumps(kernel) + "\n" for kernel in (*records, other)))
    choice = tmp_path / "shipped" / "3.6.0" / "GPU-B" / "SOMEKEY" / "scaled_sum.autotune.json"  # another GPU's
    choice.parent.mkdir(parents=True)
    config = lambda block: {"kwargs": {"BLOCK": block}, "num_warps": 4, "num_ctas": 1, "num_stages": 3,  # noqa: E731
                            "maxnreg": None, "pre_hook": None, "ir_override": None}
    choice.write_text(json.dumps({"key": [4096], "configs_timings": [[config(2048), [2.0, 1.9, 2.1]],
                                                                     [config(1024), [1.0, 0.9, 1.1]]]}))
    shipped = triton_kernels.read(triton_kernels.collect([recorded], "GPU-A", root=tmp_path / "shipped"))

    def block(kernel: dict) -> int:
        spec = json.loads(kernel["spec"])
        names = list(spec["signature"])
        return dict((names[at[0]], value) for at, value in zip(spec["constant_keys"], spec["constant_vals"]))["BLOCK"]

    assert [block(kernel) for kernel in shipped[:2]] == [1024, 4096]  # 2048 was timed and lost
    assert shipped[2:] == [other]


def test_warm_compiles_the_jobs_model_types_kernels_on_a_pool_and_names_what_it_left_to_the_ranks(tmp_path,
                                                                                                  monkeypatch):
    kernels, _ = _recorded(tmp_path, monkeypatch, *(dict(BLOCK=block, DTYPE=tl.bfloat16) for block in (256, 512, 128)))
    cache = tmp_path / "cache"
    missing = {**kernels[0], "name": "no_such_kernel"}
    another_types = {**kernels[2], "models": ["mamba2"]}
    mine, compiled, failures = triton_kernels.warm([kernels[0], kernels[1], another_types, missing], jobs=2,
                                                   model_type=lambda: "gla")
    assert (mine, compiled, len(failures)) == (3, 2, 1)
    assert failures[0].startswith(f"{__name__}.no_such_kernel: AttributeError")
    assert len([path for path in cache.rglob("*.cubin")]) == 2  # the other type's kernel was not compiled


def test_the_check_tells_the_warm_up_the_model_type_through_a_pipe_or_ends_it_with_every_kernel(tmp_path):
    for told in ("gla", None):
        read, write = os.pipe()
        warm_up = triton_kernels.WarmUp(subprocess.Popen(["sleep", "60"]), write)
        if told:
            warm_up.tell(told)  # the job's check, forked from the launcher, once it has parsed the job
        warm_up.release()  # the launcher's end: a check that ended without a word reads as "every kernel"
        with os.fdopen(read) as pipe:
            assert pipe.readline().strip() == (told or "")
        warm_up.stop()
        assert warm_up.process.wait(timeout=10) != 0  # terminated: the run no longer needs it


def test_a_jobs_model_type_is_read_from_its_config_file_or_folder(tmp_path):
    from tests.conftest import ROOT

    assert triton_kernels.model_type_of(str(ROOT / "configs" / "gla_340M.json")) == "gla"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba2"}))
    assert triton_kernels.model_type_of(str(tmp_path)) == "mamba2"
    assert triton_kernels.model_type_of("fla-hub/gla-340M-15B") == ""  # a hub name: every kernel


@pytest.mark.parametrize("shipped", [False, True])
def test_the_launcher_starts_no_warm_up_without_a_list_for_its_triton_or_a_gpu(tmp_path, monkeypatch, shipped):
    monkeypatch.setattr(triton_kernels, "SHIPPED", tmp_path)
    if shipped:
        _ship(tmp_path / triton.__version__ / "GPU-A", [])
    assert triton_kernels.start_warm_up() is None  # this machine has no NVIDIA GPU


@pytest.mark.parametrize("switch", ["0", "off", "1"])
def test_flame_warm_kernels_0_turns_the_warm_up_off(tmp_path, monkeypatch, switch):
    monkeypatch.setattr(triton_kernels, "SHIPPED", tmp_path)
    _ship(tmp_path / triton.__version__ / "GPU-A", [])
    monkeypatch.setattr(triton_kernels, "NVIDIA_DEVICE", tmp_path / "nvidiactl")
    (tmp_path / "nvidiactl").touch()  # as on a machine with an NVIDIA driver
    monkeypatch.setenv("FLAME_WARM_KERNELS", switch)
    warm_up = triton_kernels.start_warm_up()
    if switch in ("0", "off"):
        assert warm_up is None
    else:  # started; with no nvidia-smi answer here it compiles nothing and ends
        assert warm_up.process.wait(timeout=60) == 0
        warm_up.stop()


def test_list_counts_the_kernels_shipped_per_gpu_and_model_type(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(triton_kernels, "SHIPPED", tmp_path)
    kernels = [{"module": "m", "name": name, "spec": "{}", "models": models, "target": {}}
               for name, models in (("a", ["gla"]), ("b", ["gla", "delta_net"]), ("c", ["delta_net"]))]
    _ship(tmp_path / "3.6.0" / "GPU-A", kernels)
    assert triton_kernels.main(["list"]) == 0
    assert capsys.readouterr().out == "triton 3.6.0, GPU-A: 3 kernels (delta_net 2, gla 2)\n"


def test_a_gpu_warms_its_own_list_then_those_of_its_architecture_each_kernel_once(tmp_path, monkeypatch):
    """A compile names only the target: an H200 compiles the kernels recorded on an H100 (both sm_90), not an A100's."""
    monkeypatch.setattr(triton_kernels, "triton_version", lambda: "3.6.0")

    def kernel(name: str, arch: int) -> dict:
        return {"module": "m", "name": name, "spec": "{}", "models": ["gla"], "target": {"backend": "cuda", "arch": arch,
                                                                                      "warp_size": 32}}

    lists = {"NVIDIA-H100-80GB-HBM3": [kernel("a", 90), kernel("b", 90)], "NVIDIA-H200": [kernel("b", 90)],
             "NVIDIA-A100-SXM4-80GB": [kernel("c", 80)]}
    for gpu, kernels in lists.items():
        _ship(tmp_path / "3.6.0" / gpu, kernels)
    names = lambda kernels: [k["name"] for k in kernels]  # noqa: E731
    assert names(triton_kernels.shipped_for("NVIDIA-H200", 90, root=tmp_path)) == ["b", "a"]
    assert names(triton_kernels.shipped_for("NVIDIA-A100-SXM4-80GB", 80, root=tmp_path)) == ["c"]
    assert names(triton_kernels.shipped_for("NVIDIA-H200", None, root=tmp_path)) == ["b"]  # arch unknown: its own
    assert triton_kernels.shipped_for("NVIDIA-L4", 89, root=tmp_path) == []


def test_warm_starts_no_pool_for_a_model_type_with_no_kernels_shipped(tmp_path, monkeypatch):
    kernels, _ = _recorded(tmp_path, monkeypatch, dict(BLOCK=256, DTYPE=tl.bfloat16))
    monkeypatch.setattr(triton_kernels, "ProcessPoolExecutor", None)  # a pool would fail here
    assert triton_kernels.warm(kernels, jobs=2, model_type=lambda: "mamba2") == (0, 0, [])
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("*.cubin"))
