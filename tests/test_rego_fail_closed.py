"""A policy the engine cannot evaluate as written is refused when it loads (issue 17, part 0): a call
of a built-in regopy does not implement, or of a function nobody defines, would evaluate as undefined
and a deny rule using it would never fire; errors name file, line and column; the tests run in a
process of their own, so an engine crash takes down neither ext_proc nor `llmgw policy test`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import regopy

from extproc.config import ConfigError, load_snapshot
from extproc.config.policy_tests import run_isolated
from extproc.config.rego_check import unknown_calls
from extproc.config.reload import Live, Reloader
from tests.conftest import POLICY

DENY_BY_NETWORK = """package llmgw.authz

import rego.v1

# Refuse callers from the lab network.
reasons contains "from the lab network" if net.cidr_contains("10.0.0.0/8", input.ip)
"""
CALL_AT = f"6:{DENY_BY_NETWORK.splitlines()[5].index('net.cidr_contains') + 1}"


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    dst = tmp_path / "policy"
    shutil.copytree(POLICY, dst)
    return dst


def test_regopy_would_let_such_a_deny_rule_allow() -> None:
    """The premise, checked against the engine itself: the call evaluates as undefined, so the deny
    rule does not fire and `allow if not deny` holds."""
    rego = regopy.Interpreter()
    rego.add_module("p.rego", "package p\nimport rego.v1\ndeny if net.cidr_contains(\"10.0.0.0/8\", input.ip)\n"
                              "allow if not deny\n")
    rego.set_input(regopy.Input({"ip": "10.1.1.1"}))  # in the network: OPA denies
    assert json.loads(str(rego.query("x = data.p.allow")))["bindings"]["x"] is True
    assert not rego.is_builtin("net.cidr_contains")


def test_a_deny_rule_on_an_unimplemented_builtin_is_refused_with_its_position(policy: Path) -> None:
    (policy / "network.rego").write_text(DENY_BY_NETWORK)
    with pytest.raises(ConfigError) as e:
        load_snapshot(policy)
    (issue,) = e.value.issues
    assert (issue.file, issue.field) == ("network.rego", CALL_AT)
    assert "`net.cidr_contains`" in issue.message and "never fire" in issue.message


def test_a_running_gateway_keeps_its_revision_when_such_a_policy_lands(policy: Path) -> None:
    snap = load_snapshot(policy)
    r = Reloader(policy, lambda s: Live(s, {}), Live(snap, {}))
    (policy / "network.rego").write_text(DENY_BY_NETWORK)
    assert not r.reload("test") and r.live.snapshot.revision == snap.revision
    assert any(f"network.rego: {CALL_AT}" in e for e in r.status["last_error"]), r.status


def test_a_syntax_error_names_file_line_and_column(policy: Path) -> None:
    (policy / "authz.rego").write_text("package llmgw.authz\nimport rego.v1\n\nallow if {\n")
    with pytest.raises(ConfigError) as e:
        load_snapshot(policy)
    assert ("authz.rego", "4:10") in [(i.file, i.field) for i in e.value.issues], e.value.issues


@pytest.mark.parametrize(("text", "unknown"), [
    ('package p\nimport rego.v1\nx := count([1]) + object.union({}, {})["a"]\n', []),
    ('package p\nimport rego.v1\n# net.cidr_contains(a, b) in a comment\ns := "http.send({}) in a string"\n', []),
    ('package p\nimport rego.v1\nf(x) := x + 1\ny := f(1)\nz := data.p.f(2)\n', []),
    ('package p\nimport rego.v1\nimport data.lib\ny := lib.helper(1)\n', ["lib.helper"]),
    ('package p\nimport rego.v1\ny := http.send({"url": "x"})\nz := nosuch(1)\n', ["http.send", "nosuch"]),
    ('package p\nimport rego.v1\nok if json.match_schema({}, {})\n', ["json.match_schema"]),
])
def test_only_calls_the_engine_can_evaluate_pass(text: str, unknown: list[str]) -> None:
    found = [i.message.split("`")[1] for i in unknown_calls({"p.rego": text}, regopy.Interpreter().is_builtin)]
    assert found == unknown


def test_functions_of_another_module_are_known() -> None:
    modules = {"lib.rego": "package lib\nimport rego.v1\nhelper(x) := x * 2\n",
               "p.rego": "package p\nimport rego.v1\nimport data.lib\ny := lib.helper(1)\n"}
    assert unknown_calls(modules, regopy.Interpreter().is_builtin) == []


def test_an_engine_crash_fails_the_tests_and_spares_the_caller(policy: Path) -> None:
    crash = (sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    (result,) = run_isolated({}, {}, runner=crash)
    assert not result.passed and "SIGSEGV" in result.error
    snap = load_snapshot(policy)
    assert all(r.passed for r in run_isolated(snap.rego, snap.policy_data))  # the real runner


def test_policy_test_refuses_a_test_module_calling_what_the_engine_lacks(policy: Path) -> None:
    (policy / "net_test.rego").write_text('package llmgw.net_test\nimport rego.v1\n'
                                          'test_office if net.cidr_contains("10.0.0.0/8", "10.1.1.1")\n')
    out = subprocess.run([sys.executable, "-m", "llmgw", "policy", "test", str(policy)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and "net_test.rego:3:16" in out.stderr, out
