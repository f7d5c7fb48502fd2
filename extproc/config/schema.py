"""Configuration schema: gateway.yaml, routes/*.yaml, deployments/*.yaml.

Every model is frozen and refuses unknown fields, so a typo in a policy file is an error that names
the file and the field instead of a setting that silently does nothing.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, date, datetime, time
from functools import cached_property
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from extproc.corpora import digest_of

Name = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$")]
HexDigest = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
CredentialRef = Annotated[str, StringConstraints(pattern=r"^(env:[A-Za-z_][A-Za-z0-9_]*|file:.+)$")]
HostPort = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9.\-]+:[0-9]{1,5}$")]
DEPLOYMENT_REF = re.compile(r"^(?P<name>[a-z0-9][a-z0-9._-]{0,62})@sha256:(?P<digest>[0-9a-f]{64})$")


def _deployment_ref(v: str) -> str:
    if not DEPLOYMENT_REF.match(v):
        raise ValueError("must be `<deployment>@sha256:<64 hex digits of the fingerprint>`")
    return v


DeploymentRef = Annotated[str, AfterValidator(_deployment_ref)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- gateway.yaml -------------------------------------------------------------------------------


class ApiKey(Strict):
    id: Name
    sha256: HexDigest  # hash of the key; the key itself is never stored
    expires: date | None = None
    revoked: bool = False
    effects: tuple[Name, ...] = ()  # tool effects this key's caller may exercise (input.identity.effects)
    demo: bool = False  # made by `llmgw up` for a demo: never accepted on a listener beyond loopback


class ManagedKey(ApiKey):
    """An entry of `keys.yaml`, the file `llmgw keys` writes; hand-written keys live in gateway.yaml."""

    tenant: Name
    created: date | None = None


class KeysFile(Strict):
    keys: tuple[ManagedKey, ...] = ()


JwtAlgorithm = Literal["RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "EdDSA"]


class JwtIssuer(Strict):
    """A workload-identity issuer. Only asymmetric algorithms exist here: `none` and HS* cannot be
    configured, so a public key can never be used as an HMAC secret (key confusion)."""

    issuer: str = Field(min_length=1)
    audiences: tuple[str, ...] = Field(min_length=1)
    jwks_file: str | None = None  # relative to the policy directory
    jwks_url: str | None = None
    algorithms: tuple[JwtAlgorithm, ...] = ("RS256", "ES256", "EdDSA")
    max_lifetime_s: int = Field(default=3600, gt=0)  # exp - iat; only short-lived tokens pass
    leeway_s: int = Field(default=30, ge=0, le=300)
    jwks_cache_s: int = Field(default=300, gt=0)
    tenant_claim: str = "tenant"
    subject_claim: str = "sub"
    groups_claim: str = "groups"
    tenants: tuple[Name, ...] | None = None  # tenants this issuer may assert; None = any configured

    @model_validator(mode="after")
    def _one_key_source(self) -> JwtIssuer:
        if (self.jwks_file is None) == (self.jwks_url is None):
            raise ValueError("exactly one of `jwks_file` or `jwks_url` must be set")
        return self


class Tool(Strict):
    """A catalog entry (extproc/tool_catalog.py): a tool callers may offer the model, by name or by
    pattern; `effects` name what calling it can do (read, edit, execute, network, delegate, write,
    payment, or the operator's own: policy/README.md); `clients` narrow it to some clients' requests."""

    effects: tuple[Name, ...] = ()
    clients: tuple[Name, ...] = ()  # () any client; else the tool packs' client names


class ToolPack(Strict):
    """A client's own tools with their effects (extproc/tool_packs/*.yaml, or the operator's file):
    its entries apply to requests whose User-Agent matches one of `user_agents`."""

    client: Name
    checked_against: str  # the client version whose tools were read to write the pack
    user_agents: tuple[str, ...] = Field(min_length=1)  # fnmatch patterns over the User-Agent header
    tools: dict[str, Tool]


class UnlistedTools(Strict):
    """What a tool no catalog entry lists gets: refused, or admitted taken to have `effects` (policy
    then reasons over those as over a listed tool's)."""

    rule: Literal["refuse", "admit"] = "refuse"
    effects: tuple[Name, ...] = ()

    @model_validator(mode="after")
    def _effects_only_when_admitted(self) -> UnlistedTools:
        if self.effects and self.rule == "refuse":
            raise ValueError("effects: only an `admit` rule takes default effects")
        return self


EntityType = Literal["email", "phone", "payment_card", "iban", "us_ssn", "ip_address", "secret"]
ENTITY_TYPES: tuple[EntityType, ...] = ("email", "phone", "payment_card", "iban", "us_ssn", "ip_address", "secret")


class RedactionSettings(Strict):
    """What the example policy's `redact` obligation draws from (data.gateway.redaction)."""

    entities: tuple[EntityType, ...] = ENTITY_TYPES
    from_data_class: Name | None = "internal"  # redact requests at or above this class


class ListenerTls(Strict):
    """TLS Envoy terminates for clients. Files only: Envoy reads them, config never holds them."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None
    require_client_certificate: bool = False


class ExtprocTls(Strict):
    """mTLS between Envoy and ext_proc: both sides present certificates signed by `ca_file`."""

    ca_file: str
    server_cert_file: str
    server_key_file: str
    client_cert_file: str
    client_key_file: str
    server_name: str = "extproc.llmgw.internal"


class TlsSettings(Strict):
    listener: ListenerTls | None = None
    extproc: ExtprocTls | None = None


class Bulkhead(Strict):
    """Per-tenant caps on what it may have in flight at once (invariant 11): beyond them, 429
    concurrency_limited, while other tenants' permits are untouched."""

    max_in_flight: int = Field(gt=0)
    max_in_flight_tokens: int | None = Field(default=None, gt=0)  # sum of reserved token bounds


class Tenant(Strict):
    default_data_class: Name
    allowed_data_classes: tuple[Name, ...]
    regions: tuple[Name, ...] | None = None  # residency: where its requests may be served; None = any
    api_keys: tuple[ApiKey, ...] = ()
    bulkhead: Bulkhead | None = None
    # Its share of a saturated pool against the other tenants of the same priority (admission's
    # weighted fairness, extproc/admission.py): a tenant of weight 2 is admitted twice as often as one
    # of weight 1 while both have requests waiting.
    weight: float = Field(default=1.0, gt=0)
    # Tool effects every caller of the tenant holds, beside its key's or JWT groups' grants.
    tool_effects: tuple[Name, ...] = ()
    unlisted_tools: UnlistedTools = UnlistedTools()  # a route may set its own


class Scope(Strict):
    """Who a budget or quota counts: a tenant, narrowed to one API key or JWT subject and/or one route."""

    tenant: Name
    api_key: Name | None = None
    subject: str | None = None
    route: Name | None = None

    def matches(self, tenant: str, subject: str, route: str) -> bool:
        return (self.tenant == tenant and (self.api_key is None or self.api_key == subject)
                and (self.subject is None or self.subject == subject)
                and (self.route is None or self.route == route))


class Budget(Scope):
    name: Name
    window: Literal["daily", "monthly", "total"] = "monthly"  # calendar windows in UTC
    # What it pays for: the requests the gateway serves, or the shadow copies a route mirrors to a
    # candidate under evaluation (route `shadow`): neither ever charges the other's budget.
    traffic: Literal["served", "shadow"] = "served"
    limit_micros: int | None = Field(default=None, ge=0)  # money, integer micro-units of the price currency
    limit_tokens: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _has_a_limit(self) -> Budget:
        if self.limit_micros is None and self.limit_tokens is None:
            raise ValueError("a budget needs limit_micros and/or limit_tokens")
        return self


class Quota(Scope):
    name: Name
    requests_per_minute: int | None = Field(default=None, gt=0)
    tokens_per_minute: int | None = Field(default=None, gt=0)  # reserved with the bound, corrected at settlement


class StoreSettings(Strict):
    url: str | None = None  # redis:// or rediss://; None: the one `llmgw up` starts (ext_proc --store-url)
    timeout_ms: int = Field(default=250, gt=0)  # per command: a dead store fails requests fast, closed
    lease_grace_ms: int = Field(default=10_000, ge=0)  # after the deadline, before the sweeper charges
    idempotency_ttl_s: int = Field(default=86_400, gt=0)
    idempotency_max_body_bytes: int = Field(default=1 << 20, gt=0)  # larger answers: a repeat gets 409
    # Key for sealing idempotent answers kept for replay (extproc/replay.py). None: only a digest is
    # kept, and a repeated key of a completed request gets 409 instead of the answer.
    replay_key_ref: CredentialRef | None = None
    # A Valkey/Redis Cluster: `url` names one node, the rest are found with CLUSTER SHARDS; each script
    # goes to the primary of its tenant's slot (extproc/store/cluster.py).
    cluster: bool = False
    # After each batch of scripts, wait until this many replicas hold it (Valkey's WAIT), for at most
    # replica_ack_timeout_ms: a failover then loses no acknowledged reservation or settlement.
    replica_acks: int = Field(default=0, ge=0)
    replica_ack_timeout_ms: int = Field(default=50, gt=0)
    # Slices (extproc/slices.py): a worker holds up to `slice_requests` requests' worth of a tenant's
    # budgets, quotas and bulkhead (and of a pool's slots, and of a hosted deployment's provider quota:
    # extproc/provider_quota.py) and admits against it without waiting for the store; it admits from one
    # slice for at most `slice_ms`, and every `slice_commit_ms` writes again what failed and ends slices
    # whose time is up. 0: every request reserves in the store. A request with an
    # Idempotency-Key always does (record 0033).
    slice_requests: int = Field(default=16, ge=0)
    slice_ms: int = Field(default=1_000, gt=0)
    slice_commit_ms: int = Field(default=20, gt=0)

    @model_validator(mode="after")
    def _ack_within_timeout(self) -> StoreSettings:
        # A script can wait for the previous batch's WAIT and then its own, within the store timeout.
        if self.replica_acks and 2 * self.replica_ack_timeout_ms >= self.timeout_ms:
            raise ValueError("replica_ack_timeout_ms must be below half of timeout_ms (a script can wait "
                             "for two WAITs)")
        return self


class OutlierSettings(Strict):
    """Passive health: an endpoint that fails this many requests in a row at the connection level
    (refused, reset, timed out) leaves rotation at once, before the active health check notices."""

    consecutive_failures: int = Field(default=2, ge=1)
    base_ejection_ms: int = Field(default=5_000, gt=0)
    max_ejection_percent: int = Field(default=50, ge=1, le=100)


class PoolAdmission(Strict):
    """How much a pool is given at once (extproc/admission.py). The bound on its requests in flight, across
    every worker and replica (counted in the store), is `max_in_flight`, shrunk to what the engines run
    while they report a queue of their own (more than `waiting_per_engine` waiting each) or a KV cache past
    `kv_usage_limit`. A request beyond the bound waits in its worker's queue (priority, then the tenants'
    weights) for at most its class's `queue_ttl_ms` and what is left of its deadline, then gets 429
    `overloaded` with Retry-After; a worker queues at most `max_queued` requests for the pool."""

    max_in_flight: int = Field(gt=0)
    max_queued: int = Field(default=256, ge=0)
    waiting_per_engine: float = Field(default=1.0, ge=0)
    kv_usage_limit: float = Field(default=0.95, gt=0, le=1)


class Pool(Strict):
    """A set of interchangeable engine endpoints: one Envoy cluster."""

    endpoints: tuple[HostPort, ...] = Field(min_length=1)
    connect_timeout_ms: int = Field(default=1000, gt=0)
    # Retries Envoy may have outstanding to this pool at once (its circuit breaker; Envoy's default
    # of 3 turned most failures after an engine died into retry overflow).
    max_retries: int = Field(default=256, ge=1)
    outlier: OutlierSettings = OutlierSettings()
    admission: PoolAdmission | None = None  # None: the engines take whatever comes


class EnvoySettings(Strict):
    listen: HostPort = "127.0.0.1:8080"
    admin: HostPort = "127.0.0.1:9901"
    extproc: tuple[HostPort, ...] = ("127.0.0.1:50051",)
    max_request_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    max_connections: int = Field(default=10_000, gt=0)  # downstream connections Envoy accepts at once
    extproc_message_timeout_ms: int = Field(default=1000, gt=0)
    # Longest silence between a stream's chunks, before its first byte too (each attempt's own limit):
    # a stalled stream ends as stream_interrupted; before any byte, the attempt may fall back.
    stream_idle_timeout_ms: int = Field(default=60_000, gt=0)
    concurrency: int = Field(default=1, ge=1)
    # Slow clients: the request's headers must arrive within the first, its whole body within the
    # second; a connection that sends nothing is closed after the third.
    request_headers_timeout_ms: int = Field(default=10_000, gt=0)
    request_timeout_ms: int = Field(default=60_000, gt=0)
    idle_connection_timeout_ms: int = Field(default=60_000, gt=0)
    # Retries outstanding at once to a deployment reached by its own endpoints or through a fallback
    # plan (pools have their own `max_retries`).
    max_concurrent_retries: int = Field(default=1024, ge=1)


class DecisionLog(Strict):
    """OPA-shaped decision log entries (decision_id, revision, path, input, result, timestamp), written
    to the store in batches and exported like the ledger. The input never holds message content."""

    enabled: bool = False
    # Input fields erased from each entry, as JSON pointers (`/identity/subject`); named in `erased`.
    mask: tuple[str, ...] = ()

    @field_validator("mask")
    @classmethod
    def _pointers(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for p in v:
            if not p.startswith("/") or p == "/":
                raise ValueError(f"{p!r} is not a JSON pointer into the input (like /identity/subject)")
        return v


class PolicyDryRun(Strict):
    """A candidate policy evaluated beside the enforced one on live traffic; it never changes what a
    request gets. Differences are counted and written to the decision log with both decision ids."""

    directory: str = Field(min_length=1)  # relative to the policy directory; its Rego is not enforced
    sample: float = Field(default=1.0, gt=0, le=1)  # share of requests, chosen by request id


class Limits(Strict):
    max_messages: int = Field(default=1024, gt=0)
    default_max_tokens: int = Field(default=1024, gt=0)
    max_n: int = Field(default=8, ge=1, le=128)  # completions per request (`n`); each is reserved in full


class MetricsSettings(Strict):
    # Per-tenant metric families beside the default ones (which never carry a tenant): one series per
    # tenant, so only where the tenants are few.
    tenant_label: bool = False


class ClassSlo(Strict):
    """A request class's latency objective: the limits each request must meet (all of them, jointly)
    and the share of requests that must meet them at the declared peak rate."""

    ttft_ms: int | None = Field(default=None, gt=0)  # time to the first token
    tpot_ms: int | None = Field(default=None, gt=0)  # time per output token after the first
    e2e_ms: int | None = Field(default=None, gt=0)  # the whole request
    attainment: float = Field(default=0.95, gt=0, le=1)
    # The class's declared peak arrival rate: a load record (`llmgw bench sweep --evidence`) passes when
    # the limits hold jointly for `attainment` of the admitted requests offered at this rate.
    peak_rps: float | None = Field(default=None, gt=0)


class QualityGate(Strict):
    """The task-quality corpus a candidate of this class is evaluated on (`llmgw evaluate`) and the
    score it must reach, q_s: the share of tasks it answers right."""

    corpus: str = Field(min_length=1)  # a shipped corpus (extproc/corpora/quality-<name>.yaml) or a path in the policy
    threshold: float = Field(gt=0, le=1)


class RequestClass(Strict):
    """What a route's requests are, as versioned configuration: their latency objective and the quality
    a candidate must earn for them. A class without `quality` requires no quality_gate record (stated
    here, where a reviewer sees it): embeddings, say, whose tasks this gateway does not grade."""

    slo: ClassSlo | None = None
    quality: QualityGate | None = None
    # Admission (extproc/admission.py): a saturated pool's waiting requests of a higher priority are
    # admitted first (interactive above batch); a request waits at most queue_ttl_ms (0: refused at once).
    priority: int = 0
    queue_ttl_ms: int = Field(default=1000, ge=0, le=60_000)


class LoopSettings(Strict):
    """The supervised loops `llmgw up` runs (llmgw/ops/loops.py): seconds between two runs; 0 turns one off."""

    engine_verify_s: float = Field(default=30, ge=0)  # each pool engine against its fingerprint
    reevaluate_s: float = Field(default=3600, ge=0)  # provider drift, SLO regression, workload shift
    canary_watch_s: float = Field(default=60, ge=0)  # a regressing canary rolled back


class GatewayConfig(Strict):
    data_classes: tuple[Name, ...] = Field(min_length=1)  # ordered, least to most sensitive
    # Keys the per-tenant prefix-cache salt (HMAC(secret, tenant)); resolved when ext_proc starts.
    cache_salt_secret_ref: CredentialRef = "env:LLMGW_CACHE_SALT_SECRET"
    tenants: dict[Name, Tenant]
    pools: dict[Name, Pool] = {}
    envoy: EnvoySettings = EnvoySettings()
    limits: Limits = Limits()
    jwt_issuers: tuple[JwtIssuer, ...] = ()
    group_effects: dict[str, tuple[Name, ...]] = {}  # JWT group -> tool effects its members may use
    tools: dict[str, Tool] = {}  # the operator's catalog entries: names or patterns (extproc/tool_catalog.py)
    # Client tool packs: a shipped one's name (claude-code, codex, gemini-cli) or a .yaml path here.
    tool_packs: tuple[str, ...] = ()
    request_classes: dict[Name, RequestClass] = {}  # every route names one of these
    loops: LoopSettings = LoopSettings()
    redaction: RedactionSettings = RedactionSettings()
    tls: TlsSettings = TlsSettings()
    store: StoreSettings = StoreSettings()
    budgets: tuple[Budget, ...] = ()
    quotas: tuple[Quota, ...] = ()
    decision_log: DecisionLog = DecisionLog()
    metrics: MetricsSettings = MetricsSettings()
    policy_dry_run: PolicyDryRun | None = None

    @model_validator(mode="after")
    def _tenants_use_known_classes(self) -> GatewayConfig:
        known = set(self.data_classes)
        if len(known) != len(self.data_classes):
            raise ValueError("data_classes: duplicate entries")
        for name, tenant in self.tenants.items():
            unknown = ({tenant.default_data_class, *tenant.allowed_data_classes}) - known
            if unknown:
                raise ValueError(f"tenants.{name}: unknown data class(es) {sorted(unknown)}")
            if tenant.default_data_class not in tenant.allowed_data_classes:
                raise ValueError(f"tenants.{name}: default_data_class must be one of allowed_data_classes")
        key_ids = [k.id for t in self.tenants.values() for k in t.api_keys]
        dup = {k for k in key_ids if key_ids.count(k) > 1}
        if dup:
            raise ValueError(f"tenants: api key ids used twice: {sorted(dup)}")
        issuers = [i.issuer for i in self.jwt_issuers]
        if len(set(issuers)) != len(issuers):
            raise ValueError("jwt_issuers: an issuer is listed twice")
        for i, iss in enumerate(self.jwt_issuers):
            if iss.tenants and set(iss.tenants) - set(self.tenants):
                raise ValueError(f"jwt_issuers.{i}.tenants: unknown tenant(s) "
                                 f"{sorted(set(iss.tenants) - set(self.tenants))}")
        for kind, items in (("budgets", self.budgets), ("quotas", self.quotas)):
            names = [b.name for b in items]
            if len(set(names)) != len(names):
                raise ValueError(f"{kind}: a name is used twice")
            for i, b in enumerate(items):
                if b.tenant not in self.tenants:
                    raise ValueError(f"{kind}.{i}.tenant: unknown tenant {b.tenant!r}")
        if self.redaction.from_data_class is not None and self.redaction.from_data_class not in known:
            raise ValueError(f"redaction.from_data_class: unknown data class {self.redaction.from_data_class!r}")
        return self


# --- deployments/*.yaml -------------------------------------------------------------------------


class Fingerprint(Strict):
    """What makes two deployments the same served system. Its hash is the deployment's identity."""

    adapter: str
    engine: str
    model_digest: str
    tokenizer_digest: str
    prompt_template: str
    precision: str
    placement: str
    kv_cache_policy: str
    decoding_policy: str
    batching_policy: str
    hardware: str
    route_retry_policy: str = "envoy-router"
    # The adapter's settings for this upstream: for `openai`, `kind` (vllm, openai or azure: what it
    # honours) and, for Azure, `deployment` (the path's name) and `api_version`. Part of the served
    # system: another API version is another fingerprint, whose evidence must be earned again.
    adapter_options: dict[str, str] = {}

    def digest(self) -> str:
        doc = self.model_dump()
        if not doc["adapter_options"]:
            del doc["adapter_options"]  # fingerprints without options keep the digests they had
        canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


class Prices(Strict):
    """Integer micro-units of `currency` per million tokens, one rate per token class
    (extproc/settlement/charge.py `token_classes`). The classes a provider prices like another may leave
    their rate out: cache writes then cost input, 1-hour writes what other writes cost, and reasoning
    costs output (as OpenAI and Gemini bill it)."""

    version: str
    currency: str = "USD"
    input_per_mtok: int = Field(ge=0)
    cached_input_per_mtok: int = Field(ge=0)  # cache reads
    output_per_mtok: int = Field(ge=0)
    cache_write_per_mtok: int | None = Field(default=None, ge=0)  # Anthropic's 5-minute writes; Bedrock's
    cache_write_1h_per_mtok: int | None = Field(default=None, ge=0)  # Anthropic's 1-hour writes
    reasoning_per_mtok: int | None = Field(default=None, ge=0)

    def per_mtok(self, token_class: str) -> int:
        """The rate of one token class (TOKEN_CLASSES in extproc/settlement/charge.py)."""
        write = self.input_per_mtok if self.cache_write_per_mtok is None else self.cache_write_per_mtok
        return {"input": self.input_per_mtok, "cached_input": self.cached_input_per_mtok,
                "cache_write": write,
                "cache_write_1h": write if self.cache_write_1h_per_mtok is None else self.cache_write_1h_per_mtok,
                "output": self.output_per_mtok,
                "reasoning": self.output_per_mtok if self.reasoning_per_mtok is None else self.reasoning_per_mtok,
                }[token_class]


SYSTEM_CA_FILE = "/etc/ssl/certs/ca-certificates.crt"  # Debian's bundle (ca-certificates)


class UpstreamTls(Strict):
    """TLS to a hosted deployment's endpoints: Envoy sends `server_name` as SNI and accepts only a
    certificate for that name from a CA in `ca_file` (a path relative to the policy directory, or
    absolute; default: the system's bundle)."""

    server_name: str | None = None  # default: the first endpoint's host name
    ca_file: str = SYSTEM_CA_FILE


class ModelGeometry(Strict):
    """What the model's KV cache holds per token: 2 (K and V) x layers x KV heads x head dim x bytes
    per element (`llmgw review` sizes a sequence's KV memory from it)."""

    layers: int = Field(gt=0)
    kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    kv_bytes_per_element: int = Field(default=2, gt=0)  # 2: fp16/bf16 KV cache; 1: fp8


class ProviderQuota(Strict):
    """The provider's rate limits for a deployment, as agreed (a hosted model's quota): what its evidence
    was earned under, so a change voids the evidence. The gateway's own quotas (gateway.yaml) enforce
    limits on callers; this one is a fact about the served system."""

    requests_per_minute: int | None = Field(default=None, gt=0)
    tokens_per_minute: int | None = Field(default=None, gt=0)
    # What each tenant may take of it (a share in (0, 1]); a tenant not named may take `default_share`.
    # Reserved in the store before dispatch across every replica (extproc/provider_quota.py); not part of the
    # evidence's quota digest (the agreement with the provider is the same).
    tenant_shares: dict[Name, float] = {}
    default_share: float = Field(default=1.0, gt=0, le=1)

    @field_validator("tenant_shares")
    @classmethod
    def _shares(cls, v: dict[str, float]) -> dict[str, float]:
        for tenant, share in v.items():
            if not 0 < share <= 1:
                raise ValueError(f"{tenant}: a share is in (0, 1], not {share}")
        return v

    def agreed(self) -> dict[str, int | None]:
        """The agreement with the provider (what evidence was earned under), without the shares."""
        return {"requests_per_minute": self.requests_per_minute, "tokens_per_minute": self.tokens_per_minute}


RETIRE_WARNING_DAYS = 30  # a deployment this close to its retire_at is warned about (and checked: llmgw check)


# What a deployment serves, and what a route asks of its candidates: chat completions (a generating
# engine or provider) or embeddings (an engine started as vLLM's pooling runner serves nothing else).
Serves = Literal["chat", "embeddings"]


class Deployment(Strict):
    deployment: Name
    fingerprint: Fingerprint
    served_model: str  # the model name the upstream answers to
    serves: Serves = "chat"
    pool: Name | None = None
    endpoints: tuple[HostPort, ...] = ()
    context_window: int = Field(gt=0)
    template_allowance_tokens: int = Field(default=8, ge=0)  # per-message chat template overhead
    prices: Prices
    regions: tuple[Name, ...] = Field(min_length=1)
    data_classes: tuple[Name, ...] = Field(min_length=1)
    # A deprecation is a scheduled outage: its date, who owns the move, and what replaces it (a route,
    # or a deployment serving beside it as a candidate) with passing evidence before the date
    # (`llmgw check` fails inside the warning window when the replacement is missing or unqualified).
    retire_at: date | None = None
    retire_owner: str | None = Field(default=None, min_length=1, max_length=200)
    retire_replacement: Name | None = None
    withdrawn: bool = False
    credential_ref: CredentialRef | None = None  # sent to this deployment's upstream as its adapter says
    tls: UpstreamTls | None = None  # hosted endpoints over TLS (a real provider always is)
    model_geometry: ModelGeometry | None = None  # self-hosted models: for KV memory sizing
    provider_quota: ProviderQuota | None = None  # hosted models: the quota agreed with the provider

    @model_validator(mode="after")
    def _one_upstream(self) -> Deployment:
        if (self.pool is None) == (not self.endpoints):
            raise ValueError("exactly one of `pool` or `endpoints` must be set")
        if self.retire_at is None and (self.retire_owner or self.retire_replacement):
            raise ValueError("retire_owner and retire_replacement describe a retirement: set retire_at")
        if self.retire_replacement == self.deployment:
            raise ValueError("retire_replacement: a deployment cannot replace itself")
        if self.tls is not None and not self.endpoints:
            raise ValueError("tls: only a deployment with `endpoints` is reached over TLS this way")
        if self.tls is not None and self.tls.server_name is None and all(
                c.isdigit() or c == "." for c in self.endpoints[0].rpartition(":")[0]):
            raise ValueError("tls.server_name is required when the endpoint is an IP address")
        return self

    @property
    def provider(self) -> str:
        """Who serves it: `self-hosted` for a pool, else its adapter's shape (`anthropic`, ...)."""
        return "self-hosted" if self.pool else self.fingerprint.adapter.partition("@")[0]

    @property
    def server_name(self) -> str:
        """The name TLS asks for and verifies (with `tls` set)."""
        return (self.tls.server_name if self.tls and self.tls.server_name
                else self.endpoints[0].rpartition(":")[0])

    @cached_property
    def ref(self) -> str:
        """`name@sha256:<fingerprint digest>`: how a route contract names exactly this system."""
        return f"{self.deployment}@sha256:{self.fingerprint.digest()}"


# --- evidence/*.yaml ----------------------------------------------------------------------------


class CaseResult(Strict):
    id: str
    result: Literal["pass", "fail", "lost", "not_run"]
    detail: str = ""


class EvidenceBasis(Strict):
    """What a record was earned under (extproc/config/evidence.py). A change to any of these voids the
    record: its re-evaluation triggers beside the fingerprint, which a changed artifact or adapter
    already voids by changing the reference."""

    prices_version: str | None = None  # the deployment's price version: a price change
    quota_digest: str | None = None  # the provider's quota for the deployment: a quota change
    policy_digest: str | None = None  # the data classes it may serve and how they are redacted: a policy change
    # What produced it, each required (a record that names none of them is bound to nothing, so it
    # counts for nothing): the corpus it ran, the code of the shape that translated it, and the
    # retry and fallback policy of the route it ran under (it qualifies routes with that policy only).
    corpus_digest: str | None = None
    shape_digest: str | None = None
    route_policy_digest: str | None = None


class EvidenceVoid(Strict):
    """A re-evaluation trigger that fired at run time (`llmgw evidence reevaluate` writes them to
    evidence/voids/): every record of this fingerprint earned before it is void; a record earned after
    it lifts it (an engine mismatch excepted: it holds while its file exists, extproc/config/evidence.py)."""

    deployment_ref: DeploymentRef
    trigger: Literal["provider_drift", "workload_shift", "slo_regression", "engine_mismatch", "model_mismatch"]
    reason: str
    recorded_at: date
    voided_at: datetime | None = None  # when it fired (UTC); a void without one fired at the end of its day

    def moment(self) -> datetime:
        """When it fired: a void dated by its day only voids every record of that day."""
        return _aware(self.voided_at) if self.voided_at else datetime.combine(self.recorded_at, time.max, UTC)


class ClassLoad(Strict):
    """One request class at the sweep level that first offered its declared peak rate."""

    peak_rps: float = Field(gt=0)
    offered_rps: float = Field(ge=0)
    attainment: float = Field(ge=0, le=1)  # joint, among the admitted
    admission: float = Field(ge=0, le=1)
    holds: bool


class LoadFigures(Strict):
    """What a load record measured: the service rate, the knee, and each class at its peak rate."""

    mu_rps: float = Field(ge=0)  # the most completed per second at any level
    knee_rps: float | None = Field(default=None, ge=0)  # the highest offered load where every class held
    classes: dict[str, ClassLoad] = Field(min_length=1)
    objectives_digest: str  # of the classes' objectives then: a changed limit or peak voids the record


class Evidence(Strict):
    """A qualification record for one exact fingerprint (the reference names its digest, so changing
    any fingerprint field leaves the record qualifying nothing). `llmgw conformance` writes the
    conformance records, with the adapter, the corpus version, each case's result and the fields the
    adapter reported lost; a candidate without passing records of every required kind is not
    eligible (unknown evidence does not pass)."""

    deployment_ref: DeploymentRef
    kind: Literal["conformance", "quality_gate", "load"]
    result: Literal["pass", "fail"]
    recorded_at: date
    earned_at: datetime | None = None  # when its run ended (UTC); a record without one was earned at its day's start
    expires_at: date | None = None
    source: str = ""
    adapter: str = ""
    corpus_version: str = ""
    losses: tuple[str, ...] = ()
    cases: tuple[CaseResult, ...] = ()
    basis: EvidenceBasis | None = None  # without one the record is bound to nothing: it counts for nothing
    route: str = ""  # the route whose retry and fallback policy it ran under (its digest is in `basis`)
    # quality_gate: the request class whose corpus it ran, the share of tasks answered right and the
    # class's threshold then (the record qualifies routes of that class only).
    request_class: str = ""
    score: float | None = Field(default=None, ge=0, le=1)
    threshold: float | None = Field(default=None, gt=0, le=1)
    load: LoadFigures | None = None  # a load record's figures (`llmgw bench sweep --evidence`)

    @model_validator(mode="after")
    def _result_follows_cases(self) -> Evidence:
        if self.result == "pass" and self.kind == "conformance" and any(c.result == "fail" for c in self.cases):
            raise ValueError("result: pass, but a case failed")
        if self.result == "pass" and self.score is not None and self.threshold is not None \
                and self.score < self.threshold:
            raise ValueError("result: pass, but its score is below its threshold")
        if self.result == "pass" and self.load is not None and not all(c.holds for c in self.load.classes.values()):
            raise ValueError("result: pass, but a class missed its objective at its peak rate")
        return self

    def moment(self) -> datetime:
        """When it was earned: a record dated by its day only counts as earned at that day's start."""
        return _aware(self.earned_at) if self.earned_at else datetime.combine(self.recorded_at, time.min, UTC)

    def key(self) -> tuple[str, str, str]:
        """What a later record of the same key replaces: its kind, for the same route policy and class."""
        policy = self.basis.route_policy_digest if self.basis is not None else None
        return self.kind, policy or "", self.request_class


def _aware(moment: datetime) -> datetime:
    """A timestamp read without an offset is UTC, as the gateway writes them."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def required_evidence(gateway: GatewayConfig, route: Route) -> frozenset[str]:
    """What a candidate of this route needs a passing record of: conformance always, a quality gate
    when the route's request class declares one, a load record when the route requires it."""
    rc = gateway.request_classes.get(route.request_class)
    return frozenset({"conformance"} | ({"quality_gate"} if rc is not None and rc.quality is not None else set())
                     | ({"load"} if route.requires_load_evidence else set()))


# --- routes/*.yaml ------------------------------------------------------------------------------


class Candidate(Strict):
    deployment_ref: DeploymentRef
    adapter_ref: str
    data_classes: tuple[Name, ...] = Field(min_length=1)
    regions: tuple[Name, ...] = Field(min_length=1)
    # Prompt size this candidate takes (the bound of invariant 3, template allowance included): a route
    # can send long prompts to a pool of their own, so long-context requests do not starve short ones.
    min_prompt_tokens: int = Field(default=0, ge=0)
    max_prompt_tokens: int | None = Field(default=None, gt=0)

    @property
    def deployment_name(self) -> str:
        return v.group("name") if (v := DEPLOYMENT_REF.match(self.deployment_ref)) else ""


MAX_RETRIES = 5


class RetryPolicy(Strict):
    attempts: int = Field(default=1, ge=1, le=MAX_RETRIES)
    eligible_failures: tuple[
        Literal["connect_before_send", "rate_limited", "overloaded", "unavailable", "no_first_byte"], ...
    ] = ("connect_before_send",)
    requires: Literal["read_only_or_idempotency_key", "idempotency_key", "never"] = (
        "read_only_or_idempotency_key"
    )


class FallbackPolicy(Strict):
    # Off: a request goes to its first qualified candidate only (later ones still serve it when the
    # earlier are disqualified for it), and retries stay on that candidate.
    enabled: bool = True
    # Fallback is only ever to another candidate of the same contract; nothing else can be configured.
    requires_same_contract: Literal[True] = True


class DegradedAnswer(Strict):
    """What a route answers when no qualified, policy-equivalent candidate exists (all withdrawn,
    retired or without evidence): a fixed answer, or a named cheaper route whose candidates pass the
    same checks for the request. Never open: without one, 503 no_qualified_route."""

    response: str | None = Field(default=None, min_length=1, max_length=4096)  # the assistant's text
    route: Name | None = None

    @model_validator(mode="after")
    def _one(self) -> DegradedAnswer:
        if (self.response is None) == (self.route is None):
            raise ValueError("exactly one of `response` or `route`")
        return self


class Canary(Strict):
    """A candidate of the route taking a share of its traffic first, chosen per request by its id
    (deterministic), for some request classes and tenants; the rest never reach it while another
    candidate qualifies. `llmgw canary watch` removes it (an audited revision) when its error rate or
    TTFT p95 over the window exceeds the stable candidates' by the margins."""

    deployment: Name
    share: float = Field(gt=0, le=1)
    request_classes: tuple[Name, ...] = ()  # empty: every class the route serves
    tenants: tuple[Name, ...] = ()  # empty: every tenant
    max_error_rate_increase: float = Field(default=0.05, ge=0, le=1)
    max_ttft_p95_ratio: float = Field(default=1.5, ge=1)
    window_s: int = Field(default=300, gt=0)
    min_requests: int = Field(default=20, gt=0)  # per side, before anything is decided


class Shadow(Strict):
    """A candidate of the route under evaluation that receives a copy of a share of its read-only
    requests (no offered tool with effects), chosen per request by its id, for some request classes and
    tenants, when the policy lets it receive the request's data class and region. Its answer never
    reaches the caller; it is charged to the tenant's `traffic: shadow` budgets (a tenant without one
    is never shadowed) and has its own ledger entry (`shadow_of`). Evidence is not required of it:
    gathering it is what the shadow is for."""

    deployment: Name
    share: float = Field(gt=0, le=1)
    request_classes: tuple[Name, ...] = ()  # empty: every class the route serves
    tenants: tuple[Name, ...] = ()  # empty: every tenant


class TelemetryPolicy(Strict):
    record_content: bool = False
    propagate_trace_context: bool = True


MAX_CANDIDATES = 5  # per route; the renderer writes a composite cluster per ordered subset (26 at most)


class Route(Strict):
    route_contract: Name
    request_class: Name
    serves: Serves = "chat"  # every candidate serves it; a request to the other endpoint is refused
    candidates: tuple[Candidate, ...] = Field(min_length=1, max_length=MAX_CANDIDATES)
    # Refused when set (see _no_route_credential): kept as a field so the refusal says where a
    # credential belongs rather than "extra field".
    credential_ref: CredentialRef | None = None
    deadline_ms: int = Field(default=30_000, gt=0)
    max_stream_ms: int = Field(default=600_000, gt=0)  # a stream's whole length, from its arrival
    max_tokens_cap: int | None = Field(default=None, gt=0)
    budget_reservation: Literal["required", "optional", "off"] = "required"
    # A field a candidate's adapter cannot carry (extproc/shapes/): refuse the request (400
    # unsupported_field naming it) or serve it and report the field (x-llmgw-translation-loss, ledger).
    translation_loss: Literal["reject", "report"] = "reject"
    # One field's rule, over the default above and over a hint's `report` (extproc/shapes/loss.py):
    # an internal field name (`user`, `response_format`) or a door's own as its caller writes it
    # (`thinking`, `generationConfig.thinkingConfig`).
    translation_loss_fields: dict[str, Literal["reject", "report"]] = {}
    # Tools no catalog entry lists, on this route: None takes the tenant's rule (Tenant.unlisted_tools).
    unlisted_tools: UnlistedTools | None = None
    # A returned tool call or JSON answer that fails its checks (extproc/answer_checks.py): refuse it
    # (502 answer_rejected; a stream ends with stream_interrupted before the failing call) or pass it
    # and name the failed checks (x-llmgw-answer-checks on a JSON answer; the ledger either way).
    answer_checks: Literal["enforce", "report"] = "enforce"
    # A candidate also needs a passing `load` record (`llmgw bench sweep --evidence`): its request
    # classes' objectives held at their declared peak rates.
    requires_load_evidence: bool = False
    retry: RetryPolicy = RetryPolicy()
    fallback: FallbackPolicy = FallbackPolicy()
    telemetry: TelemetryPolicy = TelemetryPolicy()
    degraded: DegradedAnswer | None = None
    canary: Canary | None = None
    shadow: Shadow | None = None

    @field_validator("credential_ref")
    @classmethod
    def _no_route_credential(cls, v: str | None) -> str | None:
        if v is not None:
            raise ValueError("a route sends no credential: each hosted deployment names its own "
                             "(deployments/<name>.yaml credential_ref), the one its adapter sends")
        return v

    @cached_property
    def policy_digest(self) -> str:
        """The digest of its retry and fallback policy: evidence earned under another qualifies nothing
        here (invariant 17)."""
        policy = {"retry": self.retry.model_dump(mode="json"), "fallback": self.fallback.model_dump(mode="json")}
        return digest_of(policy)
