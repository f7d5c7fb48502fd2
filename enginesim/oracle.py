"""An operator's setting for answer quality: an oracle for the tasks of a quality corpus (a YAML file of
the gateway's, read as data), right on a configured share of them.

A model's quality is what a quality gate measures; the simulator has none of its own (its text is
seeded words). Given `--quality-oracle FILE --quality-accuracy P`, a request whose last user message
is a task's answers that task right when the task is among the share P the seed picks (the same tasks
on every request: a model that cannot do a task fails it every time), and otherwise as the simulator
always does - wrong, by construction: seeded words, random arguments, the first tool called.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import yaml

from enginesim.output import Output, ToolCall, _last_user_text, _tokens

DECLINE = "I can't do that: it goes against the instructions I was given."


class Oracle:
    def __init__(self, paths: list[Path], accuracy: float, seed: int):
        self.tasks: dict[str, dict[str, Any]] = {}
        for path in paths:
            for task in yaml.safe_load(path.read_text(encoding="utf-8")).get("tasks") or ():
                last = task["request"]["messages"][-1]
                self.tasks[str(last["content"]).strip()] = task
        self.accuracy = accuracy
        self.seed = seed

    def knows(self, task_id: str) -> bool:
        """Whether this oracle answers the task right: a fixed share of the tasks, chosen by the seed."""
        return zlib.crc32(f"{self.seed}:{task_id}".encode()) / 2**32 < self.accuracy

    def answer(self, body: dict[str, Any], rid: str) -> Output | None:
        """The right answer to the task this request is, when this oracle knows it; else None."""
        text = _last_user_text(body.get("messages") or [])
        task = self.tasks.get(text.strip()) if text is not None else None
        if task is None or not self.knows(task["id"]):
            return None
        want = task["expect"]
        if "tool" in want:
            args = json.dumps(want["tool"]["arguments"])
            out = Output(_tokens(args), natural_finish="tool_calls")
            out.tool_calls = [ToolCall(f"chatcmpl-tool-{rid[:12]}00", want["tool"]["name"], args)]
            out.owner = [0] * len(out.pieces)
            return out
        if "json" in want:
            return Output(_tokens(json.dumps(want["json"])))
        return Output(_tokens(str(want["answer"]) if "answer" in want else DECLINE))
