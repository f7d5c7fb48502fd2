"""A Gemini-shaped front end on the simulated engine: `POST /v1beta/models/{model}:generateContent` and
`:streamGenerateContent?alt=sse`, as the Gemini API answers them, writing from the same output plan as
the other front ends (enginesim/output.py).

Checks, as the provider makes them: the key in `x-goog-api-key` or `?key=` (when the server has one:
400 INVALID_ARGUMENT "API key not valid"), the model in the path (404 NOT_FOUND), `contents`
non-empty with roles `user` / `model` and parts (400 INVALID_ARGUMENT), a prompt beyond the window
(400 INVALID_ARGUMENT "...exceeds the maximum number of tokens allowed"), `candidateCount` above 1
(400: one candidate per request here). Errors are `{"error": {"code", "message", "status"}}`.

Answers: `candidates[0].content.parts` (text, or whole `functionCall` parts), `finishReason` (STOP,
MAX_TOKENS), `usageMetadata` with the prompt's prefix-cache hits as `cachedContentTokenCount`,
`modelVersion`, `responseId`. A stream is one whole response per token (`data: {...}` and CRLF CRLF,
as the API frames it), the last with `finishReason` and the totals; no `[DONE]`; a function call
arrives whole in one response. `generationConfig.thinkingConfig` (a `thinkingBudget`, -1 for the
model's own choice, or a `thinkingLevel`) makes the model think first: its thoughts count as
`thoughtsTokenCount` (apart from `candidatesTokenCount`) and, with `includeThoughts`, come back as
parts marked `thought` before the answer. Faults as for the other front ends: `status=429` answers
RESOURCE_EXHAUSTED, 503 UNAVAILABLE; `error_after=N` sends an error response after N; `refuse` blocks
the prompt (`promptFeedback.blockReason: SAFETY`, no candidate); malformed, disconnect, stall and delay
as before.
"""

from __future__ import annotations

import asyncio
import json
import uuid
import zlib
from typing import Any

from aiohttp import web

from enginesim.engine import Sequence
from enginesim.output import Output, RequestError, check
from enginesim.server import EngineServer, Fault, garbage, stream_fault
from enginesim.tokenizer import apply_chat_template

STATUSES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
            429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


def gemini_error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"code": status, "message": message,
                                        "status": STATUSES.get(status, "UNKNOWN")}}, status=status)


def _text(parts: list[Any]) -> str:
    out = []
    for p in parts:
        if not isinstance(p, dict):
            continue
        if "text" in p:
            out.append(str(p["text"]))
        elif "functionCall" in p:
            out.append(json.dumps({"name": p["functionCall"].get("name"), "parameters": p["functionCall"].get("args")}))
        elif "functionResponse" in p:
            out.append(json.dumps(p["functionResponse"].get("response")))
    return "".join(out)


def plan_body(body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the conversation as the chat template renders it, the request as output.py reads it)."""
    messages: list[dict[str, Any]] = []
    system = body.get("systemInstruction")
    if isinstance(system, dict):
        messages.append({"role": "system", "content": _text(system.get("parts") or [])})
    for c in body["contents"]:
        messages.append({"role": "assistant" if c["role"] == "model" else "user", "content": _text(c["parts"])})
    last_parts = body["contents"][-1]["parts"]
    plan_messages = list(messages)
    if any(isinstance(p, dict) and "functionResponse" in p for p in last_parts):
        plan_messages.append({"role": "tool", "content": ""})  # a tool's result last: answered in text
    out: dict[str, Any] = {"messages": plan_messages}
    decls = [d for t in body.get("tools") or () if isinstance(t, dict) for d in t.get("functionDeclarations") or ()]
    if decls:
        out["tools"] = [{"type": "function", "function": {
            "name": d.get("name"), "parameters": d.get("parametersJsonSchema") or d.get("parameters")}} for d in decls]
        calling = (body.get("toolConfig") or {}).get("functionCallingConfig") or {}
        allowed = calling.get("allowedFunctionNames") or []
        mode = calling.get("mode", "AUTO")
        named = mode == "ANY" and len(allowed) == 1
        out["tool_choice"] = ({"type": "function", "function": {"name": allowed[0]}} if named
                              else {"ANY": "required", "NONE": "none"}.get(mode, "auto"))
    config = body.get("generationConfig") or {}
    if config.get("stopSequences"):
        out["stop"] = config["stopSequences"]
    thinking = config.get("thinkingConfig") or {}
    budget = thinking.get("thinkingBudget", THINKING_LEVELS.get(str(thinking.get("thinkingLevel")), 0))
    if budget:
        out["thinking_budget"] = 256 if budget == -1 else budget  # -1: the model decides
    if config.get("responseMimeType") == "application/json":
        schema = config.get("responseJsonSchema") or config.get("responseSchema")
        out["response_format"] = ({"type": "json_schema", "json_schema": {"schema": schema}} if schema
                                  else {"type": "json_object"})
    return messages, out


# What safetySettings may name (the API refuses anything else).
HARM_CATEGORIES = frozenset({"HARM_CATEGORY_HARASSMENT", "HARM_CATEGORY_HATE_SPEECH", "HARM_CATEGORY_SEXUALLY_EXPLICIT",
                             "HARM_CATEGORY_DANGEROUS_CONTENT", "HARM_CATEGORY_CIVIC_INTEGRITY"})
HARM_THRESHOLDS = frozenset({"HARM_BLOCK_THRESHOLD_UNSPECIFIED", "BLOCK_LOW_AND_ABOVE", "BLOCK_MEDIUM_AND_ABOVE",
                             "BLOCK_ONLY_HIGH", "BLOCK_NONE", "OFF"})


# A thinking level as a budget of thought tokens (the API takes a level or a budget, not both).
THINKING_LEVELS = {"THINKING_LEVEL_UNSPECIFIED": 0, "MINIMAL": 16, "LOW": 64, "MEDIUM": 256, "HIGH": 1024}
THINKING_KEYS = frozenset({"includeThoughts", "thinkingBudget", "thinkingLevel"})


def _thinking_error(config: Any) -> str | None:
    """generationConfig.thinkingConfig as the API checks it."""
    if not isinstance(config, dict):
        return None
    thinking = config.get("thinkingConfig")
    if thinking is None:
        return None
    if not isinstance(thinking, dict) or set(thinking) - THINKING_KEYS:
        return "Invalid JSON payload received. Unknown name in 'generation_config.thinking_config'"
    budget, level = thinking.get("thinkingBudget"), thinking.get("thinkingLevel")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < -1):
        return "Invalid value at 'generation_config.thinking_config.thinking_budget'"
    if level is not None and level not in THINKING_LEVELS:
        return "Invalid value at 'generation_config.thinking_config.thinking_level'"
    if budget is not None and level is not None:
        return "thinking_budget and thinking_level cannot both be set"
    if not isinstance(thinking.get("includeThoughts", False), bool):
        return "Invalid value at 'generation_config.thinking_config.include_thoughts'"
    return None


class GeminiFrontEnd:
    """Serves Gemini's generateContent from an EngineServer's engine, model, request log and faults."""

    def __init__(self, server: EngineServer, api_key: str | None):
        self.server = server
        self.api_key = api_key
        server.app.router.add_post("/v1beta/models/{call}", self.generate)
        server.refusals = True

    def _check(self, request: web.Request, body: Any, model: str) -> web.Response | None:
        key = request.headers.get("x-goog-api-key") or request.query.get("key")
        if self.api_key is not None and key != self.api_key:
            return gemini_error(400, "API key not valid. Please pass a valid API key.")
        if model != self.server.served_model:
            return gemini_error(404, f"models/{model} is not found for API version v1beta")
        if not isinstance(body, dict):
            return gemini_error(400, "Invalid JSON payload received.")
        contents = body.get("contents")
        if not isinstance(contents, list) or not contents:
            return gemini_error(400, "contents is not specified")
        for i, c in enumerate(contents):
            if not isinstance(c, dict) or c.get("role", "user") not in ("user", "model") or not isinstance(
                    c.get("parts"), list) or not c["parts"]:
                return gemini_error(400, f"contents[{i}]: a role of user or model and at least one part are required")
            c.setdefault("role", "user")
        if int((body.get("generationConfig") or {}).get("candidateCount") or 1) != 1:
            return gemini_error(400, "candidateCount must be 1 here")
        wrong = _thinking_error(body.get("generationConfig"))
        if wrong:
            return gemini_error(400, wrong)
        for i, s in enumerate(body.get("safetySettings") or ()):
            if not isinstance(s, dict) or s.get("category") not in HARM_CATEGORIES:
                return gemini_error(400, f"Invalid value at 'safety_settings[{i}].category'")
            if s.get("threshold") not in HARM_THRESHOLDS:
                return gemini_error(400, f"Invalid value at 'safety_settings[{i}].threshold'")
        return None

    def _count_tokens(self, request: web.Request, body: Any, model: str) -> web.Response:
        """`:countTokens`: the prompt's tokens as generateContent would count them (`totalTokens`), of
        `contents` or of a whole `generateContentRequest` (which names the model it counts for)."""
        whole = body.get("generateContentRequest") if isinstance(body, dict) else None
        if isinstance(whole, dict):
            if whole.get("model") != f"models/{model}":
                return gemini_error(400, "generateContentRequest.model must name the model in the path")
            body = {k: v for k, v in whole.items() if k != "model"}
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex[:16]
        bad = self._check(request, body, model)
        logged = dict(body) if isinstance(body, dict) else {}
        self.server._log_request(rid, request, {**logged, "model": model, "messages": logged.get("contents")},
                                 bad.status if bad else 200)
        if bad is not None:
            return bad
        messages, wants = plan_body(body)
        tokens = len(apply_chat_template(messages, wants.get("tools")))
        return web.json_response({"totalTokens": tokens,
                                  "promptTokensDetails": [{"modality": "TEXT", "tokenCount": tokens}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        srv = self.server
        model, _, method = request.match_info["call"].partition(":")
        if method not in ("generateContent", "streamGenerateContent", "countTokens"):
            return gemini_error(404, f"method {method} not found")
        try:
            body = await request.json()
        except ValueError:
            return gemini_error(400, "Invalid JSON payload received.")
        if method == "countTokens":
            return self._count_tokens(request, body, model)
        fault = srv._take_fault(request, _fault_view(body))
        if isinstance(fault, web.Response):
            return fault
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex[:16]
        bad = self._check(request, body, model)
        logged = dict(body) if isinstance(body, dict) else {}
        logged["model"] = model
        entry = srv._log_request(rid, request, {**logged, "messages": logged.get("contents")},
                                 bad.status if bad else 200)
        if bad is not None:
            return bad
        if fault.garbage is not None:
            return await garbage(request, fault.garbage, method == "streamGenerateContent")
        if fault.status:
            entry["status"] = fault.status
            await asyncio.sleep(fault.delay_ms / 1000)
            return gemini_error(fault.status, f"injected {fault.status}")
        messages, wants = plan_body(body)
        try:
            check(wants)
        except RequestError as e:
            return gemini_error(400, str(e))
        prompt = apply_chat_template(messages, wants.get("tools"))
        max_len = srv.engine.profile.max_model_len
        if len(prompt) >= max_len:
            return gemini_error(400, f"The input token count ({len(prompt)}) exceeds the maximum number of tokens "
                                     f"allowed ({max_len - 1}).")
        if fault.refuse:  # the prompt is blocked: no candidate at all
            usage = {"promptTokenCount": len(prompt), "totalTokenCount": len(prompt)}
            blocked = {"promptFeedback": {"blockReason": "SAFETY"}, "modelVersion": srv.served_model,
                       "responseId": rid, "usageMetadata": usage}
            if method != "streamGenerateContent":
                return web.json_response(blocked)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"data: " + json.dumps(blocked).encode() + b"\r\n\r\n")
            await resp.write_eof()
            return resp
        config = body.get("generationConfig") or {}
        requested = config.get("maxOutputTokens")
        max_tokens = min(requested if isinstance(requested, int) and requested > 0 else max_len, max_len - len(prompt))
        seed = config.get("seed")
        seed = seed if isinstance(seed, int) else zlib.crc32(json.dumps(body["contents"]).encode()) ^ srv.seed
        out, seq = await srv.submit_planned(wants, seed, prompt, max_tokens, rid, fault)
        shown = bool((config.get("thinkingConfig") or {}).get("includeThoughts"))  # thoughts are counted anyway
        try:
            if method == "streamGenerateContent":
                return await self._stream(request, seq, out, rid, fault, shown)
            return await self._complete(seq, out, rid, shown)
        finally:
            srv.engine.abort(seq)
            entry.update(prompt_tokens=len(seq.prompt), cached_tokens=seq.cached_tokens, output_tokens=seq.output_len,
                         finish_reason=seq.finish_reason)

    def _usage(self, seq: Sequence, out: Output) -> dict[str, int]:
        """The answer's tokens as `candidatesTokenCount`, the thoughts' apart (`thoughtsTokenCount`)."""
        thoughts = min(seq.output_len, len(out.thoughts))
        usage = {"promptTokenCount": len(seq.prompt), "candidatesTokenCount": seq.output_len - thoughts,
                 "totalTokenCount": len(seq.prompt) + seq.output_len}
        if thoughts:
            usage["thoughtsTokenCount"] = thoughts
        if seq.cached_tokens:
            usage["cachedContentTokenCount"] = seq.cached_tokens
        return usage

    @staticmethod
    def _finish(seq: Sequence) -> str:
        return "MAX_TOKENS" if seq.finish_reason == "length" else "STOP"

    def _response(self, rid: str, parts: list[dict[str, Any]], finish: str | None,
                  usage: dict[str, int] | None) -> dict[str, Any]:
        cand: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
        if finish:
            cand["finishReason"] = finish
        doc: dict[str, Any] = {"candidates": [cand], "modelVersion": self.server.answer_model, "responseId": rid}
        if usage is not None and "usage" not in self.server.corrupt:
            doc["usageMetadata"] = usage
        return doc

    @staticmethod
    def _parts(out: Output, produced: int, shown: bool) -> list[dict[str, Any]]:
        parts: list[dict[str, Any]] = ([{"text": out.thought(produced), "thought": True}]
                                       if shown and out.thoughts else [])
        if not out.tool_calls:
            return [*parts, {"text": out.text(produced)}]
        for j, call in enumerate(out.tool_calls):
            args = "".join(p for p, owner in zip(out.pieces[:out.answered(produced)], out.owner, strict=False)
                           if owner == j)
            try:
                value: Any = json.loads(args)
            except ValueError:
                value = args  # cut by max_tokens, or a corrupted provider's: sent as it was written
            parts.append({"functionCall": {"name": call.name, "args": value}})
        return parts

    async def _complete(self, seq: Sequence, out: Output, rid: str, shown: bool) -> web.Response:
        produced = 0
        while await seq.out.get() is not None:
            produced += 1
        return web.json_response(self._response(rid, self._parts(out, produced, shown), self._finish(seq),
                                                self._usage(seq, out)))

    async def _stream(self, request: web.Request, seq: Sequence, out: Output, rid: str,
                      fault: Fault, shown: bool) -> web.StreamResponse:
        resp = fault.stream_response({"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(doc: dict[str, Any]) -> None:
            await resp.write(b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\r\n\r\n")

        sent, produced = 0, 0
        while (idx := await seq.out.get()) is not None:
            produced = idx + 1
            if await stream_fault(fault, sent, request, resp, b'data: {"candidates": [\r\n\r\n'):
                return resp
            if fault.error_after is not None and sent >= fault.error_after:
                await send({"error": {"code": 503, "message": "The model is overloaded.", "status": "UNAVAILABLE"}})
                await resp.write_eof()
                return resp
            done = seq.finish_reason is not None and produced == seq.output_len
            thinking, piece = out.piece(idx)
            if thinking:  # (cut while thinking: the last response still finishes)
                if shown or done:
                    await send(self._response(rid, [{"text": piece, "thought": True} if shown else {"text": ""}],
                                              self._finish(seq) if done else None, self._usage(seq, out)))
            elif out.tool_calls:
                # Calls arrive whole: nothing until the last token, then every call at once.
                if done:
                    parts = self._parts(out, produced, False)
                    await send(self._response(rid, parts, self._finish(seq), self._usage(seq, out)))
            else:
                await send(self._response(rid, [{"text": piece}], self._finish(seq) if done else None,
                                          self._usage(seq, out)))
            sent += 1
        await resp.write_eof()
        return resp


def _fault_view(body: Any) -> Any:
    """The request as the fault queue matches it (by the text of its messages)."""
    if isinstance(body, dict) and isinstance(body.get("contents"), list):
        return {"messages": body["contents"]}
    return body
