"""The GPU-check driver (scripts/gpu_check.py): its suites are data that must stay runnable.

The suites run only on GPU machines; here their table is checked against the repository (every
config, test file and worker they name exists, every reference names a run of the same suite),
the driver's refusals are checked, and so are the pieces that run without a GPU: flame.data's
benchmark batches, the comparison tables, and torchtitan's own trainer as the peers suite runs
it (on the CPU, 2 steps).
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts import gpu_check
from scripts.bench import reports, runs, torchtitan_peer
from scripts.bench.batches import packed_batches
from scripts.bench.plan import Run, Step
from scripts.bench.runs import Result
from tests.conftest import ROOT, flame_env



@pytest.mark.parametrize("name", sorted(gpu_check.SUITES))
def test_a_suite_names_only_what_exists(name):
    suite = gpu_check.SUITES[name]
    assert all((ROOT / config).is_file() for config in suite.configs), suite.configs
    items = (*suite.setup, *suite.per_config)
    runs = {item.name for item in items if isinstance(item, Run)}
    for item in items:
        if isinstance(item, Run):
            assert item.reference in runs | {None}, f"{item.name}'s reference {item.reference} is not a run of {name}"
            continue
        for argument in item.argv:
            if argument.startswith("tests/"):
                assert (ROOT / argument).exists(), argument
        module = item.argv[item.argv.index("-m") + 1] if "-m" in item.argv else None
        if module and module.startswith(("scripts.", "flame.")):
            assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), module
    assert suite.report in reports.REPORTS
    assert suite.baseline in runs | {None}


@pytest.mark.parametrize("name", sorted(gpu_check.SUITES))
def test_a_suite_plans_its_steps_without_a_gpu(name, capsys):
    assert gpu_check.main(["--suite", name, "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(line.startswith(f"[{name}] ") for line in lines)
    assert not any(re.search(r"\{\w+\}", line) for line in lines), "a placeholder was left unfilled"


def test_layouts_run_in_the_order_given_with_their_references():
    steps = gpu_check.plan("layouts", gpu_check.parse_args(["--suite", "layouts", "--only", "cp2", "fsdp1"]))
    assert [(s.name, s.gpus, s.reference) for s in steps] == [
        ("transformer_340M-fsdp1", 1, None),
        ("transformer_340M-cp2", 2, "transformer_340M-fsdp1"),
    ]
    assert all(s.seeded and s.train for s in steps)


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--suite", "default", "--steps", "3"], "--steps means nothing to suite default"),
        (["--suite", "tp", "--jobs", "2"], "--jobs means nothing to suite tp"),
        (["--suite", "tp", "--only", "fsdp1"], "--only fsdp1: not an item of tp"),
        (["--suite", "zoo", "--configs", "configs/none.json"], "configs/none.json not found"),
        (["--suite", "zoo", "--tokens", "0"], "--tokens must be positive"),
        ([], "choose a suite"),
    ],
)
def test_options_that_cannot_work_are_refused_up_front(argv, error, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(argv)
    assert exit_info.value.code == 2
    assert error in capsys.readouterr().err


def test_compiled_runs_are_left_out_with_no_compile():
    args = gpu_check.parse_args(["--suite", "tp", "--configs", "configs/tiny/llama.json", "--no-compile"])
    assert [s.item for s in gpu_check.plan("tp", args)] == ["1gpu", "tp2", "tp2-fused"]
    zoo = gpu_check.parse_args(["--suite", "zoo", "--configs", "configs/tiny/gla.json", "--no-compile"])
    assert gpu_check.plan("zoo", zoo)[0].argv[-1] == "--no-compile"


def test_benchmark_batches_are_rows_of_flame_data():
    (batch, labels), = packed_batches(1, rows=1, seq_len=1024, context_len=256, device="cpu")
    cu_seqlens, positions = batch["cu_seqlens"], batch["position_ids"].flatten()
    assert batch["input"].shape == labels.shape == (1, 1024)
    assert cu_seqlens[0] == 0 and cu_seqlens[-1] == 1024
    assert batch["max_seqlen"] == int(cu_seqlens.diff().max()) <= 256
    # position ids restart exactly where the segments start
    assert (positions == 0).nonzero().flatten().tolist() == cu_seqlens[:-1].tolist()
    # no target crosses a document: the last token of each document has none
    assert (labels == -100).sum() >= 1


def test_the_runs_table_compares_each_run_with_its_reference(tmp_path):
    def run(name, run_losses, reference=None):
        (tmp_path / name).mkdir()
        rows = [{"step": step + 1, "loss_metrics/global_avg_loss": loss, "throughput(tps)": 1000.0, "mfu(%)": 10.0,
                 "memory/max_reserved(GiB)": 2.0} for step, loss in enumerate(run_losses)]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        step = Step("tp", name.split("-")[1], name, [], config="configs/tiny/llama.json", train=True, reference=reference)
        return Result(step, 0, 1.0)

    results = [run("llama-1gpu", [8.0, 7.0, 6.0]), run("llama-tp2", [8.0, 7.0, 6.06], reference="llama-1gpu"),
               Result(Step("tp", "tp2-fused", "llama-tp2-fused", [], train=True), None, note="needs 2 GPUs, 1 visible")]
    # a run with --memory.plan auto logs its estimate beside the measured peak after step 1 (flame.training.metrics)
    (tmp_path / "llama-tp2.log").write_text("[titan] 2026-11-27 02:00:00,000 - root - INFO - memory: measured peak "
                                            "20.00 GiB reserved, planned 22.00 GiB\n")
    table = reports.runs(results, tmp_path)
    assert table[2].split()[:3] == ["llama-tp2", "llama-1gpu", "1.0e-02"]
    assert table[2].endswith("planned 22.0 GiB (+10% of the measured peak 20.0)") and "planned" not in table[1]
    assert "needs 2 GPUs" in table[3]


def test_the_curves_table_sets_losses_side_by_side_with_the_step_time_against_the_baseline(tmp_path):
    def run(item, run_losses, tps):
        name = f"transformer_340M-{item}"
        (tmp_path / name).mkdir()
        rows = [{"step": 10 * (i + 1), "loss_metrics/global_avg_loss": loss, "throughput(tps)": tps}
                for i, loss in enumerate(run_losses)]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        step = Step("muon", item, name, [], config="configs/transformer_340M.json", train=True,
                    common=["--training.seq_len", "65536"])
        return Result(step, 0, 1.0)

    results = [run("adamw", [8.0, 6.0, 5.0, 4.5], 100_000.0), run("muon", [7.8, 5.5, 4.5, 4.2], 96_000.0)]
    table = reports.curves(results, tmp_path, baseline="adamw")
    assert table[0] == "transformer_340M: loss per logged step (65,536 tokens per step)"
    assert table[1].split() == ["step", "adamw", "muon"] and table[3].split() == ["20", "6.0000", "5.5000"]
    assert table[-1] == ("  muon: 96,000 tok/s, step time +4.2% vs adamw; reaches adamw's last loss 4.5000 at step 30 "
                         "(of 40)")


def test_a_command_shows_the_lines_its_pattern_picks(tmp_path):
    (tmp_path / "job.log").write_text("noise\nstep  1/300  loss 8.37\nmore\nsample from exp:\ndef f():\n  pass\nend\n")
    step = Step("default", "job", "job", ["bash", "train.sh"], show=r"step +1/300", show_block="^sample from")
    assert reports.lines([Result(step, 0, 3.0)], tmp_path) == [
        "job: ok, 3 s", "  step  1/300  loss 8.37", "  sample from exp:", "  def f():", "    pass"]



def test_kernel_caches_travel_as_the_union_of_what_machines_returned(tmp_path, monkeypatch):
    triton, tilelang = tmp_path / "triton", tmp_path / "tilelang" / "tlcache"
    monkeypatch.setattr(runs, "TRITON_CACHE", triton)
    monkeypatch.setattr(runs, "TILELANG_CACHE", tilelang)
    monkeypatch.setattr(runs, "CARRIED_CACHES", tmp_path / "carried")
    for machine, kernel in enumerate(["a", "b"]):  # two device commands, each with its own choices
        (triton / kernel).mkdir(parents=True)
        (triton / kernel / "choice.autotune.json").write_text("{}")
        (triton / kernel / "compiled.bin").write_text("too large to carry")
        tilelang.mkdir(parents=True, exist_ok=True)
        (tilelang / f"kernel{machine}.so").write_text("")
        returned = tmp_path / f"out{machine}"
        returned.mkdir()
        runs.save_kernel_caches(returned)
        runs.merge_kernel_caches(returned)
        shutil.rmtree(tmp_path / "triton")
    # a fresh machine unpacks both machines' autotune choices and TileLang kernels, once
    monkeypatch.setattr(runs, "RESTORED_MARKER", tmp_path / "restored")
    monkeypatch.setattr(runs, "TRITON_CACHE", tmp_path / "fresh" / "triton")
    monkeypatch.setattr(runs, "TILELANG_CACHE", tmp_path / "fresh" / "tlcache")
    runs.restore_kernel_caches()
    fresh = sorted(str(p.relative_to(tmp_path / "fresh")) for p in (tmp_path / "fresh").rglob("*") if p.is_file())
    assert fresh == ["tlcache/kernel0.so", "tlcache/kernel1.so", "triton/a/choice.autotune.json",
                     "triton/b/choice.autotune.json"]


def test_the_peers_suite_times_the_same_window_on_every_side():
    steps = gpu_check.plan("peers", gpu_check.parse_args(["--suite", "peers"]))
    assert [s.name for s in steps] == [
        "llama_340M-torchtitan", "llama_340M-torchtitan-compiled", "llama_340M-flame", "llama_340M-flame-compiled",
        "llama_340M-flame-fp8", "llama_340M-plain", "transformer_340M-flame", "transformer_340M-flame-compiled",
        "transformer_340M-plain"]
    for step in steps:  # 20 steps of one 32K row, timed over steps 11-20
        argv = " ".join([*step.common, *step.argv])
        assert re.search(r"(--training.seq_len|--tokens|--seq) 32768", argv), argv
        assert re.search(r"--training.steps 20 .*--metrics.log_freq 10|--steps 20 --log-freq 10|--warmup 10 --steps 10",
                         argv), argv
        compiled = step.name.endswith(("-compiled", "-fp8"))
        assert ("--compile" in step.argv or "--training.compile" in step.argv) == compiled, step.name
        assert ("--float8.recipe_name" in step.argv) == step.name.endswith("-fp8"), step.name
    billion = gpu_check.parse_args(["--suite", "peers", "--configs", "configs/llama_1B.json",
                                    "configs/transformer_1B.json", "--tokens", "16384", "--no-compile"])
    assert [s.name for s in gpu_check.plan("peers", billion)] == [
        "llama_1B-torchtitan", "llama_1B-flame", "llama_1B-plain", "transformer_1B-flame", "transformer_1B-plain"]
    # the plain loop's compiled run is left out unless --only names it
    extra = gpu_check.parse_args(["--suite", "peers", "--only", "plain", "plain-compiled"])
    assert [s.name for s in gpu_check.plan("peers", extra)] == [
        "llama_340M-plain", "llama_340M-plain-compiled", "transformer_340M-plain", "transformer_340M-plain-compiled"]


def test_torchtitans_llama3_twin_has_the_configs_shapes(tiny_model):
    from torchtitan.models.llama3.model.model import FeedForward

    for dim, width in [(1024, 2816), (2048, 5632), (256, 704), (64, 128)]:
        multiple_of, multiplier = torchtitan_peer.ffn_args(dim, width)
        with torch.device("meta"):
            assert FeedForward(dim, 4 * dim, multiple_of, multiplier).w1.out_features == width
    for config in ("configs/llama_340M.json", "configs/transformer_340M.json", tiny_model):
        args, flame_count, torchtitan_count = torchtitan_peer.twin_of(config, "varlen")
        assert flame_count == torchtitan_count and args.attn_mask_type == "block_causal"
    with pytest.raises(ValueError, match="tied embeddings"):
        torchtitan_peer.twin_of("configs/llama_4M.json", "varlen")


def test_torchtitans_own_trainer_runs_and_its_log_is_read(tiny_model, tmp_path):
    """torchtitan's trainer on the CPU (flame's CPU seam; sdpa attention), 2 steps on the exported corpus."""
    run = subprocess.run([sys.executable, "-m", "scripts.bench.torchtitan_peer", "--config", tiny_model, "--tokens",
                          "512", "--steps", "2", "--device", "cpu", "--dump", str(tmp_path)],
                         cwd=ROOT, env=flame_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    text = run.stdout.splitlines()
    windows = reports.torchtitan_windows(text)
    assert [w["step"] for w in windows] == [1, 2] and all(w["tps"] > 0 and w["loss"] > 0 for w in windows)
    assert reports.parameter_count(text) == torchtitan_peer.twin_of(tiny_model, "sdpa")[1]
    assert "--training.dataset_path" in text[0] and "--compile.enable" not in text[0]


def peer_result(work: Path, suite: str, config: str, item: str, status=0, log="", flame_tps=None, gpus=1,
                run: int | None = None) -> Result:
    """A finished step of the peers or scaling suite: its log, and a flame run's metrics (32,768 tokens a row);
    ``run``: its round under --repeat."""
    name = f"{Path(config).stem}-{item}" + (f"-run{run}" if run else "")
    (work / f"{name}.log").write_text(log)
    if flame_tps:
        (work / name).mkdir()
        rows = [{"step": s, "throughput(tps)": tps, "mfu(%)": 30.0, "memory/max_reserved(GiB)": 35.5}
                for s, tps in ((10, 1.0), (20, flame_tps))]
        (work / name / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    flame = item.startswith("flame")
    return Result(Step(suite, item, name, [] if flame else ["--tokens", "32768"], config=config, train=flame,
                       common=["--training.seq_len", "32768"] if flame else [], gpus=gpus), status, 60.0)


def test_the_peers_table_sets_the_three_sides_side_by_side(tmp_path):
    llama, transformer = "configs/llama_340M.json", "configs/transformer_340M.json"

    def step(config, item, status=0, log="", flame_tps=None):
        return peer_result(tmp_path, "peers", config, item, status, log, flame_tps)

    def torchtitan_log(tps):  # torchtitan's own lines (components/metrics.py), after the trainer's size line
        return ("[titan] 2026-11-25 10:00:00,000 - root - INFO - Model llama3 flame_llama_340M size: 373,867,520 "
                "total parameters\n" + "".join(
                    f"[titan] 2026-11-25 10:00:0{i},000 - root - INFO - step: {s:2}  loss: 7.12345  grad_norm:  1.2345"
                    f"  memory: 40.12GiB(50.70%)  tps: {t:,}  tflops: 250.12  mfu: 25.29%\n"
                    for i, (s, t) in enumerate(((1, 900), (10, 50_000), (20, tps)))))

    size = "[default0]:[titan] ... - root - INFO - Model flame llama_340M size: 373,867,520 total parameters\n"
    plain = json.dumps({"tokens_per_s": 100_000, "peak_mem_gib": 50.9, "params": 373_867_520}) + "\n"
    results = [step(llama, "torchtitan", log=torchtitan_log(100_000)),
               step(llama, "torchtitan-compiled", log=torchtitan_log(140_000)),
               step(llama, "flame", log=size, flame_tps=90_000), step(llama, "flame-compiled", log=size, flame_tps=150_000),
               step(llama, "flame-fp8", log=size, flame_tps=170_000), step(llama, "plain", log=plain),
               step(transformer, "flame", log=size, flame_tps=145_000), step(transformer, "flame-compiled", status=124),
               step(transformer, "plain", log=plain)]
    table = reports.peers(results, tmp_path)
    rows = {tuple(line.split()[:3]): line.split()[3:] for line in table[1:6]}
    assert rows[("llama_340M", "32,768", "eager")] == [
        "373,867,520", "373,867,520", "100,000", "90,000", "100,000", "0.90", "0.90", "30.0", "40.1", "35.5", "50.9"]
    assert rows[("llama_340M", "32,768", "compiled")][2:6] == ["140,000", "150,000", "-", "1.07"]
    assert rows[("llama_340M", "32,768", "fp8")][2:6] == ["140,000", "170,000", "-", "1.21"]  # against tt compiled
    # the fla transformer is compared with the llama of its size; its compiled run stopped, so no figures of its own
    assert rows[("transformer_340M", "32,768", "eager")][2:6] == ["100,000", "145,000", "100,000", "1.45"]
    assert rows[("transformer_340M", "32,768", "compiled")][2:4] == ["140,000", "-"]
    notes = "\n".join(table[6:])
    assert "transformer_340M eager: torchtitan's columns are llama_340M's run" in notes
    assert "transformer_340M-flame-compiled: stopped at its limit" in notes and "WARNING" not in notes


def test_a_profiled_step_is_summed_by_kernel_kind_with_the_gpus_idle_time(tmp_path):
    from scripts.bench import trace_summary

    # the events as torch's profiler writes them for CUDA (Chrome trace, microseconds): two streams overlap
    def kernel(name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#10", "ts": 0, "dur": 1000, "pid": 1, "tid": 1},
        kernel("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", 100, 300),
        kernel("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", 400, 100),
        kernel("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90>>", 500, 50),
        kernel("chunk_gla_fwd_kernel_o", 550, 50),
        {**kernel("layer_norm_fwd_kernel_row", 700, 20), "args": {"correlation": 5}},  # after 100 us with nothing on the GPU
        kernel("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", 720, 30),
        kernel("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", 750, 40),
        kernel("ncclDevKernel_AllGather_RING_LL", 760, 200),  # on another stream, beside the optimizer
        kernel("Memcpy HtoD (Pageable -> Device)", 960, 40, cat="gpu_memcpy"),
    ]
    # the host's side: it waited in .item() for the GPU, then launched the norm that ended the idle stretch
    def host(name, ts, dur, cat="cpu_op", **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1, "args": args}

    events += [
        host("aten::item", 500, 185), host("aten::_local_scalar_dense", 501, 183),
        host("cudaMemcpyAsync", 502, 3, cat="cuda_runtime"), host("cudaStreamSynchronize", 506, 170, cat="cuda_runtime"),
        host("aten::layer_norm", 686, 10), host("cudaLaunchKernel", 688, 4, cat="cuda_runtime", correlation=5),
    ]
    trace = tmp_path / "rank0_trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    summary = trace_summary.summarize(trace)
    lines = summary.splitlines()
    waits = lines.index("host waits (ms, calls, host op): 0.2 ms in all")
    assert lines[waits + 1].split() == ["0.17", "1", "aten::item", ">", "aten::_local_scalar_dense"]
    idle = next(i for i, line in enumerate(lines) if line.startswith("idle before launches"))
    assert lines[idle].endswith(": 0.1 ms in all") and lines[idle + 1].split() == ["0.10", "1", "aten::layer_norm"]
    assert "1 profiled step, 0.9 ms from the first GPU kernel to the last; the GPU busy 0.8 ms (88.9%), idle 0.1 ms" \
        in summary
    # the all-gather ran alone from the optimizer's end (790) to the copy (960)
    assert lines[1] == ("communication alone (NCCL kernels and nothing else, including their wait for the other "
                        "ranks): 0.2 ms (18.9%)")
    kinds = {line[:32].strip(): line[32:].split() for line in summary.splitlines()[3:13]}
    assert kinds["matmuls (cuBLAS, CUTLASS)"] == ["0.30", "36.1%", "1"]
    assert kinds["attention (flash)"] == ["0.15", "18.1%", "2"]  # FlashAttention 3's CUTLASS template included
    assert kinds["fla Triton kernels"][0] == "0.05" and kinds["norms"][0] == "0.02"
    assert kinds["compiled (inductor's Triton)"][0] == "0.03" and kinds["optimizer"][0] == "0.04"
    assert kinds["communication (NCCL)"][0] == "0.20" and kinds["memory copies and fills"][0] == "0.04"
    lines = summary.splitlines()
    longest = lines[lines.index(f"the {trace_summary.TOP} longest kernels (ms, launches, kind, name):") + 1]
    assert longest.split()[:3] == ["0.30", "1", "matmuls"]

    # a trace recorded without CUDA activity (here: the CPU's own profiler) is refused in one line
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        torch.ones(64, 64) @ torch.ones(64, 64)
    cpu_trace = tmp_path / "cpu_trace.json"
    profiler.export_chrome_trace(str(cpu_trace))
    result = subprocess.run([sys.executable, "-m", "scripts.bench.trace_summary", str(cpu_trace)], capture_output=True,
                            text=True, cwd=ROOT)
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [
        f"trace_summary: error: {cpu_trace} holds no GPU kernels: it was recorded without CUDA activity "
        "(train.sh's --profiling.enable_profiling on a GPU records them)"]


def test_spread_runs_one_gpu_steps_side_by_side_each_on_its_own_gpu_then_the_larger_ones(tmp_path, monkeypatch):
    import threading
    import time

    running, seen, lock = set(), [], threading.Lock()

    def fake_run_step(step, work, limit, env):
        device = env.get("CUDA_VISIBLE_DEVICES")
        with lock:
            assert device not in running, f"two steps on GPU {device} at once"
            running.add(device)
            seen.append((step.name, device, len(running)))
        time.sleep(0.2)
        with lock:
            running.discard(device)
        return Result(step, 0, 0.2)

    monkeypatch.setattr(runs, "run_step", fake_run_step)
    monkeypatch.setattr(runs, "save_kernel_caches", lambda out: None)
    args = gpu_check.parse_args(["--suite", "scaling", "--spread", "--work", str(tmp_path), "--out", str(tmp_path)])
    steps = gpu_check.plan("scaling", args)
    results = gpu_check.run_suite("scaling", steps, args, {}, gpu_check.Budget(None), gpus=4)
    assert [r.step.name for r in results] == [s.name for s in steps]  # the suite's order
    singles = {name: device for name, device, _ in seen if device is not None}
    assert sorted(singles) == sorted(s.name for s in steps if s.gpus == 1) and len(set(singles.values())) == 4
    assert max(count for *_, count in seen) == 4  # the four one-GPU runs overlapped
    # the 4-GPU runs come after, alone, on every GPU (no CUDA_VISIBLE_DEVICES of their own)
    assert [(name, device) for name, device, _ in seen[4:]] == [(s.name, None) for s in steps if s.gpus == 4]


def test_spread_is_refused_where_runs_share_a_seed_checkpoint(capsys):
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--suite", "layouts", "--spread"])
    assert "--spread: suite layouts starts every run of a config from one seed checkpoint" in capsys.readouterr().err


def test_the_scaling_table_sets_each_sides_share_of_its_one_gpu_rate_beside_flame_over_torchtitan(tmp_path):
    def step(item, log="", flame_tps=None, status=0):
        return peer_result(tmp_path, "scaling", "configs/llama_340M.json", item, status, log, flame_tps,
                           gpus=int(item[-1]))

    def torchtitan_log(tps):
        return "".join(f"[titan] 2026-11-28 10:00:0{i},000 - root - INFO - step: {s:2}  loss: 7.1  grad_norm:  1.2  "
                       f"memory: 40.12GiB(50.70%)  tps: {t:,}  tflops: 250.12  mfu: 25.29%\n"
                       for i, (s, t) in enumerate(((10, 50_000), (20, tps))))

    results = [step("torchtitan-1", torchtitan_log(160_000)), step("torchtitan-4", torchtitan_log(112_000)),
               step("flame-1", flame_tps=150_000), step("flame-4", flame_tps=135_000)]
    table = reports.scaling(results, tmp_path)
    rows = {line.split()[2]: line.split()[3:8] for line in table[1:3]}
    assert rows["1"] == ["160,000", "150,000", "0.94", "100%", "100%"]
    assert rows["4"] == ["112,000", "135,000", "1.21", "70%", "90%"]
    # a side that did not finish shows no share, and is named under the table
    results[3] = step("flame-4", status=124)
    table = reports.scaling(results, tmp_path)
    assert table[2].split()[3:8] == ["112,000", "-", "-", "70%", "-"]
    assert "llama_340M-flame-4: stopped at its limit" in table[-1]


def test_repeated_scaling_runs_come_in_rounds_and_the_table_gives_each_sides_median_beside_its_range(tmp_path,
                                                                                                      capsys):
    config = "configs/llama_340M.json"
    args = gpu_check.parse_args(["--suite", "scaling", "--repeat", "3", "--configs", config,
                                 "--only", "flame-1", "flame-4"])
    steps = gpu_check.plan("scaling", args)
    assert [step.name for step in steps] == [f"llama_340M-flame-{gpus}-run{k}" for k in (1, 2, 3) for gpus in (1, 4)]
    assert [step.item for step in steps] == ["flame-1", "flame-4"] * 3

    def runs(item, rates):
        return [peer_result(tmp_path, "scaling", config, item, flame_tps=tps, gpus=int(item[-1]), run=k)
                for k, tps in enumerate(rates, 1)]

    table = reports.scaling(runs("flame-1", (150_000, 160_000, 155_000)) + runs("flame-4", (120_000, 140_000, 135_000)),
                            tmp_path)
    one, four = (line.split() for line in table[1:3])
    assert one[4] == "155,000" and four[4] == "135,000" and four[7] == "87%"  # medians; 135,000 / 155,000
    assert four[-2:] == ["3:", "120.0-140.0K"] and one[-2:] == ["3:", "150.0-160.0K"]
    assert table[2].split()[-3] == "-"  # no torchtitan runs: no range

    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--suite", "peers", "--repeat", "2"])
    assert ("--repeat: suite peers reports each run by itself; only the scaling suite's table takes the median of "
            "repeated runs") in capsys.readouterr().err


@pytest.mark.parametrize("argv, error", [
    (["--gpus", "0", "--device", "cpu"], "--gpus must be positive, got 0"),
    (["--gpus", "2", "--device", "cpu"], "--gpus 2 shards the model with torchtitan's FSDP"),
])
def test_torchtitans_trainer_over_several_gpus_is_refused_where_it_cannot_run(argv, error, capsys):
    with pytest.raises(SystemExit):
        torchtitan_peer.parse_args(["--config", "configs/llama_340M.json", *argv])
    assert error in capsys.readouterr().err


def test_spread_keeps_to_the_gpus_its_parent_made_visible(tmp_path, monkeypatch):
    """Under CUDA_VISIBLE_DEVICES=1,2 the one-GPU runs go to GPUs 1 and 2, not to 0 and 1 (which another job of
    the machine may be using)."""
    seen = []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")
    monkeypatch.setattr(runs, "run_step", lambda step, work, limit, env: seen.append(env.get("CUDA_VISIBLE_DEVICES"))
                        or Result(step, 0, 0.0))
    monkeypatch.setattr(runs, "save_kernel_caches", lambda out: None)
    args = gpu_check.parse_args(["--suite", "scaling", "--spread", "--work", str(tmp_path), "--out", str(tmp_path)])
    gpu_check.run_suite("scaling", gpu_check.plan("scaling", args), args, {}, gpu_check.Budget(None), gpus=2)
    assert {device for device in seen if device is not None} == {"1", "2"}


def test_packing_a_work_folder_skips_what_a_run_beside_it_removes_meanwhile(tmp_path, monkeypatch):
    """--spread packs the work folder as each run ends, while the others clear their dump folders."""
    import tarfile

    work = tmp_path / "work"
    (work / "run_b").mkdir(parents=True)
    (work / "a.log").write_text("a")
    (work / "run_b" / "job_config.json").write_text("{}")
    add = tarfile.TarFile.add

    def add_while_run_b_clears(self, name, *args, **kwargs):
        if str(name).endswith("job_config.json"):  # run_b's cleanup, between listing the file and adding it
            Path(name).unlink()
        return add(self, name, *args, **kwargs)

    monkeypatch.setattr(tarfile.TarFile, "add", add_while_run_b_clears)
    runs.pack(work, tmp_path / "memory.tgz")
    with tarfile.open(tmp_path / "memory.tgz") as tar:
        assert tar.getnames() == ["a.log"]


def test_the_profile_suite_reads_traces_where_torchtitan_writes_them():
    """runs.run_step sums the trace under torchtitan's default traces folder (a wrong name found none on a GPU)."""
    from torchtitan.config.job_config import Profiling

    assert runs.PROFILE_TRACES == Profiling().save_traces_folder
    assert "--profiling.save_traces_folder" not in " ".join(map(str, gpu_check.SUITES["profile"].flags))


def test_the_plain_loops_profiled_step_is_its_last_and_the_profiles_report_prints_its_summary(tmp_path):
    """The profile suite profiles the plain loop beside flame's runs: the loop's profiler records only its last
    step, and the summary goes where the profiles report looks for a step's summary."""
    from scripts.bench.plain_loop import last_step_profiler

    with last_step_profiler(4, str(tmp_path)) as profiler:
        for step in range(4):
            with torch.profiler.record_function(f"step{step}"):
                torch.ones(8).sum()
            profiler.step()
    recorded = {e.get("name") for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]}
    assert "step3" in recorded and not recorded & {"step0", "step1", "step2"}

    args = gpu_check.parse_args(["--suite", "profile", "--configs", "configs/gla_340M.json", "--work", str(tmp_path)])
    plain = next(s for s in gpu_check.plan("profile", args) if s.item == "plain")
    summary = tmp_path / "profile" / "gla_340M-plain.profile.txt"
    assert plain.argv[-2:] == ["--profile", str(summary)]
    summary.parent.mkdir()
    summary.write_text("matmuls (cuBLAS, CUTLASS)     180.00     60.0%       400\n")
    (summary.parent / "gla_340M-plain.log").write_text('{"tokens_per_s": 120000}\n')
    shown = reports.profiles([Result(plain, 0, 60.0)], summary.parent)
    assert shown[-2:] == ["gla_340M-plain:", "matmuls (cuBLAS, CUTLASS)     180.00     60.0%       400"]
    # a summary that could not be written is refused before the run, in one line
    refused = subprocess.run([sys.executable, "-m", "scripts.bench.plain_loop", "--config", "configs/llama_4M.json",
                              "--profile", str(tmp_path / "missing" / "x.txt")], cwd=ROOT, capture_output=True, text=True)
    assert refused.returncode == 2
    assert refused.stderr.splitlines()[-1].endswith(f"no folder {tmp_path / 'missing'} to write it in; create it first")


def test_host_waits_name_the_callers_lines_outside_torch_most_visited_first():
    import traceback
    from collections import Counter

    from scripts.bench import host_waits

    def frame(path, line, name):
        return traceback.FrameSummary(path, line, name)

    torch_dir = str(Path(torch.__file__).parent)
    flame_attention = frame("/repo/flame/models/attention.py", 261, "hf_document_attention")
    stack = [frame("/repo/flame/trainer.py", 240, "_train_step"), flame_attention,
             frame(f"{torch_dir}/nn/attention/varlen.py", 308, "varlen_attn"),
             frame(f"{torch_dir}/_ops.py", 1255, "__call__"), frame("/usr/lib/python3.11/warnings.py", 109, "_showwarnmsg")]
    assert host_waits.place(stack) == ("/repo/flame/trainer.py:240 in _train_step",
                                       "/repo/flame/models/attention.py:261 in hf_document_attention")
    deep = [frame(f"/repo/fla/layer{i}.py", i, f"f{i}") for i in range(10)]
    assert host_waits.place(deep) == tuple(f"/repo/fla/layer{i}.py:{i} in f{i}" for i in range(4, 10))
    places = Counter({host_waits.place(stack): 48, host_waits.place(deep[:1]): 1})
    lines = host_waits.report(places).splitlines()
    assert lines[0] == "49 synchronizing calls at 2 places"
    assert lines[1] == "   48x  /repo/flame/trainer.py:240 in _train_step"
    assert lines[2].strip() == "/repo/flame/models/attention.py:261 in hf_document_attention"
    assert lines[3] == "    1x  /repo/fla/layer0.py:0 in f0"
