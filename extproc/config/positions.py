"""Where a field sits in a YAML file: line and column (1-based) for `path:line:col: message` errors.

A policy file is parsed once into its node tree and its data (one pass of the YAML parser); the tree is
kept only while the directory is checked, so that every problem, the schema's and the cross-checks'
alike, can point an editor at the line it names.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode


def read(text: str) -> tuple[Any, Node | None]:
    """The document's data and its node tree (None for an empty document). Raises yaml.YAMLError."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        return (loader.construct_document(node) if node is not None else None), node
    finally:
        loader.dispose()


def syntax_error(e: yaml.YAMLError) -> tuple[str, int, int]:
    """A parser error as its message and the line and column it points at (0, 0 when it names none)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None)
    context = getattr(e, "context", None)
    message = ": ".join(p for p in (context, problem) if p) or str(e).splitlines()[0]
    return message, (mark.line + 1 if mark else 0), (mark.column + 1 if mark else 0)


def locate(root: Node | None, field: str) -> tuple[int, int]:
    """The line and column of a dotted field path (`candidates.0.deployment_ref`): its key where the
    path names a key, its item where it names a list item; the deepest part of the path that exists
    when the rest does not (a missing field points at the mapping that lacks it); (0, 0) with no tree."""
    if root is None:
        return 0, 0
    node, at = root, root
    for part in field.split(".") if field else ():
        nxt: tuple[Node, Node] | None = None
        if isinstance(node, MappingNode):
            nxt = next(((k, v) for k, v in node.value if str(k.value) == part), None)
        elif isinstance(node, SequenceNode) and part.isdigit() and int(part) < len(node.value):
            item = node.value[int(part)]
            nxt = (item, item)
        if nxt is None:
            break
        at, node = nxt
    return at.start_mark.line + 1, at.start_mark.column + 1
