"""Turns a policy directory into one immutable, cross-checked Snapshot with a revision hash.

The hot path only reads the Snapshot; nothing here runs per request.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import date, datetime, timedelta
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError
from yaml.nodes import Node

from extproc.config import positions
from extproc.config.earned import VOIDS, evidence_dirs
from extproc.config.evidence import sift
from extproc.config.policy import CompiledPolicy, PolicyCompileError
from extproc.config.schema import (
    RETIRE_WARNING_DAYS,
    ApiKey,
    Deployment,
    Evidence,
    EvidenceVoid,
    GatewayConfig,
    KeysFile,
    Prices,
    Route,
    Tool,
    ToolPack,
    required_evidence,
)
from extproc.corpora import quality_corpus, shipped_quality
from extproc.names import POOL_CLUSTER_PREFIX
from extproc.shapes.registry import check_options
from extproc.tool_catalog import Entry, Pack, ToolCatalog
from extproc.tool_packs import shipped, shipped_names

M = TypeVar("M", bound=BaseModel)
RECORD_DATE_GRACE = timedelta(days=1)  # how far past `today` an evidence record may be dated


@dataclass(frozen=True)
class ConfigIssue:
    """One problem: its file relative to the policy directory, the field (a dotted path) and, where
    known, the line and column (1-based). Printed `path:line:col: field: message`, the form editors
    and CI annotators jump from, with the path under the directory as the user named it."""

    file: str
    field: str
    message: str
    line: int = 0
    column: int = 0
    directory: str = ""  # the policy directory as the user gave it

    @property
    def path(self) -> str:
        return os.path.normpath(os.path.join(self.directory, self.file)) if self.directory else self.file

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}:{self.column}" if self.line else self.path

    @property
    def what(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


class ConfigError(Exception):
    """Every problem found in a policy directory, each naming its file and field."""

    def __init__(self, issues: list[ConfigIssue]):
        self.issues = issues
        super().__init__("\n".join(str(i) for i in issues))


@dataclass(frozen=True)
class KeyOwner:
    tenant: str
    key: ApiKey


@dataclass(frozen=True)
class Snapshot:
    directory: Path
    gateway: GatewayConfig
    routes: Mapping[str, Route]
    deployments: Mapping[str, Deployment]
    rego: Mapping[str, str]
    revision: str
    warnings: tuple[str, ...] = ()
    keys_by_hash: Mapping[str, KeyOwner] = field(default_factory=dict)
    evidence: Mapping[str, tuple[Evidence, ...]] = field(default_factory=dict)  # by deployment_ref, still valid
    voided: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # deployment_ref -> why records were voided
    void_triggers: Mapping[str, frozenset[str]] = field(default_factory=dict)  # the run-time triggers among them
    voids: tuple[EvidenceVoid, ...] = ()  # every run-time void read, fired or not
    # deployment_ref -> when its newest record was earned, counted or not: what the ledger says of it
    # from before then (drift, SLO regression) is about what that record replaced.
    earned: Mapping[str, datetime] = field(default_factory=dict)
    policy: CompiledPolicy | None = None  # None only for snapshots built without their Rego
    dry_run_policy: CompiledPolicy | None = None  # gateway.yaml policy_dry_run's candidate, never enforced
    policy_data: Mapping[str, Any] = field(default_factory=dict)  # data.gateway, for `llmgw policy test`
    tools: ToolCatalog = field(default_factory=ToolCatalog)  # gateway.yaml's tools and its tool packs

    def passing_evidence(self, deployment_ref: str, route: Route, today: date, until: date | None = None) -> set[str]:
        """Kinds of evidence that pass for exactly this fingerprint as a candidate of `route`: earned
        under the route's retry and fallback policy (a quality gate: for its request class; a load
        record: with its class among those judged),
        unexpired at `until` (default `today`). A record dated after `today` (a day's grace: records
        are dated in UTC, `today` may be a local date) was made under a clock that ran ahead, or by
        hand: it proves nothing yet, and as its kind's latest record it hides the earlier ones, so the
        kind does not pass (fail closed)."""
        latest, end = today + RECORD_DATE_GRACE, until or today
        return {e.kind for e in self.records_for(deployment_ref, route)
                if e.result == "pass" and e.recorded_at <= latest and (e.expires_at is None or e.expires_at > end)}

    def records_for(self, deployment_ref: str, route: Route) -> list[Evidence]:
        """The fingerprint's records that speak for it as a candidate of `route`, passing or not:
        earned under the route's retry and fallback policy; a quality gate, for its request class; a
        load record, with its class among those judged."""
        return [e for e in self.evidence.get(deployment_ref, ())
                if e.basis is not None and e.basis.route_policy_digest == route.policy_digest
                and (e.kind != "quality_gate" or e.request_class == route.request_class)
                and (e.kind != "load" or (e.load is not None and route.request_class in e.load.classes))]

    def missing_evidence(self, route: Route, deployment_ref: str, today: date, until: date | None = None) -> set[str]:
        """The kinds a candidate of `route` still needs a passing record of (empty: qualified)."""
        return set(required_evidence(self.gateway, route)) - self.passing_evidence(deployment_ref, route, today, until)

    def why_unqualified(self, route: Route, deployment_ref: str, today: date) -> str:
        """`llmgw check`'s words for a candidate that is not qualified: what is missing, and what
        became of the records it has."""
        missing = sorted(self.missing_evidence(route, deployment_ref, today))
        if not missing:
            return ""
        out = f"no passing {', '.join(missing)} evidence"
        records = [e for e in self.evidence.get(deployment_ref, ()) if e.kind in missing and e.basis is not None]
        other = sorted({e.basis.route_policy_digest or "" for e in records if e.basis is not None} - {""})
        if other and route.policy_digest not in other:
            out += (f" for this route's retry/fallback policy {route.policy_digest} (records earned under "
                    f"{', '.join(str(o) for o in other)})")
        if self.voided.get(deployment_ref):
            out += f" (voided: {'; '.join(self.voided[deployment_ref])})"
        return out

    def demo_keys_exposed_on(self, host: str) -> list[str]:
        """Ids of the demo keys (made by `llmgw up`) a gateway reachable at `host` would accept from
        beyond this machine: none on loopback."""
        if is_loopback(host):
            return []
        return sorted(o.key.id for o in self.keys_by_hash.values() if o.key.demo and not o.key.revoked)

    def pool_of(self, deployment: Deployment) -> str:
        """Envoy cluster name for a deployment's upstream."""
        return f"{POOL_CLUSTER_PREFIX}{deployment.pool}" if deployment.pool else f"dep_{deployment.deployment}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


Trees = dict[str, Node | None]  # each file's YAML node tree, by path relative to the policy directory
UNREADABLE = object()  # a file whose problem is already reported: nothing more to say of its content


def _rel(path: Path, root: Path) -> str:
    """A file's name as issues print it: under the policy directory, else as it is (earned evidence)."""
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def _read_yaml(path: Path, root: Path, issues: list[ConfigIssue], trees: Trees) -> Any:
    rel = _rel(path, root)
    try:
        data, trees[rel] = positions.read(path.read_text(encoding="utf-8"))
        return data
    except yaml.YAMLError as e:
        message, line, column = positions.syntax_error(e)
        issues.append(ConfigIssue(rel, "", f"cannot read YAML: {message}", line, column))
    except (OSError, UnicodeDecodeError) as e:
        issues.append(ConfigIssue(rel, "", f"cannot read YAML: {e}"))
    return UNREADABLE


def _placed(issues: list[ConfigIssue], trees: Trees, directory: str) -> list[ConfigIssue]:
    """Each issue with the line and column of its field (where it has none yet) and the directory it
    is printed under."""
    out = []
    for i in issues:
        line, column = (i.line, i.column) if i.line else positions.locate(trees.get(i.file), i.field)
        out.append(replace(i, line=line, column=column, directory=directory))
    return out


def _parse(model: type[M], data: Any, rel: str, issues: list[ConfigIssue]) -> M | None:
    if data is UNREADABLE:
        return None
    if not isinstance(data, dict):
        issues.append(ConfigIssue(rel, "", "expected a mapping at the top level"))
        return None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            if not loc and ": " in msg:  # model-level checks name their field first
                loc, msg = msg.split(": ", 1)
            issues.append(ConfigIssue(rel, loc, msg))
        return None


def _revision(gateway: GatewayConfig, routes: dict[str, Route], deployments: dict[str, Deployment],
              rego: dict[str, str], evidence: dict[str, list[Evidence]], keys: list[Any],
              voids: list[EvidenceVoid], packs: list[ToolPack]) -> str:
    doc = {
        **({"tool_packs": [p.model_dump(mode="json") for p in packs]} if packs else {}),
        "keys": keys,
        **({"evidence_voids": [v.model_dump(mode="json") for v in voids]} if voids else {}),
        "evidence": {k: [e.model_dump(mode="json") for e in v] for k, v in sorted(evidence.items())},
        "gateway": gateway.model_dump(mode="json"),
        "routes": {k: v.model_dump(mode="json") for k, v in sorted(routes.items())},
        "deployments": {k: v.model_dump(mode="json") for k, v in sorted(deployments.items())},
        "rego": dict(sorted(rego.items())),
    }
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def policy_data(gateway: GatewayConfig, catalog: ToolCatalog | None = None) -> dict[str, Any]:
    """The static facts Rego sees as `data.gateway`: baked into the bundle, not sent per request."""
    return {
        "data_classes": list(gateway.data_classes),
        "class_rank": {c: i for i, c in enumerate(gateway.data_classes)},
        "tenants": {name: {"allowed_data_classes": list(t.allowed_data_classes),
                           "regions": list(t.regions) if t.regions is not None else None,
                           "tool_effects": list(t.tool_effects)}
                    for name, t in gateway.tenants.items()},
        # Every catalog entry, `pattern [clients]` -> its effects and where it is written (requests carry
        # each offered tool's resolved facts: extproc/stages/authorize.py).
        "tools": dict((catalog or tool_catalog(gateway, [])).listed()),
        "redaction": {"entities": list(gateway.redaction.entities),
                      "from_data_class": gateway.redaction.from_data_class},
    }


def _entries(tools: Mapping[str, Tool], listed_by: str, clients: tuple[str, ...] = ()) -> tuple[Entry, ...]:
    return tuple(Entry(name, t.effects, t.clients or clients, listed_by) for name, t in tools.items())


def _tool_packs(gateway: GatewayConfig, root: Path, issues: list[ConfigIssue]) -> list[ToolPack]:
    """gateway.yaml's `tool_packs`: a shipped pack by name, or a .yaml file in the policy directory."""
    packs: list[ToolPack] = []
    for i, ref in enumerate(gateway.tool_packs):
        path = (root / ref) if ref.endswith((".yaml", ".yml")) else shipped(ref)
        if path is None or not path.is_file():
            issues.append(ConfigIssue("gateway.yaml", f"tool_packs.{i}", f"no tool pack {ref!r}: a shipped one "
                                      f"({', '.join(shipped_names())}) or a .yaml file in the policy directory"))
            continue
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as e:
            issues.append(ConfigIssue("gateway.yaml", f"tool_packs.{i}", f"{ref}: {e}"))
            continue
        pack = _parse(ToolPack, data, f"tool pack {ref}", issues)
        if pack is not None:
            packs.append(pack)
    clients = [p.client for p in packs]
    for c in {c for c in clients if clients.count(c) > 1}:
        issues.append(ConfigIssue("gateway.yaml", "tool_packs", f"two packs for client {c!r}"))
    for name, tool in gateway.tools.items():
        for c in set(tool.clients) - set(clients):
            issues.append(ConfigIssue("gateway.yaml", f"tools.{name}.clients",
                                      f"no tool pack names client {c!r}: a request is recognised as a client "
                                      "by its pack's user_agents"))
    return packs


def tool_catalog(gateway: GatewayConfig, packs: list[ToolPack]) -> ToolCatalog:
    return ToolCatalog(_entries(gateway.tools, "gateway.yaml"),
                       tuple(Pack(p.client, p.user_agents, _entries(p.tools, f"pack {p.client}", (p.client,)))
                             for p in packs))


def _cross_check(gateway: GatewayConfig, routes: dict[str, tuple[str, Route]],
                 deployments: dict[str, tuple[str, Deployment]], today: date,
                 issues: list[ConfigIssue], warnings: list[str], root: Path) -> None:
    known_classes = set(gateway.data_classes)
    for rel, dep in deployments.values():
        try:
            problem = check_options(dep.fingerprint.adapter, dep.fingerprint.adapter_options)
            if problem:
                issues.append(ConfigIssue(rel, "fingerprint.adapter_options", problem))
        except (KeyError, ValueError) as e:
            issues.append(ConfigIssue(rel, "fingerprint.adapter", f"no such adapter: {e}"))
        if dep.pool is not None and dep.pool not in gateway.pools:
            issues.append(ConfigIssue(rel, "pool", f"no pool named {dep.pool!r} in gateway.yaml"))
        pooled = dep.pool is not None and dep.fingerprint.adapter.startswith("openai-compat@")
        if dep.serves == "embeddings" and not pooled:
            issues.append(ConfigIssue(rel, "serves", "embeddings are served by an engine pool (vLLM's pooling "
                                      "runner, the openai-compat adapter) only"))
        for dc in set(dep.data_classes) - known_classes:
            issues.append(ConfigIssue(rel, "data_classes", f"unknown data class {dc!r}"))
        quota = dep.provider_quota
        for tenant in sorted(set(quota.tenant_shares) - set(gateway.tenants)) if quota is not None else ():
            issues.append(ConfigIssue(rel, f"provider_quota.tenant_shares.{tenant}", f"unknown tenant {tenant!r}"))
        if dep.retire_at is not None and dep.retire_at <= today:
            warnings.append(f"{rel}: deployment {dep.deployment} is retired since {dep.retire_at}")
        elif dep.retire_at is not None and (dep.retire_at - today).days <= RETIRE_WARNING_DAYS:
            warnings.append(f"{rel}: deployment {dep.deployment} retires on {dep.retire_at}")
    served: dict[str, set[str]] = {}  # pool -> what its deployments serve: an engine runs one runner
    for rel, dep in deployments.values():
        if dep.pool is not None:
            served.setdefault(dep.pool, set()).add(dep.serves)
            if len(served[dep.pool]) > 1:
                issues.append(ConfigIssue(rel, "serves", f"pool {dep.pool!r} serves chat and embeddings: an engine "
                                          "is a generating or a pooling runner, not both"))
    for name, rc in gateway.request_classes.items():
        if rc.slo is not None and rc.slo.ttft_ms is not None and rc.queue_ttl_ms >= rc.slo.ttft_ms:
            warnings.append(f"gateway.yaml: request_classes.{name}: queue_ttl_ms {rc.queue_ttl_ms} is not below "
                            f"slo.ttft_ms {rc.slo.ttft_ms}: a request admitted after its full wait cannot meet its "
                            "time to first token")
        if rc.quality is not None and not quality_corpus(rc.quality.corpus, root).is_file():
            issues.append(ConfigIssue("gateway.yaml", f"request_classes.{name}.quality.corpus",
                                      f"no corpus {rc.quality.corpus!r} (shipped: {', '.join(shipped_quality())}; "
                                      "or a .yaml path in the policy directory)"))
    for rel, route in routes.values():
        if route.request_class not in gateway.request_classes:
            issues.append(ConfigIssue(rel, "request_class", f"unknown request class {route.request_class!r} "
                                      f"(gateway.yaml request_classes: {', '.join(sorted(gateway.request_classes))})"))
        for i, cand in enumerate(route.candidates):
            where = f"candidates.{i}"
            found = deployments.get(cand.deployment_name)
            if found is None:
                issues.append(ConfigIssue(rel, f"{where}.deployment_ref",
                                          f"no deployment named {cand.deployment_name!r}"))
                continue
            dep = found[1]
            if cand.adapter_ref != dep.fingerprint.adapter:
                issues.append(ConfigIssue(rel, f"{where}.adapter_ref", f"{cand.adapter_ref!r} is not the adapter of "
                                          f"deployment {dep.deployment}'s fingerprint ({dep.fingerprint.adapter})"))
            if dep.serves != route.serves:
                issues.append(ConfigIssue(rel, f"{where}.deployment_ref", f"deployment {dep.deployment} serves "
                                          f"{dep.serves}; this route serves {route.serves}"))
            if cand.deployment_ref != dep.ref:
                issues.append(ConfigIssue(
                    rel, f"{where}.deployment_ref",
                    f"fingerprint does not match the deployment's; it is now {dep.ref}"))
            for dc in cand.data_classes:
                if dc not in known_classes:
                    issues.append(ConfigIssue(rel, f"{where}.data_classes", f"unknown data class {dc!r}"))
                elif dc not in dep.data_classes:
                    issues.append(ConfigIssue(rel, f"{where}.data_classes",
                                              f"deployment {dep.deployment} does not serve {dc!r}"))
            for region in set(cand.regions) - set(dep.regions):
                issues.append(ConfigIssue(rel, f"{where}.regions",
                                          f"deployment {dep.deployment} is not in region {region!r}"))
        if route.degraded is not None and route.degraded.route is not None:
            _check_degraded_route(rel, route, routes, deployments, issues)
        names = [c.deployment_name for c in route.candidates]
        if route.canary is not None and (route.canary.deployment not in names or len(set(names)) < 2):
            issues.append(ConfigIssue(rel, "canary.deployment", f"{route.canary.deployment!r} must be a candidate of "
                                      "the route beside at least one other (the stable ones)"))
        if route.shadow is not None and (route.shadow.deployment not in names or len(set(names)) < 2):
            issues.append(ConfigIssue(rel, "shadow.deployment", f"{route.shadow.deployment!r} must be a candidate of "
                                      "the route beside at least one other (the ones that answer)"))


def _check_degraded_route(rel: str, route: Route, routes: dict[str, tuple[str, Route]],
                          deployments: dict[str, tuple[str, Deployment]], issues: list[ConfigIssue]) -> None:
    """A degraded route must exist, be another route, not degrade further, and be cheaper: no
    candidate of it prices a token above the route's dearest candidate, so the reservation made at
    the route's prices covers whichever of them serves (invariant 3)."""
    name = route.degraded.route if route.degraded is not None else None
    target = routes.get(name or "")
    if target is None or name == route.route_contract:
        issues.append(ConfigIssue(rel, "degraded.route", f"{name!r} is not another route"))
        return
    if target[1].degraded is not None and target[1].degraded.route is not None:
        issues.append(ConfigIssue(rel, "degraded.route", f"route {name} degrades to a route itself: one step only"))

    def prices(r: Route) -> list[Prices]:
        return [deployments[c.deployment_name][1].prices for c in r.candidates if c.deployment_name in deployments]

    mine = prices(route)
    for p in prices(target[1]):
        for price in ("input_per_mtok", "cached_input_per_mtok", "output_per_mtok"):
            if mine and getattr(p, price) > max(getattr(m, price) for m in mine):
                issues.append(ConfigIssue(rel, "degraded.route", f"route {name} is dearer ({price} {getattr(p, price)}"
                                          f" above every candidate of {route.route_contract}): not a cheaper route"))
                return
        if mine and any(m.currency != p.currency for m in mine):
            issues.append(ConfigIssue(rel, "degraded.route", f"route {name} prices in another currency"))
            return


def _load_named(root: Path, folder: str, model: type[M], name_field: str,
                issues: list[ConfigIssue], trees: Trees) -> dict[str, tuple[str, M]]:
    """Every `folder/*.yaml` as `model`, keyed by its name field; a name used twice is an issue."""
    found: dict[str, tuple[str, M]] = {}
    for path in sorted((root / folder).glob("*.yaml")):
        rel = str(path.relative_to(root))
        doc = _parse(model, _read_yaml(path, root, issues, trees), rel, issues)
        if doc is None:
            continue
        name = getattr(doc, name_field)
        if name in found:
            issues.append(ConfigIssue(rel, name_field, f"{name!r} also defined in {found[name][0]}"))
        found[name] = (rel, doc)
    return found


EXAMPLES = "examples"


def _compile(modules: dict[str, str], data: dict[str, Any], revision: str, prefix: str) -> CompiledPolicy:
    """The compiled policy, or a ConfigError with each problem's file (under `prefix`), line and column."""
    try:
        return CompiledPolicy(modules, data, revision)
    except PolicyCompileError as e:
        if e.issues:
            raise ConfigError([ConfigIssue(prefix + i.file, "", f"policy does not compile: {i.message}",
                                           i.line, i.column) for i in e.issues]) from None
        raise ConfigError([ConfigIssue(f"{prefix}*.rego", "", f"policy does not compile: {e}")]) from None


def load_snapshot(directory: str | Path, today: date | None = None, earned: Path | None = None,
                  unless: frozenset[str] = frozenset()) -> Snapshot:
    """Load and cross-check a policy directory (with the evidence earned at run time in `earned`, else
    where the environment keeps it: extproc/config/earned.py). `unless`: run-time triggers whose voids
    are left out (what earning would find missing once they are lifted). Raises ConfigError listing
    every problem."""
    root = Path(directory).resolve()
    issues: list[ConfigIssue] = []
    trees: Trees = {}
    warnings: list[str] = []
    if not (root / "gateway.yaml").is_file():
        raise ConfigError([ConfigIssue(str(directory), "", "gateway.yaml not found")])

    gateway = _parse(GatewayConfig, _read_yaml(root / "gateway.yaml", root, issues, trees), "gateway.yaml", issues)

    deployments = _load_named(root, "deployments", Deployment, "deployment", issues, trees)
    routes = _load_named(root, "routes", Route, "route_contract", issues, trees)

    # The policy's own records, then those of the earned state (extproc/config/earned.py).
    evidence: dict[str, list[Evidence]] = {}
    voids: list[EvidenceVoid] = []
    for folder in evidence_dirs(root, earned):
        for path in sorted(folder.glob("*.yaml")):
            record = _parse(Evidence, _read_yaml(path, root, issues, trees), _rel(path, root), issues)
            if record is not None:
                evidence.setdefault(record.deployment_ref, []).append(record)
        for path in sorted((folder / VOIDS).glob("*.yaml")):
            void = _parse(EvidenceVoid, _read_yaml(path, root, issues, trees), _rel(path, root), issues)
            if void is not None and void.trigger not in unless:
                voids.append(void)
    current_refs = {d.ref for _, d in deployments.values()}
    for ref in sorted(set(evidence) - current_refs):
        warnings.append(f"evidence for {ref} matches no current fingerprint; it qualifies nothing")

    # A dry-run candidate's Rego is evaluated beside the enforced policy, never as part of it.
    dry = gateway.policy_dry_run if gateway is not None else None
    dry_root = (root / dry.directory).resolve() if dry is not None else None
    if dry is not None and dry_root is not None and not dry_root.is_dir():
        issues.append(ConfigIssue("gateway.yaml", "policy_dry_run.directory", f"{dry.directory!r} is not a directory"))
    # examples/ is a library of patterns for authors (tested by `llmgw policy test DIR/examples`), never enforced.
    rego = {str(p.relative_to(root)): p.read_text(encoding="utf-8") for p in sorted(root.rglob("*.rego"))
            if p.relative_to(root).parts[0] != EXAMPLES
            and (dry_root is None or not p.resolve().is_relative_to(dry_root))}
    candidate = {str(p.relative_to(dry_root)): p.read_text(encoding="utf-8") for p in sorted(dry_root.rglob("*.rego"))
                 } if dry_root is not None and dry_root.is_dir() else {}

    managed: tuple[ApiKey, ...] = ()
    managed_owner: dict[str, str] = {}
    if (root / "keys.yaml").is_file():
        keys_file = _parse(KeysFile, _read_yaml(root / "keys.yaml", root, issues, trees) or {"keys": []},
                           "keys.yaml", issues)
        if keys_file is not None:
            managed = keys_file.keys
            managed_owner = {k.sha256: k.tenant for k in keys_file.keys}

    packs = _tool_packs(gateway, root, issues) if gateway is not None else []
    if gateway is not None:
        _cross_check(gateway, routes, deployments, today or date.today(), issues, warnings, root)
        for i, k in enumerate(managed):
            if managed_owner[k.sha256] not in gateway.tenants:
                issues.append(ConfigIssue("keys.yaml", f"keys.{i}.tenant",
                                          f"unknown tenant {managed_owner[k.sha256]!r}"))
    if issues or gateway is None:
        raise ConfigError(_placed(issues, trees, str(directory)))

    plain_routes = {k: v for k, (_, v) in routes.items()}
    plain_deps = {k: v for k, (_, v) in deployments.items()}
    keys = {k.sha256: KeyOwner(t, k) for t, tenant in gateway.tenants.items() for k in tenant.api_keys}
    keys.update({k.sha256: KeyOwner(managed_owner[k.sha256], k) for k in managed})
    all_rego = {**rego, **{f"dry-run:{k}": v for k, v in candidate.items()}}
    revision = _revision(gateway, plain_routes, plain_deps, all_rego, evidence,
                         [k.model_dump(mode="json") for k in managed], voids, packs)
    counted, voided, triggered = sift(evidence, plain_deps, gateway, voids, root)
    for ref, why in sorted(voided.items()):
        warnings.append(f"evidence for {ref} voided: {'; '.join(why)}")
    catalog = tool_catalog(gateway, packs)
    data = policy_data(gateway, catalog)
    try:
        policy = _compile(rego, data, revision, "")
        dry_run = _compile(candidate, data, f"{revision}+dry-run", f"{dry.directory}/") if dry is not None else None
    except ConfigError as e:
        raise ConfigError(_placed(e.issues, trees, str(directory))) from None
    return Snapshot(
        evidence=MappingProxyType(counted),
        voided=MappingProxyType(voided),
        void_triggers=MappingProxyType(triggered),
        voids=tuple(voids),
        earned=MappingProxyType({ref: max(r.moment() for r in recs) for ref, recs in evidence.items()}),
        directory=root,
        gateway=gateway,
        routes=MappingProxyType(plain_routes),
        deployments=MappingProxyType(plain_deps),
        rego=MappingProxyType(rego),
        revision=revision,
        warnings=tuple(warnings),
        keys_by_hash=MappingProxyType(keys),
        policy=policy,
        dry_run_policy=dry_run,
        policy_data=MappingProxyType(data),
        tools=catalog,
    )
