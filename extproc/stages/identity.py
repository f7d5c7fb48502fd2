"""Identity: who is calling. API keys are looked up by their SHA-256; the key itself is never kept.

Every failure is the same 401, so a caller learns nothing about which check failed.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime

from extproc.contract import ErrorCode, GatewayError
from extproc.exchange import Exchange, Identity

_UNAUTHENTICATED = "missing, invalid or expired credential"


def bearer_token(authorization: str) -> str | None:
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or len(token) > 8192:
        return None
    return token


class ApiKeyIdentity:
    name = "identity"

    async def run(self, ex: Exchange) -> None:
        token = bearer_token(ex.headers.get("authorization", ""))
        if token is None:
            raise GatewayError(ErrorCode.UNAUTHENTICATED, _UNAUTHENTICATED)
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()
        owner = ex.snapshot.keys_by_hash.get(digest)
        if owner is None or owner.key.revoked:
            raise GatewayError(ErrorCode.UNAUTHENTICATED, _UNAUTHENTICATED)
        if owner.key.expires is not None and owner.key.expires < datetime.now(UTC).date():
            raise GatewayError(ErrorCode.UNAUTHENTICATED, _UNAUTHENTICATED)
        ex.identity = Identity(tenant=owner.tenant, subject=owner.key.id, kind="api_key")
