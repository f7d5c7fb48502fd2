"""Whether each pool's engines serve what their deployment's fingerprint declares (invariant 17).

Evidence is earned by a fingerprint; an engine that quietly serves another model, another context
window, another vLLM or another KV cache configuration is another system, whose evidence nobody
earned. Each engine of a pool is asked what it serves, the way vLLM's server answers:

- `GET /v1/models`: the served model (`id`) and `max_model_len`, against the deployment's
  `served_model` and `context_window`;
- `GET /version`: vLLM's version, against the fingerprint's `engine` (`vllm@<version>`);
- `GET /metrics`: the `vllm:cache_config_info` gauge's labels (`block_size`, `enable_prefix_caching`)
  against the fingerprint's `kv_cache_policy` (`prefix-caching` or `no-prefix-caching`, `block<N>`).

Batching settings (`max-num-seqs`, `max-batched-tokens`) have no signal in vLLM's server and are not
checked. An engine that does not answer is a health matter (Envoy's outlier detection), not a mismatch.

A hosted deployment is not probed (a request to a provider costs money); its answers are read instead:
the ledger keeps the model each answer named (`upstream_model`), which must be the deployment's
`served_model` or a dated version of it (`gpt-4o` answered as `gpt-4o-2024-08-06`; a model whose name
merely extends it, `gpt-4o-mini`, passes too: the rule cannot tell). A Bedrock answer names no model.
An answer that names another writes `voids/<deployment>-model_mismatch-<date>.yaml` (in the earned
state, extproc/config/earned.py), a run-time trigger like the ledger's others: it voids the records
earned before it fired, so the candidate is back once its evidence is earned again, against the
provider as it now answers (the answers before that record count no more).

A mismatch writes a void record, `voids/<deployment>-engine_mismatch.yaml`, which voids every
record of the fingerprint while it exists (the candidate leaves routing at the workers' next reload);
the check removes it once every engine of the deployment serves what it declares again: the records
were earned by that very fingerprint. `llmgw engines verify` runs it once; `llmgw up` every
`loops.engine_verify_s`.
"""

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from extproc.config import Snapshot
from extproc.config.earned import voids_dir
from extproc.config.evidence import ENGINE_MISMATCH
from extproc.config.schema import Deployment
from llmgw.ops.ledger import ledger_entries
from llmgw.ops.reevaluate import after_earning, write_void

TRIGGER = ENGINE_MISMATCH
ANSWERS = "answers"  # a Finding's `engine` when the ledger's answers, not a probe, showed it


@dataclass(frozen=True)
class Served:
    """What one engine says it serves (None: it did not say)."""

    models: tuple[str, ...] | None
    max_model_len: int | None
    version: str | None
    cache: Mapping[str, str] | None


@dataclass(frozen=True)
class Finding:
    deployment: str
    engine: str  # host:port
    field: str
    declared: str
    served: str

    def __str__(self) -> str:
        who = "its answers name" if self.engine == ANSWERS else f"engine {self.engine} serves"
        return f"{who} {self.field} {self.served!r}, the fingerprint declares {self.declared!r}"


def _get(url: str, path: str, timeout: float) -> tuple[int, bytes]:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


CACHE_INFO = re.compile(r'^vllm:cache_config_info\{(?P<labels>[^}]*)\}', re.MULTILINE)
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def probe(url: str, timeout: float = 2.0) -> Served | None:
    """What the engine at `url` serves; None when it does not answer at all."""
    try:
        status, body = _get(url, "/v1/models", timeout)
    except OSError:
        return None
    models: tuple[str, ...] | None = None
    window: int | None = None
    if status == 200:
        try:
            data = json.loads(body).get("data") or []
            entries = [m for m in data if isinstance(m, dict)]
            models = tuple(str(m.get("id")) for m in entries)
            lens = [int(m["max_model_len"]) for m in entries if isinstance(m.get("max_model_len"), int)]
            window = max(lens) if lens else None
        except (ValueError, AttributeError):
            models = None
    version = cache = None
    try:
        status, body = _get(url, "/version", timeout)
        if status == 200:
            version = str(json.loads(body).get("version"))
    except (OSError, ValueError, AttributeError):
        pass
    try:
        status, body = _get(url, "/metrics", timeout)
        found = CACHE_INFO.search(body.decode("utf-8", "replace")) if status == 200 else None
        cache = dict(LABEL.findall(found.group("labels"))) if found else None
    except OSError:
        pass
    return Served(models, window, version, cache)


def declared_cache(kv_cache_policy: str) -> dict[str, str]:
    """The `cache_config_info` labels a fingerprint's `kv_cache_policy` declares (those it names)."""
    out = {}
    for part in (p.strip() for p in kv_cache_policy.split(",")):
        if part in ("prefix-caching", "no-prefix-caching"):
            out["enable_prefix_caching"] = "True" if part == "prefix-caching" else "False"
        elif m := re.fullmatch(r"block(\d+)", part):
            out["block_size"] = m.group(1)
    return out


def compare(dep: Deployment, engine: str, served: Served) -> list[Finding]:
    """Every declared field the engine serves otherwise. A field it does not report is not compared,
    except the served model: an engine that names no model serves none of the declared one."""
    out = []

    def differs(field: str, declared: object, got: object) -> None:
        out.append(Finding(dep.deployment, engine, field, str(declared), str(got)))

    if served.models is None or dep.served_model not in served.models:
        differs("model", dep.served_model, ", ".join(served.models or ()) or "none")
    if served.max_model_len is not None and served.max_model_len != dep.context_window:
        differs("max_model_len", dep.context_window, served.max_model_len)
    name, _, version = dep.fingerprint.engine.partition("@")
    if name == "vllm" and version and served.version is not None and served.version != version:
        differs("engine version", version, served.version)
    for label, want in declared_cache(dep.fingerprint.kv_cache_policy).items():
        got = (served.cache or {}).get(label)
        if served.cache is not None and got != want:
            differs(f"cache_config_info {label}", want, got)
    return out


@dataclass(frozen=True)
class Check:
    findings: tuple[Finding, ...]
    unreachable: tuple[str, ...]  # engines that did not answer
    matching: tuple[str, ...]  # deployments whose every answering engine serves what they declare


def verify(snap: Snapshot, engines: Mapping[str, Sequence[str]], timeout: float = 2.0) -> Check:
    """Every pool deployment's engines (`engines`: pool -> base URLs) against its fingerprint."""
    findings: list[Finding] = []
    unreachable: list[str] = []
    matching: list[str] = []
    for name, dep in sorted(snap.deployments.items()):
        if dep.pool is None or dep.withdrawn:
            continue
        mine: list[Finding] = []
        answered = 0
        for url in engines.get(dep.pool, ()):
            engine = urlsplit(url).netloc
            served = probe(url, timeout)
            if served is None:
                unreachable.append(engine)
                continue
            answered += 1
            mine += compare(dep, engine, served)
        findings += mine
        if answered and not mine:
            matching.append(name)
    return Check(tuple(findings), tuple(sorted(set(unreachable))), tuple(matching))


def names_model(answered: str, declared: str) -> bool:
    """Whether an answer's model is the declared one or a dated version of it."""
    return answered == declared or answered.startswith(declared + "-")


def answer_findings(snap: Snapshot, entries: Sequence[Mapping[str, Any]]) -> list[Finding]:
    """Hosted deployments whose answers (ledger entries' attempts) named another model than declared:
    the first such answer of each."""
    out: dict[str, Finding] = {}
    for entry in entries:
        for attempt in entry.get("attempts") or ():
            dep = snap.deployments.get(str(attempt.get("deployment") or ""))
            model = str(attempt.get("upstream_model") or "")
            if dep is None or dep.pool is not None or not model or names_model(model, dep.served_model):
                continue
            out.setdefault(dep.deployment, Finding(dep.deployment, ANSWERS, "model", dep.served_model, model))
    return list(out.values())


def answers_since(snap: Snapshot, client: Any, since: float) -> list[Finding]:
    """`answer_findings` over the ledger's entries that arrived at or after `since`, each answered
    after its deployment's newest record was earned (what came before is about the candidate it replaced)."""
    return answer_findings(snap, after_earning(ledger_entries(client, sorted(snap.gateway.tenants), since=since),
                                               snap))


def model_voids(snap: Snapshot, findings: Sequence[Finding], now: datetime) -> list[Path]:
    """A `model_mismatch` void per deployment whose answers named another model: one a day, unless
    evidence was earned again since the day's void fired."""
    written = []
    for f in findings:
        dep = snap.deployments[f.deployment]
        name = f"{f.deployment}-model_mismatch-{now.date().isoformat()}.yaml"
        held = next((v for v in snap.voids if v.deployment_ref == dep.ref and v.trigger == "model_mismatch"
                     and v.recorded_at == now.date()), None)
        if held is not None and (dep.ref not in snap.earned or held.moment() >= snap.earned[dep.ref]):
            continue
        written.append(write_void(snap.directory, name, dep.ref, "model_mismatch", str(f), now))
    return written


def void_path(directory: Path, deployment: str) -> Path:
    return voids_dir(directory) / f"{deployment}-{TRIGGER}.yaml"


def apply(snap: Snapshot, check: Check, now: datetime) -> tuple[list[Path], list[Path]]:
    """The check's consequences in the policy directory: a void per mismatched deployment (rewritten
    only when its reason changed, so the workers reload once), and the voids of deployments that match
    again removed. Returns (written, removed)."""
    directory = snap.directory
    written, removed = [], []
    by_dep: dict[str, list[Finding]] = {}
    for f in check.findings:
        by_dep.setdefault(f.deployment, []).append(f)
    for name, found in sorted(by_dep.items()):
        path = void_path(directory, name)
        ref, reason = snap.deployments[name].ref, "; ".join(str(f) for f in found)[:1000]
        try:
            held = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):
            held = None
        if isinstance(held, dict) and held.get("reason") == reason and held.get("deployment_ref") == ref:
            continue
        written.append(write_void(directory, path.name, ref, TRIGGER, reason, now, header=(
            "# Written by the engine check (llmgw/ops/engines.py): removed when the engines serve what\n"
            "# the fingerprint declares again.\n")))
    for name in check.matching:
        path = void_path(directory, name)
        if name not in by_dep and path.exists():
            path.unlink()
            removed.append(path)
    return written, removed
