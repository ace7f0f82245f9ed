"""A single-node Slurm on this machine, for trying `lctrain submit` and for the end-to-end tests.

    python tools/local_slurm.py start DIR [--cpus N] [--install]   # prints `export SLURM_CONF=...`
    python tools/local_slurm.py stop DIR

`start` writes a munge key, slurm.conf and the daemons' state, spool, log and pid files under DIR,
starts munged, slurmctld and slurmd as root (no systemd), and returns once the node accepts jobs.
Every client command (sbatch, squeue, scontrol) finds this cluster through SLURM_CONF, which
`start` prints for the shell to eval. `--install` first apt-installs Debian's slurmctld, slurmd,
slurm-client and munge when they are missing. `stop` ends the daemons `start` began.

The configuration is the smallest that runs lctrain's jobs: process tracking by /proc
(proctrack/linuxproc) and no task binding (task/none), since a container has no cgroup or
systemd to hand; consumable cores (select/cons_tres, CR_Core); batch jobs scheduled at once
(batch_sched_delay=0); the node may claim `--cpus` CPUs whatever it has (config_overrides), so
that several ranks of one rank per core fit on a small machine; no accounting (sacct answers
nothing: `lctrain status` reads the run dir and squeue/scontrol). No GRES: a job that requests
GPUs here never starts, as on a real CPU partition.

Exit code 0 when the node is up (or is stopped), 1 with the reason on stderr otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
BINARIES = ["slurmctld", "slurmd", "sbatch", "munged", "mungekey"]
PARTITION = "cpu"
START_TIMEOUT_S = 60


class SlurmError(RuntimeError):
    """Why the local Slurm could not be started."""


def _paths(root: Path) -> dict[str, Path]:
    return {name: root / name for name in ("slurm.conf", "munge", "state", "spool", "log", "run")}


def slurm_conf(root: Path, host: str, cpus: int) -> str:
    p = _paths(root)
    return "\n".join([
        "ClusterName=lctrain-local",
        f"SlurmctldHost={host}",
        "SlurmUser=root",
        "AuthType=auth/munge",
        f"AuthInfo=socket={p['munge'] / 'munge.socket'}",
        "MpiDefault=none",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=batch_sched_delay=0",
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        "JobRequeue=1",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none",
        f"StateSaveLocation={p['state']}",
        f"SlurmdSpoolDir={p['spool']}",
        f"SlurmctldPidFile={p['run'] / 'slurmctld.pid'}",
        f"SlurmdPidFile={p['run'] / 'slurmd.pid'}",
        f"SlurmctldLogFile={p['log'] / 'slurmctld.log'}",
        f"SlurmdLogFile={p['log'] / 'slurmd.log'}",
        f"NodeName={host} CPUs={cpus} State=UNKNOWN",
        f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


def _run(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def install() -> None:
    missing = [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise SlurmError(f"{', '.join(missing)} missing and apt-get is not available; install "
                         f"{' '.join(PACKAGES)} with this system's package manager")
    done = _run(["apt-get", "install", "-y", "-q", *PACKAGES],
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    if done.returncode != 0:
        raise SlurmError(f"apt-get install {' '.join(PACKAGES)} failed: "
                         f"{done.stderr.strip()[-500:]}")


def _binary(name: str) -> str:
    found = shutil.which(name) or next((str(Path(d, name)) for d in ("/usr/sbin", "/sbin")
                                        if Path(d, name).exists()), None)
    if found is None:
        raise SlurmError(f"{name} not found; run with --install or apt-get install "
                         f"{' '.join(PACKAGES)}")
    return found


def _wait_until(check, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)  # polling a daemon's start-up, not pacing a test
    tail = log.read_text()[-1500:] if log is not None and log.exists() else ""
    raise SlurmError(f"{what} within {START_TIMEOUT_S} s" + (f"; {log} ends:\n{tail}" if tail
                                                               else ""))


def start(root: Path, cpus: int, with_install: bool) -> dict[str, str]:
    """Start the cluster under `root`; returns the environment clients need (SLURM_CONF)."""
    if os.geteuid() != 0:
        raise SlurmError("the local Slurm runs its daemons as root; run this as root")
    if with_install:
        install()
    root = root.resolve()
    p = _paths(root)
    for name in ("munge", "state", "spool", "log", "run"):
        p[name].mkdir(parents=True, exist_ok=True)
    os.chmod(p["munge"], 0o700)
    key = p["munge"] / "munge.key"
    if not key.exists():
        done = _run([_binary("mungekey"), "--create", f"--keyfile={key}"])
        if done.returncode != 0:
            raise SlurmError(f"mungekey --create failed: {done.stderr.strip()}")
    os.chmod(key, 0o400)
    host = socket.gethostname().split(".")[0]
    p["slurm.conf"].write_text(slurm_conf(root, host, cpus))
    env = {**os.environ, "SLURM_CONF": str(p["slurm.conf"])}
    socket_path = p["munge"] / "munge.socket"
    done = _run([_binary("munged"), "--force", f"--key-file={key}", f"--socket={socket_path}",
                 f"--pid-file={p['run'] / 'munged.pid'}", f"--log-file={p['log'] / 'munged.log'}",
                 f"--seed-file={p['munge'] / 'munge.seed'}"])
    if done.returncode != 0:
        raise SlurmError(f"munged did not start: {done.stderr.strip()}")
    for daemon in ("slurmctld", "slurmd"):
        done = _run([_binary(daemon), "-f", str(p["slurm.conf"])], env=env)
        if done.returncode != 0:
            raise SlurmError(f"{daemon} did not start: {done.stderr.strip()}; see {p['log']}")
    def ready() -> bool:
        for daemon in ("slurmctld", "slurmd"):
            if not _alive(_pid(p["run"] / f"{daemon}.pid")):
                log = p["log"] / f"{daemon}.log"
                raise SlurmError(f"{daemon} exited at start (another Slurm on its port?); "
                                 f"{log} ends:\n{log.read_text()[-1500:] if log.exists() else ''}")
        return _node_state(env) in ("idle", "mixed", "allocated")

    _wait_until(ready, f"node {host} did not become idle", p["log"] / "slurmctld.log")
    return {"SLURM_CONF": str(p["slurm.conf"])}


def _node_state(env: dict) -> str:
    done = _run(["sinfo", "-h", "-o", "%T"], env=env)
    return done.stdout.strip().split("\n")[0].rstrip("*~#") if done.returncode == 0 else ""


def stop(root: Path) -> None:
    """End the daemons `start` began under `root` (slurmd first, munged last)."""
    run = _paths(root.resolve())["run"]
    for name in ("slurmd", "slurmctld", "munged"):
        pid_file = run / f"{name}.pid"
        if not pid_file.exists():
            continue
        pid = _pid(pid_file)
        try:
            if pid:
                os.kill(pid, signal.SIGTERM)
                _wait_until(lambda pid=pid: not _alive(pid), f"{name} (pid {pid}) did not stop")
        except ProcessLookupError:
            pass
        pid_file.unlink(missing_ok=True)


def _pid(pid_file: Path) -> int:
    """The pid a daemon wrote (0 while it has not yet)."""
    try:
        return int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return 0


def _alive(pid: int) -> bool:
    if pid == 0:
        return True  # not written yet: still starting
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as stopped
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["start", "stop"])
    parser.add_argument("dir", type=Path, help="folder for the cluster's files")
    parser.add_argument("--cpus", type=int, default=16,
                        help="CPUs the node claims (default 16, whatever the machine has)")
    parser.add_argument("--install", action="store_true",
                        help="apt-get install the Slurm and munge packages when missing")
    args = parser.parse_args(argv)
    try:
        if args.action == "stop":
            stop(args.dir)
            return 0
        env = start(args.dir, args.cpus, args.install)
    except SlurmError as e:
        print(f"local_slurm: {e}", file=sys.stderr)
        if args.action == "start":
            stop(args.dir)  # whatever did start
        return 1
    print(f"export SLURM_CONF={env['SLURM_CONF']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
