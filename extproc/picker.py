"""Endpoint picker for an engine pool: one Envoy cluster, N vLLM engines.

Every engine's `/metrics` is scraped every `interval` (75 ms) while the gateway has traffic, and every
`idle_interval` (1 s) when it has had none for `active_for` (10 s): a reading older than `stale_after`
(2 s) does not count, so a dead or hung engine is never picked, and an idle gateway costs little. The
first pick after a quiet spell waits (briefly) for a round of scrapes made for it (`ensure_fresh`).
Candidates are scored with the Gateway
API Inference Extension's default weights - waiting queue (2), free KV cache (2), prefix affinity (3) -
plus running requests (1), each term in [0, 1] on absolute load (1 / (1 + queue)), and ordered best
first. Envoy's `override_host` policy takes
that order from the `envoy.lb` metadata and falls back to least-request when the list is empty.

Workers on one host share one scraper (`shared_dir`): the worker holding the directory's lock scrapes
and publishes the readings in a file the others read on the same schedule; a worker that picks marks
the directory active, so the scraper keeps the fast pace while any worker has traffic. When the
scraper's worker dies its lock is released and another worker takes over within one interval. A
worker that reads the file marks the directory too, and the scraper writes the file only while some
worker has marked it lately: the only worker on its host (a sidecar's) writes nothing nobody reads.

Prefix affinity is keyed by tenant: block hashes of the prompt chain from the tenant's cache salt, so
one tenant's traffic never steers towards blocks another tenant cached (invariant 10).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import logging
import math
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from extproc.metrics import count_pick

log = logging.getLogger("llmgw.picker")

WEIGHTS = {"queue": 2.0, "kv": 2.0, "prefix": 3.0, "running": 1.0}
AFFINITY_BLOCK_CHARS = 256  # prompt characters per affinity block
AFFINITY_ENTRIES = 100_000
IDLE_TICK_S = 0.25  # how often an idle picker checks whether the host has traffic again
FIRST_PICK_WAIT_S = 0.05  # the longest a pick waits for fresh readings after a quiet spell
PENDING_TAU_S = 0.025  # a pick not yet in metrics counts exp(-age / tau): likely still in flight
RESOLVED_FOR_S = 5.0  # how long an engine's name resolved to an address is used before resolving it again
MARK_EVERY_S = 0.5  # the most often a worker touches a mark in the shared directory, or a scraper reads one


@dataclass(frozen=True)
class EngineLoad:
    waiting: float
    running: float
    kv_usage: float
    at: float  # monotonic time of the scrape
    # Where the page was read: the engine's IP:port. Envoy's override_host matches a host by its address,
    # so an endpoint given by name (docker-compose's service names, a Kubernetes headless Service) is
    # picked by the address its name resolved to when it was read.
    address: str = ""


_WANTED = {"vllm:num_requests_waiting": "waiting", "vllm:num_requests_running": "running",
           "vllm:kv_cache_usage_perc": "kv_usage"}


def parse_load(text: str, at: float) -> EngineLoad:
    """Read the three gauges from a vLLM /metrics page (summed over label sets, e.g. engines)."""
    found = {"waiting": 0.0, "running": 0.0, "kv_usage": 0.0}
    seen = set()
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in _WANTED:
            continue
        try:
            found[_WANTED[name]] += float(line.rsplit(" ", 1)[1])
        except ValueError:
            continue
        seen.add(name)
    if len(seen) < len(_WANTED):
        raise ValueError(f"metrics page lacks {sorted(set(_WANTED) - seen)}")
    return EngineLoad(waiting=found["waiting"], running=found["running"], kv_usage=found["kv_usage"], at=at)


def is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def prompt_blocks(salt: str, messages: object) -> list[int]:
    """Chained hashes of the prompt in fixed-size character blocks, seeded with the tenant's salt."""
    text = repr(messages)
    out, prev = [], hash(("affinity", salt))
    for i in range(0, len(text) - AFFINITY_BLOCK_CHARS + 1, AFFINITY_BLOCK_CHARS):
        prev = hash((prev, text[i:i + AFFINITY_BLOCK_CHARS]))
        out.append(prev)
    return out


class Picker:
    def __init__(self, pools: Mapping[str, Iterable[str]], interval: float = 0.075, stale_after: float = 2.0,
                 idle_interval: float = 1.0, active_for: float = 10.0, shared_dir: Path | None = None):
        self.pools = {name: tuple(eps) for name, eps in pools.items()}
        self.interval, self.idle_interval, self.active_for = interval, idle_interval, active_for
        self.stale_after = stale_after
        self.loads: dict[str, EngineLoad] = {}
        self.scrapes = 0  # metrics pages fetched by this worker (GET /status reports it)
        self._affinity: OrderedDict[int, str] = OrderedDict()  # block hash -> endpoint
        self._picked_at: dict[str, list[float]] = {}  # picks per endpoint, newest last
        self._last_pick = 0.0
        self._read_at = 0.0  # when this worker last read the shared scraper's readings
        self._marked_active = 0.0  # when this worker last told the shared scraper it has traffic
        self._marked_reading = 0.0  # when this worker last told the shared scraper it reads its file
        self._readers_seen = (-math.inf, False)  # when the scraper last looked for readers, and its answer
        self._woken = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._refresh: asyncio.Future[None] | None = None  # a round started for a pick (ensure_fresh)
        self._session: aiohttp.ClientSession | None = None
        self._shared = shared_dir
        self._lock_fd: int | None = None
        self._resolved: dict[str, tuple[str, float]] = {}  # endpoint -> (IP:port, when resolved)

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0))
        if self._shared is not None:
            self._shared.mkdir(parents=True, exist_ok=True)
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._session is not None:
            await self._session.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock: another worker scrapes
            self._lock_fd = None

    def _active(self, now: float) -> bool:
        """Traffic within `active_for`: here, or (shared) at any worker on this host."""
        if now - self._last_pick < self.active_for:
            return True
        return self._shared is not None and self._mark_age("active") < self.active_for

    def _mark_age(self, name: str) -> float:
        """Seconds since a worker last touched the shared directory's mark `name` (infinite: never)."""
        assert self._shared is not None
        try:
            return time.time() - (self._shared / name).stat().st_mtime
        except OSError:
            return math.inf

    def _mark(self, name: str, last: float, now: float) -> float:
        """The shared directory's mark `name` touched, unless this worker did so within MARK_EVERY_S
        (`last`): when it was last touched."""
        assert self._shared is not None
        if now - last <= MARK_EVERY_S:
            return last
        with contextlib.suppress(OSError):
            (self._shared / name).touch()
        return now

    def _scraper(self) -> bool:
        """Whether this worker scrapes: always when not shared, else while it holds the lock."""
        if self._shared is None or self._lock_fd is not None:
            return True
        fd = os.open(self._shared / "scraper.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._lock_fd = fd
        log.info("this worker scrapes the engines' metrics for the workers on this host")
        return True

    async def _run(self) -> None:
        """A look, every `interval` (IDLE_TICK_S when idle), at whether a round is due: at the fast
        pace while this host has traffic (a shared scraper learns of another worker's within one
        tick), else once every `idle_interval`."""
        last_round, pace = -math.inf, self.interval
        while True:
            now = time.monotonic()
            try:
                pace = self.interval if self._active(now) else self.idle_interval
                if now - last_round >= pace:
                    last_round = now
                    if self._scraper():
                        await self._scrape_all()
                    else:
                        self._read_shared()
            except Exception:  # never let the picker's loop die: stale readings only mean Envoy picks
                log.exception("picker round failed")
            self._woken.clear()
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel that arrives as the
            # event is set, and stop() would then wait for ever.
            with contextlib.suppress(TimeoutError):
                tick = self.interval if pace == self.interval else min(IDLE_TICK_S, self.idle_interval)
                async with asyncio.timeout(max(0.0, tick - (time.monotonic() - now))):
                    await self._woken.wait()
            if self._woken.is_set():
                last_round = -math.inf  # a pick after a quiet spell: a round now

    async def ensure_fresh(self) -> None:
        """Before a pick: readings older than two intervals (the first request after a quiet spell,
        when scraping runs at the idle pace) are refreshed by one round of scrapes now, awaited for at
        most FIRST_PICK_WAIT_S, so the request is not steered by a reading up to a second old.
        Concurrent picks wait for the same round; under traffic readings are fresh and this returns
        at once."""
        now = time.monotonic()
        if self._shared is not None and self._lock_fd is None and now - self._read_at > self.interval:
            self._read_shared()  # a worker that does not scrape: the scraper's latest first
        newest = max((ld.at for ld in self.loads.values()), default=-math.inf)
        if now - newest <= 2 * self.interval or self._session is None:
            return
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self._scrape_all(publish=self._lock_fd is not None))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FIRST_PICK_WAIT_S):
                await asyncio.shield(self._refresh)

    async def _scrape_all(self, publish: bool = True) -> None:
        # An engine in two pools (one engine serving two routes' pools) is scraped once a round: its
        # page is the same, and its reading is kept by endpoint.
        endpoints = dict.fromkeys(ep for eps in self.pools.values() for ep in eps)
        await asyncio.gather(*(self._scrape(ep) for ep in endpoints))
        if self._shared is not None and publish and self._has_readers():
            doc = {ep: asdict(ld) for ep, ld in self.loads.items()}
            tmp = self._shared / f"loads.{os.getpid()}.tmp"
            tmp.write_bytes(orjson.dumps(doc))
            tmp.replace(self._shared / "loads.json")  # readers see a whole file, old or new

    async def _scrape(self, endpoint: str) -> None:
        assert self._session is not None
        self.scrapes += 1
        try:
            address = await self._address(endpoint)
            async with self._session.get(f"http://{address}/metrics") as r:
                if r.status == 200:
                    load = parse_load(await r.text(), time.monotonic())
                    self.loads[endpoint] = replace(load, address=address)
        except (TimeoutError, aiohttp.ClientError, ValueError, OSError) as e:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("scrape %s failed: %s", endpoint, e)

    async def _address(self, endpoint: str) -> str:
        """`endpoint` as IP:port: itself when its host is an address, else its name resolved (again
        after RESOLVED_FOR_S, so a restarted container's new address is picked within that)."""
        host, _, port = endpoint.rpartition(":")
        if is_address(host):
            return endpoint
        known = self._resolved.get(endpoint)
        now = time.monotonic()
        if known is not None and now - known[1] < RESOLVED_FOR_S:
            return known[0]
        infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        ip = str(infos[0][4][0])
        address = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
        self._resolved[endpoint] = (address, now)
        return address

    def _has_readers(self) -> bool:
        """Whether a worker has read the shared readings lately (its mark within two idle rounds):
        writing the file costs a write and a rename each round (about 0.2 ms of CPU, 16% of a worker's
        profile under slow streams: docs/BENCHMARKS.md), wasted where nobody reads it. Looked at twice
        a second at most."""
        assert self._shared is not None
        now = time.monotonic()
        looked, seen = self._readers_seen
        if now - looked >= MARK_EVERY_S:
            seen = self._mark_age("readers") < 2 * self.idle_interval + MARK_EVERY_S
            self._readers_seen = (now, seen)
        return seen

    def _read_shared(self) -> None:
        """The shared scraper's readings (monotonic times are host-wide on Linux). Each engine keeps
        the newer of its reading here and the file's: a worker that scraped for itself (a new reader,
        before the scraper has seen its mark and written the file) keeps what it scraped."""
        assert self._shared is not None
        self._read_at = time.monotonic()
        self._marked_reading = self._mark("readers", self._marked_reading, self._read_at)
        try:
            doc = orjson.loads((self._shared / "loads.json").read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return  # no file yet: readings stay as they are and go stale
        for ep, ld in doc.items():
            mine = self.loads.get(ep)
            if mine is None or ld["at"] > mine.at:
                self.loads[ep] = EngineLoad(**ld)

    def _note_pick(self, now: float) -> None:
        """A pick after a quiet spell wakes the scraping at once; a shared scraper learns of traffic
        here from the directory's mark (touched at most twice a second)."""
        if now - self._last_pick >= self.active_for:
            self._woken.set()
        self._last_pick = now
        if self._shared is not None:
            self._marked_active = self._mark("active", self._marked_active, now)

    def status(self) -> dict[str, Any]:
        """Each pool's engines as this worker reads them (GET /status): the three gauges and how old the
        reading is; `fresh`: a pick may use it (younger than stale_after). An engine never read shows
        none: a pool whose engines all show none is left to Envoy's own balancing."""
        now = time.monotonic()

        def reading(ep: str) -> dict[str, Any]:
            load = self.loads.get(ep)
            if load is None:
                return {"endpoint": ep, "reading": None, "fresh": False}
            return {"endpoint": ep, "waiting": load.waiting, "running": load.running, "kv_usage": load.kv_usage,
                    "age_s": round(now - load.at, 3), "fresh": self.fresh(ep, now) is not None}

        return {"scrapes": self.scrapes, "shared": self._shared is not None,
                "pools": {pool: [reading(ep) for ep in eps] for pool, eps in sorted(self.pools.items())}}

    def pool_loads(self, pool: str) -> list[EngineLoad]:
        """The fresh readings of a pool's engines (admission derives the pool's bound from them)."""
        now = time.monotonic()
        return [ld for ep in self.pools.get(pool, ()) if (ld := self.fresh(ep, now)) is not None]

    def fresh(self, endpoint: str, now: float) -> EngineLoad | None:
        load = self.loads.get(endpoint)
        return load if load is not None and now - load.at <= self.stale_after else None

    def pick(self, pool: str, salt: str, messages: object, record: bool = True) -> list[str]:
        """The addresses of `pool`'s engines, best first; empty when no engine has fresh metrics (Envoy
        then picks).
        `record`: the first is where the request goes (its prefix affinity and a pending request are
        noted); False for a fallback candidate's pool, which only a failure sends to."""
        now = time.monotonic()
        self._note_pick(now)
        loads = {ep: ld for ep in self.pools.get(pool, ()) if (ld := self.fresh(ep, now)) is not None}
        if not loads:
            if record:
                count_pick(pool, "no_fresh_metrics")
            return []
        blocks = prompt_blocks(salt, messages)
        matched = self._matched_blocks(blocks)
        # Picks made since an engine's last scrape are requests its metrics cannot show yet; they
        # count as running there, each weighted by the chance it is still in flight (exp(-age/tau)),
        # so a burst spreads while a trickle of short requests does not look like load.
        pending = {ep: self._pending(ep, ld.at, now) for ep, ld in loads.items()}

        def score(ep: str) -> float:
            ld = loads[ep]
            return (WEIGHTS["queue"] / (1.0 + ld.waiting)
                    + WEIGHTS["kv"] * (1.0 - min(max(ld.kv_usage, 0.0), 1.0))
                    + WEIGHTS["prefix"] * (matched.get(ep, 0) / len(blocks) if blocks else 0.0)
                    + WEIGHTS["running"] / (1.0 + ld.running + pending[ep]))

        order = sorted(loads, key=lambda ep: (-score(ep), pending[ep], ep))
        if record:
            self._record(order[0], blocks, now)
            count_pick(pool, "prefix" if matched.get(order[0]) else "load")
        return [loads[ep].address or ep for ep in order]

    def _matched_blocks(self, blocks: list[int]) -> dict[str, int]:
        """For each endpoint, how many leading blocks of this prompt it served last."""
        matched: dict[str, int] = {}
        for i, h in enumerate(blocks):
            ep = self._affinity.get(h)
            if ep is None:
                break
            matched[ep] = i + 1
        return matched

    def _pending(self, ep: str, scraped_at: float, now: float) -> float:
        times = [t for t in self._picked_at.get(ep, ()) if t > scraped_at]
        self._picked_at[ep] = times
        return sum(math.exp(-(now - t) / PENDING_TAU_S) for t in times)

    def _record(self, ep: str, blocks: list[int], now: float) -> None:
        self._picked_at.setdefault(ep, []).append(now)
        for h in blocks:
            self._affinity[h] = ep
            self._affinity.move_to_end(h)
        while len(self._affinity) > AFFINITY_ENTRIES:
            self._affinity.popitem(last=False)
