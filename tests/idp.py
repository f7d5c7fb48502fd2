"""A test identity provider: RSA, EC and Ed25519 signing keys, a JWKS file, and tokens minted on
demand, including the malicious ones (alg none, HS256 signed with the public key, unknown kid)."""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

ISSUER = "https://idp.test.llmgw"
AUDIENCE = "llmgw"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass
class Idp:
    keys: dict[str, Any] = field(default_factory=lambda: {
        "rsa-1": rsa.generate_private_key(public_exponent=65537, key_size=2048),
        "ec-1": ec.generate_private_key(ec.SECP256R1()),
        "ed-1": ed25519.Ed25519PrivateKey.generate(),
    })
    algs: dict[str, str] = field(default_factory=lambda: {"rsa-1": "RS256", "ec-1": "ES256", "ed-1": "EdDSA"})

    def jwks(self) -> dict[str, Any]:
        out = []
        for kid, key in self.keys.items():
            jwk = json.loads(jwt.algorithms.get_default_algorithms()[self.algs[kid]].to_jwk(key.public_key()))
            out.append({**jwk, "kid": kid, "use": "sig"})
        return {"keys": out}

    def write_jwks(self, path: Path) -> None:
        path.write_text(json.dumps(self.jwks()))

    def claims(self, **over: Any) -> dict[str, Any]:
        now = int(time.time())
        base = {"iss": ISSUER, "aud": AUDIENCE, "sub": "svc-reporting", "tenant": "acme", "groups": [],
                "iat": now, "nbf": now, "exp": now + 300}
        base.update(over)
        return {k: v for k, v in base.items() if v is not None}

    def token(self, kid: str = "rsa-1", alg: str | None = None, **claims: Any) -> str:
        return jwt.encode(self.claims(**claims), self.keys[kid], algorithm=alg or self.algs[kid],
                          headers={"kid": kid})

    def unsigned(self, **claims: Any) -> str:
        header = _b64(json.dumps({"alg": "none", "typ": "JWT", "kid": "rsa-1"}).encode())
        return f"{header}.{_b64(json.dumps(self.claims(**claims)).encode())}."

    def hs256_with_public_key(self, **claims: Any) -> str:
        """Key confusion: an HMAC token whose secret is the RSA public key's PEM."""
        pem = self.keys["rsa-1"].public_key().public_bytes(serialization.Encoding.PEM,
                                                          serialization.PublicFormat.SubjectPublicKeyInfo)
        header = _b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "rsa-1"}).encode())
        payload = _b64(json.dumps(self.claims(**claims)).encode())
        import hashlib
        import hmac
        sig = hmac.new(pem, f"{header}.{payload}".encode(), hashlib.sha256).digest()
        return f"{header}.{payload}.{_b64(sig)}"


def issuer_config(jwks_file: str, **over: Any) -> dict[str, Any]:
    return {"issuer": ISSUER, "audiences": [AUDIENCE], "jwks_file": jwks_file, "max_lifetime_s": 900,
            "tenants": ["acme"], **over}
