"""A real ``redis-server`` (Debian's package; ``.ci/run`` installs it) on a free port, for the fleet tests and
``scripts/bench_fleet.py``; and a real Redis Cluster of them, joined by ``redis-cli --cluster create`` (Debian's
redis-tools, which redis-server depends on).

No persistence, bound to loopback, its own directory. :meth:`RedisServer.kill` and :meth:`RedisServer.start` on the
same port let a test take Redis away mid-run and bring it back; :meth:`RedisCluster.kill_primary_of` takes one
primary of a cluster away, and :meth:`RedisCluster.wait_ok` waits for the cluster to have failed over.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from edgecache.bench.harness import free_port


class PortTaken(RuntimeError):
    """redis-server exited at start: most likely another process took the free port it was given."""


class RedisServer:
    """One redis-server; with ``cluster_node_timeout_ms``, a cluster node (not yet in a cluster: see
    :class:`RedisCluster`), its bus on a second free port (the default, port + 10000, may be taken or past 65535)."""

    def __init__(self, directory: Path, *, cluster_node_timeout_ms: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server; .ci/run does this)")
        self.binary = binary
        self.directory = directory
        self.cluster_node_timeout_ms = cluster_node_timeout_ms
        self._pick_ports()
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = False  # once started, a restart keeps its port (the tests bring Redis back where it was)

    def _pick_ports(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.cluster_args: list[str] = []
        if self.cluster_node_timeout_ms is not None:
            self.cluster_args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                 "--cluster-port", str(free_port()),
                                 "--cluster-node-timeout", str(self.cluster_node_timeout_ms),
                                 # A replica syncs at once (not after 5 s), and may take over however old its data.
                                 "--repl-diskless-sync-delay", "0", "--cluster-replica-validity-factor", "0"]

    def start(self) -> RedisServer:
        """Start it; a first start whose free ports another process took meanwhile tries new ones."""
        for _ in range(4):
            try:
                return self._start()
            except PortTaken:
                if self.started:
                    raise
                self._pick_ports()
        return self._start()

    def _start(self) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.directory), "--protected-mode", "no", *self.cluster_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 20
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise PortTaken(f"redis-server exited at start (port {self.port} taken?)")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        self.started = True
                        return self
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def flushall(self) -> None:
        self.command("FLUSHALL")
        self.command("SCRIPT", "FLUSH")

    def fresh(self) -> str:
        """Running (started again if a test left it down) and empty; its URL."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self.flushall()
        return self.url

    def command(self, *args: str) -> Any:
        """One command, its reply decoded (bytes as str; an error reply raised)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as conn:
            conn.sendall(f"*{len(args)}\r\n".encode() + b"".join(
                f"${len(a.encode())}\r\n".encode() + a.encode() + b"\r\n" for a in args))
            return _reply(conn.makefile("rb"))


def _reply(stream: Any) -> Any:
    line = stream.readline().rstrip(b"\r\n")
    kind, rest = line[:1], line[1:].decode()
    if kind == b"+":
        return rest
    if kind == b"-":
        raise RuntimeError(f"redis: {rest}")
    if kind == b":":
        return int(rest)
    if kind == b"$":
        return None if rest == "-1" else stream.read(int(rest) + 2)[:-2].decode()
    if kind == b"*":
        return None if rest == "-1" else [_reply(stream) for _ in range(int(rest))]
    raise RuntimeError(f"redis: an unreadable reply {line!r}")


class RedisCluster:
    """A Redis Cluster of ``primaries`` primaries with ``replicas`` replicas each, every node a
    :class:`RedisServer` on free ports, joined by ``redis-cli --cluster create``. ``url`` names one node, as a
    fleet is told. A short ``cluster-node-timeout`` lets a replica take over from a killed primary in seconds."""

    def __init__(self, directory: Path, *, primaries: int = 3, replicas: int = 0,
                 node_timeout_ms: int = 1000) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed (Debian's redis-tools, a dependency of redis-server)")
        self.cli = cli
        self.replicas = replicas
        self.nodes = [RedisServer(directory / f"node{i}", cluster_node_timeout_ms=node_timeout_ms)
                      for i in range(primaries * (1 + replicas))]
        self.primaries = primaries

    @property
    def url(self) -> str:
        """The URL of one node (a node's ports are settled once it has started)."""
        return self.nodes[0].url

    def start(self) -> RedisCluster:
        for node in self.nodes:
            node.start()
        subprocess.run([self.cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                        "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                       check=True, capture_output=True, timeout=120)
        self.wait_ok()
        return self

    def wait_ok(self, patience_s: float = 120.0) -> None:
        """Until every live node says the cluster is ok and sees ``primaries`` live primaries covering every
        slot: after a start, or after a primary was killed, once a replica has taken its place."""
        deadline = time.monotonic() + patience_s
        while time.monotonic() < deadline:
            try:
                if all(self._ok(node) for node in self.nodes if node.alive):
                    return
            except (OSError, RuntimeError):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"the cluster was not ok within {patience_s:g} s")

    def _ok(self, node: RedisServer) -> bool:
        """``node`` says the cluster is ok, the primaries it knows of with slots are all alive, and (a replica)
        it is in sync with its primary."""
        if "cluster_state:ok" not in node.command("CLUSTER", "INFO"):
            return False
        replication = node.command("INFO", "replication")
        if "role:slave" in replication and "master_link_status:up" not in replication:
            return False
        alive = {n.port for n in self.nodes if n.alive}
        lines = [line.split() for line in node.command("CLUSTER", "NODES").splitlines()]
        serving = [int(f[1].split("@")[0].rsplit(":", 1)[1]) for f in lines if "master" in f[2] and len(f) > 8]
        return len(serving) == self.primaries and set(serving) <= alive

    def primary_of(self, key: str) -> RedisServer:
        """The live node that holds ``key``'s slot as primary."""
        node = next(n for n in self.nodes if n.alive)
        slot = int(node.command("CLUSTER", "KEYSLOT", key))
        for fields in (line.split() for line in node.command("CLUSTER", "NODES").splitlines()):
            if "master" not in fields[2] or "fail" in fields[2]:
                continue
            for part in fields[8:]:
                low, _, high = part.partition("-")
                if part[0] != "[" and int(low) <= slot <= int(high or low):
                    port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
                    return next(n for n in self.nodes if n.port == port)
        raise RuntimeError(f"no primary holds slot {slot}")

    def kill_primary_of(self, key: str) -> RedisServer:
        """Kill the primary holding ``key``'s slot (SIGKILL: what it had not replicated is lost)."""
        primary = self.primary_of(key)
        primary.kill()
        return primary

    def flushall(self) -> None:
        for node in self.nodes:
            if node.alive and "role:master" in node.command("INFO", "replication"):
                node.flushall()

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()
