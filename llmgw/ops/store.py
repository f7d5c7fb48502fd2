"""Where the store is, and a client for it: what the operations tools, the benchmarks and the chaos
table share to read the ledger, the revisions and the decision log."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


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


def store_url(args: argparse.Namespace, config_url: str | None) -> str | None:
    if args.store_url:
        return str(args.store_url)
    if config_url:
        return config_url
    up = Path(args.state_dir) / "up.json"
    if up.exists():
        url: str | None = json.loads(up.read_text()).get("store_url")
        return url
    return None
