"""AWS event-stream framing, as Bedrock's ConverseStream writes it (the simulator's encoder; the
gateway decodes with botocore's parser, so the two are checked against each other).

A message: total length (4 bytes, big-endian), headers length (4), the CRC32 of those 8 bytes, the
headers (name length (1), name, value type 7 = string, value length (2), value), the payload, and the
CRC32 of everything before it.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

STRING = 7


def message(headers: dict[str, str], payload: bytes) -> bytes:
    encoded = b"".join(struct.pack(">B", len(k)) + k.encode() + struct.pack(">BH", STRING, len(v.encode()))
                       + v.encode() for k, v in headers.items())
    prelude = struct.pack(">II", 12 + len(encoded) + len(payload) + 4, len(encoded))
    body = prelude + struct.pack(">I", zlib.crc32(prelude)) + encoded + payload
    return body + struct.pack(">I", zlib.crc32(body))


def event(kind: str, doc: dict[str, Any]) -> bytes:
    return message({":event-type": kind, ":content-type": "application/json", ":message-type": "event"},
                   json.dumps(doc, separators=(",", ":")).encode())


def exception(kind: str, text: str) -> bytes:
    return message({":exception-type": kind, ":content-type": "application/json", ":message-type": "exception"},
                   json.dumps({"message": text}).encode())
