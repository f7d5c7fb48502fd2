"""The simulator against real vLLM: the same requests to both, compared field by field.

Everything compared here must agree. What legitimately differs (token counts, generated text, block
size on the CPU backend, metrics the simulator does not model) is listed in docs/SIMULATOR.md.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.helpers import Response, chat_body, request
from tests.promtext import label_names, names, scrape, value
from tests.vllm.conftest import MAX_MODEL_LEN, MODEL

Engines = tuple[str, str]  # (simulator, vLLM)


@pytest.fixture(scope="module")
def engines(sim_url: str, vllm_url: str) -> Engines:
    return sim_url, vllm_url


def both(engines: Engines, path: str, method: str = "POST", body: Any = None,
         headers: dict[str, str] | None = None) -> tuple[Response, Response]:
    sim, real = (request(f"{u}{path}", method, body, headers, timeout=120) for u in engines)
    return sim, real


def shape(doc: Any) -> Any:
    """Keys and value types, recursively; lists by their first element."""
    if isinstance(doc, dict):
        return {k: shape(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [shape(doc[0])] if doc else []
    return type(doc).__name__


def sse(r: Response) -> tuple[list[dict[str, Any]], str]:
    events = [e for e in r.body.decode().split("\n\n") if e.strip()]
    return [json.loads(e[6:]) for e in events[:-1]], events[-1]


def test_non_streaming_shape(engines: Engines) -> None:
    sim, real = both(engines, "/v1/chat/completions", body=chat_body(MODEL, max_tokens=4),
                     headers={"X-Request-Id": "d1"})
    assert sim.status == real.status == 200
    s, r = sim.json(), real.json()
    assert shape(s) == shape(r)
    assert s["id"] == r["id"] == "chatcmpl-d1"
    assert s["choices"][0]["finish_reason"] == r["choices"][0]["finish_reason"] == "length"
    for u in (s["usage"], r["usage"]):
        assert u["completion_tokens"] == 4 and u["total_tokens"] == u["prompt_tokens"] + 4
    assert sim.headers["content-type"].split(";")[0] == real.headers["content-type"].split(";")[0]


def test_stream_chunk_sequence(engines: Engines) -> None:
    body = chat_body(MODEL, max_tokens=3, stream=True, stream_options={"include_usage": True})
    sim, real = both(engines, "/v1/chat/completions", body=body)
    assert sim.headers["content-type"].split(";")[0] == real.headers["content-type"].split(";")[0] == \
        "text/event-stream"
    (s, s_end), (r, r_end) = sse(sim), sse(real)
    assert s_end == r_end == "data: [DONE]"
    # Role, then a chunk per token, then usage. vLLM sends no chunk for a token whose text is still
    # an incomplete UTF-8 sequence (the tiny model samples byte tokens), so it may send fewer
    # content chunks than tokens; the simulator's tokens are whole text, one chunk each.
    assert len(s) == 5 and 3 <= len(r) <= 5, (len(s), len(r))
    assert shape(s[0]) == shape(r[0]) and s[0]["choices"][0]["delta"] == r[0]["choices"][0]["delta"]
    assert all(shape(c) == shape(s[1]) for c in r[1:-2])
    assert shape(s[-2]) == shape(r[-2]) and s[-2]["choices"][0]["finish_reason"] == r[-2]["choices"][0][
        "finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in (*s[1:-2], *r[1:-2]))
    assert shape(s[-1]) == shape(r[-1]) and s[-1]["choices"] == r[-1]["choices"] == []
    assert s[-1]["usage"]["completion_tokens"] == r[-1]["usage"]["completion_tokens"] == 3


def test_stream_without_usage_has_no_usage_chunk(engines: Engines) -> None:
    sim, real = both(engines, "/v1/chat/completions", body=chat_body(MODEL, max_tokens=2, stream=True))
    (s, _), (r, _) = sse(sim), sse(real)
    assert len(s) == 3 and 2 <= len(r) <= 3  # role, a chunk per whole token (see above)
    assert all("usage" not in c for c in (*s, *r))


BAD_INPUTS = {
    "unknown model": chat_body("no-such-model"),
    "max_tokens over the window": chat_body(MODEL, max_tokens=MAX_MODEL_LEN + 1),
    "prompt over the window": chat_body(MODEL, "hello there world " * 1500, max_tokens=4),
    "empty conversation": {"model": MODEL, "messages": []},
    "empty cache_salt": chat_body(MODEL, cache_salt=""),
    "max_tokens zero": chat_body(MODEL, max_tokens=0),
    "missing messages": {"model": MODEL},
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_error_bodies_and_statuses(engines: Engines, case: str) -> None:
    sim, real = both(engines, "/v1/chat/completions", body=BAD_INPUTS[case])
    assert sim.status == real.status, (sim.body, real.body)
    s, r = sim.json()["error"], real.json()["error"]
    assert set(s) == set(r) == {"message", "type", "param", "code"}
    assert (s["type"], s["param"], s["code"]) == (r["type"], r["param"], r["code"])
    # Messages agree up to the first number or quoted value (counts differ between tokenizers).
    assert s["message"].split("1")[0][:40] == r["message"].split("1")[0][:40], (s["message"], r["message"])


def test_malformed_json(engines: Engines) -> None:
    sim, real = both(engines, "/v1/chat/completions", body=b"{not json")
    assert sim.status == real.status == 400
    assert sim.json()["error"]["type"] == real.json()["error"]["type"] == "Bad Request"


def test_priority_is_accepted_without_priority_scheduling(engines: Engines) -> None:
    sim, real = both(engines, "/v1/chat/completions", body=chat_body(MODEL, max_tokens=1, priority=3))
    assert sim.status == real.status == 200


def test_generation_stops_at_the_window_instead_of_refusing(engines: Engines) -> None:
    body = chat_body(MODEL, "hello there world " * 30, max_tokens=MAX_MODEL_LEN, ignore_eos=True)
    sim, real = both(engines, "/v1/chat/completions", body=body)
    assert sim.status == real.status == 200
    for doc in (sim.json(), real.json()):
        assert doc["usage"]["total_tokens"] <= MAX_MODEL_LEN


def test_health(engines: Engines) -> None:
    sim, real = both(engines, "/health", "GET")
    assert sim.status == real.status == 200 and sim.body == real.body == b""


def test_models(engines: Engines) -> None:
    sim, real = both(engines, "/v1/models", "GET")
    assert shape(sim.json()) == shape(real.json())
    assert sim.json()["data"][0]["id"] == real.json()["data"][0]["id"] == MODEL
    assert sim.json()["data"][0]["max_model_len"] == real.json()["data"][0]["max_model_len"] == MAX_MODEL_LEN


def test_tokenize(engines: Engines) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for body in ({"prompt": "hello world"}, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                 # what the gateway sends for a token count: the template as for generation, tools included
                 {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": tools,
                  "add_generation_prompt": True}):
        sim, real = both(engines, "/tokenize", body=body)
        assert sim.status == real.status == 200
        assert shape(sim.json()) == shape(real.json())
        for doc in (sim.json(), real.json()):
            assert doc["count"] == len(doc["tokens"]) and doc["max_model_len"] == MAX_MODEL_LEN


# What endpoint pickers and dashboards read (reference/engines-and-providers.md).
PICKER_METRICS = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
    "vllm:cache_config_info",
)


def test_metrics_names_and_labels(engines: Engines) -> None:
    both(engines, "/v1/chat/completions", body=chat_body(MODEL, max_tokens=2))
    sim, real = (scrape(u) for u in engines)
    for name in PICKER_METRICS:
        assert name in names(sim) and name in names(real), name
        if name != "vllm:cache_config_info":
            assert label_names(sim, name) == label_names(real, name), name
    reasons = {dict(ls)["finished_reason"] for (n, ls) in real if n == "vllm:request_success_total"}
    assert reasons == {dict(ls)["finished_reason"] for (n, ls) in sim if n == "vllm:request_success_total"}
    for samples in (sim, real):
        assert 0.0 <= value(samples, "vllm:kv_cache_usage_perc") <= 1.0
        assert dict(next(ls for (n, ls) in samples if n == "vllm:cache_config_info"))["enable_prefix_caching"] == "True"


def test_logprobs_shape(engines: Engines) -> None:
    body = chat_body(MODEL, max_tokens=3, logprobs=True, top_logprobs=2)
    sim, real = both(engines, "/v1/chat/completions", body=body)
    assert sim.status == real.status == 200
    s, r = (x.json()["choices"][0]["logprobs"] for x in (sim, real))
    assert shape(s) == shape(r)
    for doc in (s, r):
        assert all(len(t["top_logprobs"]) == 2 for t in doc["content"])


def test_n_choices_and_their_usage(engines: Engines) -> None:
    body = chat_body(MODEL, max_tokens=3, n=2, ignore_eos=True)
    sim, real = both(engines, "/v1/chat/completions", body=body)
    assert sim.status == real.status == 200
    for doc in (sim.json(), real.json()):
        assert [c["index"] for c in doc["choices"]] == [0, 1]
        assert doc["usage"]["completion_tokens"] == 6  # both choices counted, the prompt once
