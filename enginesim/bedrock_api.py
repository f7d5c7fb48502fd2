"""A Bedrock-shaped front end on the simulated engine: `POST /model/{modelId}/converse` and
`/model/{modelId}/converse-stream` as Bedrock's Converse API answers them, writing from the same
output plan as the other front ends (enginesim/output.py).

Checks, as the provider makes them: a SigV4 signature for the service `bedrock` (when the server has
a key, `ACCESS_KEY_ID:SECRET_ACCESS_KEY`: 403 with the provider's exception types, checked by
enginesim/sigv4.py from the request as it arrived), the model id in the path (400 "The provided model
identifier is invalid."), `messages` non-empty, starting with a user turn, alternating user and
assistant, each with a list of content blocks (400 ValidationException), `inferenceConfig.maxTokens`
positive, a prompt beyond the window (400 "Input is too long for requested model."). Errors are
`{"message": ...}` with the type in `x-amzn-ErrorType`.

Answers: `output.message.content` (a text block, or `toolUse` blocks with their input as an object),
`stopReason` (end_turn, tool_use, max_tokens, stop_sequence), `usage` (`inputTokens`, `outputTokens`,
`totalTokens`; cache reads and writes only for a request that marks a `cachePoint`, as Bedrock
reports them: the prompt through the last cache point, read when cached, else written -
enginesim/prompt_cache.py), `metrics.latencyMs`. The stream is AWS event-stream framing
(enginesim/eventstream.py): messageStart, per token a contentBlockDelta (a tool call opens with
contentBlockStart and streams its input JSON in pieces), contentBlockStop, messageStop, metadata.
Faults as for the other front ends: `status=429` answers ThrottlingException, 503
ServiceUnavailableException, 500 InternalServerException; `error_after=N` sends a throttlingException
message after N deltas; `malformed_after=N` sends a message whose CRC does not match; `refuse` answers
`stopReason: content_filtered` with nothing written.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
import zlib
from typing import Any

from aiohttp import web

from enginesim import eventstream
from enginesim.engine import Sequence
from enginesim.output import Output, RequestError, check
from enginesim.prompt_cache import CacheUse, PromptCache, prefix_through
from enginesim.server import EngineServer, Fault, garbage, stream_fault
from enginesim.sigv4 import SignatureError, verify
from enginesim.tokenizer import apply_chat_template

ERROR_TYPES = {400: "ValidationException", 403: "AccessDeniedException", 404: "ResourceNotFoundException",
               408: "ModelTimeoutException", 424: "ModelErrorException", 429: "ThrottlingException",
               500: "InternalServerException", 503: "ServiceUnavailableException"}
STATUS_OF = {"MissingAuthenticationTokenException": 403, "UnrecognizedClientException": 403,
             "IncompleteSignatureException": 403, "InvalidSignatureException": 403}


def bedrock_error(status: int, message: str, kind: str | None = None) -> web.Response:
    kind = kind or ERROR_TYPES.get(status, "InternalServerException")
    return web.json_response({"message": message}, status=status, headers={
        "x-amzn-ErrorType": f"{kind}:http://internal.amazon.com/coral/com.amazon.bedrock/",
        "x-amzn-RequestId": str(uuid.uuid4())})


def _text(blocks: list[Any]) -> str:
    out = []
    for b in blocks:
        if not isinstance(b, dict):
            continue
        if "text" in b:
            out.append(str(b["text"]))
        elif "toolUse" in b:
            out.append(json.dumps({"name": b["toolUse"].get("name"), "parameters": b["toolUse"].get("input")}))
        elif "toolResult" in b:
            out.append(json.dumps(b["toolResult"].get("content")))
    return "".join(out)


def plan_body(body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the conversation as the chat template renders it, the request as output.py reads it)."""
    messages: list[dict[str, Any]] = []
    system = "".join(str(b.get("text", "")) for b in body.get("system") or () if isinstance(b, dict))
    if system:
        messages.append({"role": "system", "content": system})
    for m in body["messages"]:
        messages.append({"role": m["role"], "content": _text(m["content"])})
    plan_messages = list(messages)
    if any(isinstance(b, dict) and "toolResult" in b for b in body["messages"][-1]["content"]):
        plan_messages.append({"role": "tool", "content": ""})  # a tool's result last: answered in text
    out: dict[str, Any] = {"messages": plan_messages}
    tool_config = body.get("toolConfig") or {}
    specs = [t["toolSpec"] for t in tool_config.get("tools") or () if isinstance(t, dict) and "toolSpec" in t]
    if specs:
        out["tools"] = [{"type": "function", "function": {
            "name": s.get("name"), "parameters": (s.get("inputSchema") or {}).get("json")}} for s in specs]
        choice = tool_config.get("toolChoice") or {"auto": {}}
        out["tool_choice"] = ({"type": "function", "function": {"name": choice["tool"].get("name")}}
                              if "tool" in choice else "required" if "any" in choice else "auto")
    config = body.get("inferenceConfig") or {}
    if config.get("stopSequences"):
        out["stop"] = config["stopSequences"]
    return messages, out


async def _request_id(_: web.Request, response: web.StreamResponse) -> None:
    """Every answer names itself, as AWS does (`x-amzn-RequestId`; botocore's ResponseMetadata reads it)."""
    response.headers.setdefault("x-amzn-RequestId", str(uuid.uuid4()))


class ConverseFrontEnd:
    """Serves Bedrock's Converse from an EngineServer's engine, model, request log and faults."""

    def __init__(self, server: EngineServer, api_key: str | None):
        self.server = server
        key_id, _, secret = (api_key or "").partition(":")
        self.key = (key_id, secret) if api_key else None
        self.cache = PromptCache()  # what the provider bills as cache reads and writes
        server.app.router.add_post("/model/{model}/{call}", self.converse)
        server.app.on_response_prepare.append(_request_id)
        server.refusals = True

    def _check(self, request: web.Request, raw: bytes, body: Any, model: str) -> web.Response | None:
        if self.key is not None:
            try:
                verify(request.method, request.rel_url.raw_path, request.rel_url.raw_query_string, request.headers,
                       raw, *self.key, service="bedrock")
            except SignatureError as e:
                return bedrock_error(STATUS_OF[e.kind], str(e), e.kind)
        if model != self.server.served_model:
            return bedrock_error(400, "The provided model identifier is invalid.")
        if not isinstance(body, dict):
            return bedrock_error(400, "Malformed input request, please reformat your input and try again.")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not isinstance(messages[0], dict) or (
                messages[0].get("role") != "user"):
            return bedrock_error(400, "A conversation must start with a user message. Try again with a "
                                      "conversation that starts with a user message.")
        for i, m in enumerate(messages):
            if (not isinstance(m, dict) or m.get("role") not in ("user", "assistant")
                    or not isinstance(m.get("content"), list) or not m["content"]):
                return bedrock_error(400, f"messages.{i}: a role of user or assistant and content blocks are required")
            if m["role"] != ("user" if i % 2 == 0 else "assistant"):
                return bedrock_error(400, "A conversation must alternate between user and assistant roles. Make "
                                          "sure the conversation alternates between user and assistant roles "
                                          "and try again.")
        max_tokens = (body.get("inferenceConfig") or {}).get("maxTokens")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 1):
            return bedrock_error(400, "The maximum tokens you requested must be at least 1.")
        return None

    def _count_tokens(self, request: web.Request, raw: bytes, body: Any, model: str) -> web.Response:
        """CountTokens (`/model/{id}/count-tokens`): `{"input": {"converse": {...}}}`, the Converse
        request's input counted as Converse would (`inputTokens`); signed and checked like it."""
        converse = ((body.get("input") or {}).get("converse") if isinstance(body, dict)
                    and isinstance(body.get("input"), dict) else None)
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex[:16]
        bad = self._check(request, raw, converse, model) if isinstance(converse, dict) else bedrock_error(
            400, "input: exactly one of converse or invokeModel is required")
        logged = dict(converse) if isinstance(converse, dict) else {}
        self.server._log_request(rid, request, {**logged, "model": model}, bad.status if bad else 200)
        if bad is not None:
            return bad
        assert isinstance(converse, dict)
        messages, wants = plan_body(converse)
        return web.json_response({"inputTokens": len(apply_chat_template(messages, wants.get("tools")))},
                                 headers={"x-amzn-RequestId": str(uuid.uuid4())})

    async def converse(self, request: web.Request) -> web.StreamResponse:
        srv = self.server
        model, call = request.match_info["model"], request.match_info["call"]
        if call not in ("converse", "converse-stream", "count-tokens"):
            return bedrock_error(404, f"Unknown operation {call}", "UnknownOperationException")
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if call == "count-tokens":
            return self._count_tokens(request, raw, body, model)
        fault = srv._take_fault(request, body)
        if isinstance(fault, web.Response):
            return fault
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex[:16]
        bad = self._check(request, raw, body, model)
        logged = {**body, "model": model, "stream": call == "converse-stream"} if isinstance(body, dict) else {}
        entry = srv._log_request(rid, request, logged, bad.status if bad else 200)
        if bad is not None:
            return bad
        assert isinstance(body, dict)
        if fault.garbage is not None:
            return await garbage(request, fault.garbage, call == "converse-stream")
        if fault.status:
            entry["status"] = fault.status
            await asyncio.sleep(fault.delay_ms / 1000)
            return bedrock_error(fault.status, "Too many requests, please wait before trying again."
                                 if fault.status == 429 else f"injected {fault.status}")
        messages, wants = plan_body(body)
        try:
            check(wants)
        except RequestError as e:
            return bedrock_error(400, str(e))
        prompt = apply_chat_template(messages, wants.get("tools"))
        max_len = srv.engine.profile.max_model_len
        if len(prompt) >= max_len:
            return bedrock_error(400, "Input is too long for requested model.")
        if fault.refuse:
            return await self._refusal(request, len(prompt), call == "converse-stream")
        requested = (body.get("inferenceConfig") or {}).get("maxTokens")
        max_tokens = min(requested or max_len, max_len - len(prompt))
        seed = zlib.crc32(json.dumps(body["messages"]).encode()) ^ srv.seed  # Converse takes no seed
        started = time.monotonic()
        out, seq = await srv.submit_planned(wants, seed, prompt, max_tokens, rid, fault)
        cache = self.cache.use(prompt, _cache_point_prefix(body, prompt))
        try:
            if call == "converse-stream":
                return await self._stream(request, seq, out, fault, body, started, cache)
            return await self._complete(seq, out, body, started, cache)
        finally:
            srv.engine.abort(seq)
            entry.update(prompt_tokens=len(seq.prompt), output_tokens=seq.output_len, finish_reason=seq.finish_reason,
                         cached_tokens=cache.read, cache_write_tokens=cache.written)

    async def _refusal(self, request: web.Request, prompt_tokens: int, stream: bool) -> web.StreamResponse:
        """The model's safety stop: `stopReason: content_filtered`, nothing written."""
        usage = {"inputTokens": prompt_tokens, "outputTokens": 0, "totalTokens": prompt_tokens}
        if not stream:
            return web.json_response({"output": {"message": {"role": "assistant", "content": []}},
                                      "stopReason": "content_filtered", "usage": usage, "metrics": {"latencyMs": 1}})
        resp = web.StreamResponse(headers={"Content-Type": "application/vnd.amazon.eventstream"})
        await resp.prepare(request)
        for kind, doc in (("messageStart", {"role": "assistant"}), ("messageStop", {"stopReason": "content_filtered"}),
                          ("metadata", {"usage": usage, "metrics": {"latencyMs": 1}})):
            await resp.write(eventstream.event(kind, doc))
        await resp.write_eof()
        return resp

    def _usage(self, seq: Sequence, cache: CacheUse) -> dict[str, int] | None:
        """Cache reads and writes only for a request that marks a `cachePoint` (enginesim/prompt_cache.py)."""
        if "usage" in self.server.corrupt:
            return None
        usage = {"inputTokens": len(seq.prompt) - cache.read - cache.written, "outputTokens": seq.output_len,
                 "totalTokens": len(seq.prompt) + seq.output_len}
        if cache.read or cache.written:
            usage.update(cacheReadInputTokens=cache.read, cacheWriteInputTokens=cache.written)
        return usage

    @staticmethod
    def _stop_reason(seq: Sequence, out: Output) -> str:
        if seq.finish_reason == "length":
            return "max_tokens"
        return "tool_use" if out.tool_calls else "stop_sequence" if out.stop_reason else "end_turn"

    def _extra_fields(self, seq: Sequence, out: Output, body: dict[str, Any]) -> dict[str, Any]:
        """`additionalModelResponseFields`: the model family's own answer fields the request asked for by
        JSON pointer (`additionalModelResponseFieldPaths`); a Claude model's `stop_sequence` names the
        sequence that ended the text (null otherwise). A path the model does not answer is left out."""
        paths = body.get("additionalModelResponseFieldPaths") or ()
        if "/stop_sequence" not in paths:
            return {}
        said = out.stop_reason if self._stop_reason(seq, out) == "stop_sequence" else None
        return {"additionalModelResponseFields": {"stop_sequence": said}}

    @staticmethod
    def _blocks(out: Output, produced: int) -> list[dict[str, Any]]:
        if not out.tool_calls:
            return [{"text": out.text(produced)}]
        blocks = []
        for j, call in enumerate(out.tool_calls):
            args = "".join(p for p, owner in zip(out.pieces[:produced], out.owner, strict=False) if owner == j)
            try:
                tool_input: Any = json.loads(args)
            except ValueError:
                tool_input = args  # cut by max_tokens, or a corrupted provider's: sent as it was written
            blocks.append({"toolUse": {"toolUseId": f"tooluse_{call.id[-22:]}", "name": call.name,
                                       "input": tool_input}})
        return blocks

    async def _complete(self, seq: Sequence, out: Output, body: dict[str, Any], started: float,
                        cache: CacheUse) -> web.Response:
        produced = 0
        while await seq.out.get() is not None:
            produced += 1
        doc: dict[str, Any] = {"output": {"message": {"role": "assistant", "content": self._blocks(out, produced)}},
                               "stopReason": self._stop_reason(seq, out),
                               "metrics": {"latencyMs": round((time.monotonic() - started) * 1000)}}
        doc.update(self._extra_fields(seq, out, body))
        usage = self._usage(seq, cache)
        if usage is not None:
            doc["usage"] = usage
        return web.json_response(doc, headers={"x-amzn-RequestId": str(uuid.uuid4())})

    async def _stream(self, request: web.Request, seq: Sequence, out: Output, fault: Fault,
                      body: dict[str, Any], started: float, cache: CacheUse) -> web.StreamResponse:
        resp = fault.stream_response({"Content-Type": "application/vnd.amazon.eventstream",
                                      "x-amzn-RequestId": str(uuid.uuid4())})
        await resp.prepare(request)
        pad = os.urandom(8).hex()  # Bedrock pads its events (`p`) so their sizes say nothing

        async def send(kind: str, doc: dict[str, Any]) -> None:
            await resp.write(eventstream.event(kind, {**doc, "p": pad[: len(doc) % 16 + 1]}))

        await send("messageStart", {"role": "assistant"})
        block = -1  # the content block open now
        broken = eventstream.event("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": "x"}})
        broken = broken[:-4] + bytes(4)  # a message whose CRC does not match
        sent = 0
        while (idx := await seq.out.get()) is not None:
            if await stream_fault(fault, sent, request, resp, broken):
                return resp
            if fault.error_after is not None and sent >= fault.error_after:
                await resp.write(eventstream.exception("throttlingException",
                                                       "Too many tokens, please wait before trying again."))
                await resp.write_eof()
                return resp
            if out.tool_calls:
                j = out.owner[idx]
                if j != block:
                    if block >= 0:
                        await send("contentBlockStop", {"contentBlockIndex": block})
                    block = j
                    call = out.tool_calls[j]
                    await send("contentBlockStart", {"contentBlockIndex": j, "start": {"toolUse": {
                        "toolUseId": f"tooluse_{call.id[-22:]}", "name": call.name}}})
                delta: dict[str, Any] = {"toolUse": {"input": out.pieces[idx]}}
            else:
                block = 0
                delta = {"text": out.pieces[idx]}
            await send("contentBlockDelta", {"contentBlockIndex": block, "delta": delta})
            sent += 1
        if block >= 0:
            await send("contentBlockStop", {"contentBlockIndex": block})
        await send("messageStop", {"stopReason": self._stop_reason(seq, out), **self._extra_fields(seq, out, body)})
        metadata: dict[str, Any] = {"metrics": {"latencyMs": round((time.monotonic() - started) * 1000)}}
        usage = self._usage(seq, cache)
        if usage is not None:
            metadata["usage"] = usage
        await send("metadata", metadata)
        await resp.write_eof()
        return resp


def _cache_point_prefix(body: dict[str, Any], prompt: list[int]) -> int:
    """The prompt's tokens through its last `cachePoint` block (0 with none): the prompt less the text of
    every block after it (the system blocks come first, then the messages' content)."""
    blocks = [*(body.get("system") or ()), *(b for m in body["messages"] for b in m["content"])]
    marked = [i for i, b in enumerate(blocks) if isinstance(b, dict) and "cachePoint" in b]
    if not marked:
        return 0
    return prefix_through(prompt, _text(blocks[marked[-1] + 1:]))
