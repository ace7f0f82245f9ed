"""Process launch: read the rank layout torchrun or srun set, or start local ranks and watch them.

`run_ranks` starts N processes (fork by default, a fixed number of threads each), optionally
initialises a process group in each, collects every rank's return value, and turns the first
failure (exception, non-zero exit, signal) or a timeout into a `RankFailure` naming the rank after
killing the others, so a dead rank never leaves its peers hanging in a collective. Tests use the
same helper with gloo.
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing as mp
import os
import pickle
import random
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.distributed as dist

from lctrain import device

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""Signals that ask a run to checkpoint and stop (SLURM sends SIGUSR1 ahead of the time limit
with --signal, SIGTERM at preemption)."""


WATCH_INTERVAL_S = 1.0


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    launcher: str
    """torchrun | slurm | local | single"""


def env_from_environment() -> DistEnv | None:
    """The rank layout set by torchrun (RANK/WORLD_SIZE) or srun (SLURM_PROCID/...), if any."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                       env.get("LCTRAIN_LAUNCHER", "torchrun"))
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise RuntimeError(f"running under srun with SLURM_NTASKS={env['SLURM_NTASKS']} but "
                               f"{', '.join(missing)} unset; export them in the sbatch script "
                               "(lctrain submit does) or launch through torchrun")
        return DistEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                       int(env.get("SLURM_LOCALID", 0)), "slurm")
    return None


def cuda_devices() -> int:
    """GPUs this process can see (`lctrain.device.count`: CUDA itself stays uninitialised, so
    the ranks started afterwards can still use it)."""
    return device.count()


RENDEZVOUS_PORTS = (20000, 32767)
"""Where `free_port` looks: below Linux's default ephemeral range (32768-60999), from which the
kernel takes the local port of every outgoing connection. A port the kernel handed out as free
(bind to port 0) is in that range, so the connections of any other job on the machine (gloo
opens dozens per group) could take it before rank 0 listens on it."""


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A free TCP port for the rendezvous of local ranks: a random one of RENDEZVOUS_PORTS
    outside the ephemeral range that nothing listens on now."""
    low, high = _ephemeral_ports()
    candidates = [p for p in range(*RENDEZVOUS_PORTS) if not low <= p <= high]
    # the OS's randomness: two launchers that seeded `random` alike must not pick alike
    for port in random.SystemRandom().sample(candidates, min(64, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # all taken: any free one
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailure(RuntimeError):
    def __init__(self, rank: int, reason: str):
        self.rank, self.reason = rank, reason
        super().__init__(f"rank {rank} {reason}")


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _send(conn, message: tuple) -> None:
    # Plain pickle: tensors travel by value. multiprocessing's pickler would pass them as shared
    # memory file descriptors, which die with this process before the parent reads them.
    conn.send_bytes(pickle.dumps(message))


def die_with_parent(parent_pid: int | None = None) -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies, however it dies (SIGKILL
    included): a rank never trains on as an orphan holding its CPUs or GPU. Exits at once if
    the parent is already gone. False where prctl is not available (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if parent_pid is not None and os.getppid() != parent_pid:  # died before the call
        os._exit(1)
    return True


PR_SET_PDEATHSIG = 1


def _child(fn, args, rank, nproc, port, threads, backend, timeout_s, conn, parent_pid):
    die_with_parent(parent_pid)
    # what a forked rank inherits lives as long as it does: the garbage collector need not walk
    # it again (the launcher's heap, e.g. a test session's, would dominate every collection)
    gc.freeze()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), LCTRAIN_LAUNCHER="local",
                      OMP_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    try:
        if backend is not None:
            dist.init_process_group(backend, rank=rank, world_size=nproc,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        result = fn(*args)
        if backend is not None:
            dist.destroy_process_group()
        _send(conn, ("ok", result, time.time()))
        code = 0
    except BaseException as e:  # report every failure, including SystemExit from user code
        tb = traceback.format_exc()
        sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in tb.splitlines()))
        sys.stderr.flush()
        try:
            _send(conn, ("error", f"{type(e).__name__}: {e}", time.time()))
        except Exception:  # the error itself may not pickle
            _send(conn, ("error", type(e).__name__, time.time()))
        code = 1
    conn.close()
    sys.stdout.flush()
    os._exit(code)  # skip atexit handlers inherited through fork


def _collect(pending: set, conns: list, procs: list, results: dict, failures: list,
             timeout: float | None) -> None:
    """Wait up to `timeout` for ranks to report; move them from `pending` to results/failures."""
    ready = wait([conns[r] for r in pending] + [procs[r].sentinel for r in pending], timeout)
    for r in sorted(pending):
        if conns[r] not in ready and procs[r].sentinel not in ready:
            continue
        pending.discard(r)
        try:
            status, payload, when = pickle.loads(conns[r].recv_bytes())
        except EOFError:
            procs[r].join()
            failures.append((0.0, r, _describe_exit(procs[r].exitcode)))
            continue
        if status == "error":
            failures.append((when, r, f"raised {payload}"))
        else:
            results[r] = payload


def _stop(procs: list) -> None:
    """SIGTERM every live rank (5 s to finish), SIGKILL the rest; a stopped rank (SIGSTOP) cannot
    act on SIGTERM, so it is SIGKILLed at once."""
    for p in procs:
        if p.is_alive() and _stopped(p.pid):
            p.kill()
        elif p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False


def _forward_signals(procs: list) -> dict:
    """While local ranks run, SIGTERM / SIGUSR1 sent to the launcher go to every rank."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def forward(signum, frame):
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signum)

    return {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}


def run_ranks(fn: Callable, nproc: int, args: tuple = (), *, start_method: str = "fork",
              threads: int = 1, backend: str | None = "gloo", timeout_s: float | None = None,
              master_port: int = 0, collective_timeout_s: int = 600,
              watchdog: Callable[[], tuple[int, str] | None] | None = None) -> list:
    """Run fn(*args) on `nproc` local ranks; return their results in rank order.

    backend: process-group backend to initialise in each rank (None: fn does it itself).
    watchdog: called about every second while ranks run; a (rank, reason) it returns fails the
    job as that rank's failure (a stall).
    Raises RankFailure for the first rank that fails or, after timeout_s, for a rank still running.
    Every rank is SIGKILLed by the kernel if this process dies (`die_with_parent`).
    """
    if start_method == "fork" and device.initialized():
        raise RuntimeError("CUDA is initialised in this process, so ranks forked from it cannot "
                           "use CUDA; start them with start_method='spawn' "
                           "(launch.start_method=auto does on CUDA)")
    ctx = mp.get_context(start_method)
    port = master_port or free_port()
    procs, conns = [], []
    for rank in range(nproc):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, name=f"lctrain-rank{rank}",
                        args=(fn, args, rank, nproc, port, threads, backend,
                              collective_timeout_s, child, os.getpid()))
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    results: dict[int, object] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    previous = _forward_signals(procs)
    try:
        pending = set(range(nproc))
        failures: list[tuple[float, int, str]] = []  # (when, rank, reason)
        while pending and not failures:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise RankFailure(min(pending), f"still running after the {timeout_s:g} s timeout")
            if watchdog is not None:
                left = WATCH_INTERVAL_S if left is None else min(left, WATCH_INTERVAL_S)
            _collect(pending, conns, procs, results, failures, left)
            stalled = watchdog() if watchdog is not None and not failures else None
            if stalled is not None:
                raise RankFailure(*stalled)
        if failures:
            # Peers of a dead rank fail right after it (connection closed): give them a moment,
            # then blame the earliest failure; a rank that died without a word comes first.
            # (A peer's report can arrive before the dead rank's pipe is seen closed: its exit
            # closes the sockets first. So the whole moment is waited, not the first event.)
            grace = time.monotonic() + 1.0
            while pending and (left := grace - time.monotonic()) > 0:
                _collect(pending, conns, procs, results, failures, left)
            raise RankFailure(*min(failures)[1:])
    except BaseException:
        _stop(procs)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for p in procs:
        p.join()
    return [results[r] for r in range(nproc)]
