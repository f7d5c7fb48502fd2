"""Adapters: one module per upstream API shape, translating between the gateway's internal contract
(the OpenAI chat completion request, response and stream of extproc/chat.py) and that shape.

Plain values in, plain values out: no Envoy or gRPC types, so each translation is tested on its own
(the attempt filter and the decision call them). Every adapter offers the same five things:

- `request(body, target)`: the native request (path, headers, body) and the loss list
  (extproc/adapters/loss.py) - the fields it could not carry as they are;
- `response(status, body)`: a native JSON answer as the internal chat completion;
- `stream()`: an incremental translator fed the native stream's bytes, returning internal SSE events
  (`data: {chunk}`) - the rest of the gateway (stream guard, metering) sees one shape;
- `failure(status, body)`: a native error as the contract's code and the retry class it counts as;
- `usage(native)`: usage normalised to input, cached input, output and reasoning tokens.

An adapter is named in a deployment's fingerprint as `name@version` (`anthropic@1`); the version
changes when a translation changes, so evidence for the old one no longer qualifies the deployment.
"""

from __future__ import annotations

from collections.abc import Mapping

from extproc.adapters.anthropic import ANTHROPIC
from extproc.adapters.base import Adapter
from extproc.adapters.bedrock import BEDROCK
from extproc.adapters.gemini import GEMINI
from extproc.adapters.loss import LossTable
from extproc.adapters.openai import OPENAI, TABLES

ADAPTERS: dict[str, Adapter] = {"anthropic": ANTHROPIC, "bedrock": BEDROCK, "gemini": GEMINI, "openai": OPENAI}
# The adapter options a deployment may set, per adapter (`adapter_options` in its fingerprint).
OPTIONS = {"openai": {"kind", "deployment", "api_version"}, "bedrock": {"region", "host"}}
ALIASES = {"openai-compat": "openai"}  # the name deployments used before adapters had modules


def adapter_for(ref: str) -> Adapter:
    """The adapter a fingerprint names (`anthropic@1`); KeyError for one this gateway does not have,
    or for another version of it."""
    name, _, version = ref.partition("@")
    adapter = ADAPTERS[ALIASES.get(name, name)]
    if version and version != str(adapter.version):
        raise KeyError(f"{ref}: this gateway's {adapter.name} adapter is version {adapter.version}")
    return adapter


def loss_table(ref: str, options: Mapping[str, str]) -> LossTable:
    """What the adapter `ref`, with a deployment's adapter options, does with each field."""
    adapter = adapter_for(ref)
    return TABLES[options.get("kind", "vllm")] if adapter is OPENAI else adapter.loss_table


def check_options(ref: str, options: Mapping[str, str]) -> str:
    """What is wrong with a deployment's adapter options ("" when nothing)."""
    adapter = adapter_for(ref)
    unknown = sorted(set(options) - OPTIONS.get(adapter.name, set()))
    if unknown:
        return f"the {adapter.name} adapter takes no option {', '.join(unknown)}"
    if adapter is OPENAI and options.get("kind", "vllm") not in TABLES:
        return f"kind must be one of {', '.join(TABLES)}"
    if adapter is BEDROCK and not options.get("region"):
        return "the bedrock adapter needs the option region (the SigV4 signature names it)"
    return ""
