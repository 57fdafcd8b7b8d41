"""A Redis Sentinel set on this machine, for tests of failover.

Two data servers, a master and a replica (``redis-server``, the replica started with
``--replicaof``), and three sentinels (``redis-server <conf> --sentinel``) that monitor the
master under a name of the set's own (``wh-<random>``) with a quorum of 2. Every process
listens on 127.0.0.1 on a free port of its own, with its config, log and data files under
the set's base directory, so nothing is shared with the Redis the rest of the suite uses
(port 6379 is never touched). A process is killed with SIGKILL of its whole process group,
as a machine that loses power would lose it, and is started again with the same command a
supervisor would run: a killed master comes back a master of its own, and the sentinels
turn it into a replica of the new master (``+convert-to-slave``) some 10 s later, once it
has reported that role for 8 s, at their next INFO of it.

No server persists anything (``--save "" --appendonly no``): a killed server comes back
empty. That is safe here only because a test restarts a killed master after the failover;
restarted before the sentinels saw it down, it would be an empty master again and its
replica would copy the emptiness. Until the sentinels convert it, a restarted master takes
writes from a client that connects to it directly, and loses them at its first sync.

Sentinel times are short: a master is down after 1 s without a reply, a failover that
stalls is retried after 10 s (twice ``failover-timeout``), so failover takes a few seconds,
and rarely (when two sentinels split the vote) some 12 s. A sentinel whose timer runs more
than 2 s late (a machine overloaded or paused) enters TILT mode and acts on nothing for
30 s.

Celery and kombu take the set as ``urls()`` with
``broker_transport_options = {"master_name": sentinel_set.master_name}``.

By hand::

    python -m tests.redis_sentinel /tmp/sentinel    # starts the set, prints the URLs,
                                                    # stops it on Enter
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .servers import HOST, free_port, kill_group

#: The binary for every process, data server or sentinel.
REDIS_SERVER = os.environ.get("WH_TEST_REDIS_SERVER", "redis-server")
QUORUM = 2
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000
#: How long a wait sleeps between two looks.
POLL = 0.05

Address = tuple[str, int]
T = TypeVar("T")


def server_version() -> tuple[int, ...] | None:
    """``redis-server --version``'s version (e.g. (7, 0, 15)), None without a binary."""
    binary = shutil.which(REDIS_SERVER)
    if binary is None:
        return None
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    found = re.search(r"\bv=(\d+)\.(\d+)\.(\d+)", done.stdout)
    return tuple(int(part) for part in found.groups()) if found else None


def available() -> str | None:
    """Why a Sentinel set cannot be started here, or None."""
    binary = shutil.which(REDIS_SERVER)
    if binary is None:
        return f"{REDIS_SERVER} is not installed (not on PATH)"
    version = server_version()
    if version is None:
        return f"{binary} --version names no version"
    if version < (5, 0):
        return (f"{binary} is Redis {'.'.join(map(str, version))}; "
                "SENTINEL REPLICAS needs 5.0 or later")
    return None


def client(port: int, timeout: float = 1.0) -> redis.Redis:
    """A client of one process of the set that fails at once (no retries) when it is down."""
    return redis.Redis(HOST, port, socket_timeout=timeout, socket_connect_timeout=timeout,
                       decode_responses=True, retry=Retry(NoBackoff(), 0))


def _quote(value: str) -> str:
    """A string as redis.conf reads it."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _fields(item: dict[str, str] | list[str]) -> dict[str, str]:
    """One entry of ``SENTINEL REPLICAS`` or ``SENTINEL SENTINELS``: the wire's
    ``[k1, v1, k2, v2…]``, which redis-py 8 already hands over as a dict."""
    if isinstance(item, dict):
        return {str(key): str(value) for key, value in item.items()}
    return dict(zip(item[::2], item[1::2], strict=True))


@dataclass
class Instance:
    """One ``redis-server`` process: a data server or a sentinel."""
    kind: str                 # "server" or "sentinel"
    index: int
    port: int
    directory: Path
    argv: list[str] = field(default_factory=list)
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return f"{self.kind}{self.index}"

    @property
    def address(self) -> Address:
        return (HOST, self.port)

    @property
    def conf(self) -> Path:
        return self.directory / f"{self.kind}.conf"

    @property
    def log(self) -> Path:
        return self.directory / f"{self.kind}.log"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class SentinelSet:
    def __init__(self, base: Path) -> None:
        self.base = base.resolve()
        self.base.mkdir(parents=True, exist_ok=True)
        self.master_name = f"wh-{secrets.token_hex(4)}"
        ports: list[int] = []
        for _ in range(5):
            ports.append(free_port(taken=ports))
        self.servers = [Instance("server", i, ports[i], self.base / f"server{i}")
                        for i in range(2)]
        self.sentinels = [Instance("sentinel", i, ports[2 + i], self.base / f"sentinel{i}")
                          for i in range(3)]
        #: One client per process, kept: a new connection for every look would use up
        #: ephemeral ports (TIME_WAIT) at the rate of the polls.
        self._clients: dict[int, redis.Redis] = {}
        version = server_version() or (0,)
        # Redis 6.2 and later name the config file in the process title, so ``ps`` shows
        # which set a process belongs to (it would otherwise read "redis-server 127.0.0.1:p").
        title = ('proc-title-template "{title} {listen-addr} {server-mode} {config-file}"\n'
                 if version >= (6, 2) else "")
        first = self.servers[0]
        for server in self.servers:
            server.directory.mkdir(parents=True, exist_ok=True)
            # A replica's full sync waits repl-diskless-sync-delay (5 s) for other replicas
            # to join it; there are none to wait for.
            server.conf.write_text(self._common(server) + title
                                   + "repl-diskless-sync-delay 0\n")
            server.argv = [REDIS_SERVER, str(server.conf), "--save", "", "--appendonly", "no"]
            if server is not first:
                server.argv += ["--replicaof", HOST, str(first.port)]
        for sentinel in self.sentinels:
            # A sentinel rewrites its config file (what it learns: replicas, other sentinels,
            # the epoch), so the file is its own and a restart starts from what it knew.
            sentinel.directory.mkdir(parents=True, exist_ok=True)
            name = self.master_name
            sentinel.conf.write_text(
                self._common(sentinel) + title
                + f"sentinel monitor {name} {HOST} {first.port} {QUORUM}\n"
                f"sentinel down-after-milliseconds {name} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {name} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {name} 1\n")
            sentinel.argv = [REDIS_SERVER, str(sentinel.conf), "--sentinel"]
        self.killed_at: float | None = None
        self.killed_master: Address | None = None

    @staticmethod
    def _common(instance: Instance) -> str:
        return (f"port {instance.port}\nbind {HOST}\ndaemonize no\n"
                f"dir {_quote(str(instance.directory))}\nlogfile {_quote(str(instance.log))}\n")

    # ------------------------------------------------------------------ processes
    def start(self, instance: Instance, timeout: float = 30) -> None:
        """Start one process (again) and wait until it answers PING."""
        assert not instance.alive, f"{instance.name} is already running"
        with open(instance.directory / "stdout.log", "ab") as out:
            instance.process = subprocess.Popen(
                instance.argv, cwd=instance.directory, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True)
        self._wait(f"{instance.name} on port {instance.port} to answer PING",
                   lambda: self._ask(instance.port, lambda r: r.ping()), timeout, [instance])

    def kill(self, instance: Instance) -> None:
        """SIGKILL the process's whole group: it gets no word in."""
        assert instance.process is not None
        kill_group(instance.process)

    def up(self, timeout: float = 60) -> SentinelSet:
        """Start the master, the replica (until it is in sync), then the sentinels, until
        every sentinel knows the master, the replica and the other two sentinels."""
        master, replica = self.servers
        for server in self.servers:
            self.start(server)
        self._wait(f"{replica.name} to sync from {master.name}",
                   lambda: self._replica_of(replica, master.port), timeout, self.servers)
        for sentinel in self.sentinels:
            self.start(sentinel)
        self.settle(timeout)
        return self

    def down(self) -> None:
        """SIGKILL every process still running."""
        for instance in [*self.sentinels, *self.servers]:
            if instance.process is not None and instance.alive:
                self.kill(instance)
        for r in self._clients.values():
            r.close()
        self._clients.clear()

    def __enter__(self) -> SentinelSet:
        return self.up()

    def __exit__(self, *exc_info: object) -> None:
        self.down()

    # ------------------------------------------------------------------ failover
    def master(self) -> Address:
        """The master's address as the running sentinels report it now (most of them, if
        they do not agree yet)."""
        answers = Counter(a for a in self._master_answers().values() if a is not None)
        if not answers:
            raise RuntimeError(f"no sentinel names a master for {self.master_name}:\n"
                               + self.tails(self.sentinels))
        return answers.most_common(1)[0][0]

    def server_at(self, address: Address) -> Instance:
        return next(server for server in self.servers if server.address == address)

    def kill_master(self) -> float:
        """SIGKILL the server the sentinels call the master; when (time.monotonic())."""
        address = self.master()
        victim = self.server_at(address)
        assert victim.process is not None and victim.alive, f"{victim.name} is not running"
        kill_group(victim.process)
        self.killed_at = time.monotonic()
        self.killed_master = address
        return self.killed_at

    def wait_failover(self, timeout: float = 30) -> float:
        """Wait until a quorum of sentinels name a master other than the one kill_master()
        killed and that server says it is a master (ROLE); the seconds since the kill."""
        assert self.killed_at is not None and self.killed_master is not None, \
            "wait_failover() follows kill_master()"
        old = self.killed_master

        def promoted() -> Address | None:
            answers = Counter(a for a in self._master_answers().values()
                              if a is not None and a != old)
            for address, count in answers.most_common():
                if count >= QUORUM and self._role(address[1]) == "master":
                    return address
            return None
        self._wait(f"the sentinels to fail over from {old[0]}:{old[1]}", promoted, timeout,
                   [s for s in self.sentinels if s.alive])
        return time.monotonic() - self.killed_at

    def restart(self, server: Instance, timeout: float = 60) -> float:
        """Start a killed data server again with its command, and wait until it is a replica
        in sync with the master the sentinels name (they reconfigure it); the seconds that
        took from the start."""
        started = time.monotonic()
        self.start(server)
        self._wait(f"{server.name} to come back as a replica of the master",
                   lambda: self._replica_of(server, self.master()[1]), timeout, [server])
        return time.monotonic() - started

    def kill_sentinel(self, i: int) -> None:
        self.kill(self.sentinels[i])

    def start_sentinel(self, i: int, timeout: float = 30) -> None:
        """Start a killed sentinel again from its (rewritten) config; see settle()."""
        self.start(self.sentinels[i], timeout)

    def settle(self, timeout: float = 60) -> None:
        """Wait until every running sentinel names the same master, sees every other running
        server as its replica with its link up, and knows every other running sentinel."""
        self._wait("every sentinel to know the master, its replicas and the other sentinels",
                   self._settled, timeout, [s for s in self.sentinels if s.alive])

    # ------------------------------------------------------------------ what it says
    def urls(self, db: int = 0) -> str:
        """Celery's (kombu's) form: ``sentinel://127.0.0.1:p1/0;sentinel://…;…``."""
        return ";".join(f"sentinel://{HOST}:{s.port}/{db}" for s in self.sentinels)

    def tail(self, instance: Instance, chars: int = 1500) -> str:
        parts = []
        for path in (instance.log, instance.directory / "stdout.log"):
            if path.exists():
                text = path.read_text(errors="replace")[-chars:]
                if text.strip():
                    parts.append(f"--- {instance.name} {path.name}\n{text}")
        return "\n".join(parts)

    def tails(self, instances: Iterable[Instance] | None = None) -> str:
        chosen = [*self.servers, *self.sentinels] if instances is None else instances
        return "\n".join(self.tail(instance) for instance in chosen)

    # ------------------------------------------------------------------ helpers
    def _ask(self, port: int, question: Callable[[redis.Redis], T]) -> T | None:
        """One question to one process; None when it is down or cannot answer now (the
        client reconnects at the next question)."""
        if port not in self._clients:
            self._clients[port] = client(port)
        try:
            return question(self._clients[port])
        except redis.RedisError:
            return None

    def _master_answers(self) -> dict[str, Address | None]:
        """Each running sentinel's ``SENTINEL GET-MASTER-ADDR-BY-NAME``."""
        def ask(r: redis.Redis) -> Address | None:
            reply = r.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.master_name)
            return (reply[0], int(reply[1])) if reply else None
        return {s.name: self._ask(s.port, ask) for s in self.sentinels if s.alive}

    def _role(self, port: int) -> str | None:
        reply = self._ask(port, lambda r: r.execute_command("ROLE"))
        return reply[0] if reply else None

    def _replica_of(self, server: Instance, master_port: int) -> bool:
        """The server is a replica of the master on ``master_port``, its link up and its
        first sync done (``INFO replication``)."""
        info = self._ask(server.port, lambda r: r.info("replication"))
        return bool(info and info.get("role") == "slave"
                    and int(info.get("master_port", 0)) == master_port
                    and info.get("master_link_status") == "up"
                    and not int(info.get("master_sync_in_progress", 0)))

    def _settled(self) -> bool:
        running = [s for s in self.sentinels if s.alive]
        answers = self._master_answers()
        if not running or len(set(answers.values())) != 1 or None in answers.values():
            return False
        master = next(iter(answers.values()))
        assert master is not None
        if self._role(master[1]) != "master":
            return False
        replicas = {s.port for s in self.servers if s.alive and s.address != master}
        for sentinel in running:
            seen = self._ask(sentinel.port, lambda r: (
                [_fields(x) for x in r.execute_command("SENTINEL", "REPLICAS", self.master_name)],
                [_fields(x) for x in r.execute_command("SENTINEL", "SENTINELS",
                                                      self.master_name)]))
            if seen is None:
                return False
            known_replicas, known_sentinels = seen
            healthy = {int(x["port"]) for x in known_replicas
                       if x.get("master-link-status") == "ok"
                       and not {"s_down", "o_down", "disconnected"} & set(x["flags"].split(","))
                       and int(x.get("master-port", 0)) == master[1]}
            if not replicas <= healthy:
                return False
            others = {s.port for s in running if s is not sentinel}
            heard = {int(x["port"]) for x in known_sentinels
                     if not {"s_down", "disconnected"} & set(x["flags"].split(","))}
            if not others <= heard:
                return False
        return True

    def _wait(self, what: str, condition: Callable[[], T | None], timeout: float,
              watch: Iterable[Instance] = ()) -> T:
        """Poll ``condition`` until it is truthy; fail naming ``what`` (with the logs) after
        ``timeout`` s, or as soon as a process in ``watch`` exits."""
        watch = list(watch)
        deadline = time.monotonic() + timeout
        while True:
            for instance in watch:
                if not instance.alive:
                    raise RuntimeError(f"{instance.name} exited while waiting for {what}:\n"
                                       + self.tail(instance))
            value = condition()
            if value:
                return value
            if time.monotonic() >= deadline:
                raise RuntimeError(f"timed out after {timeout} s waiting for {what}:\n"
                                   + self.tails())
            time.sleep(POLL)


def main() -> None:
    base = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/workhorse-sentinel")
    why = available()
    if why:
        sys.exit(f"cannot start a Sentinel set: {why}")
    sentinels = SentinelSet(base)
    try:
        sentinels.up()
        host, port = sentinels.master()
        print(f"master {host}:{port}, replica and 3 sentinels up")
        print(f"broker_url = {sentinels.urls()!r}")
        print(f"broker_transport_options = {{'master_name': {sentinels.master_name!r}}}")
        input("Enter stops the set. ")
    finally:
        sentinels.down()


if __name__ == "__main__":
    main()
