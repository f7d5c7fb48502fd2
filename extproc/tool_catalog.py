"""The tool catalog: what each tool a request offers can do (its effects), as policy reasons over it.

A request offers tools by name; the gateway cannot see what a tool does, only what its catalog
entry declares. Entries come from two places, the operator's first:

- gateway.yaml `tools`: a name, or a pattern (`mcp__docs__*`, fnmatch's `*`, `?` and `[...]`),
  optionally only for some clients (`clients: [codex]`);
- tool packs (gateway.yaml `tool_packs`): a client's own tools with their effects written down,
  shipped for Claude Code, Codex and Gemini CLI (extproc/tool_packs/) or the operator's own file.
  A pack's entries apply only to requests from its client, recognised by the User-Agent header.

A name resolves to the first entry that matches, in this order: the operator's exact names, the
operator's patterns (longest first), the client's pack's exact names, its patterns (longest first).
An entry restricted to clients matches only their requests. A name no entry matches is unlisted:
the tenant's (or the route's) `unlisted_tools` rule refuses it, or admits it with declared default
effects (extproc/config/schema.py UnlistedTools).

The client and the tool names are what the caller says: the catalog governs what an honest agent is
allowed to be offered, and the answer checks hold the model to the offered tools; it is not an
authentication of the client (docs/decisions/0001-tool-effects-for-agents.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

PATTERN_CHARS = frozenset("*?[")
MEMO_LIMIT = 4096  # (name, client) pairs remembered: agents repeat the same few dozen names


def is_pattern(name: str) -> bool:
    return not PATTERN_CHARS.isdisjoint(name)


@dataclass(frozen=True, slots=True)
class Entry:
    pattern: str  # a name, or an fnmatch pattern
    effects: tuple[str, ...]
    clients: tuple[str, ...]  # () any client
    listed_by: str  # where it is written: "gateway.yaml" or "pack claude-code"


@dataclass(frozen=True, slots=True)
class Pack:
    client: str
    user_agents: tuple[str, ...]  # fnmatch patterns over the User-Agent header
    entries: tuple[Entry, ...]


@dataclass(frozen=True, slots=True)
class ToolFacts:
    """One offered tool as policy sees it: `known` when an entry lists it (`listed_by` says where);
    an unlisted tool has the unlisted rule's default effects, or none."""
    name: str
    known: bool
    effects: tuple[str, ...]
    listed_by: str | None

    def as_input(self) -> dict[str, object]:
        return {"name": self.name, "known": self.known, "effects": list(self.effects), "listed_by": self.listed_by}


@dataclass(frozen=True, slots=True)
class UnlistedRule:
    """What happens to an offered tool no entry lists: refused, or admitted with `effects`;
    `set_by` names where the rule is written (a 403 says so)."""
    rule: str  # "refuse" or "admit"
    effects: tuple[str, ...]
    set_by: str

    def as_input(self) -> dict[str, object]:
        return {"rule": self.rule, "effects": list(self.effects), "set_by": self.set_by}


def _ranked(entries: Iterable[Entry]) -> tuple[tuple[Entry, ...], tuple[Entry, ...]]:
    """Exact names, then patterns, the longest (most specific) pattern first."""
    items = list(entries)
    exact = tuple(e for e in items if not is_pattern(e.pattern))
    patterns = tuple(sorted((e for e in items if is_pattern(e.pattern)), key=lambda e: -len(e.pattern)))
    return exact, patterns


@dataclass(frozen=True)
class ToolCatalog:
    own: tuple[Entry, ...] = ()
    packs: tuple[Pack, ...] = ()
    _memo: dict[tuple[str, str | None], Entry | None] = field(default_factory=dict, compare=False, repr=False)

    def client_of(self, user_agent: str | None) -> str | None:
        """The pack client whose User-Agent pattern the request's matches (the first pack listed)."""
        if not user_agent:
            return None
        for pack in self.packs:
            if any(fnmatchcase(user_agent, p) for p in pack.user_agents):
                return pack.client
        return None

    def entry(self, name: str, client: str | None) -> Entry | None:
        key = (name, client)
        if key in self._memo:
            return self._memo[key]
        found = self._find(name, client)
        if len(self._memo) < MEMO_LIMIT:
            self._memo[key] = found
        return found

    def _find(self, name: str, client: str | None) -> Entry | None:
        pack = next((p.entries for p in self.packs if p.client == client), ())
        for group in (*_ranked(self.own), *_ranked(pack)):
            for e in group:
                if (not e.clients or client in e.clients) and (
                        e.pattern == name if not is_pattern(e.pattern) else fnmatchcase(name, e.pattern)):
                    return e
        return None

    def facts(self, name: str, client: str | None, unlisted: UnlistedRule) -> ToolFacts:
        e = self.entry(name, client)
        if e is not None:
            return ToolFacts(name, True, e.effects, e.listed_by)
        return ToolFacts(name, False, unlisted.effects if unlisted.rule == "admit" else (), None)

    def listed(self) -> Mapping[str, dict[str, object]]:
        """Every entry, for policy data and `llmgw policy`: `pattern [client]` -> effects and source."""
        out: dict[str, dict[str, object]] = {}
        for e in (*self.own, *(x for p in self.packs for x in p.entries)):
            out[f"{e.pattern} [{','.join(e.clients) or '*'}]"] = {"effects": list(e.effects), "listed_by": e.listed_by}
        return out
