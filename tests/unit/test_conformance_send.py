"""The corpus runner sends a request again, backing off, only while the sandbox gateway failed it itself
(503 policy_unavailable or no_qualified_route: the gateway's own fault, never the candidate's), and a
run it still failed is marked so (never recorded); any other refusal counts at once."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llmgw.conformance import runner
from llmgw.conformance.corpus import Case
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


def test_a_sandbox_that_failed_a_request_is_asked_again_backing_off(url: str, monkeypatch: pytest.MonkeyPatch
                                                                     ) -> None:
    monkeypatch.setattr(runner, "SANDBOX_RETRIES_S", (0.01, 0.02, 0.04))
    Answers.codes = ["policy_unavailable", "no_qualified_route", ""]
    assert send(url, "k", {"model": "m"}, {}).status == 200 and Answers.codes == []
    Answers.codes = ["no_qualified_route"] * 4 + [""]
    out = send(url, "k", {"model": "m"}, {})
    assert (out.status, out.error) == (503, "no_qualified_route") and Answers.codes == [""]  # 1 + 3 tries, no more
    assert runner.sandbox_failed(out)


def test_a_case_the_sandbox_failed_is_marked_and_its_run_says_so(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "SANDBOX_RETRIES_S", ())
    case = Case.model_validate({"id": "plain", "about": "a plain turn", "expect": {"status": 200},
                                "request": {"messages": [{"role": "user", "content": "hi"}]}})
    gw = runner.Gateway(url, "acme", "k", "redis://127.0.0.1:1/0", "r")
    Answers.codes = ["no_qualified_route"]
    failed, _ = runner.run_case(case, gw, 8192, runner.Upstreams([]))
    Answers.codes = ["upstream_error"]
    refused, _ = runner.run_case(case, gw, 8192, runner.Upstreams([]))
    assert (failed.result, failed.sandbox_fault) == ("fail", True)
    assert (refused.result, refused.sandbox_fault) == ("fail", False)
    assert runner.sandbox_faults([failed, refused]) == ["plain"]


def test_any_other_refusal_counts_at_once(url: str) -> None:
    Answers.codes = ["upstream_error", ""]
    out = send(url, "k", {"model": "m"}, {})
    assert (out.status, out.error) == (503, "upstream_error") and Answers.codes == [""]
