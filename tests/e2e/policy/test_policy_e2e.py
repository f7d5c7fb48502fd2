"""Identity, authorization, redaction and the logging policy through the real processes: Envoy,
ext_proc (Rego via regopy), simulated engines. Every refusal is checked in the contract's JSON shape
and, where it matters, on the engines' request log: a refused request never reached an engine."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Iterator
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, POLICY, start_stack
from tests.e2e.routing.test_e2e_served_path import clear_engine_logs, engine_log
from tests.helpers import assert_contract_error, chat_body, request
from tests.idp import Idp, issuer_config

pytestmark = pytest.mark.e2e

WRITER_KEY = "sk-test-writer-0123456789"  # acme, granted the write effect
REVOKED_KEY = "sk-test-revoked-0123456789"
EXPIRED_KEY = "sk-test-expired-0123456789"
INITECH_KEY = "sk-test-initech-0123456789"  # a tenant whose residency (us) no candidate serves
CANARY_SECRET = "canary-secret-7f3a9c1e5b"
CANARY_PROMPT = "canary-prompt-e4d2b8a6f0"


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def make_policy(root: Path, idp: Idp, record_content: bool = False) -> Path:
    dst = root / "policy"
    shutil.copytree(POLICY, dst)
    idp.write_jwks(dst / "jwks.json")
    (dst / "salt.secret").write_text(CANARY_SECRET)
    gw = yaml.safe_load((dst / "gateway.yaml").read_text())
    gw["cache_salt_secret_ref"] = "file:salt.secret"  # a credential reference holding the canary
    gw["jwt_issuers"] = [issuer_config("jwks.json")]
    gw["tenants"]["acme"]["allowed_data_classes"].append("restricted")  # the route cannot serve it
    gw["tenants"]["initech"] = {"default_data_class": "public", "allowed_data_classes": ["public"],
                                "regions": ["us"], "api_keys": [{"id": "initech-1", "sha256": _sha(INITECH_KEY)}]}
    (dst / "gateway.yaml").write_text(yaml.safe_dump(gw))
    yesterday = (date.today() - timedelta(days=1)).isoformat()
    demo = yaml.safe_load((dst / "keys.yaml").read_text())["keys"]  # the session's demo keys stay
    (dst / "keys.yaml").write_text(yaml.safe_dump({"keys": [
        *demo,
        {"id": "acme-writer", "tenant": "acme", "sha256": _sha(WRITER_KEY), "effects": ["write"]},
        {"id": "acme-revoked", "tenant": "acme", "sha256": _sha(REVOKED_KEY), "revoked": True},
        {"id": "acme-expired", "tenant": "acme", "sha256": _sha(EXPIRED_KEY), "expires": yesterday},
    ]}))
    if record_content:
        route = yaml.safe_load((dst / "routes/chat-default.yaml").read_text())
        route["telemetry"]["record_content"] = True
        (dst / "routes/chat-default.yaml").write_text(yaml.safe_dump(route))
    return dst


@pytest.fixture(scope="module")
def idp() -> Idp:
    return Idp()


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, idp: Idp) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("policy-e2e")
    s = start_stack(tmp / "state", make_policy(tmp, idp))
    yield s
    s.stop()


def chat(stack: Stack, token: str | None, body: dict[str, Any] | None = None, **headers: str) -> Any:
    hdrs = {"authorization": f"Bearer {token}"} if token is not None else {}
    return request(f"{stack.url}/v1/chat/completions", "POST", body or chat_body(max_tokens=4),
                   headers={**hdrs, **headers})


def bad_tokens(idp: Idp) -> dict[str, str]:
    now = int(time.time())
    return {
        "unknown api key": "sk-nobody-0123456789",
        "revoked api key": REVOKED_KEY,
        "expired api key": EXPIRED_KEY,
        "alg none": idp.unsigned(),
        "HS256 signed with the RSA public key": idp.hs256_with_public_key(),
        "unknown kid": Idp(keys={"rsa-9": idp.keys["rsa-1"]}, algs={"rsa-9": "RS256"}).token("rsa-9"),
        "signed by another key under a known kid": Idp().token("rsa-1"),
        "expired": idp.token(iat=now - 1000, nbf=now - 1000, exp=now - 600),
        "not yet valid": idp.token(nbf=now + 600, exp=now + 900),
        "wrong audience": idp.token(aud="someone-else"),
        "wrong issuer": idp.token(iss="https://evil.example"),
        "lifetime over the maximum": idp.token(exp=now + 3600),
        "tenant the issuer may not assert": idp.token(tenant="globex"),
        "unknown tenant": idp.token(tenant="nobody"),
        "no iat": idp.token(iat=None),
        "tampered payload": (lambda t: t.split(".")[0] + "." + idp.token(tenant="acme", sub="root").split(".")[1]
                             + "." + t.split(".")[2])(idp.token()),
    }


def test_every_identity_failure_is_401_and_reaches_no_engine(gw: Stack, idp: Idp) -> None:
    clear_engine_logs(gw)
    cases = {"missing header": None, "basic scheme": "", **bad_tokens(idp)}
    for why, token in cases.items():
        if token == "":
            r = request(f"{gw.url}/v1/chat/completions", "POST", chat_body(), headers={"authorization": "Basic eA=="})
        else:
            r = chat(gw, token)
        err = assert_contract_error(r, 401, "unauthenticated")
        assert err["message"] == "missing, invalid or expired credential", (why, err)  # no hint which check
    assert engine_log(gw) == []


@pytest.mark.parametrize("kid", ["rsa-1", "ec-1", "ed-1"])
def test_jwt_workload_identity_is_served(gw: Stack, idp: Idp, kid: str) -> None:
    r = chat(gw, idp.token(kid))
    assert r.status == 200, r.body
    assert r.json()["choices"][0]["message"]["content"]


def test_jwt_with_a_rotated_in_key_is_served_after_the_jwks_changes(gw: Stack, idp: Idp) -> None:
    new = Idp()
    new.keys = {"rsa-2": new.keys["rsa-1"]}
    new.algs = {"rsa-2": "RS256"}
    token = new.token("rsa-2")
    jwks = gw.snapshot.directory / "jwks.json"
    doc = idp.jwks()
    doc["keys"] += new.jwks()["keys"]
    jwks.write_text(json.dumps(doc))  # the IdP rotated: rsa-2 is published
    deadline = time.monotonic() + 15
    while chat(gw, token).status != 200:  # an unknown kid refreshes the set at most every 10 s
        assert time.monotonic() < deadline, "rotated key never accepted"
        time.sleep(0.5)


def test_data_class_the_tenant_may_not_send_is_403(gw: Stack) -> None:
    clear_engine_logs(gw)
    r = chat(gw, DEMO_KEYS["globex"], **{"x-llmgw-data-class": "confidential"})
    err = assert_contract_error(r, 403, "forbidden")
    assert "tenant globex may not send data class confidential" in err["message"]
    assert engine_log(gw) == []


def test_class_or_region_no_candidate_serves_is_never_dispatched(gw: Stack) -> None:
    clear_engine_logs(gw)
    r = chat(gw, DEMO_KEYS["acme"], **{"x-llmgw-data-class": "restricted"})  # allowed to acme; route can't
    assert "no candidate for data class restricted" in assert_contract_error(r, 403, "forbidden")["message"]
    r = chat(gw, INITECH_KEY)  # initech's residency is us; the only candidate is in eu
    assert "in the tenant's regions" in assert_contract_error(r, 403, "forbidden")["message"]
    assert engine_log(gw) == []


def test_unknown_data_class_is_400(gw: Stack) -> None:
    assert_contract_error(chat(gw, DEMO_KEYS["acme"], **{"x-llmgw-data-class": "top-secret"}), 400,
                          "invalid_request")


def _tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def test_write_tool_needs_the_write_effect(gw: Stack, idp: Idp) -> None:
    body = chat_body(max_tokens=4, tools=[_tool("update_ticket")])
    err = assert_contract_error(chat(gw, DEMO_KEYS["acme"], body), 403, "forbidden")
    assert "needs the write effect" in err["message"]
    assert chat(gw, WRITER_KEY, body).status == 200  # an API key granted the effect
    assert chat(gw, idp.token(groups=["ticket-writers"]), body).status == 200  # a JWT group granted it
    assert chat(gw, DEMO_KEYS["acme"], chat_body(max_tokens=4, tools=[_tool("search_docs")])).status == 200
    # A tool no entry lists meets its tenant's rule: globex refuses it, naming the tool and the rule.
    err = assert_contract_error(chat(gw, DEMO_KEYS["globex"], chat_body(tools=[_tool("rm_rf")])), 403, "forbidden")
    assert err["message"].startswith("forbidden: tool rm_rf is not in the tool catalog, and tenant globex "
                                     "refuses unlisted tools (rule: unlisted tools)")


CLAUDE_CODE = {"user-agent": "claude-cli/2.1.197 (external, sdk-cli)"}
READ_ONLY = ("Read", "Glob", "Grep", "TaskList")  # Claude Code's tools that read or change nothing


def test_agents_read_only_tools_are_admitted_and_execution_is_kept_from_confidential_data(gw: Stack) -> None:
    """The demo policy (gateway.yaml tool_packs, tool_effects, unlisted_tools; authz.rego): acme's agents
    may offer their tools on internal data; on confidential data only tools that read, and a refusal
    names the tool and the rule. The same names from a caller no pack recognises are unlisted tools."""
    clear_engine_logs(gw)
    key, confidential = DEMO_KEYS["acme"], {"x-llmgw-data-class": "confidential"}
    every = chat_body(max_tokens=4, tools=[_tool(n) for n in (*READ_ONLY, "Bash", "WebFetch", "Agent", "Edit")])
    assert chat(gw, key, every, **CLAUDE_CODE).status == 200
    read_only = chat_body(max_tokens=4, tools=[_tool(n) for n in READ_ONLY])
    r = chat(gw, key, read_only, **CLAUDE_CODE, **confidential)
    assert r.status == 200, r.body[:300]
    err = assert_contract_error(chat(gw, key, every, **CLAUDE_CODE, **confidential), 403, "forbidden")
    for tool, effect in (("Bash", "execute"), ("WebFetch", "network"), ("Agent", "delegate")):
        assert (f"tool {tool} has the {effect} effect, which confidential data may not reach "
                "(rule: effects by data class)") in err["message"]
    assert "Read" not in err["message"] and "Edit" not in err["message"]
    # Without Claude Code's User-Agent its names are unlisted: acme admits them taken to run commands.
    err = assert_contract_error(chat(gw, key, read_only, **confidential), 403, "forbidden")
    assert "tool Read has the execute effect, which confidential data may not reach" in err["message"]
    # globex holds only `read`: Claude Code's reading tools pass, its shell does not.
    assert chat(gw, DEMO_KEYS["globex"], read_only, **CLAUDE_CODE).status == 200
    err = assert_contract_error(chat(gw, DEMO_KEYS["globex"], every, **CLAUDE_CODE), 403, "forbidden")
    assert "tool Bash needs the execute effect, which the caller is not granted (rule: effect grants)" in err["message"]
    assert len(engine_log(gw)) == 3  # the refused requests never reached an engine


def test_redaction_sends_placeholders_and_records_counts_only(gw: Stack) -> None:
    clear_engine_logs(gw)
    text = ("Mail jane.doe@example.com or jane.doe@example.com, card 4111 1111 1111 1111, "
            "IBAN GB82 WEST 1234 5698 7654 32, SSN 123-45-6789, host 10.1.2.3, key AKIAIOSFODNN7EXAMPLE.")
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=DEMO_KEYS["acme"], max_retries=0)
    out = client.chat.completions.create(model="chat-default", max_tokens=4,
                                         messages=[{"role": "user", "content": text}])
    assert out.choices[0].message.content
    (sent,) = [e for e in engine_log(gw) if e["status"] == 200]
    received = sent["messages"][0]["content"]
    assert received == ("Mail [EMAIL_1] or [EMAIL_1], card [PAYMENT_CARD_1], IBAN [IBAN_1], SSN [US_SSN_1], "
                        "host [IP_ADDRESS_1], key [SECRET_1].")
    access = _access_log_line(gw, out.id)
    assert access["redactions"] == "email=2,iban=1,ip_address=1,payment_card=1,secret=1,us_ssn=1"
    logs = _all_logs(gw)
    for value in ("jane.doe@example.com", "4111 1111 1111 1111", "123-45-6789", "AKIAIOSFODNN7EXAMPLE"):
        assert value not in logs


def test_a_redacted_prompt_that_leaves_no_completion_room_is_refused_in_its_own_words(gw: Stack) -> None:
    """Placeholders longer than their values ("10.0.0.1" -> "[IP_ADDRESS_1]") take the growth from the
    completion; when none is left the request is refused naming max_tokens. The refusal comes after
    routing chose a cluster: it must reach the caller as ext_proc wrote it, not be taken for an
    upstream's 400 ("the upstream rejected the request as invalid")."""
    many = " ".join(f"10.0.0.{i}" for i in range(40))
    r = chat(gw, DEMO_KEYS["acme"], chat_body(content=many, max_tokens=1))
    assert_contract_error(r, 400, "invalid_request")
    assert r.json()["error"]["param"] == "max_tokens" and "no room" in r.json()["error"]["message"], r.json()


def test_public_data_is_not_redacted(gw: Stack) -> None:
    clear_engine_logs(gw)
    r = chat(gw, DEMO_KEYS["globex"], chat_body(max_tokens=4, content="mail bob@example.com"))
    assert r.status == 200
    assert engine_log(gw)[-1]["messages"][0]["content"] == "mail bob@example.com"


def _all_logs(stack: Stack) -> str:
    time.sleep(0.4)  # Envoy flushes its access log every 250 ms
    return "\n".join(p.read_text(errors="replace") for p in stack.logs.rglob("*") if p.is_file())


def _access_log_line(stack: Stack, completion_id: str) -> dict[str, Any]:
    rid = completion_id.removeprefix("chatcmpl-")
    for _ in range(20):
        for line in (stack.logs / "envoy.log").read_text().splitlines():
            if line.startswith("{"):
                doc = json.loads(line)
                if doc.get("status") == 200 and doc.get("route") == "chat-default" and doc.get("redactions"):
                    return doc
        time.sleep(0.1)
    raise AssertionError(f"no access log line for {rid}")


def test_canaries_never_reach_logs(gw: Stack, idp: Idp) -> None:
    """The salt secret (a credential reference's value) and a prompt string: after allowed, denied,
    malformed and unauthenticated requests that carry them, no log file of the run holds either."""
    prompt = f"please keep {CANARY_PROMPT} secret"
    assert chat(gw, DEMO_KEYS["acme"], chat_body(content=prompt, max_tokens=4)).status == 200
    assert chat(gw, DEMO_KEYS["globex"], chat_body(content=prompt, max_tokens=4)).status == 200
    denied = chat(gw, DEMO_KEYS["globex"], chat_body(content=prompt), **{"x-llmgw-data-class": "confidential"})
    assert denied.status == 403
    assert chat(gw, "sk-wrong", chat_body(content=prompt)).status == 401
    assert request(f"{gw.url}/v1/chat/completions", "POST", '{"model": "' + CANARY_PROMPT,
                   headers={"authorization": f"Bearer {DEMO_KEYS['acme']}"}).status == 400
    assert chat(gw, f"{CANARY_PROMPT}.{CANARY_PROMPT}.x").status == 401
    logs = _all_logs(gw)
    assert "chat-default" in logs  # the logs were written and are being read
    assert CANARY_SECRET not in logs
    assert CANARY_PROMPT not in logs


def test_content_is_logged_only_when_route_and_decision_allow(tmp_path: Path, idp: Idp) -> None:
    s = start_stack(tmp_path / "state", make_policy(tmp_path, idp, record_content=True))
    try:
        # public (globex): the example policy allows recording, the route too -> recorded
        assert chat(s, DEMO_KEYS["globex"], chat_body(content="public words here", max_tokens=4)).status == 200
        # internal (acme): the decision forbids recording -> not recorded, even though the route allows
        assert chat(s, DEMO_KEYS["acme"], chat_body(content=f"mail a@b.io {CANARY_PROMPT}",
                                                     max_tokens=4)).status == 200
        logs = _all_logs(s)
        assert "public words here" in logs
        assert CANARY_PROMPT not in logs and "a@b.io" not in logs
    finally:
        s.stop()
