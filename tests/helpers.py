"""Plain HTTP helpers for tests: raw requests where the SDK would hide what the gateway sent."""

from __future__ import annotations

import http.client
import json
import random
import socket
import string
import subprocess
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def request(url: str, method: str = "GET", body: bytes | str | dict[str, Any] | None = None,
            headers: dict[str, str] | None = None, timeout: float = 10.0) -> Response:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    data = json.dumps(body).encode() if isinstance(body, dict) else (
        body.encode() if isinstance(body, str) else body)
    hdrs = {"content-type": "application/json", **(headers or {})}
    try:
        conn.request(method, u.path + (f"?{u.query}" if u.query else ""), body=data, headers=hdrs)
        r = conn.getresponse()
        return Response(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    finally:
        conn.close()


def stream_raw(url: str, body: dict[str, Any], headers: dict[str, str],
               timeout: float = 15.0) -> tuple[int, str, bytes]:
    """(status, request id, everything that arrived) of a streamed answer that may be cut: a reset is
    what the client then sees, and what came before it is kept."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    conn.request("POST", u.path, json.dumps(body), {"content-type": "application/json", **headers})
    resp = conn.getresponse()
    rid, got = resp.getheader("x-request-id") or "", bytearray()
    try:
        while chunk := resp.read1(65536):
            got += chunk
    except (http.client.IncompleteRead, OSError) as e:
        got += getattr(e, "partial", b"")
    finally:
        conn.close()
    return resp.status, rid, bytes(got)


def request_quietly(*args: Any, **kwargs: Any) -> Response | None:
    """A background load whose connection the test may cut (engines stop before it ends)."""
    try:
        return request(*args, **kwargs)
    except (OSError, http.client.HTTPException):
        return None


def chat_body(model: str = "chat-default", content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def assert_contract_error(resp: Response, status: int, code: str) -> dict[str, Any]:
    """The contract's error shape: {"error": {"message", "type", "code", "param"}}."""
    assert resp.status == status, (resp.status, resp.body[:500])
    assert resp.headers.get("content-type", "").startswith("application/json"), resp.headers
    doc = resp.json()
    assert set(doc) == {"error"}, doc
    err = doc["error"]
    assert set(err) == {"message", "type", "code", "param"}, err
    assert err["code"] == code, err
    assert isinstance(err["message"], str) and err["message"], err
    return err


def unique_marker(prefix: str) -> str:
    """A marker for a request's content that redaction leaves alone: letters only, since a run of
    digits (a timestamp, a hex id that happens to be all digits) can read as a phone or card number
    and be replaced before it reaches the engine."""
    return f"{prefix}-{''.join(random.choices(string.ascii_lowercase, k=16))}"


def inject_fault(engines: list[str], spec: str, count: int = 1, marker: str | None = None) -> str:
    """Queue a fault (enginesim's SPEC, e.g. `delay_ms=300`) on every engine through the operator's
    admin API - clients cannot reach it, and the gateway forwards no fault header - for the next
    `count` requests whose messages hold the returned marker: put it in the request's content."""
    marker = marker or unique_marker("FAULT")
    for url in engines:
        r = request(f"{url}/admin/faults", "POST", {"fault": spec, "count": count, "match": marker})
        assert r.status == 200, r.body
    return marker


def clear_faults(engines: list[str]) -> None:
    for url in engines:
        request(f"{url}/admin/faults", "DELETE")


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]  # lower-case names (the last of repeated ones)
    body: bytes
    complete: bool  # the whole body arrived as its framing promised (length, last chunk, or close)


def raw_exchange(url: str, data: bytes, timeout: float = 10.0, head: bool = False) -> RawResponse | None:
    """Send raw bytes (what a client library would refuse to) and read one HTTP/1.1 response, checking
    that its framing is kept. None when the connection closed without any response."""
    u = urllib.parse.urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as s:
        s.sendall(data)
        buf = bytearray()
        closed = False

        def more() -> bool:
            nonlocal closed
            if closed:
                return False
            chunk = s.recv(65536)
            if not chunk:
                closed = True
                return False
            buf.extend(chunk)
            return True

        while b"\r\n\r\n" not in buf:
            if not more():
                return None if not buf else RawResponse(0, {}, bytes(buf), False)
        head_bytes, _, rest = bytes(buf).partition(b"\r\n\r\n")
        lines = head_bytes.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        buf[:] = rest
        if head or status in (204, 304) or 100 <= status < 200:
            return RawResponse(status, headers, b"", True)
        if "content-length" in headers:
            n = int(headers["content-length"])
            while len(buf) < n and more():
                pass
            return RawResponse(status, headers, bytes(buf[:n]), len(buf) >= n)
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = bytearray()
            while True:
                while b"\r\n" not in buf:
                    if not more():
                        return RawResponse(status, headers, bytes(body), False)
                size_line, _, after = bytes(buf).partition(b"\r\n")
                size = int(size_line.split(b";")[0], 16)
                while len(after) < size + 2:
                    if not more():
                        return RawResponse(status, headers, bytes(body), False)
                    size_line, _, after = bytes(buf).partition(b"\r\n")
                if size == 0:
                    return RawResponse(status, headers, bytes(body), True)
                body += after[:size]
                buf[:] = after[size + 2:]
        while more():
            pass
        return RawResponse(status, headers, bytes(buf), closed)


def raw_post(path: str, body: bytes, headers: list[tuple[bytes, bytes]], host: bytes = b"gw") -> bytes:
    """A POST as bytes on the wire, its headers exactly as given (any bytes)."""
    lines = [b"POST " + path.encode() + b" HTTP/1.1", b"Host: " + host,
             *(k + b": " + v for k, v in headers), b"Content-Length: " + str(len(body)).encode()]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def assert_contract_body(status: int, headers: dict[str, str], body: bytes) -> dict[str, Any]:
    """The contract's error shape, for a response read raw."""
    assert headers.get("content-type", "").startswith("application/json"), (status, headers, body[:200])
    doc = json.loads(body)
    assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "code", "param"}, doc
    return dict(doc["error"])


def llmgw(*args: str, timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The `llmgw` command, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "llmgw", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd)


def feed_hostile(stream: Any, pieces: list[bytes]) -> None:
    """Feed a provider stream translator (extproc/shapes/) arbitrary pieces and finish it: a broken
    stream must end with UpstreamBroken, the contract's way to end it; any other exception escapes and
    fails the caller."""
    from tests.oracles.base import UpstreamBroken

    try:
        for piece in pieces:
            stream.feed(piece)
        stream.finish()
    except UpstreamBroken:
        pass
