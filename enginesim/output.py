"""What the simulated model writes for one choice, decided before the engine schedules it: text, tool
calls or a JSON document, cut by `stop` strings, as vLLM's OpenAI server shapes it.

The engine core only times tokens (enginesim/engine.py); this module says what each token is. The
rules are deterministic so that a conformance case states its expected outcome:

- `tools` with `tool_choice` "none": text. "auto" (the default when tools are given): tool calls when
  the last turn is the user's (a tool result last: the model answers in text). System turns after it
  (an agent's reminders between turns, as Claude Code sends them) are instructions, not a turn. "required": tool
  calls. A named function: that one call.
- Which tools: those whose names the last user message mentions, in order (all of them when
  `parallel_tool_calls` is not false, else the first); none mentioned: the first tool.
- Arguments: a JSON object generated from the function's parameter schema (its required properties
  only, where it names them, as models leave optional ones to their defaults; types, enums, nested
  objects and arrays), seeded like the text.
- `response_format` json_object: a small JSON object; json_schema: a document matching the schema.
- `stop`: the text (a JSON document's too) ends before the first stop string, finish_reason "stop",
  `stop_reason` the string.
- finish_reason as vLLM reports it: "tool_calls" for auto and required, "stop" for a named function,
  "length" when max_tokens cut the output (tool arguments then do not parse, as on vLLM).
"""

from __future__ import annotations

import json
import math
import random
import zlib
from dataclasses import dataclass, field
from typing import Any

from enginesim.tokenizer import _PIECE, _WORDS, TextSampler


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass
class Output:
    pieces: list[str]  # one per token, in order; for tool calls, their arguments' tokens
    owner: list[int] = field(default_factory=list)  # per piece: the tool call it belongs to
    tool_calls: list[ToolCall] = field(default_factory=list)
    natural_finish: str = "stop"  # when the output ends by itself
    stop_reason: str | None = None  # the stop string that ended it
    # A thinking model's reasoning, generated (and counted as output) before the pieces above.
    thoughts: list[str] = field(default_factory=list)

    @property
    def natural_length(self) -> int:
        return len(self.thoughts) + len(self.pieces)

    def finish_reason(self, produced: int) -> str:
        return "length" if produced < self.natural_length else self.natural_finish

    def answered(self, produced: int) -> int:
        """Of `produced` tokens, how many are the answer's (after the thoughts)."""
        return max(0, produced - len(self.thoughts))

    def text(self, produced: int) -> str:
        return "".join(self.pieces[:self.answered(produced)])

    def thought(self, produced: int) -> str:
        return "".join(self.thoughts[:produced])

    def piece(self, idx: int) -> tuple[bool, str]:
        """Token `idx` of the output: (whether it is a thought, its text)."""
        at = len(self.thoughts)
        return (True, self.thoughts[idx]) if idx < at else (False, self.pieces[idx - at])

    def think(self, budget: int, seed: int) -> None:
        """Reasoning before the answer: a few dozen tokens, never more than `budget`."""
        sampler = TextSampler(seed ^ 0x7468696E)
        self.thoughts = [sampler.next_piece(i) for i in range(min(budget, 8 + seed % 24))]

    def bloat(self, extra: int) -> None:
        """The simulator's `bloat` fault: about `extra` more bytes of text, spread over the tokens (each
        one's text padded with a word repeated; their number unchanged). Tool calls' arguments stay as
        they are: padding would break their JSON."""
        if self.tool_calls or not self.pieces:
            return
        each = -(-extra // len(self.pieces))  # ceil
        self.pieces = [p + (" " + "lorem" * (each // 5 + 1))[:each] for p in self.pieces]

    def misbehave(self, tool_name: str | None, tool_args: str | None, content: str | None) -> None:
        """An operator's faults of a model that answers what it should not (enginesim/server.py): its
        calls renamed, their arguments replaced, its text replaced. A text answer becomes a call when a
        name is given (a model calling a tool the request never offered)."""
        if tool_name is not None and not self.tool_calls:
            self.tool_calls = [ToolCall("chatcmpl-tool-injected", tool_name, "{}")]
            self.pieces, self.owner, self.natural_finish = _tokens("{}"), [0], "tool_calls"
        for call in self.tool_calls:
            call.name = tool_name if tool_name is not None else call.name
        if tool_args is not None and self.tool_calls:
            self.pieces, self.owner = [], []
            for j, call in enumerate(self.tool_calls):
                call.arguments = tool_args
                toks = _tokens(tool_args) or [tool_args]
                self.pieces += toks
                self.owner += [j] * len(toks)
        if content is not None and not self.tool_calls:
            self.pieces = _tokens(content) or [content]

    def mangle_tool_calls(self) -> None:
        """The simulator's corrupted-provider mode: each call's arguments open with `[` for `{`, so
        they no longer parse (a conformance run must notice)."""
        for j in range(len(self.tool_calls)):
            first = self.owner.index(j)
            self.pieces[first] = "[" + self.pieces[first][1:]


class RequestError(ValueError):
    """A request vLLM refuses with 400; the message and param are vLLM's."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _tokens(text: str) -> list[str]:
    return _PIECE.findall(text)


def _tool_names(tools: list[Any]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def check(body: dict[str, Any]) -> None:
    """vLLM's 400s for the fields this module reads."""
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools):
        raise RequestError("tools must be a list of function tools with a name", "tools")
    choice = body.get("tool_choice")
    if choice not in (None, "none", "auto", "required"):
        name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
        if not isinstance(name, str):
            raise RequestError("Invalid tool_choice", "tool_choice")
        if name not in _tool_names(tools):
            raise RequestError(f"Tool '{name}' has not been passed in `tools`.", "tool_choice")
    if choice == "required" and not tools:
        raise RequestError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    top = body.get("top_logprobs")
    if top is not None:
        if not body.get("logprobs"):
            raise RequestError("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        if not isinstance(top, int) or not 0 <= top <= 20:
            raise RequestError("`top_logprobs` must be a positive value.", "top_logprobs")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema")):
        raise RequestError("response_format.type must be one of text, json_object, json_schema", "response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and not isinstance(
            (fmt.get("json_schema") or {}).get("schema"), dict):
        raise RequestError("response_format.json_schema.schema is required", "response_format")
    for m in body.get("messages") or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in content):
            # A text-only model: vLLM's chat template refuses multimodal parts.
            raise RequestError("The model does not support multimodal input: image_url parts are not accepted",
                               "messages")


def _last_user_text(messages: list[Any]) -> str | None:
    """The last turn's text when it is the user's (system turns after it are not turns); None when it
    is not (a tool result, ...)."""
    turns = [m for m in messages if not (isinstance(m, dict) and m.get("role") in ("system", "developer"))]
    last = turns[-1] if turns else None
    if not isinstance(last, dict) or last.get("role") != "user":
        return None
    content = last.get("content")
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


def from_schema(schema: Any, rng: random.Random, depth: int = 0) -> Any:
    """A value matching a JSON schema's common keywords (type, properties, required, enum, items)."""
    if not isinstance(schema, dict):
        return None
    if schema.get("enum"):
        return rng.choice(schema["enum"])
    if "const" in schema:
        return schema["const"]
    kind = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        props = schema.get("properties") or {}
        if depth > 4:
            return {}
        # The required properties, as models fill a tool's arguments (an optional one is left to its
        # default); a schema that names none required has all of them written.
        required = schema.get("required")
        wanted = required if isinstance(required, list) else list(props)
        return {k: from_schema(v, rng, depth + 1) for k, v in props.items() if k in wanted}
    if kind == "array":
        n = max(int(schema.get("minItems", 1)), 1)
        return [from_schema(schema.get("items") or {}, rng, depth + 1) for _ in range(n)]
    if kind == "integer":
        low, high = int(schema.get("minimum", 0)), int(schema.get("maximum", 100))
        return rng.randint(low, max(low, high))
    if kind == "number":
        # A whole number, as models write counts and sizes (`timeout_ms: 16`): a client may read a
        # `number` field into an integer type (Codex's `yield_time_ms`), and a whole number is a number.
        lo, hi = float(schema.get("minimum", 0)), float(schema.get("maximum", 100))
        whole = rng.randint(math.ceil(lo), max(math.ceil(lo), math.floor(hi)))
        return whole if lo <= whole <= max(lo, hi) else lo
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 3)))


def _text(sampler: TextSampler, length: int, stop: list[str]) -> Output:
    return _cut_at_stop([sampler.next_piece(i) for i in range(length)], stop)


def _cut_at_stop(pieces: list[str], stop: list[str]) -> Output:
    """The output as written up to the first stop string (vLLM checks them on every text it writes, a
    structured output's JSON too): finish "stop", `stop_reason` the string."""
    if not stop:
        return Output(pieces)
    text = ""
    for k, piece in enumerate(pieces):
        text += piece
        hits = [(text.find(s), s) for s in stop if s and s in text]
        if hits:
            pos, s = min(hits)
            # The text ends before the stop string; the tokens that produced it still count.
            kept, start = [], 0
            for p in pieces[:k + 1]:
                kept.append(p[:max(0, pos - start)])
                start += len(p)
            return Output(kept, natural_finish="stop", stop_reason=s)
    return Output(pieces)


def plan(body: dict[str, Any], seed: int, natural_length: int, rid: str) -> Output:
    """What this choice writes (`natural_length`: the text's length when it is text; ignore_eos
    stretches text to max_tokens)."""
    rng = random.Random(seed)
    tools = body.get("tools") or []
    choice = body.get("tool_choice", "auto" if tools else "none")
    user_text = _last_user_text(body.get("messages") or [])
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if named or choice == "required" or (choice == "auto" and tools and user_text is not None):
        if named:
            names = [named]
        else:
            mentioned = sorted((n for n in by_name if user_text and n in user_text), key=lambda n: user_text.find(n))  # type: ignore[union-attr]
            names = mentioned or [next(iter(by_name))]
            if body.get("parallel_tool_calls") is False:
                names = names[:1]
        out = Output([], natural_finish="stop" if named else "tool_calls")
        for i, name in enumerate(names):
            args = json.dumps(from_schema(by_name[name].get("parameters") or {"type": "object"}, rng))
            out.tool_calls.append(ToolCall(f"chatcmpl-tool-{rid[:12]}{i:02d}{rng.getrandbits(32):08x}", name, args))
            toks = _tokens(args)
            out.pieces += toks
            out.owner += [i] * len(toks)
        return out
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else [s for s in stop or [] if isinstance(s, str)]
    fmt = body.get("response_format") or {}
    if fmt.get("type") in ("json_object", "json_schema"):
        schema = (fmt.get("json_schema") or {}).get("schema") if fmt["type"] == "json_schema" else {
            "type": "object", "properties": {"answer": {"type": "string"}}}
        return _cut_at_stop(_tokens(json.dumps(from_schema(schema, rng))), stops)
    return _text(TextSampler(seed), natural_length, stops)


def thinking_plan(body: dict[str, Any], seed: int, natural_length: int, rid: str) -> Output:
    """`plan`, with the reasoning a provider's thinking setting asks for (`thinking_budget`, set by a
    provider front end's plan_body) generated first."""
    out = plan(body, seed, natural_length, rid)
    budget = body.get("thinking_budget")
    if isinstance(budget, int) and budget > 0:
        out.think(budget, seed)
    return out


def logprob_entry(piece: str, index: int, top: int) -> dict[str, Any]:
    """vLLM's per-token logprobs entry: the sampled token first among its `top` alternatives."""
    rng = random.Random(zlib.crc32(f"{index}:{piece}".encode()))
    lp = -round(rng.uniform(0.0, 2.5), 4)
    alts = [{"token": piece, "logprob": lp, "bytes": list(piece.encode())}]
    for w in rng.sample(_WORDS, k=min(top, len(_WORDS))):
        if len(alts) >= top:
            break
        if " " + w != piece:
            alt_lp = round(lp - rng.uniform(0.1, 5.0), 4)
            alts.append({"token": " " + w, "logprob": alt_lp, "bytes": list((" " + w).encode())})
    return {"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": alts[:top]}
