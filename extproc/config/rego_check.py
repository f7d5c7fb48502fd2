"""Checks on Rego source that the engine makes only when a call is reached, so a policy that cannot be
evaluated as written is refused when it loads instead of failing (or answering wrongly) at a request.

A call of a built-in the engine does not implement, or of a function nobody defined, is an error only
when evaluation reaches it (regorus), or evaluates as *undefined* (regopy 1.5, the engine before): a
deny rule using one would then never fire, and `allow if not deny` would be true. Every call in the
policy must therefore name a built-in the engine implements or a function the policy defines; anything
else is a config error naming file, line and column.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

KEYWORDS = frozenset({"not", "some", "every", "in", "if", "else", "with", "as", "contains", "default", "import",
                      "package", "true", "false", "null"})
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclass(frozen=True)
class RegoIssue:
    file: str
    line: int
    column: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}: {self.message}"


def _code(text: str) -> str:
    """The text with comments and the insides of strings blanked (same length: offsets stay)."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "#":
            end = text.find("\n", i)
            end = n if end == -1 else end
        elif c == '"':
            end = i + 1
            while end < n and text[end] not in '"\n':
                end += 2 if text[end] == "\\" else 1
            i += 1
        elif c == "`":
            end = text.find("`", i + 1)
            end = n if end == -1 else end
            i += 1
        else:
            i += 1
            continue
        for k in range(i, min(end, n)):
            if text[k] != "\n":
                out[k] = " "
        i = end + 1
    return "".join(out)


def position(text: str, offset: int) -> tuple[int, int]:
    line = text.count("\n", 0, offset) + 1
    return line, offset - (text.rfind("\n", 0, offset) + 1) + 1


def calls(text: str) -> Iterator[tuple[str, int, bool]]:
    """(dotted name, offset, whether it is a head: the name starts its line, after an optional
    `default`) of every `name(` outside comments and strings."""
    code = _code(text)
    for m in _NAME.finditer(code):
        end, start = m.end(), m.start()
        if end >= len(code) or code[end] != "(" or m.group() in KEYWORDS:
            continue
        if start > 0 and (code[start - 1] in ".]" or code[start - 1].isalnum() or code[start - 1] == "_"):
            continue  # part of a longer reference
        prefix = code[code.rfind("\n", 0, start) + 1:start].strip()
        yield m.group(), start, prefix in ("", "default")


def defined_functions(modules: Mapping[str, str]) -> set[str]:
    """Names of the functions the modules define (`f(x) := ...`, `f(x) if ...` starting a line)."""
    return {name.rsplit(".", 1)[-1] for text in modules.values() for name, _, head in calls(text) if head}


def unknown_calls(modules: Mapping[str, str], is_builtin: Callable[[str], bool]) -> list[RegoIssue]:
    """Every call of something that is neither a built-in the engine implements nor a function
    defined in these modules (called by its name, an import alias or its `data.` path)."""
    functions = defined_functions(modules)
    issues = []
    for file, text in sorted(modules.items()):
        for name, offset, head in calls(text):
            if head or is_builtin(name) or name.rsplit(".", 1)[-1] in functions:
                continue
            line, col = position(text, offset)
            issues.append(RegoIssue(file, line, col, f"`{name}` is neither a built-in this engine implements nor a "
                                    "function the policy defines: refused when the policy loads, not at the first "
                                    "request that reaches it"))
    return issues
