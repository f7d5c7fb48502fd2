"""The bedrock adapter's answer side in Python (extproc/shapes/bedrock/adapter.py has its request
side): its answers, streams, errors and usage as the internal shape - what Envoy's Lua answer filter
does in production (extproc/shapes/bedrock/answers.lua), and the reference the tests hold it to."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from extproc.contract import ErrorCode
from extproc.names import MAX_EVENT_BYTES
from extproc.shapes.base import tool_arguments
from extproc.shapes.bedrock.adapter import BEDROCK as _BEDROCK
from extproc.shapes.bedrock.adapter import OUTPUT_TOOL, STOP_REASONS
from tests.oracles.base import (
    Failure,
    NativeStream,
    Oracle,
    UpstreamBroken,
    Usage,
    completion_of,
    read_answer,
    sse,
    token_count,
)
from tests.oracles.openai import failure_for_status

# -- answers ----------------------------------------------------------------------------------------

def _usage(native: Mapping[str, Any]) -> Usage:
    read = token_count(native.get("cacheReadInputTokens"))
    written = token_count(native.get("cacheWriteInputTokens"))
    return Usage(token_count(native["inputTokens"]) + read + written, read, token_count(native["outputTokens"]),
                 cache_write=written)


def _finish(reason: Any, calls: int) -> str:
    """A stop for the output tool's call alone (the answer given as the schema asked) is the answer's end."""
    return "stop" if reason == "tool_use" and not calls else STOP_REASONS.get(str(reason), "stop")


def completion(doc: Mapping[str, Any]) -> dict[str, Any]:
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in doc["output"]["message"]["content"]:
        if "text" in block:
            text.append(str(block["text"]))
        elif "toolUse" in block:
            use = block["toolUse"]
            if use["name"] == OUTPUT_TOOL:  # the answer, as the response_format's schema asked
                given = use.get("input")
                if isinstance(given, dict):
                    text.append(json.dumps(given))
                elif isinstance(given, str):  # cut by max_tokens: the text written so far
                    text.append(given)
                elif given is not None:
                    raise TypeError("the output tool's input is neither an object nor text")
                continue
            calls.append({"id": str(use["toolUseId"]), "type": "function",
                          "function": {"name": str(use["name"]), "arguments": tool_arguments(use.get("input"))}})
        elif "reasoningContent" in block:
            reasoning.append(str((block["reasoningContent"].get("reasoningText") or {}).get("text", "")))
    return completion_of(uuid.uuid4().hex[:24], "", text, reasoning, calls,
                         _finish(doc.get("stopReason"), len(calls)), _usage(doc["usage"]), stop_sequence(doc))


def stop_sequence(doc: Mapping[str, Any]) -> str | None:
    """The stop sequence that ended the text: Converse names it only in the model family's own fields."""
    said = (doc.get("additionalModelResponseFields") or {}).get("stop_sequence")
    return said if doc.get("stopReason") == "stop_sequence" and isinstance(said, str) else None


class BedrockStream(NativeStream):
    """ConverseStream's event-stream messages -> internal chunks. A tool call's input arrives as pieces
    of JSON and leaves as argument deltas of the same call index."""

    def __init__(self, include_usage: bool = True):
        from botocore.eventstream import EventStreamBuffer  # see sign()

        super().__init__(include_usage)
        self.id = uuid.uuid4().hex[:24]
        self.frames = EventStreamBuffer()
        self.pending = 0  # bytes fed that no whole message has used yet
        self.calls: dict[int, int] = {}  # content block index -> tool call index
        self.output_block: int | None = None  # the output tool's block: its input is the content
        self.stopped = False  # messageStop came
        self.ended = False  # metadata came: nothing may follow

    def _documents(self, chunk: bytes) -> Iterator[dict[str, Any]]:
        from botocore.eventstream import ParserError  # see sign()

        self.pending += len(chunk)
        if self.pending > MAX_EVENT_BYTES:
            raise UpstreamBroken(f"an event-stream message is larger than {MAX_EVENT_BYTES} bytes")
        self.frames.add_data(chunk)
        try:
            for message in self.frames:
                self.pending -= message.prelude.total_length
                headers = message.headers
                if headers.get(":message-type") != "event":
                    raise UpstreamBroken(f"the provider ended the stream: "
                                         f"{headers.get(':exception-type') or headers.get(':error-code') or 'error'}")
                try:
                    payload = json.loads(message.payload or b"{}")
                except ValueError:
                    raise UpstreamBroken("an event's payload is not JSON") from None
                if not isinstance(payload, dict):
                    raise UpstreamBroken("an event's payload is not a JSON object")
                yield {str(headers.get(":event-type", "")): payload}
        except ParserError as e:
            raise UpstreamBroken(f"the event-stream framing is broken ({type(e).__name__})") from None

    def _event(self, doc: dict[str, Any]) -> list[bytes]:
        if self.ended:
            raise UpstreamBroken("an event after the metadata event")
        (kind, ev), = doc.items()
        try:
            return self._handle(kind, ev)
        except (KeyError, TypeError, AttributeError, ValueError):
            raise UpstreamBroken(f"a malformed {kind} event") from None

    def _handle(self, kind: str, ev: dict[str, Any]) -> list[bytes]:
        if kind == "messageStart":
            return [self._chunk({"role": "assistant", "content": ""})]
        if kind == "contentBlockStart":
            use = ev["start"]["toolUse"]
            if use["name"] == OUTPUT_TOOL:
                self.output_block = int(ev["contentBlockIndex"])
                return []
            n = self.calls[int(ev["contentBlockIndex"])] = len(self.calls)
            return [self._chunk({"tool_calls": [{"index": n, "id": str(use["toolUseId"]), "type": "function",
                                                 "function": {"name": str(use["name"]), "arguments": ""}}]})]
        if kind == "contentBlockDelta":
            delta = ev["delta"]
            if "text" in delta:
                return [self._chunk({"content": str(delta["text"])})]
            answering = self.output_block is not None and ev.get("contentBlockIndex") == self.output_block
            if "toolUse" in delta and answering:
                return [self._chunk({"content": str(delta["toolUse"]["input"])})]
            if "toolUse" in delta:
                n = self.calls[int(ev["contentBlockIndex"])]
                return [self._chunk({"tool_calls": [{"index": n, "function": {
                    "arguments": str(delta["toolUse"]["input"])}}]})]
            if "reasoningContent" in delta:
                return [self._chunk({"reasoning": str(delta["reasoningContent"].get("text", ""))})]
            return []  # citations and what the API adds later: nothing to carry
        if kind == "messageStop":
            self.stopped = True
            return [self._chunk({}, _finish(ev.get("stopReason"), len(self.calls)), stop_sequence(ev))]
        if kind == "metadata":
            if not self.stopped:
                raise UpstreamBroken("the metadata event came before messageStop")
            self.ended = True
            usage = _usage(ev["usage"])
            return [*([self._usage_chunk(usage)] if self.include_usage else []), sse("[DONE]")]
        return []  # contentBlockStop

    def finish(self) -> list[bytes]:
        if not self.ended:
            raise UpstreamBroken("the stream ended before its metadata event")
        if self.pending:
            raise UpstreamBroken("the stream ended inside an event-stream message")
        return []


# -- errors -----------------------------------------------------------------------------------------

def failure(status: int, body: bytes) -> Failure:
    """Converse's errors are `{"message": ...}` with the type in a header (`x-amzn-ErrorType`); the
    status says what it is."""
    try:
        doc = json.loads(body)
        message = str(doc.get("message") or doc.get("Message") or "")[:500] if isinstance(doc, dict) else ""
    except ValueError:
        message = ""
    if status == 400 and "too long" in message.lower():
        return Failure(ErrorCode.CONTEXT_LENGTH_EXCEEDED, 400, message)
    if status == 500:  # InternalServerException: retry
        return Failure(ErrorCode.UPSTREAM_ERROR, 502, message or "InternalServerException", "unavailable")
    return failure_for_status(status, message)



def response(status: int, body: bytes) -> dict[str, Any]:
    return read_answer(body, lambda doc: "output" in doc, "a Converse response", completion)


BEDROCK = Oracle(_BEDROCK, response, BedrockStream, failure, _usage)
