"""Time to first token is the first token's, not the headers': an engine (vLLM, and the simulator) sends
its response headers and an empty role chunk at once, then queues and prefills. A stream with a long
prompt, on an engine running at real time, shows the difference in every place a TTFT is read: the
ledger (beside its time to headers), the metrics, `llmgw report`, the canary watch, the SLO-regression
trigger and the request-class objectives."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from llmgw.local.stack import Stack
from llmgw.ops.canary import side
from llmgw.ops.reevaluate import Bounds, evaluate
from llmgw.ops.report import reading
from tests.conftest import DEMO_KEYS, ledger_of, start_stack
from tests.e2e.operations.test_metrics_e2e import families, total

pytestmark = pytest.mark.e2e
KEY = DEMO_KEYS["globex"]
PROMPT_WORDS = 3000  # about 12,000 tokens: ~0.5 s of prefill for llama-3-8b on an H100, at real time
SLOW_MS = 300.0  # below the prefill, far above the headers


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("first-token"), time_scale=1.0)  # the engine's real prefill time
    yield s
    s.stop()


def slow_prefill_stream(gw: Stack, idempotent: bool) -> tuple[dict[str, Any], float, float]:
    """(its ledger entry, the client's time to headers and to first content, in ms): a stream whose
    prompt is new to the engine (no prefix cached), guarded in Envoy or, with an Idempotency-Key, by
    ext_proc."""
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY, max_retries=0)
    words = " ".join(f"w{random.randrange(10**12)}" for _ in range(PROMPT_WORDS))
    started = time.monotonic()
    with client.chat.completions.with_streaming_response.create(
            model="chat-default", max_tokens=5, stream=True, messages=[{"role": "user", "content": words}],
            extra_headers={"idempotency-key": f"ttft-{time.time_ns()}"} if idempotent else {}) as resp:
        headers_ms, first_ms = (time.monotonic() - started) * 1000, None
        rid = resp.headers["x-request-id"]
        for chunk in resp.parse():
            if first_ms is None and chunk.choices and chunk.choices[0].delta.content:
                first_ms = (time.monotonic() - started) * 1000
    assert first_ms is not None
    return ledger_of(gw, rid, "globex"), headers_ms, first_ms


def test_ttft_is_the_first_token_s_everywhere_and_the_headers_are_their_own_figure(gw: Stack) -> None:
    sent = [slow_prefill_stream(gw, idempotent) for idempotent in (False, True, False, True)]
    entries = [e for e, _, _ in sent]
    for entry, headers_ms, first_ms in sent:
        # The client saw the headers long before the first token; so does the ledger.
        assert first_ms - headers_ms > SLOW_MS, (headers_ms, first_ms)
        assert entry["first_token_ms"] > SLOW_MS, entry
        assert entry["first_byte_ms"] < entry["first_token_ms"] - SLOW_MS + 100, entry
        # The gateway's stamp is taken on the way to the client: no later than the client's.
        assert entry["first_token_ms"] <= first_ms + 5, (entry["first_token_ms"], first_ms)
        assert entry["first_token_ms"] < entry["duration_ms"]

    # Metrics: the first-token histogram holds the slow figures, the headers' the fast ones.
    m = families(gw.metrics_url)
    served = {"route": "chat-default", "deployment": "pool-llama-8b"}
    n = total(m["gen_ai_server_time_to_first_token_seconds_count"], **served)
    assert n == total(m["llmgw_time_to_headers_seconds_count"], **served) == len(sent)
    assert total(m["gen_ai_server_time_to_first_token_seconds_sum"], **served) / n > SLOW_MS / 1000
    headers_mean = total(m["llmgw_time_to_headers_seconds_sum"], **served) / n
    assert headers_mean < total(m["gen_ai_server_time_to_first_token_seconds_sum"], **served) / n - 0.2

    # `llmgw report`, the canary watch, the SLO trigger and the class objectives read the first token.
    assert all(reading(e).ttft_s == e["first_token_ms"] / 1000 for e in entries)
    assert (side(entries).ttft_p95_ms or 0) > SLOW_MS
    (slo,) = evaluate(entries, entries, Bounds(ttft_p95_ms=SLOW_MS, min_requests=len(entries)))
    assert slo.trigger == "slo_regression" and slo.reason.startswith("TTFT p95"), slo
    cls = entries[0]["request_class"]
    objectives = {cls: (SLOW_MS, None, 0.95)}
    (missed,) = evaluate(entries, entries, Bounds(min_requests=len(entries), objectives=objectives))
    assert missed.reason.startswith(f"{cls}: 0.0% of {len(entries)} answers within its objective"), missed
