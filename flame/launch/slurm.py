"""A Slurm job step's node settings for train.sh (which runs this when SLURM_JOB_ID is set).

    settings=$(python -m flame.launch.slurm) && eval "$settings"

Prints ``export NAME=value`` for each of NNODE, NODE_RANK, MASTER_ADDR, MASTER_PORT and NGPU
that the environment does not set already (what the user sets wins), derived from the step
that runs train.sh once per node (``srun --ntasks-per-node=1``):

- NNODE: the step's nodes (SLURM_STEP_NUM_NODES, else the job's SLURM_NNODES / SLURM_JOB_NUM_NODES);
- NODE_RANK: SLURM_NODEID;
- MASTER_ADDR: the first host of the step's (else the job's) nodelist, which is node 0;
- MASTER_PORT: a function of the job id, so every node computes the same port without talking;
- NGPU: SLURM_GPUS_ON_NODE when Slurm allocated GPUs (else train.sh counts the visible ones).

Imports nothing heavy: it runs before every launch.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import zlib
from collections.abc import Mapping

PORT_BASE, PORT_SPAN = 15000, 15000  # below Linux's ephemeral range (32768-60999)
_ITEM = re.compile(r"(?:[^,\[]|\[[^\]]*\])+")  # one comma-separated item; commas in brackets belong to it
_BRACKET = re.compile(r"([^\[]*)\[([^\]]*)\](.*)")


def expand_nodelist(nodelist: str) -> list[str]:
    """Hostnames of a Slurm hostlist, in order: ``gpu[01-03,07],cpu5`` -> gpu01 gpu02 gpu03 gpu07 cpu5.

    Ranges keep the zero padding of their first number (``[098-100]`` -> 098 099 100), and
    several bracket groups in one name multiply (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2).
    """
    items = _ITEM.findall(nodelist)
    if not items or ",".join(items) != nodelist:  # empty, or a bracket left open
        raise ValueError(f"cannot parse the Slurm nodelist {nodelist!r}")
    return [host for item in items for host in _expand_name(item)]


def _expand_name(name: str) -> list[str]:
    match = _BRACKET.fullmatch(name)
    if match is None:
        if "[" in name or "]" in name:
            raise ValueError(f"cannot parse the Slurm host name {name!r}")
        return [name]
    prefix, ranges, rest = match.groups()
    suffixes = _expand_name(rest)
    hosts = []
    for part in ranges.split(","):
        first, dash, last = part.partition("-")
        if not first.isdigit() or dash and not last.isdigit():
            raise ValueError(f"cannot parse the range [{ranges}] in the Slurm host name {name!r}")
        numbers = range(int(first), int(last) + 1) if dash else [int(first)]
        hosts.extend(f"{prefix}{n:0{len(first)}d}{suffix}" for n in numbers for suffix in suffixes)
    return hosts


def first_host(nodelist: str) -> str:
    """Node 0 of ``nodelist``: asks ``scontrol show hostnames`` where Slurm's tools are installed."""
    if shutil.which("scontrol"):
        command = ["scontrol", "show", "hostnames", nodelist]
        result = subprocess.run(command, check=False, capture_output=True, text=True)
        if result.returncode == 0 and result.stdout.split():
            return result.stdout.split()[0]
    return expand_nodelist(nodelist)[0]


def job_port(job_id: str) -> int:
    """The rendezvous port of a job: the same on every node, different for up to PORT_SPAN consecutive jobs."""
    number = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    return PORT_BASE + number % PORT_SPAN


def node_settings(env: Mapping[str, str]) -> dict[str, str]:
    """The variables train.sh needs that ``env`` (a Slurm step's environment) does not set."""

    def first(*names: str) -> str | None:
        return next((env[n] for n in names if env.get(n)), None)

    nodelist = first("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    derived = {  # called only for what is missing (scontrol is slow on a busy controller)
        "NNODE": lambda: first("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"),
        "NODE_RANK": lambda: first("SLURM_NODEID"),
        "MASTER_ADDR": lambda: nodelist and first_host(nodelist),
        "MASTER_PORT": lambda: str(job_port(env["SLURM_JOB_ID"])),
        "NGPU": lambda: first("SLURM_GPUS_ON_NODE"),
    }
    settings = {}
    for name, derive in derived.items():
        if not env.get(name) and (value := derive()):
            settings[name] = value
    return settings


def main() -> int:
    try:
        settings = node_settings(os.environ)
    except ValueError as error:
        print(f"flame: error: {error}; set MASTER_ADDR to node 0's address", file=sys.stderr)
        return 2
    for name, value in settings.items():
        print(f"export {name}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
