"""`docker compose up` for real: the project's docker-compose.yml, unchanged, on Debian's Docker daemon and
docker-compose, with images built here (tests/compose/images.py) named through its LLMGW_*_IMAGE
variables.

A copy of what a user's checkout holds (the compose file, the rendered Envoy config, the policy, the
deploy folder) is the project directory; the policy gets its API keys as a user's does (`llmgw keys
create`). Then, through the composed Envoy: every demo route answered by the openai, anthropic and
google-genai SDKs; the ledger read from the composed store; the metrics read from the composed
Prometheus; and what the compose file promises about its topology checked from inside it - the decision
port on no network, the store and the workers out of the applications' reach, the loops running, the
picker steering by the engines' addresses.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import openai
import pytest
from google import genai
from google.genai import types

from llmgw.local.procs import free_port
from tests.compose.images import ROOT, compose_images
from tests.helpers import request, unique_marker

pytestmark = pytest.mark.compose
PROJECT_FILES = ("docker-compose.yml", "envoy/envoy.compose.yaml", "policy", "deploy/prometheus.yml")
CHAT_ROUTES = ("chat-default", "chat-anthropic", "chat-gemini", "chat-bedrock", "chat-fallback")
# ext_proc's GET /status, read from inside the backend network (the loops' container).
STATUS = ("import json,urllib.request; "
          "print(json.dumps(json.load(urllib.request.urlopen('http://extproc:9090/status'))))")
UP_TIMEOUT_S = 600  # first start: the init service earns the simulated candidates' evidence (about 30 s here)


@dataclass
class Composed:
    directory: Path
    project: str
    env: dict[str, str]
    url: str  # the gateway, as the host's applications reach it (published on loopback)
    prometheus: str
    key: str  # acme's, made with `llmgw keys create`

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(["docker-compose", "-p", self.project, *args], cwd=self.directory, env=self.env,
                           capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"docker-compose {' '.join(args)}: {r.returncode}\n{r.stdout}\n{r.stderr}")
        return r

    def run_in(self, service: str, *argv: str) -> str:
        """A command in a running service's container."""
        return self.compose("exec", "-T", service, *argv).stdout

    def network(self, name: str) -> str:
        return self.env["LLMGW_APPS_NETWORK"] if name == "apps" else f"{self.project}_{name}"


def _project_copy(to: Path) -> Path:
    for rel in PROJECT_FILES:
        src, dst = ROOT / rel, to / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("keys.yaml", "*-conformance-*.yaml",
                                                                    "*-quality-gate-*.yaml", "voids"))
        else:
            shutil.copy2(src, dst)
    return to


def _key(policy: Path, tenant: str) -> str:
    made = subprocess.run([str(ROOT / ".venv/bin/llmgw"), "keys", "create", "--tenant", tenant,
                           "--config", str(policy)], capture_output=True, text=True, check=True)
    return made.stdout.strip()


def _serving(url: str, key: str) -> bool:
    try:
        return request(f"{url}/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=2).status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def composed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Composed]:
    directory = _project_copy(tmp_path_factory.mktemp("compose"))
    key = _key(directory / "policy", "acme")
    project = f"llmgw-test-{os.getpid()}"
    port, prometheus = free_port(), free_port()
    env = {**os.environ, **compose_images(), "LLMGW_PORT": str(port), "LLMGW_PROMETHEUS_PORT": str(prometheus),
           "LLMGW_APPS_NETWORK": f"{project}-apps"}
    c = Composed(directory, project, env, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{prometheus}", key)
    t0 = time.monotonic()
    try:
        c.compose("up", "-d", timeout=UP_TIMEOUT_S)
        deadline = time.monotonic() + UP_TIMEOUT_S
        while not _serving(c.url, key):
            if time.monotonic() > deadline:
                raise AssertionError(f"the composed gateway did not answer in {UP_TIMEOUT_S}s:\n"
                                     + c.compose("logs", "--tail", "60", check=False).stdout)
            time.sleep(1)
        print(f"docker-compose up: serving in {time.monotonic() - t0:.1f}s")
        yield c
    finally:
        logs = c.compose("logs", "--no-color", check=False).stdout
        (directory / "compose.log").write_text(logs)
        c.compose("down", "-v", "--remove-orphans", timeout=300, check=False)


def _ledger(c: Composed, n: int = 200) -> list[dict[str, object]]:
    out = c.run_in("loops", "llmgw", "ledger", "tail", "--config", "/etc/llmgw/policy",
                   "--store-url", "redis://valkey:6379/0", "--tenant", "acme", "-n", str(n))
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_every_demo_route_answers_each_sdk_through_the_composed_envoy(composed: Composed) -> None:
    c, sent = composed, []
    oa = openai.OpenAI(base_url=f"{c.url}/v1", api_key=c.key, max_retries=0)
    an = anthropic.Anthropic(base_url=c.url, api_key=c.key, max_retries=0)
    ge = genai.Client(api_key=c.key, http_options=types.HttpOptions(
        base_url=c.url, retry_options=types.HttpRetryOptions(attempts=1)))
    for route in CHAT_ROUTES:
        chat = oa.chat.completions.with_raw_response.create(
            model=route, messages=[{"role": "user", "content": "Say hello in one line."}], max_tokens=16)
        assert chat.parse().choices[0].message.content and chat.parse().model == route
        msg = an.messages.with_raw_response.create(
            model=route, max_tokens=16, messages=[{"role": "user", "content": "Say hello in one line."}])
        assert msg.parse().content[0].type == "text" and msg.parse().content[0].text  # type: ignore[union-attr]
        with oa.chat.completions.create(model=route, stream=True, max_tokens=16,
                                        messages=[{"role": "user", "content": "Count to three."}]) as stream:
            assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        answer = ge.models.generate_content(model=route, contents="Say hello in one line.",
                                            config=types.GenerateContentConfig(max_output_tokens=16))
        assert answer.text
        sent += [chat.headers["x-request-id"], msg.headers["x-request-id"]]
    emb = oa.embeddings.with_raw_response.create(model="embed-default", input=["a", "b"])
    assert len(emb.parse().data) == 2 and len(emb.parse().data[0].embedding) > 0
    sent.append(emb.headers["x-request-id"])

    # The ledger, read from the composed store: each request, answered 200 on the route it asked for.
    deadline, entries = time.monotonic() + 20, {}
    while time.monotonic() < deadline and not set(sent) <= set(entries):
        entries = {str(e.get("request_id")): e for e in _ledger(c)}
        time.sleep(0.5)
    assert set(sent) <= set(entries), sorted(set(sent) - set(entries))
    for rid in sent:
        assert entries[rid]["status"] == 200, entries[rid]
    routes = {entries[rid]["route"] for rid in sent}
    assert routes == {*CHAT_ROUTES, "embed-default"}, routes
    assert all(e["route"] in routes for e in entries.values())


def test_the_composed_prometheus_reads_the_gateways_and_envoys_metrics(composed: Composed) -> None:
    c = composed
    oa = openai.OpenAI(base_url=f"{c.url}/v1", api_key=c.key, max_retries=0)
    oa.chat.completions.create(model="chat-default", messages=[{"role": "user", "content": "hi"}], max_tokens=4)

    def query(expr: str) -> list[dict[str, object]]:
        r = request(f"{c.prometheus}/api/v1/query?query={urllib.parse.quote(expr)}", timeout=5)
        return list(r.json()["data"]["result"])

    deadline = time.monotonic() + 60  # a 5 s scrape interval; the first scrape after start
    wanted = {"llmgw": 'sum(llmgw_admitted_total{route="chat-default"})',
              "picker": 'sum(llmgw_picker_decisions_total{pool="engine-pool"})',
              "envoy": "sum(envoy_http_downstream_rq_total)"}
    seen: dict[str, float] = {}
    while time.monotonic() < deadline and len(seen) < len(wanted):
        for name, expr in wanted.items():
            if rows := query(expr):
                seen[name] = float(rows[0]["value"][1])  # type: ignore[index]
        time.sleep(1)
    assert seen.keys() == wanted.keys() and min(seen.values()) >= 1, seen
    targets = request(f"{c.prometheus}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
    health = {t["labels"]["job"]: t["health"] for t in targets}
    assert health["llmgw"] == health["envoy"] == "up", health


def _reachable(c: Composed, network: str, host: str, port: int) -> bool:
    """Whether a container on `network` (an application's, on `apps`) can open host:port."""
    probe = ("import socket,sys\ntry:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)\n"
             "except OSError as e:\n print(e); sys.exit(1)")
    r = subprocess.run(["docker", "run", "--rm", "--network", c.network(network), c.env["LLMGW_IMAGE"],
                        "python", "-c", probe, host, str(port)], capture_output=True, text=True, timeout=60)
    return r.returncode == 0


def test_applications_reach_envoy_and_nothing_behind_it(composed: Composed) -> None:
    """An application on the `apps` network reaches Envoy by name; ext_proc (its status port, and the
    decision port it would have had), the store and the engines are not there to reach."""
    c = composed
    assert _reachable(c, "apps", "envoy", 8080)
    for host, port in (("extproc", 9090), ("extproc", 50051), ("valkey", 6379), ("engine-pool-1", 8000)):
        assert not _reachable(c, "apps", host, port), f"{host}:{port} is reachable from the applications' network"
    # The decision and settlement port is a socket on the `decisions` volume: nothing listens on TCP 50051
    # anywhere, even on the backend network.
    assert _reachable(c, "backend", "extproc", 9090)  # (the probe can reach what is there)
    assert not _reachable(c, "backend", "extproc", 50051)
    listing = c.run_in("extproc", "python", "-c", "import os,stat; m=os.stat('/run/llmgw/extproc.sock').st_mode; "
                       "print(stat.S_ISSOCK(m), oct(m & 0o777))")
    assert listing.split() == ["True", "0o666"], listing


def test_the_state_the_loops_and_the_picker_are_running(composed: Composed) -> None:
    c = composed
    # init made the gateway's own secrets once, readable by the gateway's user only.
    modes = c.run_in("extproc", "sh", "-c", "stat -c '%n %a %U' /var/lib/llmgw/cache-salt.key "
                     "/var/lib/llmgw/replay.key /var/lib/llmgw/admin.token")
    assert [line.split()[1:] for line in modes.splitlines()] == [["600", "llmgw"]] * 3, modes
    deadline, status = time.monotonic() + 60, {}
    while time.monotonic() < deadline:
        status = json.loads(c.run_in("loops", "python", "-c", STATUS))
        if status.get("loops", {}).get("engine_verify", {}).get("runs", 0) >= 1:
            break
        time.sleep(1)
    loops = status["loops"]
    assert set(loops) == {"engine_verify", "reevaluate", "canary_watch"}, loops
    verify = loops["engine_verify"]
    assert verify["error"] == "" and "deployment(s) serve what they declare" in verify["last_outcome"], verify
    assert "unreachable" not in verify["last_outcome"], verify
    # The picker scrapes the pools' engines by service name and reads them fresh.
    picker = status["picker"]["pools"]
    assert {r["endpoint"] for r in picker["engine-pool"]} == {"engine-pool-1:8000", "engine-pool-2:8000"}, picker
    assert all(r["fresh"] for r in picker["engine-pool"]), picker


BUSY = """
import json, sys, threading, urllib.request
body = json.dumps({"model": "meta-llama/Llama-3.1-8B-Instruct", "max_tokens": 1500, "ignore_eos": True,
                   "messages": [{"role": "user", "content": "write a long story"}]}).encode()
def one():
    req = urllib.request.Request("http://engine-pool-1:8000/v1/chat/completions", body,
                                 {"content-type": "application/json"})
    urllib.request.urlopen(req, timeout=120).read()
threads = [threading.Thread(target=one) for _ in range(3)]
[t.start() for t in threads]; [t.join() for t in threads]
"""
SERVED = """
import json, sys, urllib.request
print(json.dumps({e: sum(sys.argv[1] in json.dumps(r["messages"]) for r in json.load(
    urllib.request.urlopen(f"http://{e}/admin/requests"))) for e in ("engine-pool-1:8000", "engine-pool-2:8000")}))
"""


def test_the_picker_steers_by_the_engines_addresses(composed: Composed) -> None:
    """Envoy's override_host matches hosts by address: the picker, given the engines by service name,
    steers every request away from the engine it reads as busy. (Were the names passed as they are,
    Envoy would match no host and spread the requests by its own balancing.)"""
    c = composed
    busy = subprocess.Popen(["docker-compose", "-p", c.project, "exec", "-T", "loops", "python", "-c", BUSY],
                            cwd=c.directory, env=c.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the busy engine, read as such by the picker
            readings = json.loads(c.run_in("loops", "python", "-c", STATUS))["picker"]["pools"]["engine-pool"]
            if any(r["endpoint"] == "engine-pool-1:8000" and r["fresh"] and r["running"] + r["waiting"] >= 3
                   for r in readings):
                break
            time.sleep(0.5)
        else:
            busy.kill()
            raise AssertionError(f"engine-pool-1 never read as busy: {readings}; {busy.communicate()[1].decode()}")
        oa = openai.OpenAI(base_url=f"{c.url}/v1", api_key=c.key, max_retries=0)
        marker = unique_marker("steer")  # letters only: a run of digits may be redacted as a number
        for i in range(6):
            oa.chat.completions.create(model="chat-default", max_tokens=2,
                                       messages=[{"role": "user", "content": f"{marker} {i}"}])
        served = json.loads(c.run_in("loops", "python", "-c", SERVED, marker))
        assert served == {"engine-pool-1:8000": 0, "engine-pool-2:8000": 6}, served
    finally:
        busy.kill()  # (its requests end on their own in the engine)
        busy.wait()


def test_restarts_keep_the_state_and_the_gateway_serves_again(composed: Composed) -> None:
    """A deployment's life: the store, ext_proc and Envoy restarted, then `up` run again (init runs again):
    the gateway's own secrets stay what they were, the ledger keeps its entries (the store's append-only
    file on its volume), and the gateway answers again."""
    c = composed
    secrets = "cat /var/lib/llmgw/cache-salt.key /var/lib/llmgw/replay.key | sha256sum"
    before = c.run_in("extproc", "sh", "-c", secrets)
    kept = {e["request_id"] for e in _ledger(c)}
    assert kept
    c.compose("restart", "valkey", "extproc", "envoy")
    c.compose("up", "-d", timeout=UP_TIMEOUT_S)
    deadline = time.monotonic() + 120
    while not _serving(c.url, c.key):
        assert time.monotonic() < deadline, c.compose("logs", "--tail", "40", check=False).stdout
        time.sleep(1)
    oa = openai.OpenAI(base_url=f"{c.url}/v1", api_key=c.key, max_retries=0)
    deadline, answered = time.monotonic() + 60, None
    while answered is None:  # the store reconnects on the first request that needs it
        try:
            answered = oa.chat.completions.with_raw_response.create(
                model="chat-default", messages=[{"role": "user", "content": "hi again"}], max_tokens=4)
        except openai.APIStatusError as e:
            assert e.status_code == 503 and time.monotonic() < deadline, e
            time.sleep(1)
    assert answered.status_code == 200
    assert c.run_in("extproc", "sh", "-c", secrets) == before
    rid, deadline = answered.headers["x-request-id"], time.monotonic() + 20
    while rid not in (after := {e["request_id"] for e in _ledger(c, n=500)}) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert kept | {rid} <= after, (kept | {rid}) - after
