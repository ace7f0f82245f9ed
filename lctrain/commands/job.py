"""What lctrain's batch script runs on a Slurm job's first node before torchrun: the rendezvous
address and port (`python -m lctrain.commands.job rendezvous HEAD_HOST`).

The port follows from the job id and its restart count, so jobs sharing a node never meet on
one port and a requeued job does not wait for its predecessor's socket to close. The address is
the head node's as the other nodes see it: MASTER_ADDR when the job's environment sets it
(slurm.env), else the head host name resolved here. A multi-node job whose head resolves to a
loopback address (a /etc/hosts line mapping the host name to 127.0.1.1 is common) would leave
every other node waiting for a rendezvous it cannot reach, so that is an error naming the fix.
Standard library only: it runs before the job imports torch.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys

PORT_BASE, PORT_SPAN = 15000, 15000
"""Ports 15000-29999: below Linux's ephemeral range (32768-60999), which outgoing connections
take from."""


def rendezvous_port(job_id: int, restarts: int) -> int:
    return PORT_BASE + (job_id * 7 + restarts) % PORT_SPAN


def head_address(head: str, nnodes: int, env_addr: str | None = None) -> str:
    """The address other nodes reach `head` at; raises ValueError when they cannot."""
    if env_addr:
        addr = env_addr
    else:
        try:
            addr = socket.getaddrinfo(head, None, socket.AF_INET)[0][4][0]
        except socket.gaierror as e:
            raise ValueError(f"the head node {head!r} does not resolve ({e}); set "
                             "+slurm.env.MASTER_ADDR=ADDRESS to an address every node "
                             "reaches") from e
    try:
        loopback = ipaddress.ip_address(addr).is_loopback
    except ValueError:  # a host name given as MASTER_ADDR
        loopback = addr in ("localhost", "localhost.localdomain")
    if loopback and nnodes > 1:
        raise ValueError(f"the head node {head!r} resolves to the loopback address {addr}, which "
                         f"the other {nnodes - 1} node(s) cannot reach; fix the host's "
                         "/etc/hosts entry, or set +slurm.env.MASTER_ADDR=ADDRESS (an "
                         "address of the head node on the cluster network)")
    return addr


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "rendezvous":
        print("usage: python -m lctrain.commands.job rendezvous HEAD_HOST", file=sys.stderr)
        return 2
    env = os.environ
    try:
        addr = head_address(argv[1], int(env.get("SLURM_NNODES", "1")), env.get("MASTER_ADDR"))
    except ValueError as e:
        print(f"lctrain: {e}", file=sys.stderr)
        return 2
    port = rendezvous_port(int(env.get("SLURM_JOB_ID", "0")),
                           int(env.get("SLURM_RESTART_COUNT", "0") or 0))
    print(addr, port)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
