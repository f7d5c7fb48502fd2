"""Shadow traffic: a signed grant that lets the copy Envoy mirrors of an admitted request re-enter the
gateway as a request of its own, on behalf of the same tenant, for one candidate under evaluation.

The copy is sent by Envoy's router (`request_mirror_policies` on the admitted route, to the gateway's
own listener), so it passes every stage again: identity (this grant instead of a credential),
authorization (the policy is asked again), the tenant's `traffic: shadow` budgets, redaction, and route
selection restricted to the shadow candidate, which must qualify for the data class and region (not
for evidence: gathering it is the point). Envoy drops the copy's answer; its ledger entry names the
request it copies (`shadow_of`).

The grant is an HMAC over what it asserts, keyed by a key derived from the gateway's own secret
(`cache_salt_secret_ref`, which every worker of every host shares), and it expires with the request's
deadline. It is added only to the copy (the mirror policy's header mutation), so it never reaches an
upstream; a client cannot make one.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from dataclasses import asdict, dataclass

import orjson

_KEY_LABEL = b"llmgw shadow grant v1"


@dataclass(frozen=True)
class Grant:
    of: str  # the request id of the request it copies
    tenant: str
    subject: str
    route: str
    data_class: str
    deployment: str  # the candidate under evaluation
    expires: float  # epoch seconds


def grant_key(secret: str) -> bytes:
    return hmac.new(secret.encode(), _KEY_LABEL, hashlib.sha256).digest()


def _mac(key: bytes, payload: bytes) -> str:
    return base64.urlsafe_b64encode(hmac.new(key, payload, hashlib.sha256).digest()).rstrip(b"=").decode()


def issue(key: bytes, grant: Grant) -> str:
    payload = base64.urlsafe_b64encode(orjson.dumps(asdict(grant))).rstrip(b"=")
    return f"{payload.decode()}.{_mac(key, payload)}"


class InvalidGrant(ValueError):
    pass


def verify(key: bytes, token: str, now: float | None = None) -> Grant:
    """The grant this token carries, if this gateway signed it and it has not expired."""
    payload, _, mac = token.partition(".")
    if not key or not payload or not token.isascii() or not hmac.compare_digest(mac, _mac(key, payload.encode())):
        raise InvalidGrant("shadow grant not signed by this gateway")
    try:
        doc = orjson.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        grant = Grant(**doc)
    except (ValueError, TypeError):
        raise InvalidGrant("malformed shadow grant") from None
    if grant.expires < (time.time() if now is None else now):
        raise InvalidGrant("shadow grant expired")
    return grant


def shadow_bucket(request_id: str) -> float:
    """Where a request falls in [0, 1) for shadowing: deterministic by request id, independent of the
    canary's bucket (a different prefix), so the two shares do not select the same requests."""
    return int(hashlib.sha256(b"shadow:" + request_id.encode()).hexdigest()[:8], 16) / 2**32
