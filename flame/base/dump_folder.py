"""A run's claim on its dump folder: one run at a time, and a record of every attempt.

**The lock**, ``<dump_folder>/.flame.lock``, is held by node 0's launcher (flame.launch.supervise) for
the run's life; train.sh's preflight (flame.launch.preflight) only looks at it. Two things make it, because
dump folders often live on network filesystems:

- ``fcntl.flock`` on the file: the kernel releases it when its holder exits, even by ``kill -9``,
  and refuses a second holder on the same host (and on NFS, which hands it to the server);
- the holder's record in the file (host, pid, start, Slurm job, attempt, command) and a
  heartbeat: the holder touches the file every HEARTBEAT_S seconds. Some filesystems do not share
  flock between hosts (Lustre without ``-o flock``), and the NFS lock of a crashed host outlives
  it, so a holder on another host counts as alive only while its heartbeat is fresh.

A holder is gone when it ran on this host and its flock is free (or, without flock, its pid no
longer runs); when it ran on another host, once its heartbeat is older than STALE_S or when it
belonged to this Slurm job (a requeued job keeps its SLURM_JOB_ID, and Slurm ends every process
of a job before requeueing it). A gone holder's lock is taken over with a one-line warning
naming it; a live one's refuses the run in one line naming the holder.

**Attempts**: each start of a run in a dump folder is an attempt, numbered 1, 2, ...: one more
than the latest that started, picked by the launcher under the lock (FLAME_ATTEMPT) or, in a
bare torchrun launch, by rank 0. Once the
run is known to start (model built, checkpoint loaded), rank 0 writes its job config to
``<dump_folder>/attempts/<n>/job_config.json`` and to ``<dump_folder>/job_config.json``, which
therefore always describes the latest attempt that started (the HF export reads it); a run that
fails before that writes neither. Each metrics.jsonl line names its attempt.

Standard library only: the launcher imports this before torch.
"""

import fcntl
import json
import os
import socket
import sys
import threading
import time
from typing import Any

from flame.base.errors import ConfigError

LOCK_FILE = ".flame.lock"
RUN_CONFIG_FILE = "job_config.json"  # the parsed job config, saved in the dump folder by rank 0 (record_attempt)
ATTEMPTS = "attempts"
HEARTBEAT_S = 15.0
STALE_S = 60.0  # four heartbeats missed: that host's run is dead (or cut off from the filesystem)


def next_attempt(dump_folder: str) -> int:
    """The number of the next attempt in ``dump_folder``: one more than the latest that started."""
    try:
        names = os.listdir(os.path.join(dump_folder, ATTEMPTS))
    except OSError:
        return 1
    return max((int(name) for name in names if name.isdigit()), default=0) + 1


def record_attempt(dump_folder: str, attempt: int, job_config: dict[str, Any]) -> None:
    """Write the job config of ``attempt``, which has started, to its own folder and as the dump folder's."""
    text = json.dumps(job_config, indent=2, default=str)
    folder = os.path.join(dump_folder, ATTEMPTS, str(attempt))
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, RUN_CONFIG_FILE), "w") as f:
        f.write(text)
    # the export reads this one: a reader must find the previous attempt's or this one's, whole
    latest = os.path.join(dump_folder, RUN_CONFIG_FILE)
    with open(latest + ".tmp", "w") as f:
        f.write(text)
    os.replace(latest + ".tmp", latest)


def describe(holder: dict[str, Any]) -> str:
    """``host H, pid P, since <local time>[, Slurm job J]`` of a lock's record."""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since {since}{job}"


def pid_alive(pid: int) -> bool:
    """Whether a process of this machine with this pid runs (another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def gone(holder: dict[str, Any], flock_free: bool | None, heartbeat_age: float) -> str | None:
    """Why the lock's recorded holder no longer runs, or None when it may.

    ``flock_free``: whether this process could take the file's flock (None: the filesystem has none).
    """
    if holder.get("host") == socket.gethostname():
        if flock_free:  # the kernel releases a holder's flock when it exits; its pid may be reused since
            return "it has ended (its lock is free)"
        if flock_free is None and not pid_alive(int(holder.get("pid", 0))):
            return f"it has ended (pid {holder.get('pid')} is not running)"
        return None
    job = os.environ.get("SLURM_JOB_ID")
    if job and holder.get("slurm_job_id") == job:
        return f"Slurm requeued job {job}"
    if heartbeat_age > STALE_S:
        return f"no heartbeat for {heartbeat_age:.0f} s"
    return None


def _try_flock(fd: int) -> bool | None:
    """Take the file's flock if free: True, False when another process holds it, None when unsupported."""
    for _ in range(3):  # a preflight's peek holds it for an instant: look again before calling it taken
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(0.1)
        except OSError:  # ENOLCK, EOPNOTSUPP...: a filesystem without flock; the record decides
            return None
    return False


def _read_holder(fd: int) -> dict[str, Any] | None:
    text = os.pread(fd, 1 << 16, 0)
    try:
        holder = json.loads(text)
    except ValueError:  # empty (no holder, or one writing it now) or cut short
        return None
    return holder if isinstance(holder, dict) else None


def _refusal(dump_folder: str, holder: dict[str, Any] | None) -> ConfigError:
    who = f"another run ({describe(holder)})" if holder else "another run, starting now"
    host = holder.get("host") if holder else None
    stop = f"stop it (kill {holder.get('pid')} on {host})" if holder else "stop it"
    return ConfigError(
        f"--job.dump_folder {dump_folder} is in use by {who}: wait for it to end or {stop}, "
        "or choose another --job.dump_folder"
    )


def check_free(dump_folder: str) -> None:
    """Raise ConfigError naming the holder when a live run holds ``dump_folder``'s lock (writes nothing)."""
    path = os.path.join(dump_folder, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDWR)  # flock over NFS needs a writable descriptor
    except OSError:  # no lock file (no run yet), or a dump folder the preflight refuses anyway
        return
    try:
        flock_free = _try_flock(fd)
        holder = _read_holder(fd)
        if flock_free:
            fcntl.flock(fd, fcntl.LOCK_UN)
        if holder is None:
            if flock_free is False:
                raise _refusal(dump_folder, None)
            return
        if gone(holder, flock_free, time.time() - os.fstat(fd).st_mtime) is None:
            raise _refusal(dump_folder, holder)
    finally:
        os.close(fd)


class DumpFolderLock:
    """The lock of one dump folder, held by this process from ``acquire`` to ``release`` (or its exit)."""

    def __init__(self, dump_folder: str, command: str):
        self.dump_folder = dump_folder
        self.command = command
        self.path = os.path.join(dump_folder, LOCK_FILE)
        self.attempt = 0
        self._fd: int | None = None
        self._stop = threading.Event()

    def acquire(self) -> None:
        """Take the lock (a gone holder's with a warning), pick this run's attempt number, start the heartbeat.

        Raises ConfigError naming the holder when a live run holds it.
        """
        os.makedirs(self.dump_folder, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            flock_free = _try_flock(fd)
            holder = _read_holder(fd)
            if holder is None and flock_free is False:
                raise _refusal(self.dump_folder, None)
            if holder is not None:
                reason = gone(holder, flock_free, time.time() - os.fstat(fd).st_mtime)
                if reason is None:
                    raise _refusal(self.dump_folder, holder)
                print(f"flame: warning: taking over the lock of {self.dump_folder} from a run that is gone "
                      f"({describe(holder)}): {reason}", file=sys.stderr)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.attempt = next_attempt(self.dump_folder)
        record = {
            "host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID", ""), "attempt": self.attempt, "command": self.command,
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        threading.Thread(target=self._heartbeat, name="flame-lock-heartbeat", daemon=True).start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self._fd)
            except OSError:  # the filesystem is away for a moment; the next beat tries again
                pass

    def release(self) -> None:
        """Clear the record and free the lock (the kernel frees the flock anyway when this process ends)."""
        if self._fd is None:
            return
        self._stop.set()
        try:
            os.ftruncate(self._fd, 0)  # an empty record: free, nobody to name
        finally:
            os.close(self._fd)  # closing drops the flock
            self._fd = None
