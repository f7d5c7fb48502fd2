"""A checked stream (extproc/answer_checks.py) event by event: the client never assembles a failing call.

A tool call's deltas are held until the call is complete - the next call of its choice begins, the
choice finishes, or the stream ends - then checked, then released in order. Anything after a held
event waits behind it, so the client sees the events in the order they came; text before the first
call flows as it comes. A JSON answer's text can only be judged whole: it flows, and its choice's
finishing event is held until the text is checked, so a failing answer never reaches its normal end.

Under `report` nothing is held: every event passes and the failures are only recorded.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from extproc.answer_checks import CallPolicy, CheckSpec, Failure, Verdict, check_call, check_content, checks_run, cut

_FINISHED = -1  # a choice's open call index once it finished: every call of it is complete


@dataclass
class _Call:
    name: str = ""
    arguments: list[str] = field(default_factory=list)
    complete: bool = False
    checked: bool = False


@dataclass
class _Choice:
    calls: dict[int, _Call] = field(default_factory=dict)
    open_call: int | None = None
    content: list[str] = field(default_factory=list)
    finish_reason: str = ""
    stop_reason: Any = None  # the stop sequence (or token) that ended it: the caller's, not the model's


class StreamChecker:
    def __init__(self, spec: CheckSpec, policy: CallPolicy | None):
        self.spec, self.policy = spec, policy
        self.hold = spec.mode == "enforce"
        self.failures: list[Failure] = []
        self._choices: dict[int, _Choice] = {}
        # held events, each with the calls (choice, call) it carries
        self._queue: deque[tuple[bytes, set[tuple[int, int]]]] = deque()

    def feed(self, event: bytes, obj: Any) -> tuple[bytes, Failure | None]:
        """One whole event (obj: its parsed data; None for `[DONE]`): what may pass now, and the first
        failure found (under `enforce` the guard then ends the stream; nothing of the failing call or
        answer was passed)."""
        touched: set[tuple[int, int]] = set()
        finishing: set[int] = set()
        if obj is None:  # the stream's end: every call is complete
            for choice in self._choices.values():
                self._complete_all(choice)
        elif isinstance(obj, dict):
            for c in obj.get("choices") or ():
                if isinstance(c, dict):
                    self._observe(c, touched, finishing)
        failure = self._check()
        if failure is None:
            failure = self._check_contents(finishing)
        if failure is not None and self.hold:
            return b"", failure
        if not self.hold or (not touched and not finishing and not self._queue):
            return event, failure
        self._queue.append((event, touched))
        return self._release(), failure

    def _observe(self, c: Mapping[str, Any], touched: set[tuple[int, int]], finishing: set[int]) -> None:
        i = c.get("index", 0)
        i = i if isinstance(i, int) else 0
        choice = self._choices.setdefault(i, _Choice())
        delta = c.get("delta") if isinstance(c.get("delta"), dict) else {}
        assert isinstance(delta, dict)
        if self.spec.format and isinstance(delta.get("content"), str):
            choice.content.append(delta["content"])
        for tc in delta.get("tool_calls") or ():
            if not isinstance(tc, dict):
                continue
            k = tc.get("index", 0)
            k = k if isinstance(k, int) else 0
            if choice.open_call is not None and choice.open_call != k:
                prev = choice.calls.get(choice.open_call)
                if prev is not None:
                    prev.complete = True
            choice.open_call = k
            call = choice.calls.setdefault(k, _Call())
            fn = tc.get("function") if isinstance(tc.get("function"), dict) else {}
            assert isinstance(fn, dict)
            if isinstance(fn.get("name"), str):
                call.name += fn["name"]
            if isinstance(fn.get("arguments"), str):
                call.arguments.append(fn["arguments"])
            touched.add((i, k))
        if c.get("finish_reason"):
            self._complete_all(choice)
            choice.finish_reason = str(c["finish_reason"])
            choice.stop_reason = c.get("stop_reason")  # the stop sequence that ended it, if the caller's did
            if self.spec.format and not choice.calls and choice.finish_reason != "tool_calls":
                finishing.add(i)

    @staticmethod
    def _complete_all(choice: _Choice) -> None:
        for call in choice.calls.values():
            call.complete = True
        choice.open_call = _FINISHED

    def _check(self) -> Failure | None:
        first: Failure | None = None
        for i, choice in self._choices.items():
            for k, call in choice.calls.items():
                if call.complete and not call.checked:
                    call.checked = True
                    failure = cut(check_call(self.spec, call.name, "".join(call.arguments),
                                             f"choices[{i}].message.tool_calls[{k}]", self.policy),
                                  choice.finish_reason, choice.stop_reason)
                    if failure is not None:
                        self.failures.append(failure)
                        first = first or failure
        return first

    def _check_contents(self, finishing: set[int]) -> Failure | None:
        first: Failure | None = None
        for i in sorted(finishing):
            failure = cut(check_content(self.spec, "".join(self._choices[i].content),
                                        f"choices[{i}].message.content"), self._choices[i].finish_reason,
                          self._choices[i].stop_reason)
            if failure is not None:
                self.failures.append(failure)
                first = first or failure
        return first

    def _release(self) -> bytes:
        out = bytearray()
        while self._queue:
            event, calls = self._queue[0]
            if not all(self._choices[i].calls[k].checked for i, k in calls):
                break
            out += event
            self._queue.popleft()
        return bytes(out)


@dataclass
class AnswerFacts:
    """What the ledger keeps of a stream's answer, read from its chunks: the upstream's own id for it,
    the model it named, and each choice's finish reason."""

    upstream_id: str = ""
    upstream_model: str = ""
    finish: dict[int, str] = field(default_factory=dict)

    def observe(self, obj: Any) -> None:
        if not isinstance(obj, dict):
            return
        if not self.upstream_id and isinstance(obj.get("id"), str):
            self.upstream_id = obj["id"]
        if not self.upstream_model and isinstance(obj.get("model"), str):  # (before the route renames it)
            self.upstream_model = obj["model"]
        for c in obj.get("choices") or ():
            if isinstance(c, dict) and c.get("finish_reason") and isinstance(c.get("index", 0), int):
                self.finish[c.get("index", 0)] = str(c["finish_reason"])

    def verdict(self, checker: StreamChecker | None) -> Verdict:
        """The stream's verdict: its checker's (None: a stream read but not checked) and these facts."""
        return Verdict(checker.spec if checker else None, tuple(checker.failures) if checker else (),
                       finish=tuple(self.finish[i] for i in sorted(self.finish)), upstream_id=self.upstream_id,
                       upstream_model=self.upstream_model,
                       run=checks_run(checker.spec, checker.policy) if checker else ())
