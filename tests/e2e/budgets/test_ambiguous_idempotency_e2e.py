"""An ambiguous outcome keeps its Idempotency-Key (invariant 21): a JSON request whose attempts were sent
and never answered within its deadline may have run to completion upstream. Its key stays
`ambiguous`; the client's retry with the key - the openai SDK at its defaults - gets a distinct 409
naming the first request, and the engine sees no second dispatch. `llmgw ledger get` shows the key
and the entry; `llmgw ledger resolve` forgets the key, and the retry then runs."""

from __future__ import annotations

import json
import time
from typing import Any

import openai
import pytest

from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, ledger_of
from tests.helpers import clear_faults, inject_fault, llmgw, request

pytestmark = pytest.mark.e2e
KEY = DEMO_KEYS["acme"]


def dispatched(stack: Stack, marker: str) -> int:
    """How many attempts the engines received with this marker."""
    return sum(marker in json.dumps(e["messages"]) for u in stack.engine_urls()
               for e in request(f"{u}/admin/requests").json())


def cli(stack: Stack, *args: str) -> Any:
    return llmgw("ledger", *args, "--config", str(stack.opts.config_dir), "--store-url", stack.store_url,
                 "--tenant", "acme")


def test_an_ambiguous_outcome_refuses_the_retry_until_an_operator_resolves_the_key(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=KEY)  # the SDK's default retries
    marker = inject_fault(stack.engine_urls(), "delay_ms=3000", count=10)
    key = f"ambiguous-{time.time_ns()}"
    ask: dict[str, Any] = {"model": "chat-default", "max_tokens": 4,
                           "messages": [{"role": "user", "content": f"book it {marker}"}]}
    headers = {"idempotency-key": key, "x-llmgw-deadline-ms": "400"}
    with pytest.raises(openai.APIStatusError) as first:
        client.chat.completions.with_raw_response.create(**ask, extra_headers=headers)
    assert first.value.status_code == 504
    rid = first.value.response.headers["x-request-id"]
    entry = ledger_of(stack, rid, "acme")
    assert (entry["termination"], entry["settlement"]) == ("deadline", "ambiguous"), entry
    sent = dispatched(stack, marker)
    assert sent >= 1

    # The retry: refused, naming the first request; nothing more reaches an engine, and the SDK,
    # which retries 409 by default, is told not to.
    with pytest.raises(openai.ConflictError) as again:
        client.chat.completions.create(**ask, extra_headers=headers)
    err = again.value.body
    assert isinstance(err, dict) and err["code"] == "idempotency_ambiguous" and rid in err["message"], err
    assert again.value.response.headers["x-should-retry"] == "false"
    assert dispatched(stack, marker) == sent

    got = cli(stack, "get", "--idempotency-key", key)
    assert got.returncode == 0, got.stderr
    shown = json.loads(got.stdout)
    assert shown["idempotency_key"] == {"acme": {"state": "ambiguous", "request_id": rid}}
    assert [e["request_id"] for e in shown["entries"]] == [rid, again.value.response.headers["x-request-id"]]
    one = cli(stack, "get", "--request-id", rid)
    assert one.returncode == 0 and json.loads(one.stdout)["settlement"] == "ambiguous", one.stderr

    clear_faults(stack.engine_urls())
    resolved = cli(stack, "resolve", "--idempotency-key", key)
    assert resolved.returncode == 0 and rid in resolved.stdout, (resolved.stdout, resolved.stderr)
    answer = client.chat.completions.create(**ask, extra_headers=headers)
    assert answer.choices[0].message.content
    assert dispatched(stack, marker) == sent + 1
    assert cli(stack, "resolve", "--idempotency-key", key).returncode == 1  # now done: not the operator's
