"""Idempotent answers at rest: what the store keeps so a repeated `Idempotency-Key` gets the same
answer without a second upstream call.

The answer is completion text, which the route's logging policy may forbid recording. So it is kept
only sealed: AES-256-GCM under a key derived (HKDF-SHA256) from `store.replay_key_ref`, with the
idempotency record's store key as associated data (a sealed answer moved to another key does not
open). Without a replay key, only a digest is kept, and a repeat of a completed request is refused
with 409 (it is never run twice). The same happens to an answer larger than
`store.idempotency_max_body_bytes`. Both are said in the refusal's message.
"""

from __future__ import annotations

import base64
import hashlib
import os
from dataclasses import dataclass

import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from extproc.contract import ErrorCode, GatewayError

SEALED = "v1:"  # version of the sealed format; a new key format gets a new prefix
DIGEST = "d1:"  # no replay key: a digest of the answer only
TOO_LARGE = "big:"


def derive_key(secret: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"llmgw idempotent replay v1").derive(
        secret.encode())


@dataclass(frozen=True)
class Answer:
    status: int
    content_type: str
    body: bytes


class NotReplayable(GatewayError):
    """A completed request whose answer the store does not hold: refused, never run again."""

    def __init__(self, why: str):
        super().__init__(ErrorCode.IDEMPOTENCY_CONFLICT,
                         f"a request with this Idempotency-Key completed, but {why}; use a new key to run it again",
                         "Idempotency-Key")


class Sealer:
    def __init__(self, secret: str | None):
        self._aead = AESGCM(derive_key(secret)) if secret else None

    @property
    def replays(self) -> bool:
        return self._aead is not None

    def seal(self, record_key: str, answer: Answer, max_bytes: int) -> str:
        """What the store keeps of a completed answer (ASCII)."""
        if len(answer.body) > max_bytes:
            return TOO_LARGE
        if self._aead is None:
            return DIGEST + hashlib.sha256(answer.body).hexdigest()
        nonce = os.urandom(12)
        text = answer.body.decode("utf-8", "replace")
        plain = orjson.dumps({"s": answer.status, "t": answer.content_type, "b": text})
        return SEALED + base64.b64encode(nonce + self._aead.encrypt(nonce, plain, record_key.encode())).decode()

    def open(self, record_key: str, kept: str) -> Answer:
        if kept.startswith(TOO_LARGE):
            raise NotReplayable("its answer was larger than the gateway keeps for replay")
        if not kept.startswith(SEALED):
            raise NotReplayable("the gateway keeps no answers for replay")
        if self._aead is None:
            raise NotReplayable("its answer cannot be read without the replay key")
        try:
            raw = base64.b64decode(kept[len(SEALED):])
            doc = orjson.loads(self._aead.decrypt(raw[:12], raw[12:], record_key.encode()))
        except (InvalidTag, ValueError):  # another key (rotated), or not ours
            raise NotReplayable("its answer was sealed with another replay key") from None
        return Answer(int(doc["s"]), str(doc["t"]), str(doc["b"]).encode())
