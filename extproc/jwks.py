"""JSON Web Key Sets for JWT issuers: read from a file or fetched from a URL, cached, and refreshed
on rotation (an unknown `kid` triggers one refresh, at most every `MIN_REFRESH_S`).

The cache outlives config revisions: a reload that keeps an issuer keeps its keys.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import jwt

from extproc.config.schema import JwtIssuer

log = logging.getLogger("llmgw.jwks")
MIN_REFRESH_S = 10.0
FETCH_TIMEOUT_S = 0.5  # well inside Envoy's ext_proc message timeout


class JwksUnavailable(Exception):
    """No keys could be loaded for an issuer and none are cached: identity cannot be established."""


@dataclass
class _Entry:
    keys: dict[str, jwt.PyJWK] = field(default_factory=dict)
    loaded_at: float = 0.0
    tried_at: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def parse_jwks(doc: Any) -> dict[str, jwt.PyJWK]:
    """Signing keys by `kid`. Keys without a kid, symmetric keys and unusable entries are skipped:
    an issuer's set never contributes an HMAC secret."""
    out: dict[str, jwt.PyJWK] = {}
    for raw in (doc or {}).get("keys", []) if isinstance(doc, dict) else []:
        if not isinstance(raw, dict) or not isinstance(raw.get("kid"), str) or raw.get("kty") == "oct":
            continue
        if raw.get("use", "sig") != "sig":
            continue
        try:
            out[raw["kid"]] = jwt.PyJWK(raw)
        except (jwt.PyJWKError, jwt.InvalidKeyError, ValueError, TypeError, KeyError):
            log.warning("JWKS key %s skipped: unusable", raw.get("kid"))
    return out


class JwksCache:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    async def key(self, issuer: JwtIssuer, kid: str, base: Path) -> jwt.PyJWK | None:
        """The key for `kid`, or None when the issuer's current set lacks it. `base` is the policy
        directory, which relative `jwks_file` paths start from."""
        source = issuer.jwks_url or f"file:{base / (issuer.jwks_file or '')}"
        entry = self._entries.setdefault(source, _Entry())
        now = time.monotonic()
        fresh = now - entry.loaded_at < issuer.jwks_cache_s
        if kid in entry.keys and fresh:
            return entry.keys[kid]
        # Expired set, or an unknown kid (the issuer may have rotated): refresh, rate-limited.
        if now - entry.tried_at >= MIN_REFRESH_S or not entry.keys:
            async with entry.lock:
                if time.monotonic() - entry.tried_at >= MIN_REFRESH_S or not entry.keys:
                    await self._refresh(issuer, entry, base)
        if not entry.keys:
            raise JwksUnavailable(f"no signing keys available for issuer {issuer.issuer}")
        return entry.keys.get(kid)

    async def _refresh(self, issuer: JwtIssuer, entry: _Entry, base: Path) -> None:
        entry.tried_at = time.monotonic()
        try:
            doc = await self._load(issuer, base)
        except (OSError, ValueError, aiohttp.ClientError, TimeoutError) as e:
            # Keep serving the cached keys (if any): a flapping IdP must not lock everyone out.
            log.warning("JWKS for issuer %s could not be refreshed: %s", issuer.issuer, type(e).__name__)
            return
        keys = parse_jwks(doc)
        if keys:
            entry.keys, entry.loaded_at = keys, time.monotonic()
        else:
            log.warning("JWKS for issuer %s holds no usable signing key", issuer.issuer)

    async def _load(self, issuer: JwtIssuer, base: Path) -> Any:
        if issuer.jwks_file is not None:
            return json.loads((base / issuer.jwks_file).read_text(encoding="utf-8"))
        assert issuer.jwks_url is not None
        # A session per fetch: refreshes are minutes apart, and nothing is left open on shutdown.
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)) as session, \
                session.get(issuer.jwks_url) as resp:
            resp.raise_for_status()
            return await resp.json(content_type=None)
