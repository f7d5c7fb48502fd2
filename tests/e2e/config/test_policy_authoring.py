"""What a policy author meets (issue 17): tests written as for `opa test` (`with input as`, `with
data.x as`) run unchanged, with `opa test`'s output, exit codes and coverage; `llmgw policy eval`."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from extproc.config import ConfigError, load_snapshot
from extproc.config.policy_tests import run_policy_tests
from extproc.decisions import differences, erase, sampled
from llmgw.cli.policy import decide_request, exit_code, input_schema, render_report
from tests.conftest import DEMO_KEYS, POLICY
from tests.helpers import chat_body, llmgw


def modules_and_data(policy: Path) -> tuple[dict[str, str], dict[str, object]]:
    snap = load_snapshot(policy)
    return dict(snap.rego), dict(snap.policy_data)


def test_the_idiomatic_tests_pass_and_fail_when_the_rule_they_test_breaks(policy: Path) -> None:
    out = llmgw("policy", "test", str(policy))
    assert out.returncode == 0 and out.stdout.strip().endswith("PASS: 23/23"), out.stdout + out.stderr
    authz = policy / "authz.rego"
    authz.write_text(authz.read_text().replace("not effect in input.identity.effects", "false"))
    out = llmgw("policy", "test", str(policy))
    assert out.returncode == 2, out.stdout + out.stderr  # opa test's code for a failing test
    assert "data.llmgw.authz_test.test_write_tool_without_grant: FAIL" in out.stdout
    assert "data.llmgw.authz_test.test_an_admitted_unlisted_tool_needs_its_default_effects: FAIL" in out.stdout
    assert out.stdout.strip().splitlines()[-2:] == ["PASS: 21/23", "FAIL: 2/23"]


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


def test_erase_removes_what_the_pointers_name_and_says_which() -> None:
    doc = {"identity": {"tenant": "acme", "subject": "k1"}, "a/b": {"c": 1}}
    out, erased = erase(doc, ("/identity/subject", "/a~1b/c", "/no/such"))
    assert out == {"identity": {"tenant": "acme"}, "a/b": {}} and erased == ["/identity/subject", "/a~1b/c"]
    assert doc["identity"]["subject"] == "k1"  # the input itself is untouched


def test_differences_and_sampling() -> None:
    allow = {"allow": True, "reasons": [], "obligations": {"redact": [], "record_content": False}}
    deny = {"allow": False, "reasons": ["no"], "obligations": {"redact": [], "record_content": False}}
    assert differences(allow, allow) == [] and differences(allow, deny) == ["allow", "reasons"]
    assert differences(allow, {"error": "boom"}) == ["error"] and differences({"error": "a"}, {"error": "b"}) == []
    ids = [f"req-{i}" for i in range(4000)]
    share = sum(sampled(i, 0.25) for i in ids) / len(ids)
    assert 0.2 < share < 0.3 and [sampled(i, 0.25) for i in ids] == [sampled(i, 0.25) for i in ids]
    assert all(sampled(i, 1.0) for i in ids[:10])


def test_a_dry_run_candidate_is_compiled_apart_and_its_errors_name_its_files(policy: Path) -> None:
    (policy / "candidate").mkdir()
    (policy / "candidate" / "authz.rego").write_text("package llmgw.authz\nimport rego.v1\ndecision := {\n")
    gw = yaml.safe_load((policy / "gateway.yaml").read_text())
    gw["policy_dry_run"] = {"directory": "candidate", "sample": 0.5}
    (policy / "gateway.yaml").write_text(yaml.safe_dump(gw))
    with pytest.raises(ConfigError) as e:
        load_snapshot(policy)
    assert [i.file for i in e.value.issues] == ["candidate/authz.rego"], e.value.issues
    (policy / "candidate" / "authz.rego").write_text(
        'package llmgw.authz\nimport rego.v1\ndecision := {"allow": false, "reasons": ["no"], '
        '"obligations": {"redact": [], "record_content": false}}\n')
    snap = load_snapshot(policy)
    assert snap.dry_run_policy is not None and snap.policy is not None
    assert not any(k.startswith("candidate/") for k in snap.rego)  # never part of the enforced policy


def test_every_input_field_is_in_the_schema_and_documented() -> None:
    schema = input_schema()
    readme = (POLICY / "README.md").read_text()

    def leaves(node: dict[str, object], prefix: str) -> list[str]:
        props = node.get("properties") or (node.get("items") or {}).get("properties")  # type: ignore[union-attr]
        if not props:
            return [prefix]
        return [leaf for k, v in props.items() for leaf in leaves(v, f"{prefix}.{k}" if prefix else k)]  # type: ignore[union-attr,arg-type]

    fields = leaves(schema, "")
    assert "request.tools.effects" in fields and "identity.tenant" in fields
    missing = [f for f in fields if f"`{f}`" not in readme]
    assert not missing, f"policy/README.md does not document {missing}"


@pytest.mark.parametrize("extra", [{}, {"x-llmgw-data-class": "public"}, {"idempotency-key": "k-1"}])
def test_the_input_ext_proc_builds_follows_the_schema(extra: dict[str, str]) -> None:
    import asyncio

    snap = load_snapshot(POLICY)
    body = chat_body(max_tokens=3, tools=[{"type": "function", "function": {"name": "update_ticket",
                                                                           "parameters": {"type": "object"}}}])
    headers = {"authorization": f"Bearer {DEMO_KEYS['acme']}", **extra}
    out = asyncio.run(decide_request(snap, "POST", "/v1/chat/completions", headers, json.dumps(body).encode()))
    jsonschema.Draft202012Validator(input_schema()).validate(out["input"])
    assert out["input"]["request"]["tools"][0]["name"] == "update_ticket"


EXAMPLES = POLICY / "examples"


def test_the_examples_tests_pass_and_each_example_breaks_its_own_tests() -> None:
    modules = {str(p.relative_to(EXAMPLES)): p.read_text() for p in sorted(EXAMPLES.glob("*.rego"))}
    report = run_policy_tests(modules, {})
    assert report.ok and len(report.results) >= 15, render_report(report, verbose=True)
    assert {r.file for r in report.results} == {f"{n}_test.rego" for n in (
        "model_data_classes", "time_window", "tool_grants", "residency", "withdrawn")}
    for name in ("model_data_classes", "time_window", "tool_grants", "residency", "withdrawn"):
        broken = dict(modules)
        text = broken[f"{name}.rego"]
        assert "reasons contains msg if {\n" in text
        broken[f"{name}.rego"] = text.replace("reasons contains msg if {\n", "reasons contains msg if {\n\tfalse\n")
        failed = [r for r in run_policy_tests(broken, {}).results if r.outcome == "FAIL"]
        assert failed and {r.file for r in failed} == {f"{name}_test.rego"}, name


def test_examples_are_never_part_of_the_enforced_policy() -> None:
    snap = load_snapshot(POLICY)
    assert not any(k.startswith("examples/") for k in snap.rego)
    assert snap.policy is not None and snap.policy.cacheable  # the time window example would make it impure


def test_the_recorder_writes_in_batches_and_counts_what_a_dead_store_loses() -> None:
    import asyncio

    import redis as sync_redis

    from extproc.decisions import DecisionRecorder
    from extproc.store import Store, decisions_key, dry_run_key
    from tests.conftest import valkey_url

    async def main() -> None:
        store = Store(valkey_url(), timeout_ms=500)
        rec = DecisionRecorder(store)
        for i in range(50):
            rec.log("rec-tenant", {"decision_id": f"d{i}", "result": {"allow": True}})
            rec.count_dry_run("rev-x", ["allow"] if i % 5 == 0 else [])
        await rec.flush()
        assert rec.logged == 50 and rec.dropped == 0 and rec.entries == []
        r = sync_redis.Redis.from_url(valkey_url(), decode_responses=True)
        assert [json.loads(f["entry"])["decision_id"] for _, f in r.xrange(decisions_key("rec-tenant"))][-50:] == [
            f"d{i}" for i in range(50)]
        assert r.hgetall(dry_run_key("rev-x")) == {"evaluated": "50", "differing": "10", "allow": "10"}
        r.delete(decisions_key("rec-tenant"), dry_run_key("rev-x"))
        await store.close()
        dead = DecisionRecorder(Store("redis://127.0.0.1:9/0", timeout_ms=200))
        dead.log("rec-tenant", {"decision_id": "lost"})
        await dead.flush()
        assert dead.dropped == 1 and dead.logged == 0
        assert DecisionRecorder(None).status()["decision_log"]["dropped"] == 0

    asyncio.run(main())
