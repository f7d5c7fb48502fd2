"""Open-loop replay of a trace of work through the gateway (issue 15, part 2).

Each request is sent at its arrival offset whatever happened to the ones before: the client never
waits for an answer before sending the next, so a slow gateway or pool does not lower the offered
load (a closed-loop client would: it measures the system it slows down). Every send is on its own
task; how late each left against its schedule is recorded, so a replay that could not keep up says
so instead of passing a lower load off as the trace.

Per request: admitted or refused (the contract's code), TTFT and TPOT for streams (time to the
first content token; time per later token), end to end, tokens, attempts.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import aiohttp

from extproc.names import Header
from llmgw.bench.stats import percentile
from llmgw.bench.workload import TraceRecord

# Words of at most eight letters: one token each in byte-level BPE vocabularies of English text and
# in the simulator's tokenizer (digits and mixed pieces split into several).
VOCABULARY = ("the", "model", "answer", "request", "policy", "budget", "route", "engine", "tenant", "token",
              "stream", "cache", "prefix", "latency", "deploy", "review", "account", "invoice", "summary", "report",
              "quarter", "revenue", "customer", "ticket", "search", "document", "contract", "system", "network",
              "storage", "service", "region")
TOOLS = [{"type": "function", "function": {"name": "search_docs", "description": "Search the documentation",
                                           "parameters": {"type": "object", "properties": {
                                               "query": {"type": "string"}}, "required": ["query"]}}}]


@dataclass(frozen=True)
class Outcome:
    """One replayed request."""

    record: TraceRecord
    late_s: float  # how long after its scheduled arrival it was sent
    status: int  # 0: no answer (connection failed, or the client cancelled first)
    code: str  # the contract's error code ("" for a 2xx)
    request_id: str
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None  # completed requests only
    output_tokens: int
    attempts: int
    cancelled: bool
    deployment: str = ""  # the candidate that answered (x-llmgw-deployment)

    @property
    def admitted(self) -> bool:
        """Reached an upstream: answered 2xx, or failed after admission (not a refusal)."""
        return 200 <= self.status < 300 or self.code in ("upstream_error", "deadline_exceeded", "stream_interrupted")

    @property
    def timed_out(self) -> bool:
        return self.code == "deadline_exceeded"


def _letters(n: int) -> str:
    """n as a word of letters (base 26), so a request's own text is unique and one token per word."""
    out = ""
    while True:
        n, d = divmod(n, 26)
        out = chr(97 + d) + out
        if n == 0:
            return "q" + out


def prompt(r: TraceRecord, index: int) -> list[dict[str, str]]:
    """Messages of about `input_tokens` tokens; a prefix group's requests share their first 60% (a
    system prompt), so the prefix cache can serve it; the rest starts with words of its own."""
    group = r.prefix_group
    shared = round(r.input_tokens * 0.6) if group is not None else 0
    messages = []
    if group is not None and shared:
        system = " ".join(VOCABULARY[(group * 7 + i * 3) % len(VOCABULARY)] for i in range(shared))
        messages.append({"role": "system", "content": system})
    own = [_letters(index), *(VOCABULARY[(index + i) % len(VOCABULARY)] for i in range(r.input_tokens - shared - 1))]
    messages.append({"role": "user", "content": " ".join(own)})
    return messages


def body(r: TraceRecord, index: int, exact_lengths: bool = True) -> dict[str, object]:
    doc: dict[str, object] = {"model": r.route, "messages": prompt(r, index), "max_tokens": r.output_tokens,
                              "stream": r.stream}
    if exact_lengths:  # vLLM's ignore_eos: the trace's output length, exactly (pools only: providers refuse it)
        doc["ignore_eos"] = True
    if r.stream:
        doc["stream_options"] = {"include_usage": True}
    if r.tools:
        doc["tools"] = TOOLS
    return doc


async def _one(session: aiohttp.ClientSession, url: str, keys: Mapping[str, str], r: TraceRecord, index: int,
               scheduled: float, exact_lengths: bool) -> Outcome:
    late = max(0.0, time.monotonic() - scheduled)
    headers = {"authorization": f"Bearer {keys[r.tenant]}", Header.DATA_CLASS: r.data_class}
    if r.idempotency_key:
        headers["idempotency-key"] = r.idempotency_key
    start = time.monotonic()
    first: float | None = None
    chunks, status, code, rid, attempts, usage_out, served = 0, 0, "", "", 0, 0, ""
    doc = body(r, index, exact_lengths)
    try:
        async with asyncio.timeout(r.cancel_after_s), session.post(url, json=doc, headers=headers) as resp:
            status, rid = resp.status, resp.headers.get("x-request-id", "")
            attempts = int(resp.headers.get(Header.ATTEMPTS, "1") or 1)
            served = resp.headers.get(Header.DEPLOYMENT, "")
            if status >= 300:
                answer = await resp.json(content_type=None)
                code = str((answer.get("error") or {}).get("code", "")) if isinstance(answer, dict) else ""
            elif r.stream:
                async for line in resp.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        usage_out = int(event["usage"].get("completion_tokens") or 0)
                    if any((c.get("delta") or {}).get("content") for c in event.get("choices") or []):
                        first = first or time.monotonic()
                        chunks += 1
            else:
                answer = await resp.json()
                usage_out = int((answer.get("usage") or {}).get("completion_tokens") or 0)
    except TimeoutError:  # the trace's client hung up (cancel_after_s)
        return Outcome(r, late, status, code, rid, None if first is None else first - start, None, None, 0,
                       attempts, True)
    except aiohttp.ClientError:
        return Outcome(r, late, 0, "connection_failed", rid, None, None, None, 0, attempts, False)
    end = time.monotonic()
    ok = 200 <= status < 300
    ttft = first - start if first is not None else None
    tpot = (end - first) / (chunks - 1) if first is not None and chunks > 1 else None
    return Outcome(r, late, status, code, rid, ttft, tpot, end - start if ok else None, usage_out, attempts, False,
                   served)


async def replay(url: str, keys: Mapping[str, str], trace: Sequence[TraceRecord], speed: float = 1.0,
                 exact_lengths: bool = True, connections: int = 4096) -> list[Outcome]:
    """Send every request at `at / speed` seconds from now, each on its own task."""
    limits = aiohttp.TCPConnector(limit=connections, limit_per_host=connections)
    async with aiohttp.ClientSession(connector=limits, timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.monotonic() + 0.05
        tasks = []
        for i, r in enumerate(trace):
            scheduled = t0 + r.at / speed
            delay = scheduled - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(_one(session, url, keys, r, i, scheduled, exact_lengths)))
        return list(await asyncio.gather(*tasks))


PERCENTILES = (50, 95, 99)


@dataclass(frozen=True)
class ClassSummary:
    request_class: str
    requests: int
    admitted: int
    refused: int  # answered with a contract error before any upstream
    timed_out: int
    cancelled: int  # by the trace's client
    ttft_s: tuple[float, ...]  # p50, p95, p99 of completed streams ((): none)
    tpot_s: tuple[float, ...]
    e2e_s: tuple[float, ...]
    output_tokens: int


def _pcts(values: list[float]) -> tuple[float, ...]:
    return tuple(percentile(values, p) for p in PERCENTILES) if values else ()


def summarise(outcomes: Sequence[Outcome]) -> list[ClassSummary]:
    by: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by.setdefault(o.record.request_class, []).append(o)
    out = []
    for cls, os_ in sorted(by.items()):
        out.append(ClassSummary(
            cls, len(os_), sum(o.admitted for o in os_),
            sum(not o.admitted and not o.cancelled and o.status >= 400 for o in os_),
            sum(o.timed_out for o in os_), sum(o.cancelled for o in os_),
            _pcts([o.ttft_s for o in os_ if o.ttft_s is not None and o.e2e_s is not None]),
            _pcts([o.tpot_s for o in os_ if o.tpot_s is not None]),
            _pcts([o.e2e_s for o in os_ if o.e2e_s is not None]),
            sum(o.output_tokens for o in os_)))
    return out
