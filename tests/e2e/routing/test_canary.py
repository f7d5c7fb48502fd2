"""Canaries (issue 16, part 2): a candidate of a route takes a share of its traffic first, chosen by
request id, request class and tenant; the rest never reach it; `llmgw canary watch` rolls it back, as
an audited revision, when its error rate or TTFT p95 regresses against the stable candidates."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config import ConfigError, load_snapshot
from extproc.config.schema import Canary
from extproc.stages.route import canary_bucket
from llmgw.local.procs import json_at
from llmgw.local.stack import Stack
from llmgw.ops.canary import Side, side, verdict
from llmgw.render.bootstrap import RenderOptions, render_yaml
from tests.conftest import DEMO_KEYS, POLICY, ledger_of, module_stack
from tests.helpers import chat_body, llmgw, request


def edit(path: Path, change: Callable[[dict[str, Any]], object]) -> None:
    doc = yaml.safe_load(path.read_text())
    change(doc)
    path.write_text(yaml.safe_dump(doc))


CANARY = {"deployment": "demo-anthropic", "share": 1.0, "tenants": ["acme"], "min_requests": 5}


def canary_policy(root: Path) -> Path:
    dst = root / "policy"
    shutil.copytree(POLICY, dst)
    edit(dst / "routes/chat-fallback.yaml", lambda d: d.update(canary=CANARY))
    return dst


def test_the_share_is_deterministic_by_request_id_and_about_its_size() -> None:
    ids = [f"req-{i}" for i in range(4000)]
    assert [canary_bucket(i) for i in ids] == [canary_bucket(i) for i in ids]
    taken = sum(canary_bucket(i) < 0.1 for i in ids) / len(ids)
    assert 0.08 < taken < 0.12


def test_a_canary_is_a_candidate_beside_stable_ones(tmp_path: Path) -> None:
    dst = tmp_path / "policy"
    shutil.copytree(POLICY, dst)
    edit(dst / "routes/chat-default.yaml", lambda d: d.update(canary=CANARY))  # not a candidate there
    with pytest.raises(ConfigError, match="must be a candidate of the route"):
        load_snapshot(dst)


def test_the_plans_that_put_the_canary_first_are_rendered(tmp_path: Path) -> None:
    snap = load_snapshot(canary_policy(tmp_path))
    text = render_yaml(snap, RenderOptions.from_snapshot(snap))
    assert "fallback_chat-fallback_1_0" in text and "fallback_chat-fallback_0_1" in text


def test_rollback_verdicts_need_enough_requests_and_a_margin() -> None:
    cfg = Canary(deployment="d", share=0.1, min_requests=20, max_error_rate_increase=0.05, max_ttft_p95_ratio=1.5)
    ok = Side(100, 0.01, 200.0)
    assert verdict(Side(100, 0.05, 250.0), ok, cfg) is None
    assert "error rate 10.0%" in str(verdict(Side(100, 0.10, 200.0), ok, cfg))
    assert "TTFT p95 400 ms" in str(verdict(Side(100, 0.01, 400.0), ok, cfg))
    assert verdict(Side(19, 0.9, 900.0), ok, cfg) is None  # too few to say
    first_failed = {"attempts": [{"status": 503}, {"status": 200}], "termination": "complete", "first_byte_ms": 50}
    assert side([first_failed, {"attempts": [{"status": 200}], "termination": "complete"}]).error_rate == 0.5
    # A stream's TTFT is its first token's: its headers (5 ms) say nothing of its prefill.
    streams = [{"attempts": [{"status": 200}], "stream": True, "first_byte_ms": 5, "first_token_ms": t}
               for t in (300, 400)]
    assert side(streams).ttft_p95_ms == 400


gw = module_stack("canary", canary_policy, simulate_providers=True)


@pytest.mark.e2e
def test_the_canary_takes_its_share_and_is_rolled_back_on_a_regression(gw: Stack) -> None:
    def send(tenant: str) -> Any:
        r = request(f"{gw.url}/v1/chat/completions", "POST", chat_body("chat-fallback", max_tokens=4),
                    {"authorization": f"Bearer {DEMO_KEYS[tenant]}"})
        assert r.status == 200, r.body
        return r

    # acme's requests go to the canary first; globex's never reach it.
    for _ in range(6):
        assert send("acme").headers["x-llmgw-deployment"] == "demo-anthropic"
        assert send("globex").headers["x-llmgw-deployment"] == "pool-llama-8b"
    r = send("acme")
    assert ledger_of(gw, r.headers["x-request-id"], "acme")["canary"] == "canary"
    # The canary regresses: it answers 503 before any byte; the stable candidate serves each request.
    (provider,) = [f"http://{h}:{p}" for h, p in gw.render.providers["demo-anthropic"]]
    request(f"{provider}/admin/faults", "POST", {"fault": "status=503", "count": 6})
    fell_back = [send("acme") for _ in range(6)]
    assert {r.headers["x-llmgw-deployment"] for r in fell_back} == {"pool-llama-8b"}
    # The pool's attempt came after Anthropic's: none of that candidate's path or headers (its key above
    # all) reached the pool, though Envoy reuses an attempt's headers for the next.
    rids = {r.headers["x-request-id"] for r in fell_back}
    logged = [e for url in gw.engine_urls() for e in json.loads(request(f"{url}/admin/requests").body)
              if e["request_id"] in rids]
    assert len(logged) == 6
    for e in logged:
        assert e["path"] == "/v1/chat/completions" and not e["api_key_present"]
        assert "anthropic-version" not in e["headers"]
    reload = [*(arg for url in gw.status_urls for arg in ("--reload-url", url)),
              "--admin-token-file", str(gw.admin_token_file)]
    watch = llmgw("canary", "watch", "--once", "--config", str(gw.snapshot.directory),
                  "--store-url", str(gw.store_url), *reload)
    assert watch.returncode == 1, watch.stdout + watch.stderr
    assert "ROLL BACK: error rate" in watch.stdout
    assert "canary" not in yaml.safe_load((gw.snapshot.directory / "routes/chat-fallback.yaml").read_text())
    revision = load_snapshot(gw.snapshot.directory).revision
    assert {json_at(u)["revision"] for u in gw.status_urls} == {revision}
    after = send("acme")
    assert after.headers["x-llmgw-deployment"] == "pool-llama-8b"
    assert "canary" not in ledger_of(gw, after.headers["x-request-id"], "acme")
    listed = llmgw("revisions", "--config", str(gw.snapshot.directory), "--store-url", str(gw.store_url), "--json")
    (entry,) = [json.loads(line) for line in listed.stdout.splitlines()]
    assert entry["who"].startswith("canary-watch (chat-fallback: error rate") and entry["accepted"]
    assert any("[route] routes/chat-fallback.yaml: canary" in c for c in entry["changes"])
