"""What several `llmgw` commands share."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from extproc.config import ConfigError, Snapshot, load_snapshot


def snapshot_or_report(directory: str | Path) -> Snapshot | None:
    """The policy directory's snapshot, or None after printing every problem with file and field."""
    try:
        return load_snapshot(directory)
    except ConfigError as e:
        print(f"error: invalid configuration\n{e}", file=sys.stderr)
        return None


def store_client(url: str) -> Any:
    """A client for the store at `url` (redis-py, strings decoded): a node of a Valkey/Redis Cluster
    (it says so in INFO cluster) gets a cluster client, which finds the node of each key."""
    import redis

    client = redis.Redis.from_url(url, decode_responses=True, socket_timeout=5)
    try:
        clustered = client.info("cluster").get("cluster_enabled") == 1
    except redis.RedisError:
        return client  # unreachable now: its commands will say so
    if not clustered:
        return client
    client.close()
    return redis.RedisCluster.from_url(url, decode_responses=True, socket_timeout=5)
