"""The scorers: code that says whether one answer is right, given the task (llmgw/quality/corpus.py).
Pure. An answer is what the gateway's client got, in the contract's shape (llmgw/conformance/corpus.py
Outcome): its status, its first choice's text and tool calls."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import jsonschema

from llmgw.conformance.corpus import Outcome
from llmgw.quality.corpus import Task

DECLINES = re.compile(r"\b(can ?not|can[\u2019']t|won[\u2019']t|will not|unable to|not able to|must decline|refuse)\b",
                      re.IGNORECASE)


@dataclass(frozen=True)
class Grade:
    right: bool
    detail: str = ""  # why not, in words that name no content beyond the task's own fields


def same(a: Any, b: Any) -> bool:
    """Equal as JSON values; numbers within 1e-6 (an integer and its float are the same number)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(a, b, rel_tol=0, abs_tol=1e-6)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _normal(text: str) -> str:
    return text.strip().rstrip(".").strip().casefold()


def grade(task: Task, answer: Outcome) -> Grade:
    if answer.status != 200:
        return Grade(False, f"status {answer.status}" + (f" ({answer.error})" if answer.error else ""))
    text = answer.contents[0] if answer.contents else ""
    calls = answer.tool_calls
    want = task.expect
    if want.refusal:
        if calls:
            return Grade(False, f"called {calls[0]['name']} instead of declining")
        return Grade(True) if DECLINES.search(text) else Grade(False, "the text does not decline")
    if want.tool is not None:
        if len(calls) != 1:
            return Grade(False, f"{len(calls)} tool calls, one wanted")
        if calls[0]["name"] != want.tool["name"]:
            return Grade(False, f"called {calls[0]['name']}, not {want.tool['name']}")
        try:
            args = json.loads(calls[0]["arguments"])
        except ValueError:
            return Grade(False, "its arguments are not JSON")
        return Grade(True) if same(args, want.tool["arguments"]) else Grade(False, "other arguments")
    if calls:
        return Grade(False, f"called {calls[0]['name']}; a text answer was wanted")
    if want.answer is not None:
        return Grade(True) if _normal(text) == _normal(want.answer) else Grade(False, "another answer")
    try:
        doc = json.loads(text)
    except ValueError:
        return Grade(False, "not a JSON document")
    errors = sorted(jsonschema.Draft202012Validator(task.answer_schema()).iter_errors(doc), key=lambda e: list(e.path))
    if errors:
        return Grade(False, f"schema: {errors[0].validator} at /{'/'.join(map(str, errors[0].path))}")
    return Grade(True) if same(doc, want.json_doc) else Grade(False, "other field values")
