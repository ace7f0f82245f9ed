"""The local launcher: results in rank order; a failing, exiting or killed rank is named and the
others are stopped instead of hanging in a collective; a timeout is enforced."""

import os
import random
import signal
import socket
import time

import pytest
import torch
import torch.distributed as dist

from lctrain.parallel import launch
from lctrain.parallel.launch import RankFailure, env_from_environment, run_ranks


def _sum_ranks():
    x = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(x)
    return int(x.item()), torch.get_num_threads(), os.environ["WORLD_SIZE"]


def _fail_on(rank_to_fail, how):
    if dist.get_rank() == rank_to_fail:
        if how == "raise":
            raise ValueError("boom")
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # the others wait for the dead rank: must not hang
    return "unreachable"


def _sleep():
    time.sleep(60)


def test_results_in_rank_order_one_thread_each():
    assert run_ranks(_sum_ranks, 3, timeout_s=60) == [(3, 1, "3")] * 3


@pytest.mark.parametrize("how,reason", [("raise", "raised ValueError: boom"),
                                         ("exit", "exited with code 3"),
                                         ("kill", "was killed by SIGKILL")])
def test_failed_rank_is_named_and_peers_stopped(how, reason):
    start = time.monotonic()
    with pytest.raises(RankFailure) as exc:
        run_ranks(_fail_on, 4, (2, how), timeout_s=60, collective_timeout_s=30)
    assert exc.value.rank == 2
    assert reason in str(exc.value)
    assert time.monotonic() - start < 20


def test_timeout_names_a_running_rank():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="still running after the 1 s timeout"):
        run_ranks(_sleep, 2, backend=None, timeout_s=1)
    assert time.monotonic() - start < 10


def test_environment_detection(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert env_from_environment() is None
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    with pytest.raises(RuntimeError, match="MASTER_ADDR, MASTER_PORT unset"):
        env_from_environment()
    monkeypatch.setenv("MASTER_ADDR", "node1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    env = env_from_environment()
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (3, 8, 1, "slurm")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert env_from_environment().rank == 5  # torchrun's variables win


def _wait_for_sigterm(ready_dir):
    """Ready once the handler is in; then the SIGTERM forwarded by the launcher must arrive."""
    from pathlib import Path

    got = []
    signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    (Path(ready_dir) / str(dist.get_rank())).touch()
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        signal.sigtimedwait([signal.SIGUSR2], 0.05)
    return bool(got)


def test_sigterm_to_the_launcher_reaches_every_rank(tmp_path):
    import threading

    def send_when_ready():
        while len(list(tmp_path.iterdir())) < 2:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=send_when_ready, daemon=True).start()
    assert run_ranks(_wait_for_sigterm, 2, (str(tmp_path),), timeout_s=60) == [True, True]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the launcher put it back


def test_rendezvous_ports_avoid_the_ephemeral_range_and_ports_in_use(monkeypatch):
    low, high = launch._ephemeral_ports()
    random.seed(0)
    first = launch.free_port()
    random.seed(0)  # two launchers seeded alike still draw different ports (the OS's randomness)
    ports = {first} | {launch.free_port() for _ in range(20)}
    assert len(ports) > 15 and not any(low <= p <= high for p in ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", first))
        busy.listen()
        monkeypatch.setattr(launch, "RENDEZVOUS_PORTS", (first, first + 2))
        assert launch.free_port() == first + 1  # the one in use is skipped
