"""`POST /v1/embeddings` as vLLM's pooling runner serves it (`vllm serve --runner pooling`, checked
against vLLM 0.32's CPU build): one engine serves either generation or pooling, never both, so a
pooling engine has no chat completions and a generating one no embeddings (404, FastAPI's
`{"detail": "Not Found"}`: vLLM registers only its runner's routes).

Request: `model` (the served name, else 404), `input` (a string, a list of strings, a list of token
ids or a list of such lists; never empty), `encoding_format` (`float`, the default, or `base64`: the
vector's float32 bytes, little-endian, as the openai SDK decodes them), `dimensions` (refused: the
model has no matryoshka representation, as vLLM refuses it), `user`. Each input is a sequence through
the simulated engine - a prefill of its tokens (the special beginning token added) and no decode - so
embeddings queue and batch beside each other like the engine's own work; an input longer than the
model's window is 400. Answer: `data` (one `embedding` per input, by `index`), the served `model`,
`usage` (`prompt_tokens` = `total_tokens`, the inputs' tokens).

The vector: a fixed pseudo-random direction per token, summed over the input's tokens and normalised
to unit length, so one text always embeds the same, texts that share words lie closer together, and
nothing depends on the request's order or batch.
"""

from __future__ import annotations

import asyncio
import base64
import math
import random
import struct
import uuid
from functools import lru_cache
from typing import Any

from aiohttp import web

from enginesim.engine import Sequence
from enginesim.server import EngineServer, vllm_error
from enginesim.tokenizer import encode

BEGIN_OF_TEXT = 128000


@lru_cache(maxsize=65536)
def _direction(token: int, dim: int) -> tuple[float, ...]:
    rng = random.Random(token * 1_000_003 + dim)
    return tuple(rng.gauss(0.0, 1.0) for _ in range(dim))


def embed(tokens: list[int], dim: int) -> list[float]:
    """The unit vector of a token sequence (the sum of its tokens' directions, normalised)."""
    total = [0.0] * dim
    for t in tokens:
        for i, x in enumerate(_direction(t, dim)):
            total[i] += x
    norm = math.sqrt(sum(x * x for x in total)) or 1.0
    return [x / norm for x in total]


def _inputs(value: Any) -> list[list[int]] | str:
    """The request's inputs as token sequences; a message (str) when `input` is not one of its forms."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        value = [value]
    if not isinstance(value, list) or not value:
        return "input must be a non-empty string, list of strings, or list of token ids"
    out = []
    for item in value:
        if isinstance(item, str):
            out.append([BEGIN_OF_TEXT, *encode(item)])
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in item):
            out.append(list(item))
        else:
            return "each input must be a string or a list of token ids"
    return out


class EmbeddingsFrontEnd:
    """Serves `/v1/embeddings` from an EngineServer's engine, for an engine started as a pooling runner."""

    def __init__(self, server: EngineServer, dim: int):
        self.server = server
        self.dim = dim
        server.embed = self.embeddings
        server.generates = False  # chat completions: "The model does not support Chat Completions API"

    async def embeddings(self, request: web.Request) -> web.Response:
        srv = self.server
        try:
            body = await request.json()
        except ValueError:
            return vllm_error(400, "request body is not valid JSON")
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex[:16]
        logged = dict(body) if isinstance(body, dict) else {}
        texts = logged.get("input")
        entry = srv._log_request(rid, request, {**logged, "messages": texts if isinstance(texts, list) else [texts]},
                                 200)
        bad = self._check(body)
        if bad is not None:
            entry["status"] = bad.status
            return bad
        inputs = _inputs(body["input"])
        assert not isinstance(inputs, str)
        seqs = [Sequence(request_id=f"{rid}-{i}", prompt=tokens, max_tokens=1, natural_length=1, salt=None,
                         arrival=srv.engine.now()) for i, tokens in enumerate(inputs)]
        for seq in seqs:
            srv.engine.submit(seq)
        try:  # a prefill each; the one token sampled after it is the pooler's output, not text
            await asyncio.gather(*(self._done(seq) for seq in seqs))
        finally:
            for seq in seqs:
                srv.engine.abort(seq)
        data = [{"index": i, "object": "embedding", "embedding": self._encoded(embed(tokens, self.dim),
                                                                                body.get("encoding_format"))}
                for i, tokens in enumerate(inputs)]
        tokens = sum(len(t) for t in inputs)
        entry.update(prompt_tokens=tokens, cached_tokens=0, output_tokens=0, finish_reason="stop")
        return web.json_response({"id": f"embd-{rid}", "object": "list", "created": int(srv.engine.now()),
                                  "model": srv.served_model, "data": data,
                                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                                            "prompt_tokens_details": None, "completion_tokens_details": None}})

    @staticmethod
    async def _done(seq: Sequence) -> None:
        while await seq.out.get() is not None:
            pass

    @staticmethod
    def _encoded(vector: list[float], encoding: Any) -> list[float] | str:
        if encoding == "base64":
            return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        return vector

    def _check(self, body: Any) -> web.Response | None:
        srv = self.server
        if not isinstance(body, dict):
            return vllm_error(400, "request body must be a JSON object")
        if body.get("model") not in (None, srv.served_model):
            return vllm_error(404, f"The model `{body.get('model')}` does not exist.", type_="NotFoundError")
        inputs = _inputs(body.get("input"))
        if isinstance(inputs, str):
            return vllm_error(400, inputs, "input")
        if body.get("encoding_format", "float") not in ("float", "base64"):
            return vllm_error(400, "encoding_format must be float or base64", "encoding_format")
        if body.get("dimensions") is not None:
            return vllm_error(400, f"Model '{srv.served_model}' does not support Matryoshka embeddings; dimensions "
                                   f"must be unset (received dimensions={body['dimensions']}).")
        window = srv.engine.profile.max_model_len
        longest = max(len(t) for t in inputs)
        if longest > window:
            return vllm_error(400, f"This model's maximum context length is {window} tokens. However, you requested "
                                   f"{longest} tokens in the input for embedding generation. Please reduce the length "
                                   "of the input.", "input")
        return None
