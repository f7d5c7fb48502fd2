"""What a policy author meets (issue 17): tests written as for `opa test` (`with input as`, `with
data.x as`) run unchanged, with `opa test`'s output, exit codes and coverage; `llmgw policy eval`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from extproc.config import load_snapshot
from extproc.config.policy_tests import run_policy_tests
from llmgw.policy_cmd import exit_code, render_report
from tests.conftest import POLICY


def llmgw(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    dst = tmp_path / "policy"
    shutil.copytree(POLICY, dst)
    return dst


def modules_and_data(policy: Path) -> tuple[dict[str, str], dict[str, object]]:
    snap = load_snapshot(policy)
    return dict(snap.rego), dict(snap.policy_data)


def test_the_idiomatic_tests_pass_and_fail_when_the_rule_they_test_breaks(policy: Path) -> None:
    out = llmgw("policy", "test", str(policy))
    assert out.returncode == 0 and out.stdout.strip().endswith("PASS: 11/11"), out.stdout + out.stderr
    authz = policy / "authz.rego"
    authz.write_text(authz.read_text().replace("not effect in input.identity.effects", "false"))
    out = llmgw("policy", "test", str(policy))
    assert out.returncode == 2, out.stdout + out.stderr  # opa test's code for a failing test
    assert "data.llmgw.authz_test.test_write_tool_without_grant: FAIL" in out.stdout
    assert out.stdout.strip().splitlines()[-2:] == ["PASS: 10/11", "FAIL: 1/11"]


def test_with_data_replaces_gateway_facts_only_inside_the_test(policy: Path) -> None:
    modules, data = modules_and_data(policy)
    report = run_policy_tests(modules, data)
    names = {r.rule: r.outcome for r in report.results}
    assert names["test_a_region_the_tenant_does_not_allow_has_no_candidate"] == "PASS"
    assert names["test_plain_chat_allowed"] == "PASS"  # the real data again after that test


def test_verbose_output_shows_the_failing_value_and_prints() -> None:
    modules = {"t_test.rego": 'package t_test\nimport rego.v1\n'
                              'test_count if {\n\tprint("counting", count([1, 2]))\n\tcount([1, 2]) == 3\n}\n'
                              'test_value := 7\ntest_false := false\n'}
    report = run_policy_tests(modules, {})
    outcomes = {r.rule: (r.outcome, r.value) for r in report.results}
    assert outcomes == {"test_count": ("FAIL", None), "test_value": ("PASS", None), "test_false": ("FAIL", False)}
    text = render_report(report, verbose=True)
    assert "value: undefined" in text and "value: false" in text and "counting 2" in text
    assert "data.t_test.test_value: PASS" in text and exit_code(report) == 2


def test_skipped_errored_and_unloadable_tests_exit_as_opa_test_does() -> None:
    modules = {"t_test.rego": 'package t_test\nimport rego.v1\n'
                              'todo_test_later if false\n'
                              'test_panics if strings.count("abc", "") == 0\n'
                              'test_fine if true\n'}
    report = run_policy_tests(modules, {})
    assert [(r.rule, r.outcome) for r in report.results] == [
        ("todo_test_later", "SKIPPED"), ("test_panics", "ERROR"), ("test_fine", "PASS")]
    assert "panicked" in report.results[1].error
    assert exit_code(report) == 2
    only_skipped = run_policy_tests({"t_test.rego": "package t_test\nimport rego.v1\ntodo_test_x if false\n"}, {})
    assert exit_code(only_skipped) == 2 and exit_code(only_skipped, exit_zero_on_skipped=True) == 0
    broken = run_policy_tests({"t_test.rego": "package t_test\nimport rego.v1\ntest_x if {\n\t1 = = 1\n}\n"}, {})
    assert exit_code(broken) == 1 and broken.load_errors[0].startswith("t_test.rego:4:")


def test_coverage_names_the_lines_no_test_reached(policy: Path) -> None:
    out = llmgw("policy", "test", "--coverage", str(policy))
    assert out.returncode == 0, out.stderr
    full = json.loads(out.stdout)
    assert full["files"]["authz.rego"]["coverage"] == 100.0
    modules, data = modules_and_data(policy)
    tests = modules["authz_test.rego"]
    modules["authz_test.rego"] = tests[:tests.index("test_write_tool_without_grant")]  # no tool tests
    partial = run_policy_tests(modules, data, coverage=True).coverage
    assert partial is not None
    missed = {r for rng in partial["files"]["authz.rego"]["not_covered"]
              for r in range(rng["start"]["row"], rng["end"]["row"] + 1)}
    lines = (policy / "authz.rego").read_text().splitlines()
    effect_line = next(i for i, t in enumerate(lines, 1) if "not effect in input.identity.effects" in t)
    assert effect_line in missed and partial["files"]["authz.rego"]["coverage"] < 100.0
