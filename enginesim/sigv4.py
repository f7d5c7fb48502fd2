"""Checks an AWS Signature Version 4 (`AWS4-HMAC-SHA256`) the way a provider does: from the request
as it arrived and the secret key, written from the published algorithm (the gateway signs with
botocore, so a mistake on either side shows).

The canonical request is the method, the path URI-encoded once more (every service but S3 does so),
the sorted query, the signed headers (lower-case names, values trimmed, inner spaces collapsed), their
names and the body's SHA-256; the string to sign names the time and the scope
(date/region/service/aws4_request); the signing key is an HMAC chain from `AWS4` + secret.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from urllib.parse import parse_qsl, quote

ALGORITHM = "AWS4-HMAC-SHA256"
SKEW = timedelta(minutes=5)  # how far the request's time may be from the provider's


class SignatureError(Exception):
    """Why the signature does not verify; `kind` is the error type the provider answers with."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def _encode(text: str) -> str:
    return quote(text, safe="-_.~")


def verify(method: str, raw_path: str, raw_query: str, headers: Mapping[str, str], body: bytes,
           key_id: str, secret: str, service: str, now: datetime | None = None) -> None:
    """Raises SignatureError unless the request is signed by `key_id` with `secret` for `service`.
    `headers` must be case-insensitive (aiohttp's are)."""
    auth = headers.get("authorization", "")
    algorithm, _, fields = auth.partition(" ")
    if algorithm != ALGORITHM:
        raise SignatureError("MissingAuthenticationTokenException", "Missing Authentication Token")
    parts = dict(p.strip().partition("=")[::2] for p in fields.split(","))
    scope_key, _, scope = parts.get("Credential", "").partition("/")
    if scope_key != key_id:
        raise SignatureError("UnrecognizedClientException", "The security token included in the request is invalid.")
    date, region, scope_service, terminal = [*scope.split("/"), "", "", ""][:4]
    stamp = headers.get("x-amz-date", "")
    try:
        when = datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
    except ValueError:
        raise SignatureError("IncompleteSignatureException", "X-Amz-Date is missing or malformed") from None
    if abs((now or datetime.now(UTC)) - when) > SKEW:
        raise SignatureError("InvalidSignatureException", "Signature expired: the request time is too far from now")
    if scope_service != service or terminal != "aws4_request" or date != stamp[:8] or not region:
        raise SignatureError("InvalidSignatureException", f"Credential should be scoped to a valid region "
                                                          f"and the service {service}")
    signed = parts.get("SignedHeaders", "").split(";")
    if "host" not in signed:
        raise SignatureError("InvalidSignatureException", "the host header must be signed")
    canonical_headers = "".join(f"{h}:{' '.join(headers.get(h, '').split())}\n" for h in signed)
    query = "&".join(f"{_encode(k)}={_encode(v)}" for k, v in sorted(parse_qsl(raw_query, keep_blank_values=True)))
    canonical = "\n".join([method, quote(raw_path, safe="/~"), query, canonical_headers, ";".join(signed),
                           hashlib.sha256(body).hexdigest()])
    to_sign = "\n".join([ALGORITHM, stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = _hmac(("AWS4" + secret).encode(), date)
    for step in (region, service, "aws4_request"):
        key = _hmac(key, step)
    if not hmac.compare_digest(hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest(),
                               parts.get("Signature", "")):
        raise SignatureError("InvalidSignatureException",
                             "The request signature we calculated does not match the signature you provided.")
