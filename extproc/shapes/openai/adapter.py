"""The `openai` adapter: vLLM and OpenAI-compatible servers (the engine pool), OpenAI itself, and
Azure OpenAI / Foundry deployments. The internal contract is this shape, so requests and answers pass
as they are; what differs between the three kinds is what each honours (vLLM's sampling extras mean
nothing to OpenAI or Azure) and, for Azure, the path and the key header.

`Target.options["kind"]`: `vllm` (default), `openai` or `azure`; Azure also takes `deployment` (the
path segment) and `api_version`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import orjson

from extproc.chat import CONTRACT_FIELDS
from extproc.shapes.base import NativeRequest, Target
from extproc.shapes.loss import CACHE_CONTROL, LossTable, Support, cache_hinted, losses, without_cache_hints

S = Support
VLLM_ONLY = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "skip_special_tokens",
             "spaces_between_special_tokens", "include_stop_str_in_output")
OPENAI_ONLY = ("verbosity",)  # vLLM's chat completions have no such field (it would be ignored)
VLLM_TABLE: LossTable = {**{name: S.SUPPORTED for name in CONTRACT_FIELDS},
                         **{name: S.UNSUPPORTED for name in OPENAI_ONLY},
                         # not sent: the pool's prefix cache (and OpenAI's prompt caching) keeps prefixes on its own
                         CACHE_CONTROL: S.EMULATED}
HOSTED_TABLE: LossTable = {**VLLM_TABLE, **{name: S.UNSUPPORTED for name in VLLM_ONLY},
                           **{name: S.SUPPORTED for name in OPENAI_ONLY},
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
        if target.options.get("kind", "vllm") != "vllm" and any("reasoning_signature" in m for m in body["messages"]):
            # The gateway's own message field (another provider's signature): OpenAI's API refuses
            # fields it does not know, vLLM ignores them.
            native["messages"] = [{k: v for k, v in m.items() if k != "reasoning_signature"} for m in body["messages"]]
        if cache_hinted(native):  # emulated: the breakpoints are not sent
            native = without_cache_hints(native)
        path, headers = self.endpoint(target)
        return NativeRequest(path, headers, orjson.dumps(native), tuple(lost))

    def counts(self, target: Target) -> bool:
        return target.options.get("kind", "vllm") == "vllm"  # OpenAI and Azure count no chat completion

    def count_request(self, body: Mapping[str, Any], target: Target) -> NativeRequest:
        """vLLM's `/tokenize` with the chat template applied as for generation (the tools rendered too)."""
        native: dict[str, Any] = {"model": target.model, "messages": body["messages"], "add_generation_prompt": True}
        if body.get("tools"):
            native["tools"] = body["tools"]
        return NativeRequest("/tokenize", {"content-type": "application/json"}, orjson.dumps(native))



OPENAI = OpenAIAdapter()
