"""Identity: who is calling. A bearer token is either an API key, looked up by its SHA-256 (the key
itself is never kept), or a JWT from a configured workload-identity issuer.

Every failure is the same 401 with the same message, so a caller learns nothing about which check
failed; the log says which, without the token.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs

import jwt

from extproc.config.schema import JwtIssuer
from extproc.contract import CHAT_PATH, ErrorCode, GatewayError
from extproc.exchange import Exchange, Identity
from extproc.jwks import JwksCache, JwksUnavailable
from extproc.names import Header
from extproc.ratelimit import RateLimitedLog
from extproc.shadow import InvalidGrant, verify
from extproc.shapes.door import Door, path_of, query_of
from extproc.shapes.registry import DOORS_BY_NAME

log = logging.getLogger("llmgw.identity")
# Anyone can send a bad credential: one line a second at most, with the count of the rest.
_refusals = RateLimitedLog(log, every_s=1.0)
_UNAUTHENTICATED = "missing, invalid or expired credential"
_MAX_TOKEN = 8192


def bearer_token(authorization: str) -> str | None:
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or len(token) > _MAX_TOKEN:
        return None
    return token


def credential(headers: dict[str, str], path: str, door: Door | None) -> str:
    """The gateway credential, where the caller's SDK puts it: `Authorization: Bearer` on every path,
    and a front door's own header or query parameter on its path (Anthropic's `x-api-key`, Google's
    `x-goog-api-key` and `?key=`; elsewhere just another header, never forwarded). Two different ones
    are refused: which counts would be a guess."""
    bearer = bearer_token(headers["authorization"]) if "authorization" in headers else None
    if "authorization" in headers and bearer is None:
        raise Unauthenticated("authorization is not a bearer token")
    tokens = {bearer} if bearer is not None else set()
    given = [headers.get(name, "") for name in door.credential_headers] if door is not None else []
    if door is not None and door.credential_query:
        given += parse_qs(query_of(path)).get(door.credential_query, [])
    for key in given:
        if len(key.strip()) > _MAX_TOKEN:
            raise Unauthenticated("credential too long")
        tokens |= {key.strip()} if key.strip() else set()
    if len(tokens) > 1:
        raise Unauthenticated("two different credentials")
    if not tokens:
        raise Unauthenticated("no credential")
    return tokens.pop()


def looks_like_jwt(token: str) -> bool:
    return token.count(".") == 2 and token.startswith("eyJ")


class Unauthenticated(GatewayError):
    def __init__(self, why: str):
        super().__init__(ErrorCode.UNAUTHENTICATED, _UNAUTHENTICATED)
        self.why = why  # for the log only


def api_key_identity(ex: Exchange, token: str) -> Identity:
    digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()
    owner = ex.snapshot.keys_by_hash.get(digest)
    if owner is None:
        raise Unauthenticated("unknown api key")
    if owner.key.revoked:
        raise Unauthenticated(f"api key {owner.key.id} is revoked")
    if owner.key.expires is not None and owner.key.expires < datetime.now(UTC).date():
        raise Unauthenticated(f"api key {owner.key.id} expired")
    return Identity(tenant=owner.tenant, subject=owner.key.id, kind="api_key", effects=owner.key.effects)


def _claims_identity(ex: Exchange, issuer: JwtIssuer, claims: dict[str, Any]) -> Identity:
    tenant, subject = claims.get(issuer.tenant_claim), claims.get(issuer.subject_claim)
    if not isinstance(tenant, str) or tenant not in ex.snapshot.gateway.tenants:
        raise Unauthenticated("token names no configured tenant")
    if issuer.tenants is not None and tenant not in issuer.tenants:
        raise Unauthenticated(f"issuer {issuer.issuer} may not assert tenant {tenant}")
    if not isinstance(subject, str) or not subject:
        raise Unauthenticated("token has no subject")
    groups = claims.get(issuer.groups_claim, [])
    if not isinstance(groups, list) or not all(isinstance(g, str) for g in groups):
        raise Unauthenticated("groups claim is not a list of strings")
    effects = sorted({e for g in groups for e in ex.snapshot.gateway.group_effects.get(g, ())})
    return Identity(tenant=tenant, subject=subject, kind="jwt", groups=tuple(groups), effects=tuple(effects))


def shadow_identity(ex: Exchange, token: str) -> Identity:
    """A shadow copy Envoy mirrored (extproc/shadow.py): the tenant and subject of the request it copies,
    on the chat path only, with the copied request's data class (the copy does not carry its headers)."""
    if ex.door or path_of(ex.path) != CHAT_PATH or len(token) > _MAX_TOKEN:
        raise Unauthenticated("shadow grant outside a chat completion")
    try:
        grant = verify(ex.shadow_key, token)
    except InvalidGrant as e:
        raise Unauthenticated(str(e)) from None
    if grant.tenant not in ex.snapshot.gateway.tenants:
        raise Unauthenticated("shadow grant names no configured tenant")
    ex.shadow_of = grant
    ex.headers[Header.DATA_CLASS] = grant.data_class
    return Identity(tenant=grant.tenant, subject=grant.subject, kind="shadow")


class CallerIdentity:
    name = "identity"

    def __init__(self, jwks: JwksCache | None = None):
        self.jwks = jwks or JwksCache()

    async def run(self, ex: Exchange) -> None:
        try:
            if Header.SHADOW_GRANT in ex.headers:
                ex.identity = shadow_identity(ex, ex.headers[Header.SHADOW_GRANT])
                return
            token = credential(ex.headers, ex.path, DOORS_BY_NAME.get(ex.door))
            ident = await self._jwt(ex, token) if looks_like_jwt(token) else api_key_identity(ex, token)
            # Effects every caller of the tenant holds join the key's or groups' own grants.
            held = ex.snapshot.gateway.tenants[ident.tenant].tool_effects
            ex.identity = replace(ident, effects=tuple(sorted({*ident.effects, *held}))) if held else ident
        except Unauthenticated as e:
            _refusals.info("request %s unauthenticated: %s", ex.request_id, e.why)
            raise

    async def _jwt(self, ex: Exchange, token: str) -> Identity:
        try:
            header = jwt.get_unverified_header(token)
            unverified = jwt.decode(token, options={"verify_signature": False})
        except (jwt.PyJWTError, ValueError, TypeError):
            raise Unauthenticated("malformed JWT") from None
        issuer = next((i for i in ex.snapshot.gateway.jwt_issuers if i.issuer == unverified.get("iss")), None)
        if issuer is None:
            raise Unauthenticated("unknown issuer")
        alg, kid = header.get("alg"), header.get("kid")
        # Only the issuer's asymmetric algorithms: `none` and HS* never verify anything here.
        if alg not in issuer.algorithms:
            raise Unauthenticated(f"algorithm {alg!r} not allowed for issuer")
        if not isinstance(kid, str):
            raise Unauthenticated("JWT has no kid")
        try:
            key = await self.jwks.key(issuer, kid, ex.snapshot.directory)
        except JwksUnavailable as e:
            raise GatewayError(ErrorCode.POLICY_UNAVAILABLE, "the identity provider's keys are unavailable") from e
        if key is None:
            raise Unauthenticated("unknown kid")
        if key.algorithm_name != alg and not (alg.startswith(("RS", "PS")) and key.key_type == "RSA"):
            raise Unauthenticated("key type does not match the algorithm")
        try:
            claims = jwt.decode(token, key=key.key, algorithms=[alg], audience=list(issuer.audiences),
                                issuer=issuer.issuer, leeway=issuer.leeway_s,
                                options={"require": ["exp", "iat", "iss", "aud"]})
        except jwt.PyJWTError as e:
            raise Unauthenticated(f"JWT rejected: {type(e).__name__}") from None
        if claims["exp"] - claims["iat"] > issuer.max_lifetime_s:
            raise Unauthenticated("JWT lifetime exceeds the issuer's maximum")
        return _claims_identity(ex, issuer, claims)
