"""Plain HTTP helpers for tests: raw requests where the SDK would hide what the gateway sent."""

from __future__ import annotations

import http.client
import json
import urllib.parse
import uuid
from dataclasses import dataclass
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


def inject_fault(engines: list[str], spec: str, count: int = 1, marker: str | None = None) -> str:
    """Queue a fault (enginesim's SPEC, e.g. `delay_ms=300`) on every engine through the operator's
    admin API - clients cannot reach it, and the gateway forwards no fault header - for the next
    `count` requests whose messages hold the returned marker: put it in the request's content."""
    marker = marker or f"FAULT-{uuid.uuid4().hex[:12]}"
    for url in engines:
        r = request(f"{url}/admin/faults", "POST", {"fault": spec, "count": count, "match": marker})
        assert r.status == 200, r.body
    return marker


def clear_faults(engines: list[str]) -> None:
    for url in engines:
        request(f"{url}/admin/faults", "DELETE")
