"""A route that sends long prompts to a pool of their own (candidate prompt-size ranges): short
requests never queue behind long-context ones. Real Envoy, two simulated pools."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from llmgw.bench.policy import add_candidate
from llmgw.local.procs import free_port
from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, POLICY, module_stack
from tests.helpers import chat_body, request

pytestmark = pytest.mark.e2e
LIMIT = 600  # prompt tokens (bound) the short pool takes


def two_pool_policy(root: Path) -> Path:
    dst = root / "policy"
    shutil.copytree(POLICY, dst)
    add_candidate(dst, "pool-llama-8b-long", "long-pool", f"127.0.0.1:{free_port()}",  # (beside `make up`'s 8111)
                  {"batching_policy": "continuous,max-num-seqs-32,max-batched-tokens-32768"},
                  {"min_prompt_tokens": LIMIT + 1}, route_name="chat-default")
    route = yaml.safe_load((dst / "routes/chat-default.yaml").read_text())
    route["candidates"][0]["max_prompt_tokens"] = LIMIT
    (dst / "routes/chat-default.yaml").write_text(yaml.safe_dump(route))
    return dst


gw = module_stack("long-pool", two_pool_policy)


def served_by(stack: Stack, content: str) -> tuple[str, str]:
    r = request(f"{stack.url}/v1/chat/completions", "POST", chat_body(content=content, max_tokens=4),
                headers={"authorization": f"Bearer {DEMO_KEYS['acme']}"})
    assert r.status == 200, r.body
    pools = {url: name for name in ("engine-pool", "long-pool") for url in stack.engine_urls(name)}
    hits = [pools[u] for u in pools for e in request(f"{u}/admin/requests").json()
            if e["messages"][0]["content"] == content]
    assert len(hits) == 1, hits
    return hits[0], r.headers["x-llmgw-deployment"]


def test_short_and_long_prompts_go_to_their_own_pools(gw: Stack) -> None:
    assert served_by(gw, "a short question") == ("engine-pool", "pool-llama-8b")
    assert served_by(gw, "a long document " + "lorem ipsum " * 80) == ("long-pool", "pool-llama-8b-long")
