"""Decision ids, the decision log and a policy dry run through the real processes (issue 17): each
decision's id joins the error body, Envoy's access log, the ledger and the decision log; a dry-run
candidate that denies everything changes no answer and shows every difference; `llmgw policy eval`
on a request sample decides what the live gateway decided for the same request."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from extproc.store import decisions_key
from llmgw.local.stack import Stack
from llmgw.ops.ledger import decision_entry
from tests.conftest import DEMO_KEYS, POLICY, ledger_of, module_stack
from tests.e2e.routing.test_fallback_e2e import access_log_line
from tests.helpers import assert_contract_error, chat_body, llmgw, request

pytestmark = pytest.mark.e2e

CANARY = "canary-prompt-5c1f0e9d"
DENY_ALL = """package llmgw.authz

import rego.v1

# A candidate under evaluation: refuses everything.
decision := {"allow": false, "reasons": ["the candidate denies everything"],
	"obligations": {"redact": [], "record_content": false}}
"""


def make_policy(root: Path) -> Path:
    dst = root / "policy"
    shutil.copytree(POLICY, dst)
    (dst / "candidate").mkdir()
    (dst / "candidate" / "authz.rego").write_text(DENY_ALL)
    gw = yaml.safe_load((dst / "gateway.yaml").read_text())
    gw["decision_log"] = {"enabled": True, "mask": ["/identity/subject"]}
    gw["policy_dry_run"] = {"directory": "candidate"}
    (dst / "gateway.yaml").write_text(yaml.safe_dump(gw))
    return dst


gw = module_stack("decisions-e2e", make_policy)


def send(stack: Stack, key: str, data_class: str | None = None, content: str = "hello") -> Any:
    headers = {"authorization": f"Bearer {key}", **({"x-llmgw-data-class": data_class} if data_class else {})}
    return request(f"{stack.url}/v1/chat/completions", "POST", chat_body(max_tokens=2, content=content),
                   headers=headers)


def decision_log(stack: Stack, tenant: str, decision_id: str) -> dict[str, Any]:
    r = redis.Redis.from_url(str(stack.store_url), decode_responses=True)
    deadline = time.time() + 5
    while time.time() < deadline:
        entries = [decision_entry(f) for _, f in r.xrange(decisions_key(tenant))]
        found = [e for e in entries if e["decision_id"] == decision_id]
        if found:
            (entry,) = found
            return entry
        time.sleep(0.05)
    raise AssertionError(f"no decision log entry {decision_id}")


def dry_run_status(stack: Stack) -> dict[str, int]:
    total: dict[str, int] = {"evaluated": 0, "differing": 0}
    for url in stack.status_urls:
        for counts in request(url, "GET").json()["policy_dry_run"].values():
            total["evaluated"] += counts["evaluated"]
            total["differing"] += counts["differing"]
    return total


def test_a_refusal_names_its_decision_everywhere(gw: Stack) -> None:
    r = send(gw, DEMO_KEYS["globex"], "confidential", CANARY)
    assert_contract_error(r, 403, "forbidden")
    did = r.headers["x-llmgw-decision-id"]
    assert r.json()["error"]["message"].endswith(f"(decision_id {did})")
    rid = r.headers["x-request-id"]
    assert ledger_of(gw, rid, "globex")["decision"]["decision_id"] == did
    assert access_log_line(gw, rid)["decision_id"] == did
    entry = decision_log(gw, "globex", did)
    assert entry["request_id"] == rid and entry["path"] == "llmgw/authz/decision"
    assert entry["result"]["allow"] is False
    assert "tenant globex may not send data class confidential" in entry["result"]["reasons"]
    assert entry["erased"] == ["/identity/subject"] and "subject" not in entry["input"]["identity"]
    assert CANARY not in json.dumps(entry)


def test_an_allowed_request_names_its_decision_in_the_ledger_access_log_and_decision_log(gw: Stack) -> None:
    r = send(gw, DEMO_KEYS["acme"])
    assert r.status == 200, r.body
    rid = r.headers["x-request-id"]
    did = ledger_of(gw, rid, "acme")["decision"]["decision_id"]
    assert did and access_log_line(gw, rid)["decision_id"] == did
    entry = decision_log(gw, "acme", did)
    assert entry["result"] == {"allow": True, "reasons": [], "obligations": entry["result"]["obligations"]}


def test_a_dry_run_that_denies_everything_changes_no_answer_and_shows_every_difference(gw: Stack,
                                                                                      tmp_path: Path) -> None:
    before = dry_run_status(gw)
    answers = [send(gw, DEMO_KEYS["acme"]) for _ in range(4)] + [send(gw, DEMO_KEYS["globex"], "confidential")]
    assert [a.status for a in answers] == [200, 200, 200, 200, 403]  # as without the candidate
    time.sleep(0.5)  # the recorder writes in batches
    after = dry_run_status(gw)
    assert after["evaluated"] - before["evaluated"] == 5
    assert after["differing"] - before["differing"] == 5  # 4 allow -> deny, and the deny's reasons
    allowed = answers[0]
    did = ledger_of(gw, allowed.headers["x-request-id"], "acme")["decision"]["decision_id"]
    dry = decision_log(gw, "acme", did)["dry_run"]
    assert dry["decision_id"] != did and dry["revision"].endswith("+dry-run")
    assert dry["differences"] == ["allow", "reasons", "obligations"]  # acme's internal data is redacted
    assert dry["result"]["reasons"] == ["the candidate denies everything"]
    out = llmgw("policy", "diff", "--store-url", str(gw.store_url), "--config", str(gw.opts.config_dir))
    assert out.returncode == 0, out.stderr
    assert f"{after['evaluated']} decision(s) evaluated" in out.stdout
    assert f"{after['differing']} differed" in out.stdout
    refused = answers[-1].headers["x-llmgw-decision-id"]
    refused_dry = decision_log(gw, "globex", refused)["dry_run"]
    assert refused_dry["differences"] == ["reasons", "obligations"]  # both deny, for different reasons
    assert f"{refused} -> {refused_dry['decision_id']} [reasons, obligations]" in out.stdout, out.stdout
    flips = [line for line in out.stdout.splitlines() if "allow -> deny:" in line]
    assert flips and int(flips[0].rsplit(":", 1)[1]) >= 4


@pytest.mark.parametrize(("tenant", "data_class"), [("acme", None), ("globex", "confidential"),
                                                     ("acme", "restricted"), ("globex", None)])
def test_policy_eval_on_a_request_sample_decides_as_the_live_gateway(gw: Stack, tmp_path: Path, tenant: str,
                                                                     data_class: str | None) -> None:
    live = send(gw, DEMO_KEYS[tenant], data_class)
    headers = {"authorization": f"Bearer {DEMO_KEYS[tenant]}", "content-type": "application/json",
               **({"x-llmgw-data-class": data_class} if data_class else {})}
    sample = tmp_path / "request.json"
    sample.write_text(json.dumps({"method": "POST", "path": "/v1/chat/completions", "headers": headers,
                                  "body": chat_body(max_tokens=2, content="hello")}))
    out = llmgw("policy", "eval", "--config", str(gw.opts.config_dir), "--request", str(sample))
    evaluated = json.loads(out.stdout)
    assert evaluated["answer"]["status"] == live.status and out.returncode == (0 if live.status == 200 else 2)
    did = (live.headers["x-llmgw-decision-id"] if live.status != 200
           else ledger_of(gw, live.headers["x-request-id"], tenant)["decision"]["decision_id"])
    assert evaluated["result"] == decision_log(gw, tenant, did)["result"]
    if live.status != 200:  # the same message but for the decision's id
        assert (evaluated["answer"]["body"]["error"]["message"].rsplit(" (decision_id", 1)[0]
                == live.json()["error"]["message"].rsplit(" (decision_id", 1)[0])
