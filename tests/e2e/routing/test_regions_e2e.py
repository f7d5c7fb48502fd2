"""Regions (issue 16, part 6): a gateway runs in a region (ext_proc --region) and refuses a tenant whose
residency excludes it before anything is processed; each region takes the control plane's current
revision through the same checks (`llmgw sync`), and keeps serving its last known good revision while
the control plane cannot be reached."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config import load_snapshot
from extproc.contract import ErrorCode, GatewayError
from extproc.exchange import Exchange, Identity
from extproc.stages.authorize import Authorization
from extproc.stages.intake import Intake
from llmgw.local.procs import Child, free_port, json_at, tcp_open, valkey_binary, wait_until
from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, POLICY, ledger_of, start_stack
from tests.helpers import assert_contract_error, chat_body, llmgw, request


def regional_policy(root: Path) -> Path:
    dst = root / "policy"
    shutil.copytree(POLICY, dst)
    gw = yaml.safe_load((dst / "gateway.yaml").read_text())
    gw["tenants"]["acme"]["regions"] = ["eu"]  # acme's data stays in the EU; globex has no residency
    (dst / "gateway.yaml").write_text(yaml.safe_dump(gw))
    return dst


@pytest.mark.parametrize(("region", "tenant", "allowed"), [
    ("eu", "acme", True), ("us", "acme", False), ("", "acme", True), ("us", "globex", True)])
def test_residency_is_enforced_for_the_gateways_region(tmp_path: Path, region: str, tenant: str,
                                                       allowed: bool) -> None:
    ex = Exchange(snapshot=load_snapshot(regional_policy(tmp_path)), method="POST", path="/v1/chat/completions",
                  region=region, identity=Identity(tenant, "k", "api_key"))
    ex.raw_body = b'{"model": "chat-default", "messages": [{"role": "user", "content": "hi"}]}'

    async def decide() -> ErrorCode | None:
        try:
            await Intake().run(ex)
            await Authorization().run(ex)
        except GatewayError as e:
            return e.code
        return None
    assert asyncio.run(decide()) == (None if allowed else ErrorCode.FORBIDDEN)


@pytest.fixture(scope="module")
def region(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path, str, Child]]:
    """The `us` region's gateway (its own store and live directory) and a control plane: a policy
    directory and the store holding its audited history."""
    tmp = tmp_path_factory.mktemp("regions")
    control = regional_policy(tmp / "control")
    port = free_port()
    store = Child("control-plane", [str(valkey_binary()), "--port", str(port), "--bind", "127.0.0.1",
                                    "--dir", tempfile.mkdtemp(prefix="llmgw-cp-"), "--save", "", "--appendonly", "no"],
                  tmp / "control-plane.log").start()
    wait_until(lambda: tcp_open("127.0.0.1", port), 30, "control plane store", store)
    cp = f"redis://127.0.0.1:{port}/0"
    applied = llmgw("apply", "--config", str(control), "--store-url", cp, "--no-reload", "--who", "platform")
    assert applied.returncode == 0, applied.stderr
    live = tmp / "us"
    shutil.copytree(control, live / "policy")
    s = start_stack(tmp / "us-state", live / "policy", region="us")
    yield s, control, cp, store
    s.stop()
    store.stop()


def chat(s: Stack, tenant: str) -> Any:
    return request(f"{s.url}/v1/chat/completions", "POST", chat_body(max_tokens=4),
                   {"authorization": f"Bearer {DEMO_KEYS[tenant]}"})


@pytest.mark.e2e
def test_a_region_refuses_a_tenant_kept_elsewhere_and_records_where(region: tuple[Stack, Path, str, Child]) -> None:
    s = region[0]
    refused = chat(s, "acme")
    assert_contract_error(refused, 403, "forbidden")
    assert "region 'us'" in refused.json()["error"]["message"]
    entry = ledger_of(s, refused.headers["x-request-id"], "acme")
    assert entry["region"] == "us" and entry["status"] == 403 and entry["charged_micros"] == 0
    served = chat(s, "globex")
    assert served.status == 200 and ledger_of(s, served.headers["x-request-id"], "globex")["region"] == "us"


@pytest.mark.e2e
def test_a_region_syncs_from_the_control_plane_and_keeps_its_last_good_revision_without_it(
        region: tuple[Stack, Path, str, Child]) -> None:
    s, control, cp, store = region
    directory = s.snapshot.directory
    sync = ["sync", "--config", str(directory), "--control-store", cp, "--store-url", str(s.store_url),
            "--who", "region-us", *[a for u in s.status_urls for a in ("--reload-url", u)],
            "--admin-token-file", str(s.admin_token_file)]
    first = llmgw(*sync)
    assert first.returncode == 0 and "in sync" in first.stdout, first.stdout + first.stderr
    # The platform team changes a route on the control plane; the region takes it through its checks.
    route = yaml.safe_load((control / "routes/chat-default.yaml").read_text())
    route["max_tokens_cap"] = 2048
    (control / "routes/chat-default.yaml").write_text(yaml.safe_dump(route))
    assert llmgw("apply", "--config", str(control), "--store-url", cp, "--no-reload").returncode == 0
    synced = llmgw(*sync)
    assert synced.returncode == 0 and "synced from the control plane" in synced.stdout, synced.stdout + synced.stderr
    new = load_snapshot(directory).revision
    assert yaml.safe_load((directory / "routes/chat-default.yaml").read_text())["max_tokens_cap"] == 2048
    assert {json_at(u)["revision"] for u in s.status_urls} == {new}
    listed = llmgw("revisions", "--config", str(directory), "--store-url", str(s.store_url))
    assert "| region-us | sync of " in listed.stdout
    # The control plane goes away: nothing changes in the region, which says so and keeps serving.
    store.stop()
    cut = llmgw(*sync)
    assert cut.returncode == 3, cut.stdout + cut.stderr
    assert f"revision {new} (last known good) keeps serving" in cut.stderr
    served = chat(s, "globex")
    assert served.status == 200 and served.headers["x-llmgw-route-revision"] == new
