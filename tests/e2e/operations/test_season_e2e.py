"""A season in the life of one deployment: one policy directory and one state directory through a
sequence of `llmgw up` runs, as an operator lives them - traffic and an engine killed under it, engine
faults that void a pool for drift, a restart, engines that serve another window, a key rotation, a
revision applied with a canary and rolled back, a provider quota change, and the clock past every
record's expiry. After each step every demo route serves, or says exactly why and how to fix it; the
last step serves them all, and the policy directory holds only what its operator wrote
(extproc/config/earned.py; docs/INVARIANTS.md, invariants 19 and 20)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from extproc.config.earned import ENV as EVIDENCE_ENV
from llmgw.local.procs import Child, free_port, http_ok, python_module, wait_until
from tests.conftest import POLICY
from tests.e2e.operations.test_up import log_tails, wait_up
from tests.helpers import request

pytestmark = pytest.mark.e2e

CHAT_ROUTES = ("chat-default", "chat-anthropic", "chat-gemini", "chat-bedrock", "chat-fallback")
ROUTES = (*CHAT_ROUTES, "embed-default")


@dataclass
class Run:
    """One `llmgw up`: its up.json, and (once stopped) everything it printed."""

    info: dict[str, Any]
    out: str = ""

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.info['url']}/v1", max_retries=0,
                             api_key=key or self.info["tenants"]["acme"]["api_key"])


class Season:
    def __init__(self, root: Path):
        self.policy = root / "policy"
        # The operator's policy: the session's, whose evidence was earned and committed with it.
        shutil.copytree(POLICY, self.policy)
        self.state = root / "state"
        # The pools' addresses, for the step where someone else serves them (`--engine none`).
        gw = yaml.safe_load((self.policy / "gateway.yaml").read_text())
        for pool in gw["pools"].values():
            pool["endpoints"] = [f"127.0.0.1:{free_port()}" for _ in pool["endpoints"]]
        (self.policy / "gateway.yaml").write_text(yaml.safe_dump(gw, sort_keys=False))
        self.pools = {name: [e for e in pool["endpoints"]] for name, pool in gw["pools"].items()}
        self.env = {**os.environ, EVIDENCE_ENV: str(self.state / "evidence")}  # as `llmgw up` tells its operator
        self.own_evidence = self.evidence_files()

    def evidence_files(self) -> set[str]:
        return {str(p.relative_to(self.policy)) for p in (self.policy / "evidence").rglob("*") if p.is_file()}

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "llmgw", *args], capture_output=True, text=True,
                              timeout=timeout, env=self.env)

    @contextmanager
    def up(self, *extra: str, env: dict[str, str] | None = None, within_s: float = 240) -> Iterator[Run]:
        proc = subprocess.Popen([sys.executable, "-m", "llmgw", "up", "--config", str(self.policy), "--state-dir",
                                 str(self.state), "--free-ports", "--time-scale", "0.05", *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **(env or {})})
        run = Run({})
        try:
            run.info = wait_up(proc, self.state, within_s=within_s)
            yield run
        finally:
            proc.send_signal(signal.SIGTERM)
            run.out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, run.out

    def check(self) -> str:
        out = self.cli("check", str(self.policy), "--state-dir", str(self.state))
        return out.stdout + out.stderr


def serves(run: Run, key: str | None = None) -> dict[str, str]:
    """Each demo route's answer: "ok", or what refused it (status, code and message)."""
    client = run.client(key)
    out = {}
    for route in ROUTES:
        try:
            if route.startswith("embed"):
                client.embeddings.create(model=route, input="hello")
            else:
                client.chat.completions.create(model=route, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
            out[route] = "ok"
        except openai.APIStatusError as e:
            out[route] = f"{e.status_code}: {e.message}"
    return out


def all_serve(run: Run, key: str | None = None) -> None:
    served = serves(run, key)
    assert set(served.values()) == {"ok"}, f"{served}\n{log_tails(Path(run.info['logs']))}"


def engine_pids(run: Run, port: int) -> list[int]:
    """The engine process listening on `port` (its command line names it)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"enginesim" in argv and str(port).encode() in argv:
                out.append(int(entry.name))
    return out


def test_a_season_in_the_life_of_one_deployment(tmp_path: Path) -> None:
    season = Season(tmp_path)
    lib = next(iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))), None)
    assert lib, "Debian's faketime is missing: make test installs it (make system-deps)"

    # 1. First start: every route serves. An engine is killed under traffic: the route keeps serving
    # (Envoy retries the other engine; `llmgw up` starts it again). Then the pool's engines fail
    # requests - enough for the re-evaluation to void the pool for provider drift.
    with season.up() as run:
        all_serve(run)
        client = run.client()
        answered = []
        for i in range(24):
            if i == 6:
                (victim,) = engine_pids(run, int(run.info["engines"][0].rsplit(":", 1)[1]))
                os.kill(victim, signal.SIGKILL)
            try:
                client.chat.completions.create(model="chat-default", max_tokens=5,
                                               messages=[{"role": "user", "content": f"under traffic {i}"}])
                answered.append(True)
            except openai.APIStatusError:
                answered.append(False)
        assert sum(answered) >= 22, answered  # at most the requests in flight on the killed engine
        wait_until(lambda: http_ok(f"{run.info['engines'][0]}/health"), 30, "the killed engine, started again")
        all_serve(run)
        for url in run.info["engines"]:
            request(f"{url}/admin/faults", "POST", {"fault": "status=500", "count": 200})
        for i in range(60):
            with suppress(openai.APIStatusError):
                client.chat.completions.create(model="chat-default", max_tokens=3,
                                               messages=[{"role": "user", "content": f"faulted {i}"}])
        for url in run.info["engines"]:
            request(f"{url}/admin/faults", "DELETE")
        drift = season.cli("evidence", "reevaluate", "--config", str(season.policy),
                           "--store-url", run.info["store_url"])
        assert "pool-llama-8b: provider_drift" in drift.stdout, drift.stdout + drift.stderr
        wait_until(lambda: serves(run)["chat-default"] != "ok", 10, "the drift void reaching the workers")
        assert "provider_drift" in serves(run)["chat-default"]
        said = season.check()
        assert re.search(r"candidate pool-llama-8b: NOT ELIGIBLE: .*provider drift", said), said
        assert "to qualify it: `llmgw demo-evidence" in said, said

    # 2. A restart re-earns what the drift took away, says so in one line, and serves every route; the
    # ledger's failures from before that record fire no second void.
    with season.up() as stable:
        run = stable
        all_serve(run)
        quiet = season.cli("evidence", "reevaluate", "--config", str(season.policy),
                           "--store-url", run.info["store_url"])
        assert "no trigger fired" in quiet.stdout, quiet.stdout + quiet.stderr
    assert "llmgw: earning evidence for pool-llama-8b (voided: provider drift)" in run.out, run.out

    # 3. Engines that serve another window (someone else's, `--engine none`): the engine check voids the
    # pool before the first request; `llmgw up` names each route it leaves and the fix.
    engines = (("engine-pool", "meta-llama/Llama-3.1-8B-Instruct", "4096", ()),  # the deployment says 131072
               ("embed-pool", "Qwen/Qwen3-Embedding-0.6B", "32768", ("--runner", "pooling")))  # as declared
    fakes = [Child(f"fake-{port}", python_module(
        "enginesim", "--host", "127.0.0.1", "--port", port, "--served-model-name", served, "--max-model-len", window,
        "--time-scale", "0.05", *runner), tmp_path / f"fake-{port}.log").start()
        for pool, served, window, runner in engines for port in (e.rsplit(":", 1)[1] for e in season.pools[pool])]
    try:
        for fake in fakes:
            wait_until(lambda f=fake: http_ok(f"http://127.0.0.1:{f.name.split('-')[1]}/health"), 60, fake.name, fake)
        with season.up("--engine", "none") as run:
            served = serves(run)
            assert served["chat-default"].startswith("503") and "engine_mismatch" in served["chat-default"], served
            # The others serve: the providers', and the embeddings pool, whose engine serves what it declares.
            assert {served[r] for r in ("chat-anthropic", "chat-gemini", "chat-bedrock", "embed-default")} == {"ok"}, \
                served
        assert re.search(r"not serving: route chat-default candidate pool-llama-8b: .*engine mismatch.*"
                         r"to qualify it: make its engines serve", run.out), run.out
    finally:
        for fake in fakes:
            fake.stop()

    # 4. Back to the simulated engines: the engine check lifts the void at start (earning again would
    # prove nothing of the fingerprint, and is not done).
    # A revision with a canary (an operator's edit, started with it: Envoy's plans for a canary are
    # rendered at start), the canary taking acme's requests, then rolled back to the revision before it
    # (step 2's, in the audited history) while serving; a key rotated while serving.
    stable_revision = stable.info["revision"]
    route_file = season.policy / "routes/chat-fallback.yaml"
    before = yaml.safe_load(route_file.read_text())
    route_file.write_text(yaml.safe_dump({**before, "canary": {"deployment": "demo-anthropic", "share": 1.0,
                                                               "tenants": ["acme"]}}))
    with season.up() as run:
        all_serve(run)
        old_key = run.info["tenants"]["acme"]["api_key"]
        client = run.client()

        def deployment() -> str:
            raw = client.chat.completions.with_raw_response.create(
                model="chat-fallback", max_tokens=3, messages=[{"role": "user", "content": "which one"}])
            return str(raw.headers["x-llmgw-deployment"])
        assert deployment() == "demo-anthropic"
        rolled = season.cli("rollback", stable_revision, "--config", str(season.policy),
                            "--state-dir", str(season.state))
        assert rolled.returncode == 0, rolled.stdout + rolled.stderr
        assert "canary" not in yaml.safe_load(route_file.read_text())
        wait_until(lambda: deployment() == "pool-llama-8b", 10, "the stable candidate after the rollback")
        made = season.cli("keys", "create", "--tenant", "acme", "--id", "acme-rotated", "--config", str(season.policy))
        new_key = made.stdout.strip()
        assert made.returncode == 0 and new_key, made.stderr
        assert season.cli("keys", "revoke", "acme-demo", "--config", str(season.policy)).returncode == 0
        wait_until(lambda: serves(run, new_key)["chat-default"] == "ok"
                   and serves(run, old_key)["chat-default"].startswith("401"), 15, "the rotated key")
        all_serve(run, new_key)
    assert "earning evidence" not in run.out and "void removed: pool-llama-8b-engine_mismatch.yaml" in run.out, run.out

    # 5. The provider's quota changes: its evidence is void, `llmgw check` says why and how; the next
    # start earns it again against the new terms and serves.
    dep = season.policy / "deployments/demo-anthropic.yaml"
    text = dep.read_text()
    dep.write_text(text.replace("requests_per_minute: 4000", "requests_per_minute: 3000"))
    said = season.check()
    assert re.search(r"candidate demo-anthropic: NOT ELIGIBLE: .*provider quota change", said), said
    with season.up() as run:
        all_serve(run, new_key)
    assert "earning evidence for demo-anthropic (voided: provider quota change)" in run.out, run.out

    # 6. The clock (Python's, libfaketime) past every record's expiry: each is earned again, all serve.
    ahead = date.today() + timedelta(days=120)
    with season.up(env={"LD_PRELOAD": str(lib), "FAKETIME": f"@{ahead.isoformat()} 12:00:00"}, within_s=400) as run:
        all_serve(run, new_key)
    assert "earning evidence for demo-anthropic" in run.out and "pool-llama-8b" in run.out, run.out

    # The policy directory holds what its operator wrote: no record, no void from any run.
    assert season.evidence_files() == season.own_evidence
