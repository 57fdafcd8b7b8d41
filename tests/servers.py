"""What the suite's own servers share (tests/rabbitmq_cluster.py, tests/redis_sentinel.py):
free ports that stay free, and a SIGKILL of a server's whole process group."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
from collections.abc import Iterable
from pathlib import Path

HOST = "127.0.0.1"
#: Ports never taken, even if free: the shared servers' defaults (Redis, Sentinel, AMQP).
RESERVED_PORTS = frozenset({6379, 26379, 5672})


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return (32768, 60999)
    return (low, high)


def free_port(taken: Iterable[int] = ()) -> int:
    """A port free now, below the kernel's ephemeral range when there is room: a port in that
    range that is free now may be the source port of an outgoing connection (the servers'
    and the tests' own, many of them) by the time its server binds it."""
    low, _ = _ephemeral_ports()
    ports = range(20000, low) if low - 20000 >= 1000 else None
    avoid = RESERVED_PORTS | set(taken)
    for _ in range(200):
        with socket.socket() as s:
            try:
                s.bind((HOST, random.choice(ports) if ports else 0))
            except OSError:
                continue
            port = int(s.getsockname()[1])
        if port not in avoid:
            return port
    raise RuntimeError(f"no free port on {HOST}")


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process's whole group (started with start_new_session): no word in."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(30)
