"""Run the corpus against one deployment, through a real gateway, over real HTTP.

The deployment is not qualified yet, so it cannot be routed to on the policy as it stands. The runner
builds a sandbox: a copy of the policy directory with more routes whose only candidate is the deployment
under test, two for each route whose policy evidence is earned under (its retry and fallback policy and
request class copied, so the record binds to them): `conformance-<i>` (`translation_loss: report`, so
that what the adapter cannot carry is reported rather than refused) and `evaluate-<i>` (the route's own
loss rule, for `llmgw evaluate`). Provisional evidence records exist only in the copy, the corpus's
tools are in the catalog, and each tenant has a demo key. A gateway (Envoy, ext_proc, a store, and the
simulated engines of a pool) starts on that copy; every case goes through the whole request path like a
client's. Faults are injected through the upstream's admin API (enginesim's), for the case's request
only; an upstream without one (a real provider) does not run those cases (`not_run`), nor does one that
cannot be made to fail that way (vLLM has no refusal to inject). A case that looks at the ledger reads
the sandbox's store; one that looks at the upstream reads its request log.
"""

from __future__ import annotations

import http.client
import json
import random
import shutil
import socket
import string
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from extproc.config import Snapshot, load_snapshot
from extproc.config.schema import Deployment, Route
from extproc.contract import CHAT_PATH, EMBEDDINGS_PATH
from extproc.names import Header
from extproc.store import ledger_entry, ledger_key
from llmgw.conformance.corpus import OVER_CONTEXT, Case, Corpus, Outcome, check
from llmgw.conformance.record import provisional
from llmgw.local.sandbox import sandbox_policy
from llmgw.local.stack import Stack, StackOptions
from llmgw.ops.store import store_client
from llmgw.render.common import hp

SOURCE = "llmgw conformance"
LOST = ("unsupported", "emulated")  # a needed field reported so is not exercised: the case is `lost`


@dataclass
class CaseResult:
    id: str
    result: str  # pass | fail | lost | not_run
    detail: str = ""
    # The sandbox gateway, not the candidate, failed it (SANDBOX_FAULTS, still after the retries): the
    # run says nothing of the candidate and is never written as its record (demo_evidence.ensure).
    sandbox_fault: bool = False


def sandbox_faults(results: Iterable[CaseResult]) -> list[str]:
    """The cases of a run that the sandbox failed: a run with any says nothing of its candidate."""
    return [r.id for r in results if r.result == "fail" and r.sandbox_fault]


def not_recorded(faults: Sequence[str]) -> str:
    """What `llmgw conformance` and `llmgw evaluate` say of a run the sandbox failed: no record."""
    return (f"  not recorded: the sandbox gateway failed {', '.join(faults[:5])} itself (it was not ready: a loaded "
            "machine), which says nothing of the candidate; run it again")


@dataclass
class Run:
    deployment_ref: str
    adapter: str
    corpus_version: str
    results: list[CaseResult] = field(default_factory=list)
    losses: set[str] = field(default_factory=set)
    corpus_digest: str = ""
    route: str = ""  # the route whose policy it ran under

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.result != "fail" for r in self.results)

    def evidence(self, today: date, valid_days: int) -> dict[str, Any]:
        """The record `evidence/<deployment>-conformance.yaml` holds (extproc/config/schema.Evidence)."""
        return {
            "deployment_ref": self.deployment_ref, "kind": "conformance",
            "result": "pass" if self.passed else "fail", "recorded_at": today.isoformat(),
            "expires_at": (today + timedelta(days=valid_days)).isoformat(), "source": SOURCE,
            "adapter": self.adapter, "corpus_version": self.corpus_version, "losses": sorted(self.losses),
            "cases": [{"id": r.id, "result": r.result, **({"detail": r.detail} if r.detail else {})}
                      for r in self.results],
        }


def marker(prefix: str = "conformance-") -> str:
    """Text that matches a fault to one request. Letters only: redaction (a run of digits can read as a
    phone number) leaves it alone, so the upstream sees it and its fault applies."""
    return prefix + "".join(random.choices(string.ascii_lowercase, k=16))


def route_for(snap: Snapshot, deployment: str, route: str | None) -> Route:
    """The route whose retry and fallback policy (and request class) evidence for `deployment` is earned
    under: the one named, which must have it as a candidate, else the first route that has."""
    having = [r for _, r in sorted(snap.routes.items()) if any(c.deployment_name == deployment for c in r.candidates)]
    if route is not None:
        found = next((r for r in having if r.route_contract == route), None)
        if found is None:
            raise ValueError(f"route {route!r} has no candidate {deployment}")
        return found
    if not having:
        raise ValueError(f"no route has {deployment} as a candidate: evidence is earned under a route's policy")
    return having[0]


@dataclass(frozen=True)
class Sandbox:
    """A sandbox policy (see the module's doc): where it is, the deployment's reference, a tenant and
    its key, and for each route evidence is earned under, the sandbox's own routes copying its policy:
    `conformance-<i>` (losses reported) and `evaluate-<i>` (the route's own loss rule)."""

    policy: Path
    ref: str
    tenant: str
    key: str
    routes: dict[str, int]  # real route -> i


def sandbox(config: Path, deployment: str, work: Path, routes: Sequence[Route],
            requests: Iterable[dict[str, Any]] = (), one_engine: bool = False) -> Sandbox:
    """The sandbox policy for `deployment`, its routes copying the retry and fallback policy and the
    request class of each of `routes`, with the tools of `requests` in the catalog. `one_engine`: each
    pool keeps its first endpoint only (real engines: one answers the corpus, and two do not fit a
    small machine)."""
    snap = load_snapshot(config)
    dep = snap.deployments[deployment]
    policy, keys = sandbox_policy(config, work / "policy")
    # Only its own provisional records below: whatever the policy holds of this candidate - a record
    # that failed, a void, a record earned under a clock that ran ahead - is what the run is to
    # replace, and must not stand between the sandbox and the candidate (nor may the earned state of
    # the gateway that started it: the sandbox's processes read their own, Stack._extproc_env).
    shutil.rmtree(policy / "evidence", ignore_errors=True)
    (policy / "evidence").mkdir()
    today = datetime.now(UTC).date()
    for i, real in enumerate(routes, 1):
        for purpose, loss in (("conformance", "report"), ("evaluate", real.translation_loss)):
            route = {
                "route_contract": f"{purpose}-{i}", "request_class": real.request_class, "serves": dep.serves,
                "translation_loss": loss, "answer_checks": real.answer_checks,
                "candidates": [{"deployment_ref": dep.ref, "adapter_ref": dep.fingerprint.adapter,
                                "data_classes": list(dep.data_classes), "regions": list(dep.regions)}],
                "deadline_ms": 30000, "max_tokens_cap": 4096, "budget_reservation": "required",
                "retry": real.retry.model_dump(mode="json"), "fallback": real.fallback.model_dump(mode="json"),
            }
            (policy / f"routes/{purpose}-{i}.yaml").write_text(yaml.safe_dump(route))
        for kind, record in provisional(snap, dep, real, today).items():
            (policy / f"evidence/{deployment}-{kind}-sandbox-{i}.yaml").write_text(yaml.safe_dump(record))
    gw = yaml.safe_load((policy / "gateway.yaml").read_text())
    tools = gw.setdefault("tools", {})
    for request in requests:
        for tool in request.get("tools") or ():
            tools.setdefault(tool["function"]["name"], {"effects": []})
    for pool in gw.get("pools", {}).values() if one_engine else ():
        pool["endpoints"] = pool["endpoints"][:1]
    (policy / "gateway.yaml").write_text(yaml.safe_dump(gw))
    tenant = next(t for t in gw["tenants"] if set(dep.data_classes) & set(gw["tenants"][t]["allowed_data_classes"]))
    return Sandbox(policy, dep.ref, tenant, keys[tenant], {r.route_contract: i for i, r in enumerate(routes, 1)})


class Upstreams:
    """The upstream's admin API (enginesim's) where it has one: faults for one request each."""

    def __init__(self, urls: list[str]):
        self.urls = [u for u in urls if _admin(u, "DELETE", "/admin/faults") == 200]
        self.injectable = bool(urls) and len(self.urls) == len(urls)

    def inject(self, spec: str, match: str) -> bool:
        """Whether every upstream took the fault (one that cannot fail so refuses it)."""
        for u in self.urls:
            # Enough for every attempt the route may make (and the picker's spread over engines).
            if _admin(u, "POST", "/admin/faults", {"fault": spec, "count": 8, "match": match}) != 200:
                self.clear()
                return False
        return True

    def logged(self, mark: str, key: str, wait: float = 5.0) -> dict[str, Any] | None:
        """The upstream's log entry of the request holding `mark`, once it holds `key`."""
        deadline = time.monotonic() + wait
        while True:
            for u in self.urls:
                entries = _admin_json(u, "/admin/requests") or []
                found = [e for e in entries if mark in json.dumps(e.get("messages"))]
                if found and key in found[-1]:
                    return dict(found[-1])
            if time.monotonic() > deadline:
                return found[-1] if found else None
            time.sleep(0.05)

    def clear(self) -> None:
        for u in self.urls:
            _admin(u, "DELETE", "/admin/faults")


def _admin(url: str, method: str, path: str, body: Any = None) -> int:
    u = urlsplit(url)
    try:
        conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=5)
        conn.request(method, path, json.dumps(body) if body is not None else None,
                     {"content-type": "application/json"})
        status = conn.getresponse().status
        conn.close()
        return status
    except OSError:
        return 0


def _admin_json(url: str, path: str) -> Any:
    u = urlsplit(url)
    try:
        conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=5)
        conn.request("GET", path)
        data = conn.getresponse().read()
        conn.close()
        return json.loads(data)
    except (OSError, ValueError):
        return None


def ledger_of(store_url: str, tenant: str, rid: str, wait: float = 5.0) -> dict[str, Any] | None:
    """The request's ledger entry, once settlement wrote it."""
    r = store_client(store_url)
    deadline = time.monotonic() + wait
    try:
        while time.monotonic() < deadline:
            entries: Any = r.xrange(ledger_key(tenant))
            for _, fields in entries:
                if (entry := ledger_entry(fields)).get("request_id") == rid:
                    return entry
            time.sleep(0.05)
    finally:
        r.close()
    return None


# More tokens than the window in as few bytes as a tokenizer allows (a letter and a space: a token
# each): a million-token window's filler stays inside the gateway's 4 MiB body limit, so the case meets
# the window's refusal, not the body limit's 413.
OVER_CONTEXT_WORD = "a "


def _body(case: Case, route: str, context_window: int, mark: str | None) -> dict[str, Any]:
    body = json.loads(json.dumps(case.request))
    body["model"] = route
    if body.get("input") == OVER_CONTEXT:  # an embeddings case's
        body["input"] = OVER_CONTEXT_WORD * (context_window + 64)
    for m in body.get("messages") or ():
        if m.get("content") == OVER_CONTEXT:
            m["content"] = OVER_CONTEXT_WORD * (context_window + 64)
    if mark:
        last = next(m for m in reversed(body["messages"]) if m.get("role") == "user")
        last["content"] = f"{last['content']} {mark}"
    return body


def _read_until(resp: http.client.HTTPResponse, chunks: int) -> tuple[bytes, bool]:
    """A stream read until it has held `chunks` content deltas (then the caller hangs up) or ended;
    (what arrived, whether the count was reached)."""
    data = b""
    while piece := resp.read1(65536):
        data += piece
        if data.count(b'"content":"') - data.count(b'"content":""') >= chunks:
            return data, True
    return data, False


# The sandbox gateway's own failures, never the candidate's: a worker just started that missed a
# decision on a loaded machine (it fails closed), and no qualified route - the sandbox's routes have one
# candidate, with records the sandbox wrote itself, and no case of a corpus expects the refusal, so it
# means the gateway was not ready for it (its workers not yet serving the sandbox's revision, the
# candidate's upstream marked down by a fault case before it). Such a request is sent again, backing off.
SANDBOX_FAULTS = ("policy_unavailable", "no_qualified_route")
SANDBOX_RETRIES_S = (0.5, 1.0, 2.0, 4.0)


def sandbox_failed(out: Outcome) -> bool:
    return out.status == 503 and out.error in SANDBOX_FAULTS


def send(url: str, key: str, body: dict[str, Any], headers: dict[str, str],
         cancel_after: int | None = None, path: str = CHAT_PATH) -> Outcome:
    """One request as the client sends it, and what it got (again, backing off, while the sandbox failed it)."""
    out = _send(url, key, body, headers, cancel_after, path)
    for pause in SANDBOX_RETRIES_S:
        if not sandbox_failed(out):
            break
        time.sleep(pause)
        out = _send(url, key, body, headers, cancel_after, path)
    return out


def _send(url: str, key: str, body: dict[str, Any], headers: dict[str, str],
          cancel_after: int | None, path: str) -> Outcome:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=60)
    cancelled = reset = False
    try:
        conn.request("POST", path, json.dumps(body),
                     {"authorization": f"Bearer {key}", "content-type": "application/json", **headers})
        resp = conn.getresponse()
        try:
            if cancel_after is not None and resp.status == 200:
                data, cancelled = _read_until(resp, cancel_after)
                if cancelled and conn.sock is not None:  # the client hangs up mid-stream
                    conn.sock.shutdown(socket.SHUT_RDWR)
            else:
                data = resp.read()
        except http.client.IncompleteRead as cut:
            data, reset = cut.partial, True
    except (OSError, http.client.HTTPException) as e:
        return Outcome(0, error=f"transport: {e}")
    finally:
        conn.close()
    losses = [part.strip() for part in (resp.getheader(Header.TRANSLATION_LOSS) or "").split(",") if part.strip()]
    if body.get("stream"):
        out = Outcome.from_stream(resp.status, data, losses, reset)
        if cancelled:
            out.stream_end = "cancelled"
    else:
        try:
            doc = json.loads(data)
        except ValueError:
            doc = None
        out = Outcome.from_json(resp.status, doc, losses)
    out.request_id = resp.getheader("x-request-id") or ""
    return out


@dataclass(frozen=True)
class Gateway:
    """The sandbox gateway a case goes through: where to send, as whom, its store, the route to name."""

    url: str
    tenant: str
    key: str
    store_url: str
    route: str


def run_case(case: Case, gw: Gateway, context_window: int, upstreams: Upstreams,
             path: str = CHAT_PATH) -> tuple[CaseResult, list[str]]:
    if case.fault and not upstreams.injectable:
        return CaseResult(case.id, "not_run", "needs fault injection (the simulator's admin API)"), []
    mark = marker() if case.fault else None
    if case.fault and mark and not upstreams.inject(case.fault, mark):
        return CaseResult(case.id, "not_run", f"the upstream cannot be made to fail so ({case.fault})"), []
    try:
        body = _body(case, gw.route, context_window, mark)
        outcomes = [send(gw.url, gw.key, body, case.headers, case.cancel_after, path) for _ in range(case.repeat)]
        if case.expect.ledger_termination is not None:
            outcomes[0].ledger = ledger_of(gw.store_url, gw.tenant, outcomes[0].request_id)
        if case.expect.upstream_cancelled and mark:
            outcomes[0].upstream = upstreams.logged(mark, "cancelled")
    finally:
        if case.fault:
            upstreams.clear()
    losses = outcomes[0].losses
    reported = dict(entry.rstrip(")").split(" (", 1) for entry in losses if " (" in entry)
    lost = [f for f in case.needs if reported.get(f) in LOST]
    if lost:
        return CaseResult(case.id, "lost", f"the adapter does not carry {', '.join(lost)}"), losses
    bad = check(case, outcomes)
    return CaseResult(case.id, "fail" if bad else "pass", "; ".join(bad),
                      sandbox_fault=any(sandbox_failed(o) for o in outcomes)), losses


@dataclass
class Session:
    """A sandboxed gateway up for one deployment: where to send as whom (per route evidence is earned
    under), its upstreams' admin APIs, the deployment as the sandbox has it."""

    sandbox: Sandbox
    stack: Stack
    dep: Deployment
    upstreams: Upstreams

    def gateway(self, purpose: str, route: str) -> Gateway:
        sb = self.sandbox
        return Gateway(self.stack.url, sb.tenant, sb.key, str(self.stack.store_url),
                       f"{purpose}-{sb.routes[route]}")


@contextmanager
def session(config: Path, deployment: str, work: Path, routes: Sequence[Route],
            requests: Iterable[dict[str, Any]] = (), time_scale: float = 0.02, engine_args: tuple[str, ...] = (),
            simulate_providers: bool = False, engine: str = "sim", sim_quality: float | None = None
            ) -> Iterator[Session]:
    """A sandboxed gateway for `deployment` (see the module's doc); a pool's engines are simulated
    (started with `engine_args`, answering quality tasks right on `sim_quality` of them) or real vLLM
    (`engine="vllm"`); with `simulate_providers`, a simulated provider for each hosted deployment on
    loopback (as `llmgw up` does)."""
    sb = sandbox(config, deployment, work, routes, requests, one_engine=engine == "vllm")
    snap = load_snapshot(sb.policy, earned=work / "gateway" / "evidence")
    dep = snap.deployments[deployment]
    opts = StackOptions.on_free_ports(sb.policy, work / "gateway", snap, time_scale=time_scale, workers=1,
                                      envoy_concurrency=1, engine_args=engine_args,
                                      simulate_providers=simulate_providers, engine=engine,
                                      engine_timeout=300.0 if engine == "vllm" else 60.0, sim_quality=sim_quality)
    stack = Stack(opts).start(timeout=300 if engine == "vllm" else 60)
    try:
        hosts = stack.render.providers.get(deployment) or tuple(hp(e) for e in dep.endpoints)
        urls = stack.engine_urls(dep.pool) if dep.pool else [f"http://{h}:{p}" for h, p in hosts]
        yield Session(sb, stack, dep, Upstreams(urls))
    finally:
        stack.stop()


def run_corpus(s: Session, corpus: Corpus, route: str, only: set[str] | None = None) -> Run:
    """The conformance corpus through the session's gateway, under `route`'s policy."""
    if corpus.serves != s.dep.serves:
        raise ValueError(f"{s.dep.deployment} serves {s.dep.serves}; this corpus is for {corpus.serves}")
    result = Run(s.sandbox.ref, s.dep.fingerprint.adapter, corpus.version, corpus_digest=corpus.digest)
    gw = s.gateway("conformance", route)
    for case in corpus.cases:
        if only and case.id not in only:
            continue
        outcome, losses = run_case(case, gw, s.dep.context_window, s.upstreams,
                                   EMBEDDINGS_PATH if corpus.serves == "embeddings" else CHAT_PATH)
        result.results.append(outcome)
        result.losses.update(losses)
    return result


def run(config: Path, deployment: str, corpus: Corpus, work: Path, time_scale: float = 0.02,
        only: set[str] | None = None, engine_args: tuple[str, ...] = (), simulate_providers: bool = False,
        engine: str = "sim", route: str | None = None) -> Run:
    """The corpus against `deployment` of the policy at `config`, under `route`'s retry and fallback
    policy (default: the first route that has it as a candidate), in a session of its own."""
    real = route_for(load_snapshot(config), deployment, route)
    with session(config, deployment, work, [real], corpus.cases_requests(), time_scale, engine_args,
                 simulate_providers, engine) as s:
        result = run_corpus(s, corpus, real.route_contract, only)
    result.route = real.route_contract
    return result
