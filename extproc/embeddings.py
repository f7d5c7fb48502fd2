"""`POST /v1/embeddings`: OpenAI's embeddings request, checked and carried through the same stages as a
chat completion.

Every stage reads the internal request, so an embeddings request becomes one at intake: each input a
user message (what authorization, the size bound, redaction and routing read), nothing to generate,
and the request's own options kept aside (`Embedding`). The route stage writes the upstream's body
back in the embeddings shape from the messages as redaction left them (`upstream_body`); the answer's
`usage.prompt_tokens` is what settlement charges, as for a chat completion's prompt.

Taken: `model` (an `embeddings` route), `input` (a string or a list of up to 2048 non-empty strings),
`encoding_format` (`float` or `base64`, passed on: the openai SDK asks for base64 and decodes it),
`user` (passed on). Refused, naming the field: token-id inputs (neither the policy nor redaction can
read them), `dimensions` (no candidate here changes its vectors' length), anything else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from extproc import chat
from extproc.contract import ErrorCode, GatewayError

MAX_INPUTS = 2048  # OpenAI's limit per request
FIELDS = frozenset({"model", "input", "encoding_format", "user"})


@dataclass(frozen=True)
class Embedding:
    """What an embeddings request asks besides its inputs."""

    encoding_format: str = "float"
    user: str | None = None


def request(raw: bytes) -> tuple[dict[str, Any], Embedding]:
    """(the internal request: each input a user message; the request's options), GatewayError on bad input."""
    doc = chat.parse_json(raw)
    if not isinstance(doc, dict):
        raise chat.invalid("the request body must be a JSON object")
    for name in doc:
        if name == "dimensions":
            raise chat.unsupported("dimensions", ": no candidate here changes the length of its vectors")
        if name not in FIELDS:
            raise chat.unsupported(name, "")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise chat.invalid("`model` is required", "model")
    inputs = doc.get("input")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs:
        raise chat.invalid("`input` must be a string or a non-empty list of strings", "input")
    if len(inputs) > MAX_INPUTS:
        raise chat.invalid(f"`input` holds at most {MAX_INPUTS} items", "input")
    for i, item in enumerate(inputs):
        if isinstance(item, (int, list)):
            raise GatewayError(ErrorCode.UNSUPPORTED_FIELD, "token-id inputs are not carried: the policy and "
                               "redaction read text", f"input[{i}]")
        if not isinstance(item, str) or not item:
            raise chat.invalid("each input must be a non-empty string", f"input[{i}]")
    encoding = doc.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise chat.invalid("`encoding_format` must be float or base64", "encoding_format")
    user = doc.get("user")
    if user is not None and not isinstance(user, str):
        raise chat.invalid("`user` must be a string", "user")
    body = {"model": model, "messages": [{"role": "user", "content": text} for text in inputs]}
    return body, Embedding(encoding, user)


def longest_input(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the context window sees it: each input is a sequence of its own, so the longest
    must fit (the reservation still holds them all)."""
    longest = max((m["content"] for m in body["messages"]), key=chat.utf8_len)
    return {"model": body["model"], "messages": [{"role": "user", "content": longest}]}


def upstream_body(body: dict[str, Any], options: Embedding, served_model: str) -> dict[str, Any]:
    """The embeddings request an upstream gets: the inputs as redaction left them, in order."""
    out: dict[str, Any] = {"model": served_model, "input": [m["content"] for m in body["messages"]],
                           "encoding_format": options.encoding_format}
    if options.user is not None:
        out["user"] = options.user
    return out
