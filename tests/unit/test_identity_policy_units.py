"""Identity, the Rego decision and redaction in isolation: property-based inputs, fail-closed paths
and the detectors' checksums. The same stages run end to end in test_policy_e2e.py."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.config import ConfigError, load_snapshot
from extproc.config.policy import CompiledPolicy, PolicyEvaluationError
from extproc.contract import ErrorCode, GatewayError
from extproc.exchange import Exchange, Identity
from extproc.redact import Redactor, iban_ok, luhn_ok
from extproc.stages.authorize import Authorization
from extproc.stages.identity import CallerIdentity
from tests.conftest import POLICY
from tests.idp import Idp, issuer_config

IDP = Idp()


@pytest.fixture(scope="module")
def jwt_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("jwt") / "policy"
    shutil.copytree(POLICY, dst)
    IDP.write_jwks(dst / "jwks.json")
    gw = yaml.safe_load((dst / "gateway.yaml").read_text())
    gw["jwt_issuers"] = [issuer_config("jwks.json"),
                         {**issuer_config("unused"), "jwks_file": None, "jwks_url": "http://127.0.0.1:9/jwks.json",
                          "issuer": "https://down.example"}]
    (dst / "gateway.yaml").write_text(yaml.safe_dump(gw))
    return dst


def identify(snap: Any, authorization: str) -> Exchange:
    ex = Exchange(snapshot=snap, headers={"authorization": authorization})
    asyncio.run(CallerIdentity().run(ex))
    return ex


def test_jwt_claims_map_to_identity(jwt_policy: Path) -> None:
    snap = load_snapshot(jwt_policy)
    ex = identify(snap, "Bearer " + IDP.token("ec-1", sub="svc-a", groups=["ticket-writers", "x"]))
    # The group's grant (write) beside what every acme caller holds (gateway.yaml tool_effects).
    assert ex.identity == Identity("acme", "svc-a", "jwt", ("ticket-writers", "x"),
                                   ("delegate", "edit", "execute", "network", "read", "write"))


def test_jwks_unreachable_without_cached_key_fails_closed_503(jwt_policy: Path) -> None:
    snap = load_snapshot(jwt_policy)
    with pytest.raises(GatewayError) as e:
        identify(snap, "Bearer " + IDP.token(iss="https://down.example"))
    assert e.value.code is ErrorCode.POLICY_UNAVAILABLE


_SNAPS: dict[Path, Any] = {}
_b64 = st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_=", max_size=80)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(
    st.text(max_size=300),
    st.builds(lambda a, b, c: f"Bearer eyJ{a}.{b}.{c}", _b64, _b64, _b64),
    st.builds(lambda h, p: f"Bearer {h}.{p}.", st.sampled_from([
        "eyJhbGciOiJub25lIn0", "eyJhbGciOiJIUzI1NiIsImtpZCI6InJzYS0xIn0", "eyJraWQiOjF9", "eyJ9"]), _b64),
    st.builds(lambda t, junk: "Bearer " + t[: len(t) // 2] + junk + t[len(t) // 2:],
              st.just(IDP.token()), st.text(alphabet="abcXYZ019-_", min_size=1, max_size=5)),
))
def test_identity_never_crashes_and_refuses_garbage(jwt_policy: Path, header: str) -> None:
    snap = _SNAPS.get(jwt_policy) or _SNAPS.setdefault(jwt_policy, load_snapshot(jwt_policy))
    try:
        identify(snap, header)
    except GatewayError as e:
        assert e.code is ErrorCode.UNAUTHENTICATED
    else:
        raise AssertionError(f"accepted {header!r}")


def _decide(policy_text: str) -> Exchange:
    snap = load_snapshot(POLICY)
    policy = CompiledPolicy({"authz.rego": policy_text}, snap.policy_data, "r")
    ex = Exchange(snapshot=snap, identity=Identity("acme", "k", "api_key"),
                  body={"model": "chat-default", "messages": [{"role": "user", "content": "x"}]})
    object.__setattr__(snap, "policy", policy)
    asyncio.run(Authorization().run(ex))
    return ex


@pytest.mark.parametrize("text", [
    "package llmgw.authz\nimport rego.v1\ndecision := {\"allow\": \"yes\"}\n",  # wrong type
    "package llmgw.authz\nimport rego.v1\nx := 1\n",  # no decision at all
    "package llmgw.authz\nimport rego.v1\ndecision := {\"allow\": true, \"reasons\": [1]}\n",
    "package llmgw.authz\nimport rego.v1\ndecision := {\"allow\": count(input.nothing) > 0}\n",  # undefined
])
def test_a_policy_without_a_usable_decision_fails_closed_503(text: str) -> None:
    with pytest.raises(GatewayError) as e:
        _decide(text)
    assert e.value.code is ErrorCode.POLICY_UNAVAILABLE


def test_a_policy_that_allows_is_obeyed_and_recorded() -> None:
    ex = _decide('package llmgw.authz\nimport rego.v1\ndecision := {"allow": true, "obligations": '
                 '{"redact": ["email"], "record_content": false}}\n')
    assert ex.decision is not None and ex.decision.allow and ex.decision.redact == ("email",)
    assert ex.metadata()["decision"] == "allow" and ex.metadata()["policy_revision"] == "r"


def test_decision_cache_is_off_for_impure_policies() -> None:
    snap = load_snapshot(POLICY)
    assert snap.policy is not None and snap.policy.cacheable
    impure = CompiledPolicy({"a.rego": "package llmgw.authz\nimport rego.v1\n"
                             "decision := {\"allow\": time.now_ns() > 0}\n"}, snap.policy_data, "r")
    assert not impure.cacheable
    with pytest.raises(PolicyEvaluationError):
        CompiledPolicy({"a.rego": "package llmgw.authz\n"}, snap.policy_data, "r").evaluate({})


def test_broken_rego_is_a_config_error_naming_the_problem(tmp_path: Path) -> None:
    dst = tmp_path / "p"
    shutil.copytree(POLICY, dst)
    (dst / "authz.rego").write_text("package llmgw.authz\nallow if {\n")
    with pytest.raises(ConfigError) as e:
        load_snapshot(dst)
    assert "policy does not compile" in str(e.value)


# -- redaction -------------------------------------------------------------------------------------

ALL = frozenset({"email", "phone", "payment_card", "iban", "us_ssn", "ip_address", "secret"})


@pytest.mark.parametrize(("text", "expected"), [
    ("card 4111 1111 1111 1111 and 4111-1111-1111-1111", "card [PAYMENT_CARD_1] and [PAYMENT_CARD_2]"),
    ("not a card 4111 1111 1111 1112", "not a card 4111 1111 1111 1112"),  # Luhn fails
    ("IBAN DE89 3704 0044 0532 0130 00", "IBAN [IBAN_1]"),
    ("not an IBAN DE00 3704 0044 0532 0130 00", "not an IBAN DE00 3704 0044 0532 0130 00"),
    ("ssn 123-45-6789, not 000-45-6789", "ssn [US_SSN_1], not 000-45-6789"),
    ("v6 2001:db8::8a2e:370:7334 and time 12:30:45", "v6 [IP_ADDRESS_1] and time 12:30:45"),
    ("ünïcödé 名前 e-mail: 名前.x@example.jp!", "ünïcödé 名前 e-mail: 名前.[EMAIL_1]!"),
    ("-----BEGIN PRIVATE KEY-----\nMIIB\n-----END PRIVATE KEY-----", "[SECRET_1]"),
    ("auth: Bearer abcdefghijklmnopqrstu", "auth: [SECRET_1]"),
    ("call +44 20 7946 0958 today", "call [PHONE_1] today"),
])
def test_detectors(text: str, expected: str) -> None:
    assert Redactor(ALL).redact(text) == expected


def test_placeholders_are_stable_across_messages_and_counts_hold_no_values() -> None:
    r = Redactor(ALL)
    assert r.redact("a@x.io b@x.io") == "[EMAIL_1] [EMAIL_2]"
    assert r.redact("again a@x.io") == "again [EMAIL_1]"
    assert r.counts == {"email": 3}
    assert "a@x.io" not in json.dumps(r.counts)


def test_only_the_obliged_entities_are_redacted() -> None:
    assert Redactor(frozenset({"email"})).redact("a@x.io 123-45-6789") == "[EMAIL_1] 123-45-6789"


def test_checksums() -> None:
    assert luhn_ok("4111111111111111") and not luhn_ok("4111111111111112")
    assert iban_ok("GB82WEST12345698765432") and not iban_ok("GB82WEST12345698765433")


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=2000))
def test_redaction_never_crashes_and_is_idempotent(text: str) -> None:
    once = Redactor(ALL).redact(text)
    assert Redactor(ALL).redact(once) == once
