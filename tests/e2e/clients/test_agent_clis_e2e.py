"""The agentic CLIs people run, against the gateway as their users point them at it: Claude Code
(`ANTHROPIC_BASE_URL`), Gemini CLI (`GOOGLE_GEMINI_BASE_URL`) and Codex (a `[model_providers]` entry
with `wire_api = "responses"`), installed from npm at the versions tests/clients/package.json pins,
run headless with nonessential traffic off, over every demo route (the vLLM-shaped pool, the
Anthropic-, Gemini- and Bedrock-shaped providers, the fallback plan):

- plain: one turn, the CLI's text output;
- stream: the same as the CLI's own event stream (each CLI streams every request it sends; these
  cases read its streamed events as they came);
- tool loop: a turn that names one of the CLI's own tools; the model calls it, the CLI runs it, the
  result goes back and the model answers.

Each CLI sends its whole tool set on every request (Claude Code two dozen tools): they are admitted by
the demo policy's tool packs and tenant grants (policy/README.md, "Tools and their effects"). Every
request the run sent is in the ledger, answered 200 on the route asked for.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, ROOT, ledger_head, ledger_since, settled_since, start_stack

pytestmark = pytest.mark.e2e
BIN = ROOT / "tests/clients/node_modules/.bin"
ROUTES = ("chat-default", "chat-anthropic", "chat-gemini", "chat-bedrock", "chat-fallback")
CLIS = ("claude-code", "gemini-cli", "codex")
KINDS = ("plain", "stream", "tool_loop")
TOOL = {"claude-code": "Read", "gemini-cli": "read_file", "codex": "exec_command"}  # the tool a loop names
ASK = {"plain": "Say hello in one line.", "stream": "Say hello in one line.",
       "tool_loop": {"claude-code": "Use the Read tool to read notes.txt, then say what it holds.",
                     "gemini-cli": "Use read_file to read notes.txt, then say what it holds.",
                     "codex": "Use exec_command to run cat notes.txt, then say what it printed."}}


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if not (BIN / "claude").exists():
        pytest.fail("the agent CLIs are not installed: `make test` installs them (tests/clients/)")
    s = start_stack(tmp_path_factory.mktemp("agent-clis"), simulate_providers=True)
    yield s
    s.stop()


def home_for(cli: str, root: Path, url: str) -> Path:
    """A user's home as the CLI's docs set it up for a gateway: Gemini CLI's API-key auth without usage
    statistics, Codex's provider entry for the gateway (its web search left at its default)."""
    home = root / f"home-{cli}"
    if home.exists():
        return home
    home.mkdir(parents=True)
    if cli == "gemini-cli":
        (home / ".gemini").mkdir()
        (home / ".gemini/settings.json").write_text(json.dumps({
            "security": {"auth": {"selectedType": "gemini-api-key"}},
            "privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False}}))
    if cli == "codex":
        (home / ".codex").mkdir()
        (home / ".codex/config.toml").write_text(
            'model_provider = "llmgw"\n\n[model_providers.llmgw]\nname = "llmgw"\n'
            f'base_url = "{url}/v1"\nenv_key = "LLMGW_API_KEY"\nwire_api = "responses"\n')
    return home


def command(cli: str, route: str, kind: str) -> list[str]:
    ask = ASK[kind] if isinstance(ASK[kind], str) else ASK[kind][cli]  # type: ignore[index]
    streamed = kind != "plain"
    if cli == "claude-code":
        return [str(BIN / "claude"), "-p", "--model", route,
                *(["--output-format", "stream-json", "--verbose"] if streamed else []), ask]
    if cli == "gemini-cli":
        return [str(BIN / "gemini"), "-m", route, "-p", ask, *(["--output-format", "stream-json"] if streamed else [])]
    return [str(BIN / "codex"), "exec", "--skip-git-repo-check", "-m", route, *(["--json"] if streamed else []), ask]


def environment(cli: str, home: Path, url: str, key: str) -> dict[str, str]:
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8", "NO_COLOR": "1"}
    if cli == "claude-code":
        env |= {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": key, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    elif cli == "gemini-cli":
        env |= {"GOOGLE_GEMINI_BASE_URL": url, "GEMINI_API_KEY": key, "GEMINI_CLI_TRUST_WORKSPACE": "true"}
    else:
        env |= {"LLMGW_API_KEY": key}
    return env


def run(stack: Stack, cli: str, route: str, kind: str, work: Path) -> tuple[str, list[dict[str, Any]]]:
    """The CLI's output, and the ledger entries of the requests it sent (settled once it exits)."""
    start = ledger_head(stack)
    home = home_for(cli, work.parent, stack.url)
    proc = subprocess.run(command(cli, route, kind), cwd=work, env=environment(cli, home, stack.url, DEMO_KEYS["acme"]),
                          capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    return proc.stdout, settled_since(stack, start)


def events(stdout: str) -> list[dict[str, Any]]:
    out = []
    for line in stdout.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            out.append(doc)
    return out


def tool_loop_of(cli: str, evs: list[dict[str, Any]]) -> tuple[list[str], int]:
    """(the tools the model called, how many results went back) in the CLI's own event stream."""
    if cli == "claude-code":
        calls = [b["name"] for e in evs if e.get("type") == "assistant" for b in e["message"]["content"]
                 if b.get("type") == "tool_use"]
        results = [b for e in evs if e.get("type") == "user" for b in e["message"]["content"]
                   if isinstance(b, dict) and b.get("type") == "tool_result"]
        return calls, len(results)
    if cli == "gemini-cli":
        return ([e["tool_name"] for e in evs if e.get("type") == "tool_use"],
                len([e for e in evs if e.get("type") == "tool_result"]))
    done = [e["item"] for e in evs if e.get("type") == "item.completed"]
    calls = [i for i in done if i.get("type") == "command_execution"]
    return ["exec_command"] * len(calls), len([i for i in calls if i.get("status") in ("completed", "failed")])


def final_text(cli: str, kind: str, stdout: str) -> str:
    if kind == "plain":
        return stdout.strip()
    evs = events(stdout)
    if cli == "claude-code":
        (result,) = [e for e in evs if e.get("type") == "result"]
        assert result["subtype"] == "success" and not result["is_error"], result
        return str(result["result"])
    if cli == "gemini-cli":
        (result,) = [e for e in evs if e.get("type") == "result"]
        assert result["status"] == "success", result
        return "".join(e["content"] for e in evs if e.get("type") == "message" and e.get("role") == "assistant")
    assert any(e.get("type") == "turn.completed" for e in evs), evs
    return "".join(e["item"]["text"] for e in evs if e.get("type") == "item.completed"
                   and e["item"].get("type") == "agent_message")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("cli", CLIS)
def test_an_agent_cli_at_its_defaults(up: Stack, cli: str, route: str, kind: str,
                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    work = tmp_path_factory.mktemp(f"{cli}-{route}-{kind}") / "work"
    work.mkdir()
    (work / "notes.txt").write_text("the gateway keeps a ledger\n")
    stdout, entries = run(up, cli, route, kind, work)
    text = final_text(cli, kind, stdout)
    assert text and "API Error" not in text and "error" not in text.lower()[:40], text[:300]
    # Every request the CLI sent was served on the route it named, and is in the ledger.
    assert entries, "the run sent no request through the gateway"
    assert {(e["route"], e["status"], e["termination"]) for e in entries} == {(route, 200, "complete")}, [
        (e.get("route"), e.get("status"), e.get("error"), e.get("field"), e.get("decision", {}).get("reasons"))
        for e in entries]
    if kind == "tool_loop":
        calls, results = tool_loop_of(cli, events(stdout))
        assert TOOL[cli] in calls and results >= 1, (calls, results, stdout[-1500:])
        assert len(entries) >= 2  # the call, then its result sent back
        assert all(e["effects"] for e in entries)  # the CLI's tools were offered, with their effects
        if cli == "codex":
            # its built-in web search, dropped and reported on every request
            assert all(any(x.startswith("tools.") for x in e["attempts"][-1].get("translation_loss", []))
                       for e in entries), [e["attempts"][-1] for e in entries]


def test_claude_code_on_confidential_data_gets_only_its_reading_tools(up: Stack,
                                                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    """The demo policy keeps confidential data from tools that run commands, reach the network or start
    agents (authz.rego, rule "effects by data class"): Claude Code at its defaults, sending that data
    class (`ANTHROPIC_CUSTOM_HEADERS`), is refused with the tools and the rule named in the ledger; the
    same run with its reading tools only (`--tools`) is served and its tool loop runs."""
    work = tmp_path_factory.mktemp("claude-confidential") / "work"
    work.mkdir()
    (work / "notes.txt").write_text("the gateway keeps a ledger\n")
    home = home_for("claude-code", work.parent, up.url)
    env = {**environment("claude-code", home, up.url, DEMO_KEYS["acme"]),
           "ANTHROPIC_CUSTOM_HEADERS": "x-llmgw-data-class: confidential"}
    ask = [str(BIN / "claude"), "-p", "--model", "chat-anthropic", "--output-format", "stream-json", "--verbose"]
    start = ledger_head(up)
    refused = subprocess.run([*ask, ASK["tool_loop"]["claude-code"]], cwd=work, env=env,  # type: ignore[index]
                             capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert refused.returncode != 0 and "403" in refused.stdout, refused.stdout[-1000:]
    (entry,) = ledger_since(up, start)[:1]
    reasons = " ".join(entry["decision"]["reasons"])
    for tool, effect in (("Bash", "execute"), ("WebFetch", "network"), ("Agent", "delegate")):
        assert f"tool {tool} has the {effect} effect, which confidential data may not reach" in reasons, reasons
    assert "(rule: effects by data class)" in reasons and "tool Read " not in reasons
    start = ledger_head(up)
    # (`--tools` takes every word after it: it goes before the other options)
    served = subprocess.run([ask[0], "--tools", "Read,Glob,Grep", *ask[1:], ASK["tool_loop"]["claude-code"]],  # type: ignore[index]
                            cwd=work, env=env, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert served.returncode == 0, served.stdout[-1500:]
    calls, results = tool_loop_of("claude-code", events(served.stdout))
    assert "Read" in calls and results >= 1
    entries = ledger_since(up, start)
    assert len(entries) >= 2 and all(e["status"] == 200 and e["data_class"] == "confidential" for e in entries)
    assert all(set(e["effects"]) <= {"read", "edit"} for e in entries), [e["effects"] for e in entries]
