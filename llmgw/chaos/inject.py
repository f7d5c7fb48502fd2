"""`llmgw chaos`: failure injection (docs/guide/operations.md, "Operating a change"). Starts its own gateway
on free ports - Envoy, two ext_proc workers, Valkey, two simulated engines and a simulated hosted
provider - from a copy of the policy, injects each fault of the table in turn, sends requests through
it, and after each checks invariants 3 to 8 (docs/INVARIANTS.md) from the ledger, the engines'
request logs, the store and what the client saw (llmgw/chaos/checks.py). Prints fault -> outcome ->
invariants and exits 1 when an invariant or a fault's expected outcome does not hold.

The policy must have the demo's shape: a route served by the engine pool (`--pool-route`) and a route
whose first candidate is the pool and second another deployment (`--fallback-route`). The copy gets
what makes each fault quick to observe: short leases and stream limits, a small token budget for one
tenant, the fallback route's retries on 429 and on no first byte, and a key allowed tools with
`write` effects; what is checked does not depend on those choices.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import secrets
import signal
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import date
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import redis
import yaml

from extproc.names import Header
from extproc.store import leases_key
from llmgw.bench.kit import demo_policy
from llmgw.chaos.checks import INVARIANTS, Arrival, Evidence, Sent, by_trace, check_all
from llmgw.conformance.record import stamp
from llmgw.conformance.runner import marker as fault_marker
from llmgw.local.procs import Child, http_ok, json_at, tcp_open, wait_until
from llmgw.local.stack import Stack, StackOptions
from llmgw.ops.keys import read_keys, write_keys
from llmgw.ops.ledger import ledger_entries
from llmgw.ops.store import store_client

LEASE_GRACE_MS = 1000
STREAM_IDLE_MS = 1500
MAX_STREAM_MS = 6000
BUDGET_TENANT, BUDGET_TOKENS = "globex", 2000
WRITER = "chaos-writer"
WRITE_TOOL = [{"type": "function", "function": {"name": "update_ticket", "description": "Update a ticket",
                                                "parameters": {"type": "object", "properties": {
                                                    "id": {"type": "string"}}, "required": ["id"]}}}]


def chaos_policy(src: Path, work: Path, pool_route: str, fallback_route: str) -> tuple[Path, dict[str, str]]:
    """A copy of `src` set up for the faults, and (tenant or WRITER) -> API key."""
    policy, keys = demo_policy(src, work / "policy")
    gw = yaml.safe_load((policy / "gateway.yaml").read_text())
    gw["store"]["lease_grace_ms"] = LEASE_GRACE_MS
    gw["envoy"]["stream_idle_timeout_ms"] = STREAM_IDLE_MS
    gw["quotas"] = []
    gw["budgets"] = [b for b in gw.get("budgets", []) if b["tenant"] != BUDGET_TENANT] + [
        {"name": f"{BUDGET_TENANT}-chaos", "tenant": BUDGET_TENANT, "window": "daily", "limit_tokens": BUDGET_TOKENS}]
    (policy / "gateway.yaml").write_text(yaml.safe_dump(gw))
    for name in (pool_route, fallback_route):
        path = policy / "routes" / f"{name}.yaml"
        route = yaml.safe_load(path.read_text())
        route["max_stream_ms"] = MAX_STREAM_MS
        if name == fallback_route:
            route["retry"] = {"attempts": 1, "requires": "read_only_or_idempotency_key", "eligible_failures": [
                "connect_before_send", "rate_limited", "unavailable", "no_first_byte"]}
        path.write_text(yaml.safe_dump(route))
    # The fallback route's new retry policy voids the records earned under the old one (invariant 17):
    # the table measures the other invariants, so its candidates get provisional records in the copy.
    for cand in yaml.safe_load((policy / "routes" / f"{fallback_route}.yaml").read_text())["candidates"]:
        stamp(policy, cand["deployment_ref"].partition("@")[0], date.today())
    # A key whose holder may offer tools with `write` effects (the ambiguous tool action).
    writer = "llmgw-" + secrets.token_urlsafe(24)
    entries = read_keys(policy / "keys.yaml")
    entries.append({"id": WRITER, "tenant": "acme", "sha256": hashlib.sha256(writer.encode()).hexdigest(),
                    "effects": ["write"], "created": date.today().isoformat()})
    write_keys(policy / "keys.yaml", entries)
    return policy, {**keys, WRITER: writer}


def _chunk_event(line: bytes) -> dict[str, Any] | None:
    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
        return None
    try:
        event = json.loads(line[6:])
    except ValueError:
        return {"error": {"code": "malformed"}}
    return event if isinstance(event, dict) else None


@dataclass
class Harness:
    """The running gateway and what the faults do to it."""

    stack: Stack
    keys: dict[str, str]
    pool_route: str
    fallback_route: str
    session: aiohttp.ClientSession
    arrivals_seen: dict[tuple[str, str, float], Arrival]

    @property
    def snap(self) -> Any:
        return self.stack.snapshot

    # -- the client ---------------------------------------------------------------------------------

    async def send(self, label: str, route: str, *, stream: bool = False, max_tokens: int = 16, tenant: str = "acme",
                   key: str | None = None, deadline_ms: int | None = None, cancel_after: int | None = None,
                   marker: str = "", ignore_eos: bool = False, tools: list[dict[str, Any]] | None = None,
                   idempotency_key: str | None = None, on_chunk: Callable[[Sent], None] | None = None) -> Sent:
        trace = secrets.token_hex(16)
        headers = {"authorization": f"Bearer {self.keys[key or tenant]}",
                   "traceparent": f"00-{trace}-{secrets.token_hex(8)}-01"}
        if deadline_ms:
            headers[Header.DEADLINE_MS] = str(deadline_ms)
        if idempotency_key:
            headers["idempotency-key"] = idempotency_key
        body: dict[str, Any] = {"model": route, "max_tokens": max_tokens, "stream": stream,
                                "messages": [{"role": "user", "content": f"chaos {label} {marker}".strip()}]}
        if ignore_eos:
            body["ignore_eos"] = True
        if tools:
            body["tools"] = tools
        effective = min(self.snap.routes[route].deadline_ms, deadline_ms or 10**9)
        s = Sent(label, route, tenant, trace, stream, effective, started=time.time(), idempotency_key=idempotency_key)
        t0 = time.monotonic()
        try:
            async with self.session.post(f"{self.stack.url}/v1/chat/completions", json=body, headers=headers) as r:
                s.status, s.request_id = r.status, r.headers.get("x-request-id", "")
                s.deployment = r.headers.get(Header.DEPLOYMENT, "")
                if r.status >= 300:
                    doc = await r.json(content_type=None)
                    error = (doc.get("error") or {}) if isinstance(doc, dict) else {}
                    s.code, s.message = str(error.get("code", "")), str(error.get("message", ""))
                elif not stream:
                    await r.json()
                    s.finished = True
                else:
                    await self._read_stream(r, s, cancel_after, on_chunk)
        except (TimeoutError, aiohttp.ClientError):
            s.cut = s.cut or s.chunks > 0
        s.elapsed_s = time.monotonic() - t0
        return s

    @staticmethod
    async def _read_stream(r: aiohttp.ClientResponse, s: Sent, cancel_after: int | None,
                           on_chunk: Callable[[Sent], None] | None) -> None:
        async for line in r.content:
            if line.startswith(b"data: [DONE]"):
                s.finished = not s.error_event
                return
            event = _chunk_event(line)
            if event is None:
                continue
            if "error" in event:
                s.error_event, s.code = True, str((event["error"] or {}).get("code", ""))
                continue
            if any((c.get("delta") or {}).get("content") for c in event.get("choices") or []):
                s.chunks += 1
                s.first_chunk_at = s.first_chunk_at or time.time()
                if on_chunk:
                    on_chunk(s)
                if cancel_after is not None and s.chunks >= cancel_after:
                    s.cancelled = True
                    r.close()
                    return
        s.cut = not s.error_event

    # -- the engines and providers -------------------------------------------------------------------

    def upstreams(self) -> dict[str, str]:
        """Engine or provider URL -> the deployment it serves."""
        out = {}
        for pool, hosts in self.stack.render.pools.items():
            dep = next((d.deployment for d in self.snap.deployments.values() if d.pool == pool), pool)
            out.update({f"http://{h}:{p}": dep for h, p in hosts})
        for name, hosts in self.stack.render.providers.items():
            out.update({f"http://{h}:{p}": name for h, p in hosts})
        return out

    def pool_engines(self) -> list[str]:
        return self.stack.engine_urls()

    def engine_child(self, url: str) -> Child:
        return self.stack.engines[url.removeprefix("http://")]

    def record_arrivals(self) -> None:
        """Read every live upstream's request log (kept: an engine killed later loses its own)."""
        for url, dep in self.upstreams().items():
            try:
                logged = json_at(f"{url}/admin/requests")
            except OSError:
                continue
            for e in logged if isinstance(logged, list) else logged.get("requests", []):
                key = (url, str(e.get("request_id")), float(e.get("time") or 0))
                self.arrivals_seen[key] = Arrival(dep, key[2], int(e.get("status") or 0))

    def fault(self, urls: list[str], spec: str, marker: str) -> None:
        for url in urls:
            _post(f"{url}/admin/faults", {"fault": spec, "count": 1, "match": marker})

    def clear_faults(self) -> None:
        for url in self.upstreams():
            with contextlib.suppress(OSError):  # an engine down for its fault has none queued
                urllib.request.urlopen(urllib.request.Request(f"{url}/admin/faults", method="DELETE"), timeout=5)

    def stop_engine(self, url: str) -> None:
        self.record_arrivals()
        self.engine_child(url).stop()

    def kill_engine(self, url: str) -> None:
        self.record_arrivals()
        self.engine_child(url).signal(signal.SIGKILL)

    def start_engine(self, url: str, timeout: float = 30) -> None:
        child = self.engine_child(url)
        if child.proc is not None:
            child.proc.wait(10)
        child.start()
        wait_until(partial(http_ok, f"{url}/health"), timeout, f"engine {url}", child)

    def wait_pool_healthy(self, timeout: float = 30) -> None:
        wait_until(self.stack._pool_healthy, timeout, "engine pool health checks", self.stack.envoy)

    # -- the store and the workers --------------------------------------------------------------------

    @property
    def valkey(self) -> Child:
        assert self.stack.valkey is not None
        return self.stack.valkey

    def start_valkey(self) -> None:
        port = self.stack.opts.valkey_port or 6379
        if self.valkey.proc is not None:
            self.valkey.proc.wait(10)
        self.valkey.start()
        wait_until(lambda: tcp_open("127.0.0.1", port), 20, "valkey", self.valkey)

    def restart_worker(self, i: int) -> None:
        child = self.stack.extprocs[i]
        if child.proc is not None:
            child.proc.wait(10)
        child.start()
        wait_until(partial(self.stack._serves_revision, self.stack.status_urls[i]), 30, "ext_proc", child)

    def reload(self) -> list[dict[str, Any]]:
        token = self.stack.admin_token_file.read_text().strip()
        return [_post(url.replace("/status", "/reload"), {}, token) for url in self.stack.status_urls]

    # -- what was recorded ------------------------------------------------------------------------------

    def evidence(self, sent: list[Sent], wait_s: float) -> Evidence:
        """The records of these requests, once each has its ledger entry and no reservation is left
        open (or `wait_s` passed: what is missing then is a finding)."""
        client = store_client(str(self.stack.store_url))
        tenants = sorted(self.snap.gateway.tenants)
        traces = {s.trace_id for s in sent}
        give_up = time.monotonic() + wait_s
        while True:
            try:
                entries = by_trace(ledger_entries(client, tenants), traces)
                rids = {str(e[0].get("request_id")) for e in entries.values()} | {s.request_id for s in sent}
                open_leases = {str(m) for t in tenants for m in client.zrange(leases_key(t), 0, -1)} & rids
            except redis.RedisError:
                entries, open_leases = {}, set()
            recorded = all(s.trace_id in entries for s in sent if not s.unprocessed)
            if (recorded and not open_leases) or time.monotonic() > give_up:
                break
            time.sleep(0.2)
        self.record_arrivals()
        arrivals: dict[str, list[Arrival]] = {}
        for (_, rid, _), a in sorted(self.arrivals_seen.items(), key=lambda kv: kv[1].at):
            arrivals.setdefault(rid, []).append(a)
        return Evidence(sent, entries, arrivals, open_leases, self.budgets_left())

    def budgets_left(self) -> dict[str, int]:
        """llmgw_budget_remaining per budget and unit, as the workers expose it."""
        out = {}
        with urllib.request.urlopen(self.stack.metrics_url, timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("llmgw_budget_remaining{"):
                    labels, value = line.rsplit(" ", 1)
                    out[labels[len("llmgw_budget_remaining"):]] = int(float(value))
        return out

    def ledger_of(self, s: Sent, ev: Evidence) -> dict[str, Any]:
        found = ev.entries.get(s.trace_id) or [{}]
        return found[0]


def _post(url: str, doc: dict[str, Any], token: str = "") -> Any:
    req = urllib.request.Request(url, data=json.dumps(doc).encode(), method="POST", headers={
        "content-type": "application/json", **({"authorization": f"Bearer {token}"} if token else {})})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read() or b"{}")


# --- the faults ----------------------------------------------------------------------------------------

# A fault's run: what it sent, what happened (one line), and what it expected that did not happen.
Result = tuple[list[Sent], str, list[str]]


@dataclass(frozen=True)
class Fault:
    name: str
    run: Callable[[Harness], Awaitable[Result]]
    wait_s: float = 8.0  # for its ledger entries and settlements


def _statuses(sent: list[Sent]) -> str:
    counts: dict[str, int] = {}
    for s in sent:
        what = (f"{s.status}" + (f" {s.code}" if s.code else "") + (" not processed" if s.unprocessed else "")
                + (" cut" if s.cut else "")
                + (" cancelled" if s.cancelled else ""))
        counts[what] = counts.get(what, 0) + 1
    return ", ".join(f"{n}x {w}" for w, n in sorted(counts.items()))


def _expect(cond: bool, what: str, misses: list[str]) -> None:
    if not cond:
        misses.append(what)


async def connection_refused(h: Harness) -> Result:
    down = h.pool_engines()[-1]
    h.stop_engine(down)
    sent = list(await asyncio.gather(*(h.send(f"refused-{i}", h.pool_route) for i in range(6))))
    misses: list[str] = []
    _expect(all(s.finished for s in sent), "every request answered by the engine still up", misses)
    return sent, f"one of two engines down: {_statuses(sent)}", misses


async def scale_up_delay(h: Harness) -> Result:
    late = h.pool_engines()[-1]  # down since connection_refused (or now)
    if h.engine_child(late).alive:
        h.stop_engine(late)

    async def load() -> list[Sent]:
        tasks = []
        for i in range(10):
            tasks.append(asyncio.ensure_future(h.send(f"scale-{i}", h.pool_route, stream=True, max_tokens=24)))
            await asyncio.sleep(0.3)
        return list(await asyncio.gather(*tasks))

    t0 = time.monotonic()
    running = asyncio.ensure_future(load())
    await asyncio.sleep(0.6)
    await asyncio.to_thread(h.start_engine, late)
    up_after = time.monotonic() - t0
    sent = await running
    await asyncio.to_thread(h.wait_pool_healthy)
    h.record_arrivals()
    rids = {s.request_id for s in sent}
    served = len({rid for (url, rid, _) in h.arrivals_seen if url == late and rid in rids})
    misses: list[str] = []
    _expect(all(s.finished for s in sent), "every request answered while the engine came up", misses)
    return sent, f"engine up after {up_after:.1f} s under load, then served {served}: {_statuses(sent)}", misses


async def _status_before_headers(h: Harness, status: int) -> Result:
    marker = fault_marker("chaos-")
    h.fault(h.pool_engines(), f"status={status}", marker)
    sent = [await h.send(f"status-{status}", h.fallback_route, marker=marker)]
    second = h.snap.routes[h.fallback_route].candidates[1].deployment_name
    misses: list[str] = []
    _expect(sent[0].finished and sent[0].deployment == second, f"served by the fallback {second}", misses)
    return sent, f"pool answered {status}: {_statuses(sent)} from {sent[0].deployment or '-'}", misses


async def rate_limited(h: Harness) -> Result:
    return await _status_before_headers(h, 429)


async def unavailable(h: Harness) -> Result:
    return await _status_before_headers(h, 503)


async def slow_first_byte(h: Harness) -> Result:
    marker = fault_marker("chaos-")
    h.fault(h.pool_engines(), "delay_ms=6000", marker)
    stream = await h.send("slow-stream", h.fallback_route, stream=True, deadline_ms=3000, marker=marker)
    marker = fault_marker("chaos-")
    h.fault(h.pool_engines(), "delay_ms=6000", marker)
    plain = await h.send("slow-json", h.pool_route, deadline_ms=1500, marker=marker)
    second = h.snap.routes[h.fallback_route].candidates[1].deployment_name
    misses: list[str] = []
    _expect(stream.finished and stream.deployment == second, "the stream falls back within its deadline", misses)
    _expect(plain.status == 504 and plain.code == "deadline_exceeded", "the JSON request ends at its deadline", misses)
    return [stream, plain], (f"stream: {_statuses([stream])} from {stream.deployment or '-'}; JSON: "
                             f"{_statuses([plain])} after {plain.elapsed_s * 1000:.0f} ms"), misses


async def _mid_stream(h: Harness, spec: str, label: str) -> Result:
    marker = fault_marker("chaos-")
    h.fault(h.pool_engines(), spec, marker)
    s = await h.send(label, h.fallback_route, stream=True, max_tokens=48, marker=marker)
    misses: list[str] = []
    _expect(s.chunks > 0 and not s.finished and s.visible_failure, "the failure after the first byte is visible",
            misses)
    end = f"error event {s.code}" if s.error_event else "cut" if s.cut else "a normal end"
    return [s], f"{s.chunks} chunks then {end}", misses


async def stall_mid_stream(h: Harness) -> Result:
    return await _mid_stream(h, "stall_after=2", "stall")


async def disconnect_mid_stream(h: Harness) -> Result:
    return await _mid_stream(h, "disconnect_after=2", "disconnect")


async def malformed_chunk(h: Harness) -> Result:
    return await _mid_stream(h, "malformed_after=2", "malformed")


async def client_cancel(h: Harness) -> Result:
    s = await h.send("cancel", h.pool_route, stream=True, max_tokens=200, ignore_eos=True, cancel_after=3)
    await asyncio.sleep(0.5)
    misses: list[str] = []
    _expect(s.cancelled, "the client left after 3 chunks", misses)
    return [s], f"client left after {s.chunks} chunks", misses


async def engine_loss_mid_stream(h: Harness) -> Result:
    streaming: asyncio.Queue[Sent] = asyncio.Queue()
    tasks = [asyncio.ensure_future(h.send(f"loss-{i}", h.pool_route, stream=True, max_tokens=400, ignore_eos=True,
                                          on_chunk=lambda s: streaming.put_nowait(s) if s.chunks == 2 else None))
             for i in range(2)]
    first = await asyncio.wait_for(streaming.get(), 10)
    h.record_arrivals()
    victim = next((url for (url, rid, _), a in h.arrivals_seen.items() if rid == first.request_id), None)
    if victim is None:
        return [], "the stream's engine was not found", ["a stream to kill"]
    h.kill_engine(victim)
    sent = list(await asyncio.gather(*tasks))
    await asyncio.to_thread(h.start_engine, victim)
    await asyncio.to_thread(h.wait_pool_healthy)
    misses: list[str] = []
    _expect(first.visible_failure and not first.finished, "the stream on the lost engine fails visibly", misses)
    return sent, f"engine killed mid-stream: {_statuses(sent)}", misses


async def store_outage(h: Harness) -> Result:
    h.valkey.stop()  # SIGTERM: Valkey writes what it has and exits
    try:
        sent = list(await asyncio.gather(*(h.send(f"store-down-{i}", h.pool_route) for i in range(4))))
    finally:
        await asyncio.to_thread(h.start_valkey)
    misses: list[str] = []
    _expect(all(s.status == 503 and s.code == "policy_unavailable" for s in sent), "refused (fail closed)", misses)
    return sent, f"store down: {_statuses(sent)}; store back", misses


async def store_stall(h: Harness) -> Result:
    h.valkey.signal(signal.SIGSTOP)
    try:
        tasks = [asyncio.ensure_future(h.send(f"store-stall-{i}", h.pool_route)) for i in range(4)]
        await asyncio.sleep(1.0)
    finally:
        h.valkey.signal(signal.SIGCONT)
    sent = list(await asyncio.gather(*tasks))
    misses: list[str] = []
    _expect(all(s.finished or (s.status == 503 and s.code == "policy_unavailable") for s in sent),
            "answered or refused (fail closed)", misses)
    return sent, f"store stalled 1 s: {_statuses(sent)}", misses


async def worker_sigkill(h: Harness) -> Result:
    # Streams with an Idempotency-Key pass every chunk through a worker's stream guard; when that
    # worker dies the guard fails open (Envoy's failure_mode_allow) and the stream continues: what it
    # reserved is settled from the access log by the surviving worker, or by the sweeper when its lease
    # expires (charged in full, marked ambiguous). Requests sent to the dead worker get Envoy's
    # "not processed" answer: never authenticated, never dispatched.
    tasks = [asyncio.ensure_future(h.send(f"worker-{i}", h.pool_route, stream=True, max_tokens=300, ignore_eos=True,
                                          deadline_ms=2000, idempotency_key=fault_marker("chaos-key-")))
             for i in range(6)]
    await asyncio.sleep(0.8)
    h.stack.extprocs[0].signal(signal.SIGKILL)
    tasks += [asyncio.ensure_future(h.send(f"worker-after-{i}", h.pool_route)) for i in range(4)]
    sent = list(await asyncio.gather(*tasks))
    await asyncio.to_thread(h.restart_worker, 0)
    after = await h.send("worker-restarted", h.pool_route)
    misses: list[str] = []
    streams = sent[:6]
    _expect(all(s.finished for s in streams), "the streams in flight continue (their guard fails open)", misses)
    _expect(after.finished, "serving after the worker is started again", misses)
    ev = await asyncio.to_thread(h.evidence, [*sent, after], MAX_STREAM_MS / 1000 + 10)
    kinds = Counter("at lease expiry" if "lease expired" in str(e.get("note", "")) else str(e.get("settlement"))
                    for e in (h.ledger_of(s, ev) for s in streams))
    settled = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    return [*sent, after], (f"worker killed under 6 keyed streams: {_statuses(sent)}; the streams settled "
                            f"{settled}; restarted"), misses


async def budget_exhaustion(h: Harness) -> Result:
    sent = list(await asyncio.gather(*(h.send(f"budget-{i}", h.pool_route, tenant=BUDGET_TENANT, max_tokens=300)
                                       for i in range(10))))
    refused = [s for s in sent if s.status == 429 and s.code == "budget_exhausted"]
    misses: list[str] = []
    _expect(0 < len(refused) < len(sent), "some admitted, the rest refused budget_exhausted", misses)
    return sent, f"{BUDGET_TOKENS}-token budget: {_statuses(sent)}", misses


async def config_reload(h: Harness) -> Result:
    before = h.snap.revision
    path = h.snap.directory / "routes" / f"{h.pool_route}.yaml"
    original = path.read_text()
    inflight = [asyncio.ensure_future(h.send(f"reload-inflight-{i}", h.pool_route, stream=True, max_tokens=100,
                                             ignore_eos=True)) for i in range(4)]
    await asyncio.sleep(0.3)
    route = yaml.safe_load(original)
    route["max_tokens_cap"] = int(route.get("max_tokens_cap") or 4096) - 1
    path.write_text(yaml.safe_dump(route))
    reloads = await asyncio.to_thread(h.reload)
    after = [await h.send(f"reload-after-{i}", h.pool_route) for i in range(2)]
    path.write_text(original.replace("candidates:", "candidates: [", 1))  # not YAML: refused
    refused = await asyncio.to_thread(h.reload)
    last = await h.send("reload-refused", h.pool_route)
    path.write_text(original)
    await asyncio.to_thread(h.reload)
    sent = [*(await asyncio.gather(*inflight)), *after, last]
    new = {r.get("revision") for r in reloads}
    misses: list[str] = []
    _expect(all(s.finished for s in sent), "every request answered across the reloads", misses)
    _expect(len(new) == 1 and before not in new, "the new revision took over on every worker", misses)
    _expect(all(r.get("revision") in new and r.get("last_error") for r in refused),
            "the invalid revision refused, the last good one serving", misses)
    ev = h.evidence(sent, 8)
    revisions = [h.ledger_of(s, ev).get("route_revision") for s in sent]
    _expect(revisions[:4] == [before] * 4 and set(revisions[4:]) <= new,
            "each request recorded under the revision that decided it", misses)
    return sent, f"reloaded under load, then refused an invalid revision: {_statuses(sent)}", misses


async def ambiguous_tool_action(h: Harness) -> Result:
    misses: list[str] = []
    sent = []
    for stream in (True, False):
        marker = fault_marker("chaos-")
        h.fault(h.pool_engines(), "delay_ms=6000", marker)
        s = await h.send(f"ambiguous-{'stream' if stream else 'json'}", h.fallback_route, key=WRITER, stream=stream,
                         deadline_ms=2000, tools=WRITE_TOOL, idempotency_key=f"chaos-{marker}", marker=marker)
        second = h.snap.routes[h.fallback_route].candidates[1].deployment_name
        _expect(s.status == 504 and s.deployment != second, "ends unanswered, never re-sent to the fallback",
                misses)
        sent.append(s)
    ev = h.evidence(sent, 8)
    for s in sent:
        e = h.ledger_of(s, ev)
        _expect(e.get("idempotency_key") == s.idempotency_key, "the ledger names its Idempotency-Key", misses)
        _expect(len(ev.arrivals.get(str(e.get("request_id")), [])) == 1, "one arrival upstream", misses)
    settled = "/".join(str(h.ledger_of(s, ev).get("settlement")) for s in sent)
    return sent, f"write tool, pool silent past the deadline: {_statuses(sent)}; settled {settled}", misses


FAULTS = (
    Fault("connection refused", connection_refused),
    Fault("scale-up delay", scale_up_delay),
    Fault("429 before headers", rate_limited),
    Fault("5xx before headers", unavailable),
    Fault("slow first byte", slow_first_byte),
    Fault("stall mid-stream", stall_mid_stream),
    Fault("disconnect mid-stream", disconnect_mid_stream),
    Fault("malformed chunk", malformed_chunk),
    Fault("client cancellation", client_cancel),
    Fault("engine loss mid-stream", engine_loss_mid_stream),
    Fault("store outage", store_outage, wait_s=10),
    Fault("store stall", store_stall),
    Fault("ext_proc worker SIGKILL", worker_sigkill, wait_s=MAX_STREAM_MS / 1000 + 10),
    Fault("budget exhaustion", budget_exhaustion),
    Fault("config reload under load", config_reload),
    Fault("ambiguous tool action", ambiguous_tool_action),
)


@dataclass(frozen=True)
class Row:
    fault: str
    outcome: str
    violations: dict[str, list[str]]
    misses: list[str]

    @property
    def held(self) -> bool:
        return not self.misses and not any(self.violations.values())


async def run_faults(h: Harness, faults: tuple[Fault, ...], out: Callable[[str], None]) -> list[Row]:
    rows = []
    for f in faults:
        t0 = time.monotonic()
        try:
            sent, outcome, misses = await f.run(h)
        except Exception as e:  # a fault that could not be carried out is a failed row, not a crash
            sent, outcome, misses = [], f"could not run: {type(e).__name__}: {e}", ["the fault ran"]
        ev = await asyncio.to_thread(h.evidence, sent, f.wait_s)
        h.clear_faults()
        row = Row(f.name, outcome, check_all(h.snap, ev) if sent else {}, misses)
        rows.append(row)
        out(f"{f.name}: {'held' if row.held else 'FAILED'} ({time.monotonic() - t0:.1f} s)")
    return rows


def table(rows: list[Row]) -> str:
    head = ["fault", "outcome", *(f"inv {i}" for i in INVARIANTS), "held"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        marks = ["-" if not r.violations else "FAIL" if r.violations[i] else "ok" for i in INVARIANTS]
        lines.append(f"| {r.fault} | {r.outcome} | " + " | ".join(marks) + f" | {'yes' if r.held else 'NO'} |")
    findings = [f"- {r.fault}: expected {m}" for r in rows for m in r.misses]
    findings += [f"- {r.fault}: invariant {i}: {v}" for r in rows for i, vs in r.violations.items() for v in vs]
    return "\n".join(lines + (["", *findings] if findings else [])) + "\n"


async def _run(args: argparse.Namespace, stack: Stack, keys: dict[str, str], faults: tuple[Fault, ...]) -> list[Row]:
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        h = Harness(stack, keys, args.pool_route, args.fallback_route, session, {})
        return await run_faults(h, faults, lambda line: print(line, file=sys.stderr))


def cmd_chaos(args: argparse.Namespace) -> int:
    wanted = {n.strip() for n in args.only.split(",")} if args.only else None
    faults = tuple(f for f in FAULTS if wanted is None or f.name in wanted)
    if wanted and len(faults) != len(wanted):
        print(f"error: unknown fault in --only; the faults: {', '.join(f.name for f in FAULTS)}", file=sys.stderr)
        return 2
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="llmgw-chaos-")).resolve()
    try:
        config, keys = chaos_policy(Path(args.config), work, args.pool_route, args.fallback_route)
        from extproc.config import load_snapshot

        snap = load_snapshot(config)
        if len(snap.routes[args.fallback_route].candidates) < 2 or args.pool_route not in snap.routes:
            raise ValueError("the pool route, and a fallback route of two candidates, are needed")
        opts = StackOptions.on_free_ports(config, work / "state", snap, workers=2, simulate_providers=True,
                                          time_scale=args.time_scale)
        stack = Stack(opts).start()
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        rows = asyncio.run(_run(args, stack, keys, faults))
    finally:
        stack.stop()
    text = table(rows)
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    held = all(r.held for r in rows)
    print(f"{sum(r.held for r in rows)} of {len(rows)} faults held every invariant; logs in {work}", file=sys.stderr)
    return 0 if held else 1
