"""An Anthropic-shaped front end on the simulated engine: `POST /v1/messages` as the Messages API
answers it (JSON, or SSE events: message_start, content_block_start, ping, content_block_delta per
token, content_block_stop, message_delta, message_stop), with the provider's own checks and errors.

Checks, as the provider makes them: `x-api-key` (when the server has one: 401 authentication_error),
`anthropic-version` (400), `model` (404 not_found_error), `max_tokens` required (400), `messages`
non-empty with user/assistant roles (400), a prompt beyond the window (400 "prompt is too long").
Usage bills the prompt's cache as the provider does - for a request that marks a caching breakpoint
(`cache_control`, at most four, `ephemeral` with a ttl of 5m or 1h) only: the prompt through the last
breakpoint is read (`cache_read_input_tokens`) when that exact prefix was cached within its TTL, else
written (`cache_creation_input_tokens`, split by TTL in `cache_creation`); `input_tokens` are the rest
(enginesim/prompt_cache.py). The stream's `message_delta` repeats the input counts, cumulative, as the
API sends them now.
Extended thinking (`thinking`: `enabled` with a `budget_tokens` of at least 1024 below `max_tokens`,
or `adaptive`) writes a thinking block first, signed over its text (a stream: `thinking_delta`s, then
`signature_delta`); a thinking block replayed in a later turn must carry its
signature unaltered, and a tool loop's last assistant turn must open with it, or the request is 400.

Faults (the server's queue or `x-enginesim-fault`, as for the OpenAI front end): `status=529` (or 429,
500, ...) answers the provider's error for that status; `error_after=N` sends N text deltas, then an
`error` event (overloaded_error) and ends; `malformed_after=N` sends N deltas, then an event that is
not JSON; `refuse` answers `stop_reason: refusal` with nothing written; `usage=VALUE` reports that
JSON value as the output token count (the answer's, the stream's `message_delta`); `disconnect_after`,
`stall_after` and `delay_ms` as before.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import re
import uuid
import zlib
from typing import Any

from aiohttp import web

from enginesim.engine import Sequence
from enginesim.output import Output
from enginesim.prompt_cache import CacheUse, PromptCache, prefix_through
from enginesim.server import EngineServer, Fault, garbage, stream_fault
from enginesim.tokenizer import apply_chat_template

VERSION = re.compile(r"\d{4}-\d{2}-\d{2}")  # `anthropic-version`: a dated API version
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               529: "overloaded_error"}


def anthropic_error(status: int, message: str) -> web.Response:
    return web.json_response({"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                                         "message": message}}, status=status)


def _block_text(block: Any) -> str:
    if not isinstance(block, dict):
        return ""
    kind = block.get("type")
    if kind == "text":
        return str(block.get("text", ""))
    if kind == "tool_use":
        return json.dumps({"name": block.get("name"), "parameters": block.get("input")})
    if kind == "tool_result":
        content = block.get("content")
        return content if isinstance(content, str) else "".join(_block_text(b) for b in content or ())
    return ""


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation as the engine's chat template renders it."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": system if isinstance(system, str)
                    else "".join(_block_text(b) for b in system)})
    for m in body["messages"]:
        content = m["content"]
        out.append({"role": m["role"], "content": content if isinstance(content, str)
                    else "".join(_block_text(b) for b in content)})
    return out


def plan_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as enginesim/output.py reads it (OpenAI's names), so both front ends write the
    same way: tools and tool_choice (auto, any, tool, none), stop_sequences, a JSON schema output
    format, and a last turn of tool results counted as the tool's, not the user's."""
    out: dict[str, Any] = {"messages": chat_messages(body)}
    last = body["messages"][-1]
    if isinstance(last.get("content"), list) and any(isinstance(b, dict) and b.get("type") == "tool_result"
                                                     for b in last["content"]):
        out["messages"].append({"role": "tool", "content": ""})
    tools = body.get("tools") or []
    if tools:
        out["tools"] = [{"type": "function", "function": {"name": t.get("name"), "parameters": t.get("input_schema")}}
                        for t in tools if isinstance(t, dict)]
        choice = body.get("tool_choice") or {"type": "auto"}
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            str(choice.get("type")), {"type": "function", "function": {"name": choice.get("name")}})
        if choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    if body.get("stop_sequences"):
        out["stop"] = body["stop_sequences"]
    fmt = (body.get("output_config") or {}).get("format") or {}
    if fmt.get("type") == "json_schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema") or {}}}
    thinking = body.get("thinking") or {}
    if thinking.get("type") == "enabled":
        out["thinking_budget"] = thinking["budget_tokens"]
    elif thinking.get("type") == "adaptive":
        out["thinking_budget"] = body["max_tokens"] // 2
    return out


def _prompt_blocks(body: dict[str, Any]) -> list[Any]:
    """The request's blocks in the order the provider caches them: tools, system blocks, then each
    message's content (a string content as one text block)."""
    system = body.get("system")
    blocks: list[Any] = [*(body.get("tools") or ()), *(system if isinstance(system, list) else ())]
    for m in body.get("messages") or ():
        content = m.get("content") if isinstance(m, dict) else None
        blocks += content if isinstance(content, list) else [{"type": "text", "text": content or ""}]
    return blocks


def _marked(block: Any) -> bool:
    return isinstance(block, dict) and block.get("cache_control") is not None


def _breakpoints(body: dict[str, Any]) -> list[Any]:
    """The request's caching breakpoints (`cache_control` on tools, system blocks and content blocks)."""
    return [b["cache_control"] for b in _prompt_blocks(body) if _marked(b)]


def _cache_prefix(body: dict[str, Any], prompt: list[int]) -> tuple[int, str]:
    """The prompt's tokens through its last caching breakpoint and that breakpoint's TTL ((0, "") with
    none): the prompt less the text of every block after the breakpoint (tools come first, then the
    system blocks, then the messages' content)."""
    blocks = _prompt_blocks(body)
    marked = [i for i, b in enumerate(blocks) if _marked(b)]
    if not marked:
        return 0, ""
    after = "".join(_block_text(b) for b in blocks[marked[-1] + 1:])
    control = blocks[marked[-1]]["cache_control"]
    ttl = str(control.get("ttl") or "5m") if isinstance(control, dict) else "5m"
    return prefix_through(prompt, after), ttl


# The provider's thinking blocks carry a signature over their text: a block replayed in a later turn must
# come back exactly as it was written, or the request is refused.
_SIGNING_KEY = b"enginesim-thinking"


def thinking_signature(thinking: str) -> str:
    return base64.b64encode(hmac.new(_SIGNING_KEY, thinking.encode(), hashlib.sha256).digest()).decode()


def _thinking_error(body: dict[str, Any]) -> str | None:
    """The Messages API's checks of extended thinking: the setting, and replayed thinking blocks."""
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            return "thinking.type: Input should be 'enabled', 'disabled' or 'adaptive'"
        if kind == "enabled":
            budget = thinking.get("budget_tokens")
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1024:
                return "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024"
            if budget >= body["max_tokens"]:
                return "`max_tokens` must be greater than `thinking.budget_tokens`"
        if kind != "disabled" and (body.get("tool_choice") or {}).get("type") in ("any", "tool"):
            return "Thinking may not be enabled when tool_choice forces tool use."
    turns = [m for m in body["messages"] if m.get("role") == "assistant"]
    last = turns[-1]["content"] if turns else None
    if (thinking or {}).get("type") in ("enabled", "adaptive") and isinstance(last, list) and any(
            isinstance(b, dict) and b.get("type") == "tool_use" for b in last) and (
            not isinstance(last[0], dict) or last[0].get("type") not in ("thinking", "redacted_thinking")):
        # A tool loop with thinking on goes back with the turn's thinking block first.
        return ("Expected `thinking` or `redacted_thinking`, but found `tool_use`. When `thinking` is enabled, a "
                "final `assistant` message must start with a thinking block.")
    for i, m in enumerate(body["messages"]):
        for j, block in enumerate(m["content"] if isinstance(m["content"], list) else ()):
            if isinstance(block, dict) and block.get("type") == "thinking" and (
                    m["role"] != "assistant" or not isinstance(block.get("thinking"), str)
                    or block.get("signature") != thinking_signature(block["thinking"])):
                return f"messages.{i}.content.{j}: Invalid `signature` in `thinking` block"
    return None


async def _request_id(_: web.Request, response: web.StreamResponse) -> None:
    """Every answer names itself, as Anthropic's API does (`request-id: req_...`; its SDK reads it)."""
    response.headers.setdefault("request-id", "req_" + uuid.uuid4().hex[:24])


class MessagesFrontEnd:
    """Serves `/v1/messages` from an EngineServer's engine, model, request log and fault queue."""

    def __init__(self, server: EngineServer, api_key: str | None):
        self.server = server
        self.api_key = api_key
        self.cache = PromptCache()  # what the provider bills as cache reads and writes
        server.app.router.add_post("/v1/messages", self.messages)
        server.app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        server.app.on_response_prepare.append(_request_id)
        server.refusals = True

    def _check(self, request: web.Request, body: Any) -> web.Response | None:
        # The key comes as `x-api-key`, or (as the newer SDKs send it) as a bearer token.
        key = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ")
        if self.api_key is not None and key != self.api_key:
            return anthropic_error(401, "invalid x-api-key")
        if not VERSION.fullmatch(request.headers.get("anthropic-version", "")):
            return anthropic_error(400, "anthropic-version: header is required")
        if not isinstance(body, dict):
            return anthropic_error(400, "body: Input should be a valid dictionary")
        if body.get("model") != self.server.served_model:
            return anthropic_error(404, f"model: {body.get('model')}")
        max_tokens = body.get("max_tokens")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            return anthropic_error(400, "max_tokens: Field required" if max_tokens is None
                                   else "max_tokens: Input should be greater than or equal to 1")
        if body.get("service_tier", "auto") not in ("auto", "standard_only"):
            return anthropic_error(400, "service_tier: Input should be 'auto' or 'standard_only'")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return anthropic_error(400, "messages: at least one message is required")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("user", "assistant") or "content" not in m:
                return anthropic_error(400, f"messages.{i}: each message needs a user or assistant role and content")
        marks = _breakpoints(body)
        if len(marks) > 4:
            return anthropic_error(400, "A maximum of 4 blocks with cache_control may be provided. "
                                        f"Found {len(marks)}.")
        if any(not isinstance(c, dict) or c.get("type") != "ephemeral" or c.get("ttl", "5m") not in ("5m", "1h")
               for c in marks):
            return anthropic_error(400, "cache_control: Input should be {'type': 'ephemeral'} with a ttl of 5m or 1h")
        wrong = _thinking_error(body)
        return anthropic_error(400, wrong) if wrong else None

    async def count_tokens(self, request: web.Request) -> web.Response:
        """`POST /v1/messages/count_tokens`: the prompt's tokens as a Messages request would count them
        (`input_tokens`); the same checks but `max_tokens`, which it does not take."""
        try:
            body = await request.json()
        except ValueError:
            return anthropic_error(400, "There was an error parsing the body of your request")
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex[:16]
        bad = self._check(request, {**body, "max_tokens": 1} if isinstance(body, dict) else body)
        if isinstance(body, dict) and "max_tokens" in body:
            bad = anthropic_error(400, "max_tokens: Extra inputs are not permitted")
        self.server._log_request(rid, request, body if isinstance(body, dict) else {}, bad.status if bad else 200)
        if bad is not None:
            return bad
        return web.json_response({"input_tokens": len(apply_chat_template(chat_messages(body), body.get("tools")))})

    async def messages(self, request: web.Request) -> web.StreamResponse:
        srv = self.server
        try:
            body = await request.json()
        except ValueError:
            return anthropic_error(400, "There was an error parsing the body of your request")
        fault = srv._take_fault(request, body)
        if isinstance(fault, web.Response):
            return fault
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex[:16]
        bad = self._check(request, body)
        entry = srv._log_request(rid, request, body if isinstance(body, dict) else {}, bad.status if bad else 200)
        if bad is not None:
            return bad
        if fault.garbage is not None:
            return await garbage(request, fault.garbage, bool(body.get("stream")))
        if fault.status:
            entry["status"] = fault.status
            await asyncio.sleep(fault.delay_ms / 1000)
            return anthropic_error(fault.status, "Overloaded" if fault.status == 529 else f"injected {fault.status}")
        prompt = apply_chat_template(chat_messages(body), body.get("tools"))
        max_len = srv.engine.profile.max_model_len
        if len(prompt) >= max_len:
            return anthropic_error(400, f"prompt is too long: {len(prompt)} tokens > {max_len - 1} maximum")
        if fault.refuse:
            return await self._refusal(request, rid, len(prompt), bool(body.get("stream")))
        max_tokens = min(body["max_tokens"], max_len - len(prompt))
        seed = zlib.crc32(json.dumps(body["messages"]).encode()) ^ srv.seed
        out, seq = await srv.submit_planned(plan_body(body), seed, prompt, max_tokens, rid, fault)
        cache = self.cache.use(prompt, *_cache_prefix(body, prompt))
        try:
            if body.get("stream"):
                return await self._stream(request, seq, out, rid, fault, cache)
            return await self._complete(seq, out, rid, fault, cache)
        finally:
            srv.engine.abort(seq)
            entry.update(prompt_tokens=len(seq.prompt), cached_tokens=cache.read, cache_write_tokens=cache.written,
                         cache_write_1h_tokens=cache.written_1h, output_tokens=seq.output_len,
                         finish_reason=seq.finish_reason)

    async def _refusal(self, request: web.Request, rid: str, prompt_tokens: int, stream: bool) -> web.StreamResponse:
        """The model's safety stop: `stop_reason: refusal`, nothing written."""
        usage = {"input_tokens": prompt_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                 "output_tokens": 0}
        message: dict[str, Any] = {"id": f"msg_{rid}", "type": "message", "role": "assistant",
                                   "model": self.server.answer_model, "content": [], "stop_reason": "refusal",
                                   "stop_sequence": None, "usage": usage}
        if not stream:
            return web.json_response(message)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        for kind, doc in (("message_start", {"message": {**message, "stop_reason": None}}),
                          ("message_delta", {"delta": {"stop_reason": "refusal", "stop_sequence": None},
                                             "usage": {"output_tokens": 0}}), ("message_stop", {})):
            await resp.write(f"event: {kind}\ndata: {json.dumps({'type': kind, **doc})}\n\n".encode())
        await resp.write_eof()
        return resp

    def _usage(self, seq: Sequence, fault: Fault, cache: CacheUse) -> dict[str, Any]:
        """The prompt's tokens as the provider bills them: read from its cache, written to it (by TTL),
        the rest as input."""
        written = cache.written + cache.written_1h
        return {"input_tokens": len(seq.prompt) - cache.read - written, "cache_creation_input_tokens": written,
                "cache_read_input_tokens": cache.read,
                "cache_creation": {"ephemeral_5m_input_tokens": cache.written,
                                   "ephemeral_1h_input_tokens": cache.written_1h},
                "output_tokens": self._output(seq, fault)}

    @staticmethod
    def _output(seq: Sequence, fault: Fault) -> Any:
        """The output count reported: the `usage` fault's value in place of the real one."""
        return seq.output_len if fault.usage is None else json.loads(fault.usage)

    @staticmethod
    def _stop_reason(seq: Sequence, out: Output) -> str:
        if seq.finish_reason == "length":
            return "max_tokens"
        return "tool_use" if out.tool_calls else "stop_sequence" if out.stop_reason else "end_turn"

    @staticmethod
    def _blocks(out: Output, produced: int) -> list[dict[str, Any]]:
        thought = out.thought(produced)
        blocks: list[dict[str, Any]] = ([{"type": "thinking", "thinking": thought,
                                          "signature": thinking_signature(thought)}] if out.thoughts else [])
        if not out.tool_calls:
            return [*blocks, {"type": "text", "text": out.text(produced)}]
        for j, call in enumerate(out.tool_calls):
            args = "".join(p for p, owner in zip(out.pieces[:out.answered(produced)], out.owner, strict=False)
                           if owner == j)
            try:
                tool_input = json.loads(args)
            except ValueError:
                tool_input = {}  # cut by max_tokens
            blocks.append({"type": "tool_use", "id": f"toolu_{call.id[-20:]}", "name": call.name, "input": tool_input})
        return blocks

    async def _complete(self, seq: Sequence, out: Output, rid: str, fault: Fault, cache: CacheUse) -> web.Response:
        produced = 0
        while await seq.out.get() is not None:
            produced += 1
        return web.json_response({
            "id": f"msg_{rid}", "type": "message", "role": "assistant", "model": self.server.answer_model,
            "content": self._blocks(out, produced), "stop_reason": self._stop_reason(seq, out),
            "stop_sequence": out.stop_reason, "usage": self._usage(seq, fault, cache)})

    async def _stream(self, request: web.Request, seq: Sequence, out: Output, rid: str,
                      fault: Fault, cache: CacheUse) -> web.StreamResponse:
        resp = fault.stream_response({"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(kind: str, doc: dict[str, Any]) -> None:
            await resp.write(f"event: {kind}\ndata: {json.dumps({'type': kind, **doc})}\n\n".encode())

        usage = {**self._usage(seq, Fault(), cache), "output_tokens": 1}
        await send("message_start", {"message": {
            "id": f"msg_{rid}", "type": "message", "role": "assistant", "model": self.server.answer_model,
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}})
        block = -1  # the content block open now (its index; the answer's blocks follow a thinking block)
        first = 1 if out.thoughts else 0  # the index of the answer's first block
        if out.thoughts:
            block = 0
            await send("content_block_start", {"index": 0, "content_block": {"type": "thinking", "thinking": "",
                                                                             "signature": ""}})
        elif not out.tool_calls:
            block = 0
            await send("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        await send("ping", {})
        sent = 0
        while (idx := await seq.out.get()) is not None:
            if await stream_fault(fault, sent, request, resp,
                                  b'event: content_block_delta\ndata: {"type": "content_block_delta", \n\n'):
                return resp
            if fault.error_after is not None and sent >= fault.error_after:
                await send("error", {"error": {"type": "overloaded_error", "message": "Overloaded"}})
                await resp.write_eof()
                return resp
            thinking, piece = out.piece(idx)
            if thinking:
                delta = {"type": "thinking_delta", "thinking": piece}
            else:
                if block == 0 and first == 1:  # the thinking block ends with its signature
                    await send("content_block_delta", {"index": 0, "delta": {
                        "type": "signature_delta", "signature": thinking_signature(out.thought(len(out.thoughts)))}})
                    await send("content_block_stop", {"index": 0})
                    block = -1
                    if not out.tool_calls:
                        block = first
                        await send("content_block_start", {"index": block, "content_block": {"type": "text",
                                                                                             "text": ""}})
                if out.tool_calls:
                    j = first + out.owner[idx - len(out.thoughts)]
                    if j != block:
                        if block >= 0:
                            await send("content_block_stop", {"index": block})
                        block = j
                        call = out.tool_calls[j - first]
                        await send("content_block_start", {"index": j, "content_block": {
                            "type": "tool_use", "id": f"toolu_{call.id[-20:]}", "name": call.name, "input": {}}})
                    delta = {"type": "input_json_delta", "partial_json": piece}
                else:
                    delta = {"type": "text_delta", "text": piece}
            await send("content_block_delta", {"index": max(block, 0), "delta": delta})
            sent += 1
        if block == 0 and first == 1:  # cut while thinking: the block still ends with its signature
            await send("content_block_delta", {"index": 0, "delta": {
                "type": "signature_delta", "signature": thinking_signature(out.thought(sent))}})
        if block >= 0:
            await send("content_block_stop", {"index": block})
        await send("message_delta", {"delta": {"stop_reason": self._stop_reason(seq, out),
                                               "stop_sequence": out.stop_reason},
                                     "usage": self._usage(seq, fault, cache)})
        await send("message_stop", {})
        await resp.write_eof()
        return resp

