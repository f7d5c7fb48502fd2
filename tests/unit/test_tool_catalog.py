"""The tool catalog (extproc/tool_catalog.py): which entry a tool name resolves to for which client,
what an unlisted tool gets, how a client is recognised, and the shipped packs as the loader reads
them - every tool the three agents were seen to offer is listed, each with effects of the documented
classes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from extproc.config.loader import ConfigError, load_snapshot
from extproc.tool_catalog import Entry, Pack, ToolCatalog, ToolFacts, UnlistedRule

POLICY = Path(__file__).resolve().parents[2] / "policy"
CLASSES = {"read", "edit", "execute", "network", "delegate"}  # the packs' effect classes (policy/README.md)
REFUSE = UnlistedRule("refuse", (), "tenant acme")
ADMIT = UnlistedRule("admit", ("execute", "network"), "route chat-x")

CATALOG = ToolCatalog(
    own=(Entry("search_docs", (), (), "gateway.yaml"),
         Entry("mcp__*", ("network",), (), "gateway.yaml"),
         Entry("mcp__docs__*", ("read",), (), "gateway.yaml"),
         Entry("run_sql", ("write",), ("codex",), "gateway.yaml")),
    packs=(Pack("claude-code", ("claude-cli/*",), (Entry("Read", ("read",), ("claude-code",), "pack claude-code"),
                                                   Entry("Bash", ("execute",), ("claude-code",), "pack claude-code"),
                                                   Entry("search_docs", ("execute",), ("claude-code",),
                                                         "pack claude-code"))),
           Pack("codex", ("codex_*",), (Entry("multi_agent_v1__*", ("delegate",), ("codex",), "pack codex"),))))


@pytest.mark.parametrize(("name", "client", "rule", "facts"), [
    # the operator's exact name
    ("search_docs", None, REFUSE, ToolFacts("search_docs", True, (), "gateway.yaml")),
    # the operator's entry wins over a pack's entry of the same name
    ("search_docs", "claude-code", REFUSE, ToolFacts("search_docs", True, (), "gateway.yaml")),
    # the longest matching pattern
    ("mcp__docs__lookup", None, REFUSE, ToolFacts("mcp__docs__lookup", True, ("read",), "gateway.yaml")),
    ("mcp__github__push", None, REFUSE, ToolFacts("mcp__github__push", True, ("network",), "gateway.yaml")),
    # a pack's entries only for its client's requests
    ("Bash", "claude-code", REFUSE, ToolFacts("Bash", True, ("execute",), "pack claude-code")),
    ("Bash", None, REFUSE, ToolFacts("Bash", False, (), None)),
    ("Bash", "codex", REFUSE, ToolFacts("Bash", False, (), None)),
    ("multi_agent_v1__spawn_agent", "codex", REFUSE,
     ToolFacts("multi_agent_v1__spawn_agent", True, ("delegate",), "pack codex")),
    # an operator's entry narrowed to clients
    ("run_sql", "codex", REFUSE, ToolFacts("run_sql", True, ("write",), "gateway.yaml")),
    ("run_sql", "claude-code", REFUSE, ToolFacts("run_sql", False, (), None)),
    # unlisted: the rule's default effects when it admits, none when it refuses
    ("Bash", None, ADMIT, ToolFacts("Bash", False, ("execute", "network"), None)),
    ("read", "claude-code", ADMIT, ToolFacts("read", False, ("execute", "network"), None)),  # names are exact
])
def test_a_name_resolves_to_its_first_matching_entry(name: str, client: str | None, rule: UnlistedRule,
                                                      facts: ToolFacts) -> None:
    assert CATALOG.facts(name, client, rule) == facts
    assert CATALOG.facts(name, client, rule) == facts  # remembered: the same answer


@pytest.mark.parametrize(("user_agent", "client"), [
    ("claude-cli/2.1.197 (external, sdk-cli)", "claude-code"),
    ("codex_exec/0.171.0 (Debian 12.0.0; x86_64) xterm (codex_exec; 0.171.0)", "codex"),
    ("codex_cli_rs/0.171.0", "codex"),
    ("OpenAI/Python 2.8.0", None),
    ("", None),
    (None, None),
])
def test_a_client_is_recognised_by_its_user_agent(user_agent: str | None, client: str | None) -> None:
    assert CATALOG.client_of(user_agent) == client


# What each agent was seen to offer on its first request (the User-Agent it sent, its tools).
SEEN = {
    "claude-code": ("claude-cli/2.1.197 (external, sdk-cli)",
                    "Agent Bash CronCreate CronDelete CronList Edit EnterWorktree ExitWorktree NotebookEdit Read "
                    "ReportFindings ScheduleWakeup SendMessage Skill TaskCreate TaskGet TaskList TaskOutput TaskStop "
                    "TaskUpdate WebFetch WebSearch Workflow Write"),
    "codex": ("codex_exec/0.171.0 (Debian 12.0.0; x86_64) xterm (codex_exec; 0.171.0)",
              "exec_command write_stdin request_user_input view_image multi_agent_v1__close_agent "
              "multi_agent_v1__spawn_agent get_goal create_goal update_goal"),
    "gemini-cli": ("GeminiCLI-tui/0.61.0/gemini-3.1-pro-preview (linux; x64; terminal)",
                   "update_topic list_directory read_file grep_search glob google_web_search enter_plan_mode "
                   "invoke_agent run_shell_command write_file replace web_fetch"),
}


def test_the_shipped_packs_list_every_tool_the_agents_offer() -> None:
    snap = load_snapshot(POLICY)
    for client, (user_agent, names) in SEEN.items():
        assert snap.tools.client_of(user_agent) == client
        for name in names.split():
            facts = snap.tools.facts(name, client, REFUSE)
            assert facts.known and facts.listed_by == f"pack {client}", (client, name)
            assert set(facts.effects) <= CLASSES, (client, name, facts.effects)
    # the classes are told apart: reading is not running
    assert snap.tools.facts("Read", "claude-code", REFUSE).effects == ("read",)
    assert snap.tools.facts("Bash", "claude-code", REFUSE).effects == ("execute",)
    assert snap.tools.facts("run_shell_command", "gemini-cli", REFUSE).effects == ("execute",)


def _policy_with(tmp_path: Path, **changes: object) -> Path:
    dst = tmp_path / "policy"
    shutil.copytree(POLICY, dst, ignore=shutil.ignore_patterns("keys.yaml"))
    gw = yaml.safe_load((dst / "gateway.yaml").read_text())
    gw.update(changes)
    (dst / "gateway.yaml").write_text(yaml.safe_dump(gw))
    return dst


def test_a_pack_file_of_the_operators_own_and_its_errors(tmp_path: Path) -> None:
    dst = _policy_with(tmp_path, tool_packs=["claude-code", "packs/aider.yaml"],
                       tools={"search_docs": {"effects": []},
                              "run_aider": {"effects": ["execute"], "clients": ["aider"]}})
    (dst / "packs").mkdir()
    (dst / "packs" / "aider.yaml").write_text(yaml.safe_dump({
        "client": "aider", "checked_against": "0.90", "user_agents": ["aider/*"],
        "tools": {"edit_file": {"effects": ["edit"]}}}))
    snap = load_snapshot(dst)
    assert snap.tools.client_of("aider/0.90.1") == "aider"
    assert snap.tools.facts("edit_file", "aider", REFUSE).effects == ("edit",)
    assert snap.tools.facts("run_aider", "aider", REFUSE).listed_by == "gateway.yaml"
    assert snap.tools.facts("run_aider", None, REFUSE).known is False
    # The pack's content is part of the revision: changing it is a new revision.
    before = snap.revision
    (dst / "packs" / "aider.yaml").write_text(yaml.safe_dump({
        "client": "aider", "checked_against": "0.90", "user_agents": ["aider/*"],
        "tools": {"edit_file": {"effects": ["execute"]}}}))
    assert load_snapshot(dst).revision != before

    bad = _policy_with(tmp_path / "b", tool_packs=["no-such-agent", "claude-code", "claude-code"],
                       tools={"x": {"effects": [], "clients": ["nobody"]}})
    with pytest.raises(ConfigError) as e:
        load_snapshot(bad)
    text = str(e.value)
    assert "no tool pack 'no-such-agent'" in text and "claude-code, codex, gemini-cli" in text
    assert "two packs for client 'claude-code'" in text
    assert "no tool pack names client 'nobody'" in text


def test_an_unlisted_rule_takes_default_effects_only_when_it_admits(tmp_path: Path) -> None:
    gw = yaml.safe_load((POLICY / "gateway.yaml").read_text())
    gw["tenants"]["globex"]["unlisted_tools"] = {"rule": "refuse", "effects": ["execute"]}
    dst = _policy_with(tmp_path, tenants=gw["tenants"])
    with pytest.raises(ConfigError, match="only an `admit` rule takes default effects"):
        load_snapshot(dst)
