"""Several nodes: train.sh's c10d rendezvous, the Slurm launcher, and what nodes share on disk."""

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from flame.checkpoint.steps import complete_steps
from flame.data import builtin
from flame.launch.slurm import expand_nodelist, job_port, node_settings
from scripts.chaos.runs import descendants, leftovers, parent_of
from tests.conftest import ROOT, SCRIPTS, base_args, check, flame_env, losses, torchrun

SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"


def clean_env(**extra: str) -> dict[str, str]:
    """The test environment without any launcher or Slurm settings of the machine running the tests."""
    names = ("NGPU", "NNODE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "LOG_RANK", "FLAME_DRY_RUN")
    env = {k: v for k, v in flame_env().items() if not k.startswith("SLURM_") and k not in names}
    return env | {"FLAME_PYTHON": sys.executable} | extra


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def start_nodes(command: list[str], env: dict[str, str], logs: dict[int, Path]) -> dict[int, subprocess.Popen]:
    """train.sh once per node (node rank -> process), each in a session of its own, its output in its log file
    (a file: nothing blocks on a full pipe meanwhile)."""
    nodes = {}
    for rank, log in logs.items():
        with open(log, "w") as out:
            nodes[rank] = subprocess.Popen(command, cwd=ROOT, env=env | {"NODE_RANK": str(rank)}, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True)
    return nodes


def test_two_nodes_train_one_nodes_curve_and_resume_it_after_a_node_is_lost(tmp_path, tiny_model, corpus):
    nodes_dump, single_dump = tmp_path / "nodes", tmp_path / "single"
    steps, interval = 12, ["--checkpoint.interval=2"]  # steps enough that the kill lands mid-run, whatever the load
    env = clean_env(NNODE="2", NGPU="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    command = ["bash", str(ROOT / "train.sh"), *base_args(tiny_model, corpus, nodes_dump, steps), *interval]
    with ThreadPoolExecutor(max_workers=1) as pool:  # the reference meanwhile: one node, two processes
        single = pool.submit(torchrun, base_args(tiny_model, corpus, single_dump, steps) + interval, nproc=2)
        first = start_nodes(command, env, {rank: tmp_path / f"first{rank}.out" for rank in (1, 0)})
        try:
            while not complete_steps(str(nodes_dump / "checkpoint")):  # step 2's checkpoint, manifest included
                assert first[0].poll() is None, (tmp_path / "first0.out").read_text()[-4000:]
                time.sleep(0.002)
            # node 1's launcher dies outright (kill -9): its rank must die with it and node 0's run must end
            [launcher] = [p.pid for p in descendants(first[1].pid) if parent_of(p.pid) == first[1].pid]
            os.kill(launcher, signal.SIGKILL)
            assert first[0].wait(timeout=60) == 1 and first[1].wait(timeout=60) != 0
        finally:
            for node in first.values():
                if node.poll() is None:
                    os.killpg(node.pid, signal.SIGKILL)
        assert not leftovers(nodes_dump, []), "a process of the killed run outlived it"
        lost = (tmp_path / "first0.out").read_text()
        # torchrun numbers the ranks in the order the nodes joined: node 0's rank is 0 or 1
        failed = (r"flame: training failed: rank (\d) exited with status 1: rank \1 failed: "
                  r"its connection to another rank broke")
        assert re.search(failed, lost), lost[-4000:]
        assert "Traceback" not in lost
        saved = complete_steps(str(nodes_dump / "checkpoint"))[-1]  # a later step's save may have been cut short

        # the same command on both nodes again: it resumes at the last complete checkpoint
        logs = {rank: tmp_path / f"node{rank}.out" for rank in (1, 0)}
        for node in start_nodes(command, env, logs).values():
            node.wait(timeout=300)
            assert node.returncode == 0, "".join(log.read_text()[-4000:] for log in logs.values())
        single = check(single.result())
    node1, node0 = (log.read_text() for log in logs.values())
    assert "Applied FSDP2 over 2 ranks" in node0 and f"Training starts at step {saved + 1}" in node0
    assert saved < steps

    expected, got = losses(single_dump), losses(nodes_dump)  # the resumed attempt's records of the steps it retook
    assert sorted(got) == sorted(expected) == list(range(1, steps + 1))
    assert got == pytest.approx(expected, rel=1e-5)

    assert (nodes_dump / "hf" / "model.safetensors").is_file()
    assert f"exported step {steps}" in node0 and "exported" not in node1
    for rank in (0, 1):  # logs/node<NODE_RANK>/<rendezvous id "flame" of the c10d rendezvous>_*/...
        assert list((nodes_dump / "logs" / f"node{rank}").glob("flame_*/attempt_0/0/stdout.log"))


def fake_slurm(tmp_path: Path, step: str) -> dict[str, str]:
    """The environment of a 2-node job 4242 on node[07-08], with the fake `srun` and `scontrol` of
    tests/scripts/fake_slurm first on PATH, recording under ``tmp_path``; srun's job step does ``step``
    ("per_node": the command once per node, concurrently; "wait": sleeps until killed)."""
    return clean_env(
        PATH=f"{SCRIPTS / 'fake_slurm'}{os.pathsep}{os.environ['PATH']}", FAKE_LOG=str(tmp_path), FAKE_SRUN_STEP=step,
        SLURM_JOB_ID="4242", SLURM_JOB_NAME="flame", SLURM_NNODES="2", SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_NODELIST="node[07-08]", SLURM_GPUS_ON_NODE="1", SLURM_CPUS_PER_TASK="2", SLURM_SUBMIT_DIR=str(ROOT),
    )


def test_sbatch_runs_train_sh_once_per_node_with_one_rendezvous(tmp_path, tiny_model, corpus):
    env = fake_slurm(tmp_path, "per_node") | {"FLAME_DRY_RUN": "1"}
    result = subprocess.run(["bash", str(SBATCH), *base_args(tiny_model, corpus, tmp_path / "dump")], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=300, check=False)
    node_outputs = [(tmp_path / f"node{n}.out").read_text() for n in (0, 1)]
    assert result.returncode == 0, result.stderr + "".join(node_outputs)
    assert (tmp_path / "srun.args").read_text().split()[:3] == [
        "--ntasks-per-node=1", "--cpus-per-task=2", "--kill-on-bad-exit=1"]
    assert "show hostnames node[07-08]" in (tmp_path / "scontrol.calls").read_text()

    endpoints = set()
    for rank, output in enumerate(node_outputs):
        assert f"dry run, node {rank} of 2 would run:" in output, output
        command = shlex.split(output.split("would run:")[1])
        assert command[0] == "torchrun" and command[-1] == f"--job.dump_folder={tmp_path}/dump"
        torchrun_args = command[1:command.index("flame.train") - 1]
        option = {name: torchrun_args[i + 1] for i, name in enumerate(torchrun_args) if name.startswith("--")}
        assert option["--nnodes"] == "2" and option["--nproc_per_node"] == "1"
        assert option["--rdzv_backend"] == "c10d" and option["--rdzv_id"] == "4242"
        assert option["--rdzv_conf"] == f"is_host={int(rank == 0)}"  # node 0 hosts the rendezvous
        assert option["--log-dir"] == f"{tmp_path}/dump/logs/node{rank}"
        assert "--standalone" not in torchrun_args and "--master_addr" not in torchrun_args
        endpoints.add(option["--rdzv_endpoint"])
    assert endpoints == {f"node07:{job_port('4242')}"}
    assert not (tmp_path / "dump").exists(), "a dry run starts nothing"


@pytest.mark.parametrize("signalled", ["while_the_step_runs", "as_the_step_starts"])
def test_sbatch_stops_the_step_with_a_checkpoint_on_usr1_then_requeues_the_job(tmp_path, signalled):
    env = fake_slurm(tmp_path, "wait")
    script = subprocess.Popen(["bash", str(SBATCH), "--training.steps=1"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        pid_file, calls = tmp_path / "srun.pid", tmp_path / "scontrol.calls"
        if signalled == "as_the_step_starts":  # the trap is set; the step's pid may not be known yet
            first_line = script.stdout.readline()
            assert first_line.startswith("flame: job 4242, attempt 1"), first_line
        else:
            deadline = time.monotonic() + 90
            while not pid_file.is_file() or not pid_file.read_text().strip():  # trap set, step running
                assert time.monotonic() < deadline and script.poll() is None
                time.sleep(0.05)
        script.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@180 sends before the time limit
        # the step gets SIGTERM (train.sh's run saves its step and ends: docs/running.md), then the job is requeued
        output, _ = script.communicate(timeout=30)  # not the fake step's 60 s sleep
        assert script.returncode == 128 + signal.SIGTERM  # the step's status: the fake step dies of the SIGTERM
        assert calls.read_text().splitlines() == ["requeue 4242"]
        assert "time limit near: saving the current step, then requeueing job 4242" in output
    finally:
        if script.poll() is None:
            script.kill()


@pytest.mark.parametrize("nodelist, hosts", [
    ("node[07-08]", ["node07", "node08"]),
    ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
    ("login1", ["login1"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("a[098-100]", ["a098", "a099", "a100"]),
    ("rack[1-2]-gpu[1,3]", ["rack1-gpu1", "rack1-gpu3", "rack2-gpu1", "rack2-gpu3"]),
    ("dgx-h100-[001-002].cluster,dgx-a[5]", ["dgx-h100-001.cluster", "dgx-h100-002.cluster", "dgx-a5"]),
])
def test_nodelist_expands_like_scontrol_show_hostnames(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["", "node[1-2", "node[a-b]", "node]1", "node[1-]", "a,,b"])
def test_malformed_nodelist_is_an_error(nodelist):
    with pytest.raises(ValueError, match="cannot parse"):
        expand_nodelist(nodelist)


def test_slurm_settings_fill_only_what_the_user_did_not_set(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol: flame parses the nodelist itself
    job = {"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "8", "SLURM_JOB_NODELIST": "gpu[001-008]",
           "SLURM_STEP_NUM_NODES": "3", "SLURM_STEP_NODELIST": "gpu[004-006]", "SLURM_NODEID": "2"}
    assert node_settings(job) == {"NNODE": "3", "NODE_RANK": "2", "MASTER_ADDR": "gpu004", "MASTER_PORT": "15077"}
    assert node_settings(job | {"SLURM_GPUS_ON_NODE": "4"})["NGPU"] == "4"
    mine = {"NNODE": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "NGPU": "2"}
    assert node_settings(job | mine) == {}
    assert job_port("77") == job_port("77") != job_port("78")


def test_concurrent_builds_of_a_builtin_neither_fail_nor_mix(tmp_path):
    """Nodes sharing FLAME_CACHE build a built-in corpus at the same time: one build wins whole."""
    target = tmp_path / "builtin" / "corpus-v1"

    def winner(out: Path) -> None:
        (out / "data.jsonl").write_text("winner\n")

    def loser(out: Path) -> None:  # another node finishes (and renames) while this one builds
        (out / "data.jsonl").write_text("loser, half written")
        builtin._build_atomically(target, winner)

    builtin._build_atomically(target, loser)
    assert [p.name for p in tmp_path.joinpath("builtin").iterdir()] == ["corpus-v1"]  # no staging left
    assert (target / "data.jsonl").read_text() == "winner\n"
