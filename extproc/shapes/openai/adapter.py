"""The `openai` adapter: vLLM and OpenAI-compatible servers (the engine pool), OpenAI itself, and
Azure OpenAI / Foundry deployments. The internal contract is this shape, so requests and answers pass
as they are; what differs between the three kinds is what each honours (vLLM's sampling extras mean
nothing to OpenAI or Azure) and, for Azure, the path and the key header.

`Target.options["kind"]`: `vllm` (default), `openai` or `azure`; Azure also takes `deployment` (the
path segment) and `api_version`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import orjson

from extproc.chat import CONTRACT_FIELDS
from extproc.contract import ErrorCode
from extproc.shapes.base import Failure, NativeRequest, Target, UpstreamBroken, Usage, token_count
from extproc.shapes.loss import LossTable, Support, losses

S = Support
VLLM_ONLY = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "skip_special_tokens",
             "spaces_between_special_tokens", "include_stop_str_in_output")
VLLM_TABLE: LossTable = {name: S.SUPPORTED for name in CONTRACT_FIELDS}
HOSTED_TABLE: LossTable = {**VLLM_TABLE, **{name: S.UNSUPPORTED for name in VLLM_ONLY},
                           # the tenant's prefix-cache salt: hosted caches are per account (no salt)
                           "cache_salt": S.EMULATED}
TABLES = {"vllm": VLLM_TABLE, "openai": HOSTED_TABLE, "azure": HOSTED_TABLE}


class OpenAIAdapter:
    name = "openai"
    version = 1
    loss_table = VLLM_TABLE  # the pool's; `table(kind)` for the others
    tables = TABLES

    def table(self, kind: str) -> LossTable:
        return TABLES[kind]

    def endpoint(self, target: Target) -> tuple[str, dict[str, str]]:
        """The path and headers of every request to this target."""
        headers = {"content-type": "application/json"}
        if target.options.get("kind") == "azure":
            deployment = quote(target.options.get("deployment", target.model), safe="")
            version = quote(target.options.get("api_version", "2024-10-21"), safe="")
            if target.credential:
                headers["api-key"] = target.credential
            return f"/openai/deployments/{deployment}/chat/completions?api-version={version}", headers
        if target.credential:
            headers["authorization"] = f"Bearer {target.credential}"
        return "/v1/chat/completions", headers

    def request(self, body: Mapping[str, Any], target: Target) -> NativeRequest:
        lost = losses(body, TABLES[target.options.get("kind", "vllm")])
        gone = {x.field for x in lost}
        native = {k: v for k, v in body.items() if k not in gone}
        native["model"] = target.model
        path, headers = self.endpoint(target)
        return NativeRequest(path, headers, orjson.dumps(native), tuple(lost))

    def response(self, status: int, body: bytes) -> dict[str, Any]:
        try:
            doc = json.loads(body)
        except ValueError:
            raise UpstreamBroken("the upstream's answer is not JSON") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("choices"), list):
            raise UpstreamBroken("the upstream's answer is not a chat completion")
        return doc

    def stream(self, include_usage: bool = True) -> PassThrough:
        return PassThrough()

    def failure(self, status: int, body: bytes) -> Failure:
        message = ""
        try:
            err = json.loads(body).get("error") or {}
            message = str(err.get("message", ""))[:500] if isinstance(err, dict) else ""
        except (ValueError, AttributeError):
            pass
        return failure_for_status(status, message)

    def usage(self, native: Mapping[str, Any]) -> Usage:
        details = native.get("prompt_tokens_details") or {}
        out_details = native.get("completion_tokens_details") or {}
        return Usage(token_count(native.get("prompt_tokens")), token_count(details.get("cached_tokens")),
                     token_count(native.get("completion_tokens")), token_count(out_details.get("reasoning_tokens")))


def failure_for_status(status: int, message: str) -> Failure:
    """What an HTTP status means to the contract, whatever the shape (the body refines it)."""
    why = message or f"the upstream answered {status}"
    if status == 429:
        # The provider's limit, not the gateway's: 429 `rate_limited` is the gateway's own quota
        # refusal (the contract's table); a provider's refusal of every attempt is `upstream_error`.
        return Failure(ErrorCode.UPSTREAM_ERROR, 502, why, "rate_limited")
    if status == 529:
        return Failure(ErrorCode.UPSTREAM_ERROR, 502, why, "overloaded")
    if status in (502, 503, 504):
        return Failure(ErrorCode.UPSTREAM_ERROR, 502, why, "unavailable")
    return Failure(ErrorCode.UPSTREAM_ERROR, 502, why)


class PassThrough:
    """The pool's streams are already the internal shape (Envoy's Lua guard checks them)."""

    def feed(self, chunk: bytes) -> list[bytes]:
        return [chunk] if chunk else []

    def finish(self) -> list[bytes]:
        return []


OPENAI = OpenAIAdapter()
