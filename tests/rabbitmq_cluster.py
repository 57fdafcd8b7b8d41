"""A RabbitMQ cluster of three nodes on this machine, for tests of failover.

Each node is a ``rabbitmq-server`` of its own: its own node name, AMQP and distribution
ports, data and log directories, and an Erlang cookie of the cluster's own (in a HOME of
its own), so nothing is shared with the RabbitMQ the rest of the suite uses (its node,
port 5672 and cookie are never touched). Nodes 2 and 3 join node 1 with ``join_cluster``.
A node is killed with SIGKILL of its whole process group (the Erlang VM and its helpers),
as a machine that loses power would lose it, and can be started again (it rejoins).

By hand::

    python -m tests.rabbitmq_cluster /tmp/cluster    # starts three nodes, prints the URL,
                                                     # stops them on Enter
"""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .servers import free_port, kill_group

#: The scripts themselves: /usr/sbin's wrappers switch to the rabbitmq user, whose HOME
#: (and cookie) is the shared node's.
RABBITMQ_BIN = Path(os.environ.get("WH_TEST_RABBITMQ_BIN", "/usr/lib/rabbitmq/bin"))


def available() -> str | None:
    """Why a cluster cannot be started here, or None."""
    for script in ("rabbitmq-server", "rabbitmqctl"):
        if not (RABBITMQ_BIN / script).exists():
            return f"{RABBITMQ_BIN / script} is not installed"
    if shutil.which("erl") is None:
        return "Erlang (erl) is not installed"
    return None


@dataclass
class Node:
    index: int
    name: str                 # e.g. whc1-3f2a@localhost
    port: int                 # AMQP
    dist_port: int            # Erlang distribution
    directory: Path
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class Cluster:
    def __init__(self, base: Path, size: int = 3) -> None:
        self.base = base
        self.home = base / "home"
        self.home.mkdir(parents=True, exist_ok=True)
        cookie = self.home / ".erlang.cookie"
        cookie.write_text(secrets.token_hex(16).upper())
        cookie.chmod(0o400)
        (base / "enabled_plugins").write_text("[].\n")
        # The machine's rabbitmq-env.conf names the shared node; this file takes its place.
        (base / "rabbitmq-env.conf").write_text(
            'ERL_EPMD_ADDRESS=127.0.0.1\n'
            'export ERL_FLAGS="-kernel inet_dist_use_interface {127,0,0,1}"\n')
        tag = secrets.token_hex(3)
        ports: list[int] = []
        for _ in range(2 * size):
            ports.append(free_port(taken=ports))
        self.nodes = [Node(i, f"whc{i}-{tag}@localhost", ports[2 * i], ports[2 * i + 1],
                           base / f"node{i}") for i in range(size)]

    # ------------------------------------------------------------------ the nodes
    def env(self, node: Node) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RABBITMQ_", "ERL_", "WORKHORSE_"))}
        node.directory.mkdir(parents=True, exist_ok=True)
        config = node.directory / "rabbitmq.conf"
        config.write_text(f"listeners.tcp.1 = 127.0.0.1:{node.port}\n"
                          "log.console = false\nlog.file.level = info\n")
        env.update({
            "HOME": str(self.home),
            "RABBITMQ_CONF_ENV_FILE": str(self.base / "rabbitmq-env.conf"),
            "RABBITMQ_NODENAME": node.name,
            "RABBITMQ_DIST_PORT": str(node.dist_port),
            "RABBITMQ_CONFIG_FILE": str(config),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(node.directory / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.base / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(node.directory / "mnesia"),
            "RABBITMQ_LOG_BASE": str(node.directory / "log"),
            "RABBITMQ_PID_FILE": str(node.directory / "pid"),
        })
        return env

    def start(self, node: Node) -> None:
        log = open(node.directory / "server.out", "ab") if node.directory.exists() else None
        if log is None:
            node.directory.mkdir(parents=True)
            log = open(node.directory / "server.out", "ab")
        with log:
            node.process = subprocess.Popen(
                [str(RABBITMQ_BIN / "rabbitmq-server")], env=self.env(node), cwd=self.base,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)

    def ctl(self, node: Node, *args: str, timeout: float = 120,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([str(RABBITMQ_BIN / "rabbitmqctl"), "-n", node.name, *args],
                              env=self.env(node), cwd=self.base, capture_output=True,
                              text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"rabbitmqctl -n {node.name} {' '.join(args)}: "
                               f"{done.stdout}{done.stderr}\n{self.tail(node)}")
        return done

    def await_startup(self, node: Node, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if not node.alive:
                raise RuntimeError(f"node {node.name} exited while starting:\n"
                                   f"{self.tail(node)}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"node {node.name} not up after {timeout} s:\n"
                                   f"{self.tail(node)}")
            done = self.ctl(node, "await_startup", "--timeout", str(int(max(left, 1))),
                            timeout=left + 10, check=False)
            if done.returncode == 0:
                return
            time.sleep(0.5)         # the node's distribution is not listening yet

    def tail(self, node: Node, chars: int = 3000) -> str:
        parts = []
        for path in [node.directory / "server.out",
                     *sorted((node.directory / "log").glob("*.log"))]:
            if path.exists():
                parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    def up(self) -> Cluster:
        """Start every node and join the others to the first."""
        for node in self.nodes:
            self.start(node)
        for node in self.nodes:
            self.await_startup(node)
        first = self.nodes[0]
        for node in self.nodes[1:]:
            self.ctl(node, "stop_app")
            self.ctl(node, "join_cluster", first.name)
            self.ctl(node, "start_app")
        self.ctl(first, "await_online_nodes", str(len(self.nodes)))
        return self

    def kill(self, node: Node) -> None:
        """SIGKILL the node's whole process group: the VM gets no word in."""
        assert node.process is not None
        kill_group(node.process)

    def restart(self, node: Node) -> None:
        """Start a killed node again; it rejoins the cluster from its data directory."""
        self.start(node)
        self.await_startup(node)

    def heal(self) -> None:
        """Every node up again (those a test killed restarted)."""
        for node in self.nodes:
            if not node.alive:
                self.restart(node)
        self.ctl(self.nodes[0], "await_online_nodes", str(len(self.nodes)))

    def down(self) -> None:
        for node in self.nodes:
            if node.process is not None and node.alive:
                self.kill(node)

    # ------------------------------------------------------------------ what it says
    @property
    def url(self) -> str:
        """The failover form of URL with every node: kombu's ``amqp://h1;amqp://h2``."""
        return ";".join(node.url for node in self.nodes)

    def node_named(self, name: str) -> Node:
        return next(node for node in self.nodes if node.name == name)

    def any_alive(self) -> Node:
        return next(node for node in self.nodes if node.alive)

    def leader(self, queue: str) -> Node | None:
        """The node that leads a quorum queue now (None: not known or no leader)."""
        done = self.ctl(self.any_alive(), "-q", "list_queues", "name", "leader",
                        check=False, timeout=60)
        for line in done.stdout.splitlines():
            name, _, leader = line.partition("\t")
            if name == queue and leader.strip() in {n.name for n in self.nodes}:
                return self.node_named(leader.strip())
        return None

    def connected_node(self, port: int) -> Node:
        return next(node for node in self.nodes if node.port == port)


def main() -> None:
    base = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/workhorse-cluster")
    why = available()
    if why:
        sys.exit(f"cannot start a cluster: {why}")
    cluster = Cluster(base)
    try:
        cluster.up()
        print(f"3 nodes up; broker_url = {cluster.url!r}")
        print(f"rabbitmqctl: HOME={cluster.home} {RABBITMQ_BIN}/rabbitmqctl -n "
              f"{cluster.nodes[0].name} cluster_status")
        input("Enter stops the cluster. ")
    finally:
        cluster.down()


if __name__ == "__main__":
    main()
