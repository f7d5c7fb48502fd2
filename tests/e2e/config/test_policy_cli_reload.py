"""`llmgw keys`, the reloader's refusal rules, and JWKS fetched over HTTP."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from aiohttp import web
from prometheus_client import REGISTRY

from extproc.config import load_snapshot
from extproc.config.reload import Live, Reloader
from extproc.config.schema import JwtIssuer
from extproc.exchange import Exchange
from extproc.jwks import JwksCache
from extproc.stages.identity import CallerIdentity
from tests.conftest import POLICY
from tests.helpers import llmgw
from tests.idp import Idp


def test_keys_create_prints_once_stores_hash_and_revoke_works(policy: Path) -> None:
    out = llmgw("keys", "create", "--tenant", "globex", "--id", "globex-ci", "--effect", "write",
                "--config", str(policy))
    assert out.returncode == 0, out.stderr
    key = out.stdout.strip()
    assert key.startswith("sk-llmgw-") and key not in (policy / "keys.yaml").read_text()
    ex = Exchange(snapshot=load_snapshot(policy), headers={"authorization": f"Bearer {key}"})
    asyncio.run(CallerIdentity().run(ex))
    # the key's grant, beside what every globex caller holds (gateway.yaml tool_effects)
    assert ex.identity is not None and (ex.identity.tenant, ex.identity.effects) == ("globex", ("read", "write"))
    assert llmgw("keys", "revoke", "globex-ci", "--config", str(policy)).returncode == 0
    snap = load_snapshot(policy)
    assert [o.key.revoked for o in snap.keys_by_hash.values() if o.key.id == "globex-ci"] == [True]
    assert llmgw("keys", "create", "--tenant", "nobody", "--config", str(policy)).returncode == 1


def _reloader(policy: Path, run_tests: bool = False) -> Reloader:
    snap = load_snapshot(policy)
    return Reloader(policy, lambda s: Live(s, {}), Live(snap, {}), run_tests=run_tests)


def reloads(result: str) -> float:
    """llmgw_config_reloads_total{result} as this process counted it (extproc/metrics.py)."""
    return REGISTRY.get_sample_value("llmgw_config_reloads_total", {"result": result}) or 0.0


def test_reloader_refuses_invalid_config_and_failing_policy_tests(policy: Path) -> None:
    refused = reloads("refused")
    r = _reloader(policy, run_tests=True)
    old = r.live.snapshot.revision
    (policy / "routes/chat-default.yaml").write_text("route_contract: chat-default\n")  # no candidates
    assert not r.reload("test") and r.live.snapshot.revision == old
    assert any("candidates" in e for e in r.status["last_error"])
    shutil.copy(POLICY / "routes/chat-default.yaml", policy / "routes/chat-default.yaml")
    (policy / "authz_test.rego").write_text((policy / "authz_test.rego").read_text().replace(
        "test_write_tool_with_grant if {\n\tauthz.allow", "test_write_tool_with_grant if {\n\tnot authz.allow"))
    assert not r.reload("test") and "test_write_tool_with_grant" in r.status["last_error"][0]
    assert r.status["refused"] == 2 and r.live.snapshot.revision == old
    assert reloads("refused") == refused + 2  # the metric counts what the status counts


def test_reloader_swaps_a_good_revision(policy: Path) -> None:
    accepted = reloads("accepted")
    r = _reloader(policy)
    old = r.live
    assert not r.reload("unchanged") and reloads("accepted") == accepted  # the same revision is no reload
    (policy / "routes/chat-default.yaml").write_text(
        (policy / "routes/chat-default.yaml").read_text().replace("deadline_ms: 30000", "deadline_ms: 20000"))
    assert r.reload("test")
    assert reloads("accepted") == accepted + 1
    assert r.live is not old and r.live.snapshot.routes["chat-default"].deadline_ms == 20000
    assert old.snapshot.routes["chat-default"].deadline_ms == 30000  # requests holding it keep it


def test_jwks_from_a_url_is_fetched_cached_and_refetched_on_rotation() -> None:
    idp = Idp()
    served = {"doc": idp.jwks(), "hits": 0}

    async def main() -> None:
        async def jwks(_: web.Request) -> web.Response:
            served["hits"] += 1
            return web.json_response(served["doc"])
        app = web.Application()
        app.router.add_get("/jwks", jwks)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        issuer = JwtIssuer(issuer="i", audiences=("a",), jwks_url=f"http://127.0.0.1:{port}/jwks")
        cache = JwksCache()
        try:
            assert await cache.key(issuer, "rsa-1", Path(".")) is not None
            assert await cache.key(issuer, "ec-1", Path(".")) is not None
            assert served["hits"] == 1  # cached
            assert await cache.key(issuer, "rsa-9", Path(".")) is None  # unknown; refresh rate-limited
            assert served["hits"] == 1
        finally:
            await runner.cleanup()
        # The IdP is now down: cached keys keep working.
        assert await cache.key(issuer, "rsa-1", Path(".")) is not None

    asyncio.run(main())
