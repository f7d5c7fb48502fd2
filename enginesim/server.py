"""A vLLM-compatible OpenAI server over the simulated engine (aiohttp).

Endpoints as vLLM serves them: POST /v1/chat/completions (stream or not, include_usage, [DONE]),
GET /v1/models, GET /health, GET /version, GET /metrics (vLLM's names), POST /tokenize, and with
VLLM_SERVER_DEV_MODE=1 (as vLLM) POST /reset_prefix_cache. Simulator-only:
GET/DELETE /admin/requests (what this engine received), POST/DELETE /admin/faults (inject faults),
GET /admin/invoice (what a provider would bill for it, as CSV).

Faults are the operator's: queued by the admin endpoint (`{"fault": SPEC, "count": N, "match": TEXT}`:
the next N requests whose messages contain TEXT, or any request without `match`), which the gateway
never routes a client to. A request header `x-enginesim-fault: SPEC` is honoured only when the engine
runs with `--fault-header` (the simulator's own tests): `llmgw up` never sets it, and the gateway
forwards no such header anyway. SPEC is one or more of:
  status=503          answer that status (vLLM's error body) before any header
  delay_ms=300        wait before answering
  stall_after=3       send 3 chunks, then go silent (until the client goes away); the pool's JSON
                      answer: its status, headers and first 3 bytes, then silence
  disconnect_after=3  send 3 chunks, then drop the connection; the pool's JSON answer: generated whole,
                      then the connection dropped before its headers (an engine's worker lost after
                      the work was done: the client cannot know whether it ran)
  malformed_after=3   send 3 chunks, then a chunk that is not JSON, then end
  stray_after=3       (the pool's streams) send 3 chunks, then an event that is JSON but no chunk, then go on
  end_after=3         send 3 chunks, then end the answer cleanly, without the stream's own end
  end_delay_ms=500    (the pool's streams) wait after [DONE] before ending the answer
  bloat=1048576       the answer's text grows by about that many bytes (each token's text padded, the
                      token count unchanged), and a stream's events all go out in one write at its end
                      (as a proxy that buffers the provider's answer sends them): a large answer the
                      gateway must carry, translate or refuse without falling over
  usage=-7            (the pool's and the Anthropic front end's answers) report this JSON value as the
                      completion's token count: a broken engine's usage (-7, 1e300, 2.5, "7", true),
                      which the gateway must not believe
  refuse              (a hosted provider's front end) refuse as that provider does: its safety stop
                      (vLLM never refuses: an engine without such a front end rejects the fault)
  tool_name=NAME      a model that misbehaves: every tool call it writes names this tool (offered or
                      not), and a text answer becomes a call of it when the request offered tools
  tool_args=TEXT      every tool call's arguments are this text (percent-encoded in SPEC: not JSON,
                      JSON missing a required property, an amount over a policy's limit)
  content=TEXT        a text answer is this text (percent-encoded: prose where JSON was asked for,
                      JSON outside the requested schema)
  html                (the pool) a 200 whose body is an HTML page, as a misconfigured proxy answers
  exit                end the whole process at once
A request whose client goes away before its answer ended is marked `cancelled` in the request log
(what a provider sees of a gateway that passes a client's cancellation on).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
import urllib.parse
import uuid
import zlib
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from enginesim.engine import Engine, Sequence
from enginesim.metrics import render_metrics
from enginesim.oracle import Oracle
from enginesim.output import Output, RequestError, check, logprob_entry, plan, thinking_plan
from enginesim.physics import EngineProfile, profile
from enginesim.tokenizer import TextSampler, apply_chat_template, encode

log = logging.getLogger("enginesim")
FAULT_HEADER = "x-enginesim-fault"
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # vLLM's switch for its development endpoints (cache resets among them)


def dev_mode() -> bool:
    return os.environ.get(DEV_MODE_ENV, "0").strip().lower() in ("1", "true")
CREDENTIAL_HEADERS = ("authorization", "x-api-key", "api-key", "x-goog-api-key", "x-amz-security-token")
SYSTEM_FINGERPRINT = "vllm-0.32.0-enginesim"  # the vLLM release whose API this simulator follows
_STATUS_TYPES = {400: "BadRequestError", 404: "NotFoundError", 429: "RateLimitError",
                 500: "InternalServerError", 503: "ServiceUnavailableError"}


def vllm_error(status: int, message: str, param: str | None = None, type_: str | None = None) -> web.Response:
    """vLLM's error body: `code` is the HTTP status as an integer."""
    body = {"error": {"message": message, "type": type_ or _STATUS_TYPES.get(status, "APIError"), "param": param,
                      "code": status}}
    return web.json_response(body, status=status)


def schema_error(loc: str, kind: str, msg: str) -> web.Response:
    """vLLM's answer to a body that fails request validation (FastAPI/pydantic)."""
    return vllm_error(400, f"1 validation error:\n  {{'type': '{kind}', 'loc': '{loc}', 'msg': '{msg}'}}",
                      loc, "Bad Request")


@dataclass
class Fault:
    status: int | None = None
    delay_ms: int = 0
    stall_after: int | None = None
    disconnect_after: int | None = None
    malformed_after: int | None = None
    stray_after: int | None = None  # (the pool's streams) a JSON event that is no chunk after N chunks
    end_after: int | None = None  # a clean end (the chunked encoding's last chunk) without the stream's own
    end_delay_ms: int = 0  # the pool's streams: the answer's end this long after [DONE]
    error_after: int | None = None  # (the Anthropic front end) an `error` event after N deltas
    garbage: int | None = None  # a 200 whose body is random bytes from this seed (JSON or stream)
    usage: str | None = None  # (the pool's and Anthropic's answers) the JSON text reported as the output count
    refuse: bool = False  # (hosted front ends) the provider's safety stop instead of an answer
    bloat: int = 0  # bytes of text added to the answer; a stream then goes out in one write
    exit: bool = False
    tool_name: str | None = None  # a misbehaving model: the name its tool calls give
    tool_args: str | None = None  # ... the arguments they carry
    content: str | None = None  # ... the text it answers
    html: bool = False  # a 200 that is an HTML page

    def stream_response(self, headers: dict[str, str]) -> web.StreamResponse:
        """A stream's response: held whole and written at once when the answer is bloated."""
        return HeldStream(headers=headers) if self.bloat else web.StreamResponse(headers=headers)

    def shape(self, out: Output) -> Output:
        """The output as this fault leaves it: its text padded by `bloat` bytes."""
        if self.bloat:
            out.bloat(self.bloat)
        out.misbehave(self.tool_name, self.tool_args, self.content)
        return out

    @classmethod
    def parse(cls, spec: str) -> Fault:
        f = cls()
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, _, value = part.partition("=")
            if key in ("exit", "refuse", "html"):
                setattr(f, key, True)
            elif key in ("tool_name", "tool_args", "content"):
                setattr(f, key, urllib.parse.unquote(value))
            elif key == "usage":
                json.loads(value)  # a JSON value, or the fault is refused
                f.usage = value
            elif key in ("status", "delay_ms", "stall_after", "disconnect_after", "malformed_after", "stray_after",
                         "end_after",
                         "end_delay_ms", "error_after", "garbage", "bloat"):
                setattr(f, key, int(value))
            else:
                raise ValueError(f"unknown fault {key!r}")
        return f


class HeldStream(web.StreamResponse):
    """A stream whose writes are held and sent in one write at its end."""

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self._held: list[bytes] = []
        self._ended = False

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        self._held.append(bytes(data))

    async def write_eof(self, data: bytes = b"") -> None:
        if self._ended:  # aiohttp ends a handler's response again once the handler returns it
            return
        self._ended = True
        await super().write(b"".join(self._held) + data)
        self._held.clear()
        await super().write_eof()


async def garbage(request: web.Request, seed: int, stream: bool) -> web.StreamResponse:
    """A provider gone wrong: 200 and random bytes, as a JSON body or as a stream of chunks."""
    rng = random.Random(seed)
    if not stream:
        return web.Response(body=rng.randbytes(rng.randint(0, 2000)), content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for _ in range(rng.randint(1, 6)):
        chunk = rng.randbytes(rng.randint(1, 300))
        await resp.write(rng.choice([chunk, b"data: " + chunk + b"\n\n"]))
    await resp.write_eof()
    return resp


HTML_PAGE = "<!doctype html><html><head><title>Welcome</title></head><body><h1>It works!</h1></body></html>\n"


async def stalled(request: web.Request, answer: web.Response, sent: int) -> web.StreamResponse:
    """A whole JSON answer's status and headers and its first `sent` bytes, then silence (until the
    client or the gateway gives up): a provider whose body stalls after a 200."""
    body = answer.body if isinstance(answer.body, bytes) else b""
    resp = web.StreamResponse(status=answer.status, headers={"Content-Type": answer.content_type,
                                                             "Content-Length": str(len(body))})
    await resp.prepare(request)
    await resp.write(body[:sent])
    await asyncio.sleep(3600)
    return resp


async def stream_fault(fault: Fault, sent: int, request: web.Request, resp: web.StreamResponse,
                       malformed: bytes) -> bool:
    """The fault due after `sent` chunks of a stream: go silent (until the client or the gateway gives
    up), drop the connection, send `malformed` and end, or just end. True when the stream ended."""
    if fault.stall_after is not None and sent >= fault.stall_after:
        await asyncio.sleep(3600)
    if fault.disconnect_after is not None and sent >= fault.disconnect_after:
        if request.transport is not None:
            request.transport.abort()
        return True
    if fault.malformed_after is not None and sent >= fault.malformed_after:
        await resp.write(malformed)
        await resp.write_eof()
        return True
    if fault.stray_after is not None and sent == fault.stray_after:  # once; the stream goes on
        await resp.write(b'data: {"id": "stray", "object": "notice", "note": "not a chunk"}\n\n')
    if fault.end_after is not None and sent >= fault.end_after:
        await resp.write_eof()
        return True
    return False


@dataclass
class QueuedFault:
    fault: Fault
    match: str  # "" = any request

    def applies(self, body: Any) -> bool:
        if not self.match:
            return True
        messages = body.get("messages") if isinstance(body, dict) else None
        return self.match in json.dumps(messages, ensure_ascii=False)


ENGINE_VERSION = "0.11.0"  # the vLLM release whose server this simulator speaks for (GET /version)


class EngineServer:
    def __init__(self, engine: Engine, served_model: str, seed: int = 0, fault_header: bool = False,
                 corrupt: frozenset[str] = frozenset()):
        self.engine = engine
        self.corrupt = corrupt  # a corrupted provider: "usage" never sent, "tool_calls" that do not parse
        self.served_model = served_model
        self.seed = seed
        self.fault_header = fault_header
        self.requests: deque[dict[str, Any]] = deque(maxlen=10_000)
        self.faults: list[QueuedFault] = []
        self.refusals = False  # set by a front end that can refuse (vLLM never does)
        # vLLM serves generation or pooling: a pooling runner (enginesim/embeddings_api.py) sets this
        # False and answers /v1/embeddings; neither has the other's endpoint (vLLM registers only the
        # routes of its runner's tasks: FastAPI's 404).
        self.generates = True
        self.reasoning_parser = ""  # vLLM's --reasoning-parser: the model thinks first, its reasoning apart
        self.oracle: Oracle | None = None  # the operator's answer quality (enginesim/oracle.py)
        self.engine_version = ENGINE_VERSION  # what GET /version says (--engine-version)
        # The model its answers name (--answer-model): the served one, unless the operator makes it a
        # provider that quietly answers with another model than the one asked for.
        self.answer_model = served_model
        self.embed: Callable[[web.Request], Awaitable[web.StreamResponse]] | None = None
        self.app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._cancellations])
        self.app.router.add_post("/v1/chat/completions", self.chat)
        self.app.router.add_post("/v1/embeddings", self.embeddings)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/version", self.version)
        self.app.router.add_get("/metrics", self.metrics)
        self.app.router.add_post("/tokenize", self.tokenize)
        self.app.router.add_get("/admin/requests", self.list_requests)
        self.app.router.add_delete("/admin/requests", self.clear_requests)
        self.app.router.add_post("/admin/faults", self.add_faults)
        self.app.router.add_get("/admin/invoice", self.invoice)
        self.app.router.add_delete("/admin/faults", self.clear_faults)
        if dev_mode():  # vLLM serves its cache-reset endpoint only in dev mode, and so does the simulator
            self.app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        self.app.on_startup.append(self._start)
        self.app.on_cleanup.append(self._stop)

    @web.middleware
    async def _cancellations(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """A request whose client went away is logged `cancelled`, however the server learned it: its
        handler cancelled (the connection closed while it waited), or a write failing on the closed
        connection (it closed while the handler was about to write: seen under load)."""
        try:
            return await handler(request)
        except (asyncio.CancelledError, ConnectionResetError):  # aiohttp's ClientConnectionResetError too
            rid = request.headers.get("X-Request-Id")
            for entry in reversed(self.requests) if rid else ():
                if entry["request_id"] == rid:
                    entry["cancelled"] = True
                    break
            raise

    async def _start(self, _: web.Application) -> None:
        self.engine.start()

    async def _stop(self, _: web.Application) -> None:
        await self.engine.stop()

    # -- plain endpoints ---------------------------------------------------------------------------

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": self.engine_version})  # vLLM's GET /version

    async def models(self, _: web.Request) -> web.Response:
        now = int(time.time())
        return web.json_response({"object": "list", "data": [{
            "id": self.served_model, "object": "model", "created": now, "owned_by": "vllm",
            "root": self.served_model, "parent": None, "max_model_len": self.engine.profile.max_model_len,
            "permission": [{"id": f"modelperm-{uuid.uuid4().hex[:16]}", "object": "model_permission",
                            "created": now, "allow_create_engine": False, "allow_sampling": True,
                            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                            "allow_fine_tuning": False, "organization": "*", "group": None,
                            "is_blocking": False}]}]})

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=render_metrics(self.engine, self.served_model),
                            content_type="text/plain", charset="utf-8")

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return vllm_error(400, "request body is not valid JSON")
        if "messages" in body:
            tokens = apply_chat_template(body["messages"], body.get("tools"))
        elif isinstance(body.get("prompt"), str):
            tokens = encode(body["prompt"])
        else:
            return vllm_error(400, "either `prompt` or `messages` is required")
        self._log_request(request.headers.get("X-Request-Id") or uuid.uuid4().hex[:16], request, body, 200)
        return web.json_response({"count": len(tokens), "max_model_len": self.engine.profile.max_model_len,
                                  "tokens": tokens, "token_strs": None})

    async def list_requests(self, _: web.Request) -> web.Response:
        return web.json_response(list(self.requests))

    async def clear_requests(self, _: web.Request) -> web.Response:
        self.requests.clear()
        return web.Response(status=204)

    async def add_faults(self, request: web.Request) -> web.Response:
        body = await request.json()
        try:
            fault = Fault.parse(body["fault"])
        except (KeyError, ValueError) as e:
            return vllm_error(400, f"bad fault: {e}")
        if fault.refuse and not self.refusals:
            return vllm_error(400, "bad fault: this API has no refusal to inject (vLLM never refuses)")
        self.faults.extend([QueuedFault(fault, str(body.get("match") or ""))] * int(body.get("count", 1)))
        return web.json_response({"queued": len(self.faults)})

    async def invoice(self, request: web.Request) -> web.Response:
        """What this provider bills for the requests it answered, as CSV: per UTC day and model, input
        tokens (cache reads and writes included), cached input tokens (reads), output tokens and their
        amount at the prices in the query (`input_per_mtok`, `cached_input_per_mtok`, `output_per_mtok`
        and, for cache writes, `cache_write_per_mtok` and `cache_write_1h_per_mtok`, which default to the
        input's and the writes' rate: micro-units of `currency` per million tokens). `discrepancy=SEED`:
        one day's output tokens are off by a few, as a provider's bill sometimes is."""
        q = request.query
        try:
            base = [int(q.get(k, "0")) for k in ("input_per_mtok", "cached_input_per_mtok", "output_per_mtok")]
            write = int(q.get("cache_write_per_mtok", base[0]))
            prices = [*base, write, int(q.get("cache_write_1h_per_mtok", write))]
        except ValueError:
            return vllm_error(400, "prices are integers (micro-units per million tokens)")
        days: dict[tuple[str, str], list[int]] = {}
        for e in self.requests:
            if e.get("status") != 200 or e.get("prompt_tokens") is None:
                continue
            day = time.strftime("%Y-%m-%d", time.gmtime(e["time"]))
            row = days.setdefault((day, str(e.get("model") or self.served_model)), [0, 0, 0, 0, 0])
            row[0] += int(e["prompt_tokens"])
            row[1] += int(e.get("cached_tokens") or 0)
            row[2] += int(e.get("output_tokens") or 0)
            row[3] += int(e.get("cache_write_tokens") or 0)
            row[4] += int(e.get("cache_write_1h_tokens") or 0)
        if q.get("discrepancy") and days:
            rng = random.Random(int(q["discrepancy"]))
            days[rng.choice(sorted(days))][2] += rng.randint(3, 40)
        lines = ["date,model,input_tokens,cached_input_tokens,output_tokens,currency,amount"]
        for (day, model), (inp, cached, out, written, written_1h) in sorted(days.items()):
            micros = ((inp - cached - written - written_1h) * prices[0] + cached * prices[1] + out * prices[2]
                      + written * prices[3] + written_1h * prices[4]) / 1e6
            lines.append(f"{day},{model},{inp},{cached},{out},{q.get('currency', 'USD')},{micros / 1e6:.6f}")
        return web.Response(text="\n".join(lines) + "\n", content_type="text/csv")

    async def clear_faults(self, _: web.Request) -> web.Response:
        self.faults.clear()
        return web.json_response({"queued": 0})

    async def reset_prefix_cache(self, _: web.Request) -> web.Response:
        """Empty the prefix cache (a cold-cache benchmark pass). As vLLM 0.32 answers: 200 with
        `{"success": false}` while sequences hold blocks (the caller may retry)."""
        return web.json_response({"success": self.engine.kv.reset_prefix_cache()})

    # -- chat completions --------------------------------------------------------------------------

    def _validate(self, body: Any) -> web.Response | None:
        if not isinstance(body, dict):
            return schema_error("body", "model_attributes_type", "Input should be a valid dictionary")
        if not isinstance(body.get("messages"), list):
            return schema_error("body.messages", "missing", "Field required")
        if body.get("model") != self.served_model:
            return vllm_error(404, f"The model `{body.get('model')}` does not exist. Valid aliases: "
                                   f"{self.served_model}.", "model")
        if not body["messages"]:
            return vllm_error(400, "Cannot apply chat template to an empty conversation. Provide at least "
                                   "one message.")
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            return vllm_error(400, "Parameter 'cache_salt' must be a non-empty string if provided. "
                                   "(parameter=cache_salt)", "cache_salt")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            return vllm_error(400, f"max_tokens must be at least 1, got {max_tokens}. "
                                   f"(parameter=max_tokens, value={max_tokens})", "max_tokens")
        try:
            check(body)  # tools, tool_choice, logprobs, response_format, image parts
        except RequestError as e:
            return vllm_error(400, str(e), e.param)
        # `priority` without priority scheduling is accepted and ignored, as vLLM 0.32 does.
        return None

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        if self.embed is None:
            return web.json_response({"detail": "Not Found"}, status=404)
        return await self.embed(request)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        if not self.generates:
            return web.json_response({"detail": "Not Found"}, status=404)
        try:
            body = await request.json()
        except ValueError:
            return schema_error("body", "json_invalid", "JSON decode error")
        fault = self._take_fault(request, body)
        if isinstance(fault, web.Response):
            return fault
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex[:16]
        bad = self._validate(body)
        entry = self._log_request(rid, request, body, 400 if bad else 200)
        if bad is not None:
            return bad
        if fault.exit:
            os._exit(3)
        if fault.garbage is not None:
            return await garbage(request, fault.garbage, bool(body.get("stream")))
        if fault.html:
            return web.Response(text=HTML_PAGE, content_type="text/html")
        if fault.status:
            entry["status"] = fault.status  # the request log says what the engine answered
            await asyncio.sleep(fault.delay_ms / 1000)
            return vllm_error(fault.status, f"injected fault: status {fault.status}")

        prompt = apply_chat_template(body["messages"], body.get("tools"))
        max_len = self.engine.profile.max_model_len
        requested = body.get("max_completion_tokens") or body.get("max_tokens")
        if requested is not None and requested > max_len:
            return vllm_error(400, f"max_tokens={requested} cannot be greater than max_model_len={max_len}. "
                                   f"Please request fewer output tokens. (parameter=max_tokens, value={requested})",
                              "max_tokens")
        if len(prompt) >= max_len:
            return vllm_error(400, (
                f"This model's maximum context length is {max_len} tokens. However, your prompt contains at "
                f"least {len(prompt)} input tokens, which exceeds this limit even without any output tokens. "
                f"Please reduce the length of the input prompt. (parameter=input_tokens, value={len(prompt)})"),
                "input_tokens")
        # Like vLLM 0.32: generation stops at the context window rather than being refused.
        max_tokens = min(requested or max_len, max_len - len(prompt))
        seed = body.get("seed")
        seed = seed if isinstance(seed, int) else zlib.crc32(json.dumps(body["messages"]).encode()) ^ self.seed
        n = body.get("n") if isinstance(body.get("n"), int) and body["n"] > 0 else 1
        # `n` completions of one prompt, as vLLM runs them: one sequence each (sharing the prompt's
        # cached blocks), each sampled on its own; what each writes is decided by enginesim/output.py.
        # vLLM's `ignore_eos` sampling parameter: text generated until max_tokens.
        lengths = [max_tokens if body.get("ignore_eos") is True else TextSampler(seed + i).natural_length
                   for i in range(n)]
        outputs = [fault.shape(self.known(body, rid) or plan(body, seed + i, lengths[i], rid)) for i in range(n)]
        if "tool_calls" in self.corrupt:
            for o in outputs:
                o.mangle_tool_calls()
        if self.reasoning_parser:  # a reasoning model thinks first; its tokens count toward max_tokens
            for i, o in enumerate(outputs):
                o.think(max_tokens, seed + i)
        seqs = [Sequence(request_id=rid if i == 0 else f"{rid}-{i}", prompt=prompt, max_tokens=max_tokens,
                         natural_length=o.natural_length, salt=body.get("cache_salt"), arrival=self.engine.now())
                for i, o in enumerate(outputs)]
        top = body.get("top_logprobs") or 0
        logprobs = top if body.get("logprobs") is True else None
        if fault.delay_ms:
            await asyncio.sleep(fault.delay_ms / 1000)
        for seq in seqs:
            self.engine.submit(seq)
        try:
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return await self._stream(request, seqs, outputs, rid, include_usage, fault, logprobs)
            answer = await self._complete(seqs, outputs, rid, logprobs, fault)
            if fault.disconnect_after is not None and request.transport is not None:
                request.transport.abort()  # the work done, the answer never sent
                return answer
            if fault.stall_after is not None:  # a JSON answer: its headers and first bytes, then silence
                return await stalled(request, answer, fault.stall_after)
            return answer
        finally:
            for seq in seqs:
                self.engine.abort(seq)  # a no-op when it finished; frees the engine when the client left
            # Simulated seconds, for benchmarks that read the engine's view of latency.
            first = seqs[0]
            entry.update(prompt_tokens=len(first.prompt), output_tokens=sum(s.output_len for s in seqs),
                         cached_tokens=first.cached_tokens,
                         ttft_s=None if first.first_token_at is None else first.first_token_at - first.arrival,
                         finish_reason=first.finish_reason)

    async def submit_planned(self, wants: dict[str, Any], seed: int, prompt: list[int], max_tokens: int, rid: str,
                             fault: Fault) -> tuple[Output, Sequence]:
        """One answer of a provider-shaped front end: its output plan (corrupted when the server is),
        its sequence, the fault's delay, then the engine."""
        out = fault.shape(self.known(wants, rid) or thinking_plan(wants, seed, TextSampler(seed).natural_length, rid))
        if "tool_calls" in self.corrupt:
            out.mangle_tool_calls()
        seq = Sequence(request_id=rid, prompt=prompt, max_tokens=max_tokens, natural_length=out.natural_length,
                       salt=None, arrival=self.engine.now())
        if fault.delay_ms:
            await asyncio.sleep(fault.delay_ms / 1000)
        self.engine.submit(seq)
        return out, seq

    def known(self, body: dict[str, Any], rid: str) -> Output | None:
        """The oracle's right answer, when the operator set one and it knows this task."""
        return self.oracle.answer(body, rid) if self.oracle is not None else None

    def _take_fault(self, request: web.Request, body: Any) -> Fault | web.Response:
        spec = request.headers.get(FAULT_HEADER) if self.fault_header else None
        try:
            if spec:
                return Fault.parse(spec)
        except ValueError as e:
            return vllm_error(400, str(e))
        for i, queued in enumerate(self.faults):
            if queued.applies(body):
                del self.faults[i]
                return queued.fault
        return Fault()

    def _log_request(self, rid: str, request: web.Request, body: Any, status: int) -> dict[str, Any]:
        body = body if isinstance(body, dict) else {}
        self.requests.append({
            "request_id": rid, "time": time.time(), "path": request.path_qs, "status": status,
            "model": body.get("model"),
            "cache_salt": body.get("cache_salt"), "stream": bool(body.get("stream")),
            "messages": body.get("messages"), "max_tokens": body.get("max_tokens"),
            "stream_options": body.get("stream_options"),
            "fields": sorted(body),  # which request fields arrived (what a gateway forwarded)
            # Credentials are never logged: only whether one came.
            "headers": {k.lower(): v for k, v in request.headers.items() if k.lower() not in CREDENTIAL_HEADERS},
            "authorization_present": "Authorization" in request.headers,
            "api_key_present": any(h in request.headers for h in CREDENTIAL_HEADERS),
        })
        return self.requests[-1]

    def _base(self, rid: str, obj: str) -> dict[str, Any]:
        return {"id": f"chatcmpl-{rid}", "object": obj, "created": int(time.time()), "model": self.answer_model}

    @staticmethod
    def _usage(seqs: list[Sequence], fault: Fault) -> dict[str, Any]:
        """The prompt once, the completions summed over the `n` choices (vLLM's usage); a `usage`
        fault's value in place of the completion's count."""
        prompt, completion = len(seqs[0].prompt), sum(s.output_len for s in seqs)
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                "completion_tokens": completion if fault.usage is None else json.loads(fault.usage)}

    async def _complete(self, seqs: list[Sequence], outputs: list[Output], rid: str,
                        logprobs: int | None, fault: Fault) -> web.Response:
        choices = []
        for i, (seq, out) in enumerate(zip(seqs, outputs, strict=True)):
            produced = 0
            while await seq.out.get() is not None:
                produced += 1
            answered = out.pieces[:out.answered(produced)]
            calls = [{"id": c.id, "type": "function",
                      "function": {"name": c.name, "arguments": "".join(
                          p for p, owner in zip(answered, out.owner, strict=False) if owner == j)}}
                     for j, c in enumerate(out.tool_calls)]
            # vLLM's message has no `tool_calls` key when there are none; `reasoning` is the reasoning
            # parser's (null without one).
            message = {"role": "assistant", "content": None if calls else out.text(produced), "refusal": None,
                       "annotations": None, "audio": None, "function_call": None,
                       **({"tool_calls": calls} if calls else {}),
                       "reasoning": out.thought(produced) if out.thoughts else None}
            choices.append({"index": i, "message": message,
                            "logprobs": None if logprobs is None else {"content": [
                                logprob_entry(p, k, logprobs)
                                for k, p in enumerate([*out.thoughts, *out.pieces][:produced])]},
                            "finish_reason": self._finish(seq, out), "stop_reason": out.stop_reason,
                            "token_ids": None, "routed_experts": None})
        return web.json_response({
            **self._base(rid, "chat.completion"),
            "choices": choices,
            "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
            **({} if "usage" in self.corrupt else {
                "usage": {**self._usage(seqs, fault), "prompt_tokens_details": None,
                          "completion_tokens_details": None}}),
            "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None, "kv_transfer_params": None,
            "ec_transfer_params": None, "metrics": None,
        })

    @staticmethod
    def _finish(seq: Sequence, out: Output) -> str | None:
        """The API's finish_reason: the engine's (length, abort) or, for a natural end, the output's."""
        return seq.finish_reason if seq.finish_reason != "stop" else out.finish_reason(seq.output_len)

    async def _stream(self, request: web.Request, seqs: list[Sequence], outputs: list[Output], rid: str,
                      include_usage: bool, fault: Fault, logprobs: int | None) -> web.StreamResponse:
        resp = fault.stream_response({"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        base = self._base(rid, "chat.completion.chunk")

        async def send(obj: Any) -> None:
            await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

        for i in range(len(seqs)):
            await send({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}],
                        "prompt_token_ids": None, "prompt_text": None})
        # The choices' tokens, in the order the engine produces them (choice, token; None: finished).
        merged: asyncio.Queue[tuple[int, int | None]] = asyncio.Queue()

        async def forward(i: int, seq: Sequence) -> None:
            while (token := await seq.out.get()) is not None:
                merged.put_nowait((i, token))
            merged.put_nowait((i, None))
        forwarders = [asyncio.ensure_future(forward(i, s)) for i, s in enumerate(seqs)]
        running, sent = len(seqs), 0
        try:
            while running:
                i, idx = await merged.get()
                if idx is None:
                    running -= 1
                    continue
                if await stream_fault(fault, sent, request, resp, b'data: {"id": "broken", "choices": [\n\n'):
                    return resp
                seq, out = seqs[i], outputs[i]
                done = seq.finish_reason is not None and idx + 1 == seq.output_len  # its last token
                thinking, piece = out.piece(idx)
                delta = {"reasoning": piece} if thinking else self._delta(out, idx - len(out.thoughts))
                choice: dict[str, Any] = {"index": i, "delta": delta,
                                          "logprobs": None if logprobs is None else {
                                              "content": [logprob_entry(piece, idx, logprobs)]},
                                          "finish_reason": None}
                if done:
                    choice["finish_reason"] = self._finish(seq, out)
                    choice["stop_reason"] = out.stop_reason
                choice["token_ids"] = None
                await send({**base, "choices": [choice]})
                sent += 1
        finally:
            for f in forwarders:
                f.cancel()
        if include_usage and "usage" not in self.corrupt:
            await send({**base, "choices": [], "usage": self._usage(seqs, fault),
                        "system_fingerprint": SYSTEM_FINGERPRINT})
        await resp.write(b"data: [DONE]\n\n")
        if fault.end_delay_ms:
            await asyncio.sleep(fault.end_delay_ms / 1000)
        await resp.write_eof()
        return resp


    @staticmethod
    def _delta(out: Output, idx: int) -> dict[str, Any]:
        """A stream's delta for token `idx`: text, or a tool call's arguments (with its id, type and
        name on the call's first token, as vLLM's tool parsers stream them)."""
        if not out.tool_calls:
            return {"content": out.pieces[idx]}
        j = out.owner[idx]
        call: dict[str, Any] = {"index": j, "function": {"arguments": out.pieces[idx]}}
        if idx == 0 or out.owner[idx - 1] != j:
            c = out.tool_calls[j]
            call = {"index": j, "id": c.id, "type": "function", "function": {"name": c.name,
                                                                            "arguments": out.pieces[idx]}}
        return {"tool_calls": [call]}


def build_engine(profile_name: str, time_scale: float, prefix_caching: bool = True, **overrides: Any) -> Engine:
    prof: EngineProfile = profile(profile_name, **{k: v for k, v in overrides.items() if v is not None})
    return Engine(prof, time_scale=time_scale, prefix_caching=prefix_caching)
