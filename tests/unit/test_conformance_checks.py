"""The conformance corpus's checks (llmgw/conformance/corpus.py), on outcomes made by hand."""

from __future__ import annotations

from llmgw.conformance.corpus import Outcome, check, load_corpus

CASES = {c.id: c for c in load_corpus().cases}


def answer(content: str | None = "hi", usage: dict | None = None, calls: list | None = None,  # type: ignore[type-arg]
           finish: str = "stop") -> Outcome:
    doc = {"choices": [{"message": {"content": content, "tool_calls": calls}, "finish_reason": finish}],
           "usage": usage}
    return Outcome.from_json(200, doc, [])


def test_usage_must_add_up_and_respect_max_tokens() -> None:
    case = CASES["plain-message"]
    assert check(case, [answer(usage={"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8})]) == []
    assert check(case, [answer(usage={"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 9})])
    assert check(case, [answer(usage={"prompt_tokens": 5, "completion_tokens": 33, "total_tokens": 38})])
    assert check(case, [answer(usage=None)]) == ["no usage"]


def test_tool_arguments_must_match_the_tools_schema() -> None:
    case = CASES["tool-auto"]
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    good = [{"function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]
    bad = [{"function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "kelvin"}'}}]
    assert check(case, [answer(None, usage, good, "tool_calls")]) == []
    assert "do not match its schema" in " ".join(check(case, [answer(None, usage, bad, "tool_calls")]))
    assert check(case, [answer("text", usage, None, "stop")])


def test_a_refusal_must_say_content_filter() -> None:
    assert check(CASES["refusal"], [answer("", finish="content_filter")]) == []
    assert check(CASES["refusal"], [answer("", finish="stop")])  # an empty normal answer is no refusal
    done = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"%s"}]}\n\ndata: [DONE]\n\n'
    assert check(CASES["refusal-streamed"], [Outcome.from_stream(200, done % b"content_filter", [])]) == []
    assert check(CASES["refusal-streamed"], [Outcome.from_stream(200, done % b"stop", [])])


def test_a_cancelled_stream_must_reach_the_upstream_and_the_ledger() -> None:
    case = CASES["stream-cancelled"]
    out = Outcome(200, stream=True, stream_end="cancelled", ledger={"termination": "client_cancel"},
                  upstream={"cancelled": True})
    assert check(case, [out]) == []
    assert check(case, [Outcome(200, stream=True, stream_end="cancelled", ledger={"termination": "complete"},
                                upstream={"cancelled": True})])  # settled as if it had finished
    assert check(case, [Outcome(200, stream=True, stream_end="cancelled", ledger={"termination": "client_cancel"},
                                upstream={"output_tokens": 64})])  # the upstream generated on for nobody
    assert check(case, [Outcome(200, stream=True, stream_end="cancelled")])  # nothing observed: no pass


def test_a_stream_must_end_as_the_case_says() -> None:
    ok = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\ndata: [DONE]\n\n'
    assert Outcome.from_stream(200, ok, []).stream_end == "done"
    cut = Outcome.from_stream(200, ok.replace(b"data: [DONE]\n\n", b""), [], reset=True)
    assert cut.stream_end == "reset"
    assert check(CASES["stream-truncated"], [cut]) == []
    assert check(CASES["stream-malformed-chunk"], [cut])  # the contract's event was due, not a reset
    assert check(CASES["stream-without-usage"], [Outcome.from_stream(200, ok.replace(b"[DONE]", b"x"), [])])
