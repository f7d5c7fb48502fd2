"""The corpus runner sends a request once more only when the sandbox gateway failed to decide it
(503 policy_unavailable: the gateway's own fault, never the candidate's); any other refusal counts."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llmgw.conformance.runner import send


class Answers(BaseHTTPRequestHandler):
    codes: list[str] = []  # the error code of each answer, in order ("" for a 200)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        code = self.codes.pop(0)
        body = (json.dumps({"error": {"code": code, "message": code}}) if code else json.dumps(
            {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop",
                                                                   "message": {"role": "assistant", "content": "hi"}}],
             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})).encode()
        self.send_response(503 if code else 200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_sandbox_that_failed_to_decide_is_asked_once_more(url: str) -> None:
    Answers.codes = ["policy_unavailable", ""]
    assert send(url, "k", {"model": "m"}, {}).status == 200
    Answers.codes = ["policy_unavailable", "policy_unavailable", ""]
    out = send(url, "k", {"model": "m"}, {})
    assert (out.status, out.error) == (503, "policy_unavailable") and Answers.codes == [""]  # once, no more


def test_any_other_refusal_counts_at_once(url: str) -> None:
    Answers.codes = ["upstream_error", ""]
    out = send(url, "k", {"model": "m"}, {})
    assert (out.status, out.error) == (503, "upstream_error") and Answers.codes == [""]
