"""The conformance corpus (extproc/corpora/conformance-*.yaml) as validated objects, the normalised outcome
of one case as the gateway's client saw it, and the checks that compare the two. Pure: no processes,
no HTTP (runner.py sends the requests)."""

from __future__ import annotations

import base64
import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import jsonschema
import yaml
from pydantic import BaseModel, ConfigDict, Field

from extproc.corpora import CONFORMANCE, digest_of

CORPORA = CONFORMANCE  # by what a deployment serves: chat completions, or embeddings
CORPUS = CORPORA["chat"]
OVER_CONTEXT = "$over_context_window"  # a content placeholder: more words than the candidate's window


class Expect(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    status: int | tuple[int, ...]  # several: any of them (then `error` is the non-200 one's code)
    error: str | None = None
    finish_reason: tuple[str, ...] | None = None
    content: Literal["nonempty", "empty", "json_object"] | dict[str, Any] | None = None
    excludes: str | None = None
    tool_calls: tuple[str, ...] | None = None
    usage: Literal["consistent", "absent"] | None = None
    output_tokens: int | None = None
    choices: int | None = None
    logprobs: int | None = None
    stream_end: Literal["done", "interrupted", "cut"] | None = None
    same_content: bool = False  # (embeddings: the same vectors)
    vectors: int | None = None  # embeddings: this many, of one length, finite, of unit length
    ledger_termination: str | None = None  # the request's ledger entry ends so (`client_cancel`)
    upstream_cancelled: bool = False  # the upstream saw the request cancelled before its answer ended


class Case(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    about: str
    request: dict[str, Any]
    headers: dict[str, str] = {}
    fault: str | None = None
    needs: tuple[str, ...] = ()
    repeat: int = Field(default=1, ge=1, le=5)
    cancel_after: int | None = Field(default=None, ge=1)  # the client hangs up after this many content chunks
    expect: Expect


class Corpus(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: str
    serves: Literal["chat", "embeddings"] = "chat"  # the endpoint its cases are sent to
    cases: tuple[Case, ...]
    digest: str = ""  # of the file's content (set by load_corpus): what a record is bound to

    def cases_requests(self) -> list[dict[str, Any]]:
        return [c.request for c in self.cases]


def corpus_for(serves: str) -> Corpus:
    """The gateway's own corpus for a deployment that serves chat completions or embeddings."""
    return load_corpus(CORPORA[serves])


def load_corpus(path: Path = CORPUS) -> Corpus:
    doc = yaml.safe_load(path.read_text())
    corpus = Corpus.model_validate({**doc, "digest": digest_of(doc)})
    ids = [c.id for c in corpus.cases]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: a case id is used twice")
    return corpus


@dataclass
class Outcome:
    """What the client got, in the internal contract's terms, whichever shape served it."""

    status: int | tuple[int, ...]  # several: any of them (then `error` is the non-200 one's code)
    error: str | None = None
    stream: bool = False
    contents: list[str] = field(default_factory=list)  # per choice
    finish_reasons: list[str | None] = field(default_factory=list)
    tool_calls: list[dict[str, str]] = field(default_factory=list)  # of choice 0: name, arguments
    usage: dict[str, Any] | None = None
    logprobs: list[dict[str, Any]] | None = None  # of choice 0
    stream_end: str | None = None  # done | interrupted | eof | reset | cancelled (by the client)
    losses: list[str] = field(default_factory=list)  # x-llmgw-translation-loss fields
    request_id: str = ""
    ledger: dict[str, Any] | None = None  # the request's ledger entry, when the case looks at it
    upstream: dict[str, Any] | None = None  # what the upstream logged of the request, likewise
    vectors: list[list[float]] | None = None  # an embeddings answer's, by index (base64 decoded)

    @classmethod
    def from_json(cls, status: int, doc: Any, losses: list[str]) -> Outcome:
        if status == 200 and isinstance(doc, dict) and doc.get("object") == "list":
            return cls._embeddings(doc, losses)
        if status != 200 or not isinstance(doc, dict) or not isinstance(doc.get("choices"), list):
            err = doc.get("error") if isinstance(doc, dict) else None
            return cls(status, error=err.get("code") if isinstance(err, dict) else None, losses=losses)
        out = cls(status, usage=doc.get("usage"), losses=losses)
        for ch in doc["choices"]:
            msg = ch.get("message") or {}
            out.contents.append(msg.get("content") or "")
            out.finish_reasons.append(ch.get("finish_reason"))
        first = doc["choices"][0] if doc["choices"] else {}
        out.tool_calls = [{"name": c["function"]["name"], "arguments": c["function"].get("arguments") or ""}
                          for c in (first.get("message") or {}).get("tool_calls") or []]
        out.logprobs = (first.get("logprobs") or {}).get("content")
        return out

    @classmethod
    def _embeddings(cls, doc: dict[str, Any], losses: list[str]) -> Outcome:
        out = cls(200, usage=doc.get("usage"), losses=losses, vectors=[])
        for item in sorted(doc.get("data") or (), key=lambda d: d.get("index", 0) if isinstance(d, dict) else 0):
            vector = item.get("embedding") if isinstance(item, dict) else None
            if isinstance(vector, str):  # base64: float32, little-endian
                raw = base64.b64decode(vector)
                vector = list(struct.unpack(f"<{len(raw) // 4}f", raw))
            out.vectors.append(vector if isinstance(vector, list) else [])  # type: ignore[union-attr]
        return out

    @classmethod
    def from_stream(cls, status: int, body: bytes, losses: list[str], reset: bool = False) -> Outcome:
        """`reset`: the connection broke before the body's framing ended."""
        if status != 200:
            return cls.from_json(status, _json(body), losses)
        out = cls(status, stream=True, stream_end="eof", losses=losses)
        calls: dict[int, dict[str, str]] = {}
        for event in body.decode("utf-8", "replace").split("\n\n"):
            data = "\n".join(line[5:].strip() for line in event.splitlines() if line.startswith("data:"))
            if not data:
                continue
            if data == "[DONE]":
                out.stream_end = "done"
                continue
            doc = _json(data.encode())
            if not isinstance(doc, dict):
                out.stream_end = "garbled"
                continue
            if "error" in doc:
                out.stream_end, out.error = "interrupted", (doc["error"] or {}).get("code")
                continue
            if doc.get("usage"):
                out.usage = doc["usage"]
            for ch in doc.get("choices") or []:
                i = ch.get("index", 0)
                while len(out.contents) <= i:
                    out.contents.append("")
                    out.finish_reasons.append(None)
                delta = ch.get("delta") or {}
                out.contents[i] += delta.get("content") or ""
                out.finish_reasons[i] = ch.get("finish_reason") or out.finish_reasons[i]
                if i == 0:
                    for d in delta.get("tool_calls") or []:
                        c = calls.setdefault(d.get("index", 0), {"name": "", "arguments": ""})
                        fn = d.get("function") or {}
                        c["name"] += fn.get("name") or ""
                        c["arguments"] += fn.get("arguments") or ""
                    if ch.get("logprobs"):
                        out.logprobs = (out.logprobs or []) + (ch["logprobs"].get("content") or [])
        out.tool_calls = [calls[i] for i in sorted(calls)]
        if reset and out.stream_end == "eof":
            out.stream_end = "reset"
        return out


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


def check(case: Case, outcomes: list[Outcome]) -> list[str]:
    """What the outcomes break of the case's expectations (empty: the case passes)."""
    e, out = case.expect, outcomes[0]
    bad: list[str] = []
    statuses = e.status if isinstance(e.status, tuple) else (e.status,)
    if out.status not in statuses:
        bad.append(f"status {out.status}, expected {e.status}" + (f" ({out.error})" if out.error else ""))
        return bad
    if e.error is not None and (out.status != 200 or e.stream_end == "interrupted") and out.error != e.error:
        bad.append(f"error {out.error!r}, expected {e.error!r}")
    if out.status != 200:
        return bad
    ends = {"cut": ("interrupted", "reset")}.get(e.stream_end or "", (e.stream_end,))
    if e.stream_end is not None and out.stream_end not in ends:
        bad.append(f"stream ended {out.stream_end}, expected {e.stream_end}")
    if out.stream_end == "interrupted" and out.error != "stream_interrupted":
        bad.append(f"interruption event code {out.error!r}, expected 'stream_interrupted'")
    if e.ledger_termination is not None and (out.ledger or {}).get("termination") != e.ledger_termination:
        bad.append(f"ledger entry {out.ledger}, expected termination {e.ledger_termination!r}")
    if e.upstream_cancelled and not (out.upstream or {}).get("cancelled"):
        bad.append(f"the upstream did not see the request cancelled: {out.upstream}")
    if e.stream_end in ("interrupted", "cut") or out.stream_end == "cancelled":
        return bad
    if out.vectors is not None or e.vectors is not None:
        return bad + _vectors(e, outcomes)
    text = out.contents[0] if out.contents else ""
    if e.finish_reason is not None and (out.finish_reasons[:1] or [None])[0] not in e.finish_reason:
        bad.append(f"finish_reason {(out.finish_reasons[:1] or [None])[0]!r}, expected one of {list(e.finish_reason)}")
    bad += _content(e, text)
    if e.excludes is not None and e.excludes in text:
        bad.append(f"content holds {e.excludes!r}")
    if e.tool_calls is not None:
        bad += _tool_calls(case, e.tool_calls, out.tool_calls)
    bad += _usage(case, e, out)
    if e.choices is not None and len(out.contents) != e.choices:
        bad.append(f"{len(out.contents)} choices, expected {e.choices}")
    if e.logprobs is not None:
        bad += _logprobs(e.logprobs, out.logprobs, text)
    if e.same_content and len({o.contents[0] if o.contents else None for o in outcomes}) != 1:
        bad.append("repeats answered different text")
    return bad


def _vectors(e: Expect, outcomes: list[Outcome]) -> list[str]:
    """An embeddings answer: the vectors asked for, one length, finite, unit length (the pooler
    normalises); usage of the inputs only; repeats the same vectors."""
    out = outcomes[0]
    vectors = out.vectors or []
    if e.vectors is not None and len(vectors) != e.vectors:
        return [f"{len(vectors)} vectors, expected {e.vectors}"]
    if len({len(v) for v in vectors}) != 1 or not vectors[0]:
        return [f"vectors of lengths {sorted({len(v) for v in vectors})}"]
    for v in vectors:
        if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in v):
            return ["a vector holds a value that is not a finite number"]
        if abs(math.sqrt(sum(x * x for x in v)) - 1) > 1e-3:
            return ["a vector is not of unit length"]
    bad = []
    u = out.usage if isinstance(out.usage, dict) else {}
    p, t = u.get("prompt_tokens"), u.get("total_tokens")
    if e.usage == "consistent" and not (isinstance(p, int) and p > 0 and t == p and not u.get("completion_tokens")):
        bad.append(f"usage inconsistent for embeddings: {out.usage}")
    if e.same_content and any(o.vectors != out.vectors for o in outcomes):
        bad.append("repeats answered different vectors")
    return bad


def _content(e: Expect, text: str) -> list[str]:
    if e.content == "nonempty" and not text:
        return ["empty content"]
    if e.content == "empty" and text:
        return ["content where none was expected"]
    if e.content == "json_object" or isinstance(e.content, dict):
        doc = _json(text.encode())
        if not isinstance(doc, dict):
            return [f"content is not a JSON object: {text[:80]!r}"]
        if isinstance(e.content, dict):
            try:
                jsonschema.validate(doc, e.content["schema"])
            except jsonschema.ValidationError as err:
                return [f"content does not match the schema: {err.message}"]
    return []


def _tool_calls(case: Case, names: tuple[str, ...], calls: list[dict[str, str]]) -> list[str]:
    got = [c["name"] for c in calls]
    if got != list(names):
        return [f"tool calls {got}, expected {list(names)}"]
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in case.request.get("tools") or []}
    bad = []
    for c in calls:
        args = _json(c["arguments"].encode())
        if not isinstance(args, dict):
            bad.append(f"{c['name']}: arguments do not parse as an object: {c['arguments'][:80]!r}")
            continue
        try:
            jsonschema.validate(args, schemas.get(c["name"], {}))
        except jsonschema.ValidationError as err:
            bad.append(f"{c['name']}: arguments do not match its schema: {err.message}")
    return bad


def _usage(case: Case, e: Expect, out: Outcome) -> list[str]:
    u = out.usage
    if e.usage == "absent":
        return ["usage the client did not ask for"] if u else []
    if e.usage is None and e.output_tokens is None:
        return []
    if not isinstance(u, dict):
        return ["no usage"]
    p, c, t = u.get("prompt_tokens"), u.get("completion_tokens"), u.get("total_tokens")
    if not all(isinstance(x, int) for x in (p, c, t)):
        return [f"usage has non-integer counts: {u}"]
    bad = []
    limit = (case.request.get("max_tokens") or 1 << 30) * (case.request.get("n") or 1)
    if not (p > 0 and c >= 1 and t == p + c and c <= limit):  # type: ignore[operator]
        bad.append(f"usage inconsistent: {u}")
    if e.output_tokens is not None and c != e.output_tokens:
        bad.append(f"{c} output tokens, expected {e.output_tokens}")
    return bad


def _logprobs(top: int, entries: list[dict[str, Any]] | None, text: str) -> list[str]:
    if not entries:
        return ["no logprobs"]
    # A token that is part of a character (byte-level vocabularies) comes from vLLM as an empty string,
    # and the content shows a replacement character where it stood.
    if "".join(str(t.get("token", "")) for t in entries) not in (text, text.replace("\ufffd", "")):
        return ["logprob tokens do not spell the content"]
    for t in entries:
        alts = t.get("top_logprobs") or []
        if len(alts) != top or t.get("token") not in [a.get("token") for a in alts]:
            return [f"a token without its {top} alternatives: {t}"]
    return []
