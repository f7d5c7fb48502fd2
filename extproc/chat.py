"""The chat completion request the gateway accepts, and the strings of it an engine renders.

Every field is listed here with its check. A field outside the list is refused with 400
`unsupported_field` naming it (invariant 13: an engine such as vLLM ignores what it does not know, so
forwarding it would drop it silently; some of vLLM's own fields would let a client change the prompt
template, the scheduler priority or the KV transfer). The legacy `functions` / `function_call` name
tools outside `tools`, where authorization reads them: refused, with a pointer to `tools`.

What an engine renders into the prompt is defined once, in `rendered_strings`: the prompt's token
bound (invariant 3) counts it and redaction rewrites it, so the two can never disagree about a field.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

import orjson

from extproc.contract import ErrorCode, GatewayError

MAX_INT32 = 2**31 - 1
MAX_JSON_DEPTH = 32  # of the free-form JSON objects (tool parameters, response schemas)
MAX_TOOLS = 128
MAX_STRING_FIELD = 256  # ids, names, user
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
LEGACY_TOOL_FIELDS = ("functions", "function_call")


def invalid(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(ErrorCode.INVALID_REQUEST, message, param)


def unsupported(param: str, why: str = "") -> GatewayError:
    return GatewayError(ErrorCode.UNSUPPORTED_FIELD, f"`{param}` is not supported by this gateway{why}", param)


def parse_json(raw: bytes) -> Any:
    """The body as JSON. orjson refuses what would fail later: invalid UTF-8, lone surrogates, NaN,
    numbers beyond a double, nesting beyond 1024 levels (no Python recursion, no RecursionError)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise invalid(f"request body is not valid JSON: {e}") from None


# -- small checks ---------------------------------------------------------------------------------

def _is_number(v: Any) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and math.isfinite(v))


def _int(lo: int, hi: int) -> Callable[[Any, str], None]:
    def check(v: Any, param: str) -> None:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise invalid(f"`{param}` must be an integer from {lo} to {hi}", param)
    return check


def _number(lo: float, hi: float) -> Callable[[Any, str], None]:
    def check(v: Any, param: str) -> None:
        if not _is_number(v) or not lo <= v <= hi:
            raise invalid(f"`{param}` must be a number from {lo:g} to {hi:g}", param)
    return check


def _bool(v: Any, param: str) -> None:
    if not isinstance(v, bool):
        raise invalid(f"`{param}` must be a boolean", param)


def _short_str(v: Any, param: str) -> None:
    if not isinstance(v, str) or len(v) > MAX_STRING_FIELD:
        raise invalid(f"`{param}` must be a string of at most {MAX_STRING_FIELD} characters", param)


def _one_of(*values: str) -> Callable[[Any, str], None]:
    def check(v: Any, param: str) -> None:
        if v not in values:
            raise invalid(f"`{param}` must be one of {', '.join(values)}", param)
    return check


def _str(v: Any, param: str) -> None:
    if not isinstance(v, str):
        raise invalid(f"`{param}` must be a string", param)


def _object(v: Any, param: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise invalid(f"`{param}` must be an object", param)
    return v


def _array(v: Any, param: str, most: int) -> list[Any]:
    if not isinstance(v, list) or len(v) > most:
        raise invalid(f"`{param}` must be an array of at most {most} entries", param)
    return v


def _keys(obj: dict[str, Any], allowed: frozenset[str], param: str) -> None:
    for k in obj:
        if k not in allowed:
            raise unsupported(f"{param}.{k}")


def _tool_name(v: Any, param: str) -> str:
    if not isinstance(v, str) or TOOL_NAME.fullmatch(v) is None:
        raise invalid(f"`{param}` must be 1-64 letters, digits, '_' or '-'", param)
    return v


def json_depth_ok(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether no object or array nests deeper than `limit` (iterative: no recursion to exhaust)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            children: Any = v.values()
        elif isinstance(v, list):
            children = v
        else:
            continue
        if depth > limit:
            return False
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return True


def _free_json(v: Any, param: str) -> None:
    _object(v, param)
    if not json_depth_ok(v):
        raise invalid(f"`{param}` nests deeper than {MAX_JSON_DEPTH} levels", param)


# -- compound fields ------------------------------------------------------------------------------

def _stop(v: Any, param: str) -> None:
    if isinstance(v, str):
        return
    for i, s in enumerate(_array(v, param, 16)):
        _str(s, f"{param}[{i}]")


def _stream_options(v: Any, param: str) -> None:
    _keys(_object(v, param), frozenset({"include_usage", "continuous_usage_stats"}), param)
    for k, flag in v.items():
        _bool(flag, f"{param}.{k}")


def _logit_bias(v: Any, param: str) -> None:
    obj = _object(v, param)
    if len(obj) > 1024:
        raise invalid(f"`{param}` holds more than 1024 entries", param)
    for k, bias in obj.items():
        if not k.isascii() or not k.isdigit():
            raise invalid(f"`{param}` keys must be token ids", param)
        _number(-100, 100)(bias, f"{param}.{k}")


def _response_format(v: Any, param: str) -> None:
    obj = _object(v, param)
    _keys(obj, frozenset({"type", "json_schema"}), param)
    kind = obj.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise invalid(f"`{param}.type` must be text, json_object or json_schema", f"{param}.type")
    if kind == "json_schema":
        schema = _object(obj.get("json_schema"), f"{param}.json_schema")
        _keys(schema, frozenset({"name", "schema", "strict", "description"}), f"{param}.json_schema")
        _short_str(schema.get("name", ""), f"{param}.json_schema.name")
        if "schema" in schema:
            _free_json(schema["schema"], f"{param}.json_schema.schema")
        if "strict" in schema and schema["strict"] is not None:
            _bool(schema["strict"], f"{param}.json_schema.strict")
        if "description" in schema:
            _str(schema["description"], f"{param}.json_schema.description")


_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


def _cache_control(v: Any, param: str) -> None:
    """A prompt-caching breakpoint on a part or a tool (Anthropic's `cache_control`): the prompt up to
    here may be cached, for five minutes or an hour. A provider that caches prompts on its own (the
    pool's prefix cache, OpenAI's, Gemini's) is not sent it (extproc/shapes/loss.py CACHE_CONTROL)."""
    _keys(_object(v, param), frozenset({"type", "ttl"}), param)
    if v.get("type") != "ephemeral":
        raise invalid(f"`{param}.type` must be ephemeral", f"{param}.type")
    if v.get("ttl") is not None and v["ttl"] not in ("5m", "1h"):
        raise invalid(f"`{param}.ttl` must be 5m or 1h", f"{param}.ttl")


def _tools(v: Any, param: str) -> None:
    names = set()
    for i, tool in enumerate(_array(v, param, MAX_TOOLS)):
        at = f"{param}[{i}]"
        _keys(_object(tool, at), frozenset({"type", "function", "cache_control"}), at)
        if tool.get("cache_control") is not None:
            _cache_control(tool["cache_control"], f"{at}.cache_control")
        if tool.get("type") != "function":
            raise unsupported(f"{at}.type", ": only function tools")
        fn = _object(tool.get("function"), f"{at}.function")
        _keys(fn, _FUNCTION_KEYS, f"{at}.function")
        names.add(_tool_name(fn.get("name"), f"{at}.function.name"))
        if fn.get("description") is not None:
            _str(fn["description"], f"{at}.function.description")
        if fn.get("parameters") is not None:
            _free_json(fn["parameters"], f"{at}.function.parameters")
        if fn.get("strict") is not None:
            _bool(fn["strict"], f"{at}.function.strict")
    if len(names) != len(v):
        raise invalid(f"`{param}` names a function twice", param)


def _tool_choice(v: Any, param: str) -> None:
    if v in ("none", "auto", "required"):
        return
    obj = _object(v, param)
    _keys(obj, frozenset({"type", "function"}), param)
    if obj.get("type") != "function":
        raise invalid(f"`{param}` must be none, auto, required or a function", param)
    fn = _object(obj.get("function"), f"{param}.function")
    _keys(fn, frozenset({"name"}), f"{param}.function")
    _tool_name(fn.get("name"), f"{param}.function.name")


# Top-level fields: OpenAI's chat completion parameters a self-hosted OpenAI-compatible engine honours,
# and vLLM's sampling extensions that change nothing but the sampling of this one request.
TOP_LEVEL: dict[str, Callable[[Any, str], None]] = {
    "model": _short_str,
    "stream": _bool,
    "stream_options": _stream_options,
    "max_tokens": _int(1, MAX_INT32),
    "max_completion_tokens": _int(1, MAX_INT32),
    "temperature": _number(0, 2),
    "top_p": _number(0, 1),
    "frequency_penalty": _number(-2, 2),
    "presence_penalty": _number(-2, 2),
    "stop": _stop,
    "seed": _int(-(2**63), 2**63 - 1),
    "logprobs": _bool,
    "top_logprobs": _int(0, 20),
    "logit_bias": _logit_bias,
    "response_format": _response_format,
    "tools": _tools,
    "tool_choice": _tool_choice,
    "parallel_tool_calls": _bool,
    "user": _short_str,
    "cache_salt": _str,  # always replaced by the tenant's (invariant 10)
    # answered by the model: each adapter's loss table says which candidates honour them
    "reasoning_effort": _one_of("none", "minimal", "low", "medium", "high", "xhigh"),
    "verbosity": _one_of("low", "medium", "high"),
    # vLLM's sampling extensions
    "top_k": _int(-1, MAX_INT32),
    "min_p": _number(0, 1),
    "repetition_penalty": _number(0.01, 10),
    "min_tokens": _int(0, MAX_INT32),
    "ignore_eos": _bool,
    "skip_special_tokens": _bool,
    "spaces_between_special_tokens": _bool,
    "include_stop_str_in_output": _bool,
}
# `reasoning_signature`: a provider's signature over the reasoning, as the gateway's answers carry it
# (a conversation replays it, and an Anthropic-shaped provider takes the reasoning back only with it).
_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "refusal", "reasoning",
                           "reasoning_content", "reasoning_signature", "annotations", "audio", "function_call"})
# Keys the openai SDK writes back into a conversation from an earlier answer; only empty values carry.
_EMPTY_ONLY = ("annotations", "audio", "function_call")


def _content(v: Any, param: str, required: bool) -> None:
    if v is None:
        if required:
            raise invalid(f"`{param}` is required", param)
        return
    if isinstance(v, str):
        return
    if not isinstance(v, list):
        raise invalid(f"`{param}` must be a string or an array of parts", param)
    for j, part in enumerate(v):
        at = f"{param}[{j}]"
        _object(part, at)
        if part.get("type") != "text":
            raise unsupported(f"{at}.type", ": only text parts (no deployment here takes other inputs)")
        _keys(part, frozenset({"type", "text", "cache_control"}), at)
        _str(part.get("text"), f"{at}.text")
        if part.get("cache_control") is not None:
            _cache_control(part["cache_control"], f"{at}.cache_control")


def _tool_calls(v: Any, param: str) -> None:
    for i, call in enumerate(_array(v, param, MAX_TOOLS)):
        at = f"{param}[{i}]"
        _keys(_object(call, at), frozenset({"id", "type", "function", "index"}), at)
        _short_str(call.get("id"), f"{at}.id")
        if call.get("type", "function") != "function":
            raise unsupported(f"{at}.type", ": only function calls")
        fn = _object(call.get("function"), f"{at}.function")
        _keys(fn, frozenset({"name", "arguments"}), f"{at}.function")
        _tool_name(fn.get("name"), f"{at}.function.name")
        _str(fn.get("arguments"), f"{at}.function.arguments")


def _message(m: Any, i: int) -> None:
    at = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise invalid(f"{at} needs a `role` of {sorted(ROLES)}", f"{at}.role")
    _keys(m, _MESSAGE_KEYS, at)
    role = m["role"]
    for k in _EMPTY_ONLY:
        if m.get(k):
            raise unsupported(f"{at}.{k}", ": use `tool_calls`" if k == "function_call" else "")
    _content(m.get("content"), f"{at}.content", required=role != "assistant")
    for k in ("name", "tool_call_id"):
        if m.get(k) is not None:
            _short_str(m[k], f"{at}.{k}")
    for k in ("refusal", "reasoning", "reasoning_content", "reasoning_signature"):
        if m.get(k) is not None:
            _str(m[k], f"{at}.{k}")
    if m.get("tool_calls") is not None:
        if role != "assistant":
            raise invalid(f"only assistant messages carry `tool_calls` ({at})", f"{at}.tool_calls")
        _tool_calls(m["tool_calls"], f"{at}.tool_calls")
    if role == "tool" and not isinstance(m.get("tool_call_id"), str):
        raise invalid(f"a tool message needs `tool_call_id` ({at})", f"{at}.tool_call_id")


# Every top-level field of the request contract besides `messages` (`n` is checked against the
# gateway's limit in `validate`); adapters declare what they do with each (extproc/shapes/).
CONTRACT_FIELDS = (*TOP_LEVEL, "n")


def validate(body: Any, max_messages: int, max_n: int) -> dict[str, Any]:
    """The request as a dict, once every field is known and well-formed; else the contract's 400."""
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    for legacy in LEGACY_TOOL_FIELDS:
        if legacy in body:
            raise unsupported(legacy, ": use `tools` and `tool_choice`")
    for key, value in body.items():
        if key == "messages" or (key == "n" and value is not None):
            continue
        check = TOP_LEVEL.get(key)
        if check is None:
            raise unsupported(key)
        if value is not None or key == "model":
            check(value, key)
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise invalid("`model` must name a route", "model")
    if body.get("n") is not None:
        _int(1, max_n)(body["n"], "n")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("`messages` must be a non-empty array", "messages")
    if len(messages) > max_messages:
        raise invalid(f"`messages` holds more than {max_messages} entries", "messages")
    for i, m in enumerate(messages):
        _message(m, i)
    if body.get("stream_options") is not None and body.get("stream") is not True:
        raise invalid("`stream_options` needs `stream: true`", "stream_options")
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        offered = {t["function"]["name"] for t in body.get("tools") or ()}
        if choice["function"]["name"] not in offered:
            raise invalid("`tool_choice` names a function that `tools` does not offer", "tool_choice.function.name")
    elif choice in ("required",) and not body.get("tools"):
        raise invalid("`tool_choice: required` needs `tools`", "tool_choice")
    return body


# -- what the engine renders ----------------------------------------------------------------------

# Message fields a chat template renders besides `content` (tool calls are rendered as JSON).
RENDERED_MESSAGE_FIELDS = ("name", "tool_call_id", "refusal", "reasoning", "reasoning_content")


def utf8_len(s: str) -> int:
    return len(s.encode("utf-8"))


def json_text_bound(value: Any) -> int:
    """Bytes of the longest JSON text a template may render for a value: Jinja's `tojson` escapes
    non-ASCII (`\u00e9` is 6 bytes where UTF-8 has 2) and puts spaces after separators; this is at
    least that, and at least the compact UTF-8 form."""
    return len(json.dumps(value))


def prompt_bytes(body: dict[str, Any]) -> int:
    """UTF-8 bytes of everything the template renders into the prompt, with tool calls and tool
    definitions as their longest JSON text (an upper bound on the token count for byte-level BPE and
    byte-fallback tokenizers; the template's own tokens are the per-message allowance)."""
    total = 0
    for m in body.get("messages") or ():
        content = m.get("content")
        if isinstance(content, str):
            total += utf8_len(content)
        elif isinstance(content, list):
            total += sum(utf8_len(p.get("text") or "") for p in content)
        for k in RENDERED_MESSAGE_FIELDS:
            if isinstance(m.get(k), str):
                total += utf8_len(m[k])
        if m.get("tool_calls"):
            total += json_text_bound(m["tool_calls"])
    if body.get("tools"):
        total += json_text_bound(body["tools"])
    return total


def map_json_strings(value: Any, fn: Callable[[str], str]) -> Any:
    """A copy of free-form JSON with every string (keys too) passed through fn (iteratively bounded by
    the depth check at intake)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, list):
        return [map_json_strings(v, fn) for v in value]
    if isinstance(value, dict):
        return {fn(k): map_json_strings(v, fn) for k, v in value.items()}
    return value


def map_rendered(body: dict[str, Any], fn: Callable[[str], str],
                 tool_name: Callable[[str, str], str]) -> dict[str, Any]:
    """A copy of the body with every rendered string passed through fn, and every tool name through
    tool_name(name, param) (which may refuse: a tool name is an identifier, not text to rewrite)."""
    messages = []
    for i, m in enumerate(body["messages"]):
        m = dict(m)
        content = m.get("content")
        if isinstance(content, str):
            m["content"] = fn(content)
        elif isinstance(content, list):
            m["content"] = [{**p, "text": fn(p["text"])} for p in content]
        for k in RENDERED_MESSAGE_FIELDS:
            if isinstance(m.get(k), str):
                m[k] = fn(m[k])
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "id": fn(c["id"]), "function": {
                    "name": tool_name(c["function"]["name"], f"messages[{i}].tool_calls[{j}].function.name"),
                    "arguments": fn(c["function"]["arguments"])}}
                for j, c in enumerate(m["tool_calls"])]
        messages.append(m)
    out = {**body, "messages": messages}
    if body.get("tools"):
        tools = []
        for i, t in enumerate(body["tools"]):
            f = dict(t["function"])
            f["name"] = tool_name(f["name"], f"tools[{i}].function.name")
            if isinstance(f.get("description"), str):
                f["description"] = fn(f["description"])
            if f.get("parameters") is not None:
                f["parameters"] = map_json_strings(f["parameters"], fn)
            tools.append({**t, "function": f})
        out["tools"] = tools
    return out
