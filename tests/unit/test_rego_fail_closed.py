"""A policy the engine cannot evaluate as written is refused when it loads (issue 17, part 0): a call
of a built-in the engine does not implement, or of a function nobody defines, fails only when reached
(and `http.send` evaluates as undefined, so a deny rule on it would never fire); errors name file, line
and column; an engine panic is an evaluation error, never an answer or a dead process; the tests run
in a process of their own, so a native crash takes down neither ext_proc nor `llmgw policy test`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import regorus

from extproc.config import ConfigError, load_snapshot
from extproc.config.policy import CompiledPolicy, PolicyEvaluationError
from extproc.config.policy_tests import run_isolated
from extproc.config.rego_check import unknown_calls
from extproc.config.rego_engine import is_builtin
from extproc.config.reload import Live, Reloader
from tests.helpers import llmgw

DENY_BY_LOOKUP = """package llmgw.authz

import rego.v1

# Refuse callers whose host resolves into the lab network.
reasons contains "from the lab network" if net.lookup_ip_addr(input.host)["10.1.1.1"]
"""
CALL_AT = f"6:{DENY_BY_LOOKUP.splitlines()[5].index('net.lookup_ip_addr') + 1}"


DENY_BY_HTTP = """package llmgw.authz

import rego.v1

reasons contains "blocked by the directory" if http.send({"method": "GET", "url": input.url}).body.blocked
"""


def test_the_engine_would_let_a_deny_rule_on_http_send_allow() -> None:
    """The premise, checked against the engine itself: `http.send` evaluates as undefined with no
    error, so the deny rule does not fire and `allow if not deny` holds."""
    engine = regorus.Engine()
    engine.add_policy("p.rego", "package p\nimport rego.v1\n"
                                "deny if http.send({\"method\": \"GET\", \"url\": input.url}).body.blocked\n"
                                "allow if not deny\n")
    engine.set_input({"url": "http://127.0.0.1:9/"})
    assert engine.eval_rule("data.p.allow") is True
    assert is_builtin("http.send") and not is_builtin("net.lookup_ip_addr") and is_builtin("net.cidr_contains")


def test_a_deny_rule_on_http_send_is_refused_with_its_position(policy: Path) -> None:
    (policy / "directory.rego").write_text(DENY_BY_HTTP)
    with pytest.raises(ConfigError) as e:
        load_snapshot(policy)
    (issue,) = e.value.issues
    at = DENY_BY_HTTP.splitlines()[4].index("http.send") + 1
    assert (issue.file, f"{issue.line}:{issue.column}") == ("directory.rego", f"5:{at}")
    assert "`http.send`" in issue.message and "never fire" in issue.message


PANICS = """package llmgw.authz

import rego.v1

default allow := true

reasons contains "too many separators" if strings.count(input.request.model, input.identity.subject) > 3

allow := false if count(reasons) > 0

decision := {"allow": allow, "reasons": reasons, "obligations": {"redact": [], "record_content": false}}
"""


def test_an_engine_panic_is_an_evaluation_error_and_spoils_no_later_decision() -> None:
    """`strings.count` with an empty needle panics inside the engine (a Rust panic, a BaseException):
    the decision fails closed, and the next request is decided as if nothing happened."""
    policy = CompiledPolicy({"authz.rego": PANICS}, {}, "r1")
    with pytest.raises(PolicyEvaluationError, match="panicked"):
        policy.evaluate({"request": {"model": "a-b-c"}, "identity": {"subject": ""}})
    ok = policy.evaluate({"request": {"model": "a-b-c"}, "identity": {"subject": "-"}})
    assert ok.allow and ok.reasons == ()
    denied = policy.evaluate({"request": {"model": "a-b-c-d-e"}, "identity": {"subject": "-"}})
    assert not denied.allow and denied.reasons == ("too many separators",)


def test_a_deny_rule_on_an_unimplemented_builtin_is_refused_with_its_position(policy: Path) -> None:
    (policy / "network.rego").write_text(DENY_BY_LOOKUP)
    with pytest.raises(ConfigError) as e:
        load_snapshot(policy)
    (issue,) = e.value.issues
    assert (issue.file, f"{issue.line}:{issue.column}") == ("network.rego", CALL_AT)
    assert "`net.lookup_ip_addr`" in issue.message and "neither a built-in" in issue.message


def test_a_running_gateway_keeps_its_revision_when_such_a_policy_lands(policy: Path) -> None:
    snap = load_snapshot(policy)
    r = Reloader(policy, lambda s: Live(s, {}), Live(snap, {}))
    (policy / "network.rego").write_text(DENY_BY_LOOKUP)
    assert not r.reload("test") and r.live.snapshot.revision == snap.revision
    assert any(f"network.rego:{CALL_AT}: " in e for e in r.status["last_error"]), r.status


def test_a_syntax_error_names_file_line_and_column(policy: Path) -> None:
    (policy / "authz.rego").write_text("package llmgw.authz\nimport rego.v1\n\nallow if {\n\tinput.a == == 1\n}\n")
    with pytest.raises(ConfigError) as e:
        load_snapshot(policy)
    assert [(i.file, i.line, i.column) for i in e.value.issues] == [("authz.rego", 5, 13)], e.value.issues  # 2nd ==


def test_an_unsafe_variable_is_refused_where_it_is_used(policy: Path) -> None:
    (policy / "extra.rego").write_text("package llmgw.extra\nimport rego.v1\n\nok if {\n    y > 2\n}\n")
    with pytest.raises(ConfigError) as e:
        load_snapshot(policy)
    (issue,) = e.value.issues
    assert (issue.file, issue.line, issue.column) == ("extra.rego", 5, 5) and "unsafe" in issue.message


@pytest.mark.parametrize(("text", "unknown"), [
    ('package p\nimport rego.v1\nx := count([1]) + object.union({}, {})["a"]\n', []),
    ('package p\nimport rego.v1\n# net.cidr_contains(a, b) in a comment\ns := "http.send({}) in a string"\n', []),
    ('package p\nimport rego.v1\nf(x) := x + 1\ny := f(1)\nz := data.p.f(2)\n', []),
    ('package p\nimport rego.v1\nimport data.lib\ny := lib.helper(1)\n', ["lib.helper"]),
    ('package p\nimport rego.v1\ny := net.lookup_ip_addr("x")\nz := nosuch(1)\n', ["net.lookup_ip_addr", "nosuch"]),
    ('package p\nimport rego.v1\nok if io.jwt.decode("a.b.c")\n', ["io.jwt.decode"]),
    ('package p\nimport rego.v1\nok if net.cidr_contains("10.0.0.0/8", "10.1.1.1")\n', []),
])
def test_only_calls_the_engine_can_evaluate_pass(text: str, unknown: list[str]) -> None:
    found = [i.message.split("`")[1] for i in unknown_calls({"p.rego": text}, is_builtin)]
    assert found == unknown


def test_functions_of_another_module_are_known() -> None:
    modules = {"lib.rego": "package lib\nimport rego.v1\nhelper(x) := x * 2\n",
               "p.rego": "package p\nimport rego.v1\nimport data.lib\ny := lib.helper(1)\n"}
    assert unknown_calls(modules, is_builtin) == []


def test_an_engine_crash_fails_the_tests_and_spares_the_caller(policy: Path) -> None:
    crash = (sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    (result,) = run_isolated({}, {}, runner=crash).results
    assert not result.passed and "SIGSEGV" in result.error
    snap = load_snapshot(policy)
    report = run_isolated(snap.rego, snap.policy_data)  # the real runner
    assert report.ok and len(report.results) >= 10


def test_policy_test_refuses_a_test_module_calling_what_the_engine_lacks(policy: Path) -> None:
    (policy / "net_test.rego").write_text('package llmgw.net_test\nimport rego.v1\n'
                                          'test_office if net.lookup_ip_addr("office.example")\n')
    out = llmgw("policy", "test", str(policy))
    assert out.returncode == 1 and "net_test.rego:3:16" in out.stderr, out


def test_a_deny_rule_on_a_network_range_fires_as_in_opa() -> None:
    """net.cidr_contains, which the engine before (regopy 1.5) evaluated as undefined, now decides."""
    text = ('package llmgw.authz\nimport rego.v1\nreasons contains "lab" if net.cidr_contains("10.0.0.0/8", input.ip)\n'
            'decision := {"allow": count(reasons) == 0, "reasons": reasons, '
            '"obligations": {"redact": [], "record_content": false}}\n')
    policy = CompiledPolicy({"authz.rego": text}, {}, "r1")
    assert not policy.evaluate({"ip": "10.1.1.1"}).allow and policy.evaluate({"ip": "192.0.2.1"}).allow
