"""A task-quality corpus (extproc/corpora/quality-*.yaml, or a policy author's own) as validated
objects. Pure: the file's own header says what each field means."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from extproc.corpora import digest_of


class Expect(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    json_doc: dict[str, Any] | None = Field(default=None, alias="json")
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # json's, when the request carries none
    tool: dict[str, Any] | None = None  # name, arguments
    answer: str | None = None
    refusal: bool | None = None

    @model_validator(mode="after")
    def _one(self) -> Expect:
        given = [k for k in ("json_doc", "tool", "answer", "refusal") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("exactly one of json, tool, answer, refusal")
        if self.schema_ is not None and self.json_doc is None:
            raise ValueError("schema: only beside json")
        if self.refusal is False:
            raise ValueError("refusal: true or absent")
        if self.tool is not None and (not isinstance(self.tool.get("name"), str)
                                      or not isinstance(self.tool.get("arguments"), dict)):
            raise ValueError("tool: {name: <string>, arguments: <object>}")
        return self


class Task(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    kind: Literal["extraction", "tool_selection", "arithmetic", "refusal"]
    request: dict[str, Any]
    expect: Expect

    @model_validator(mode="after")
    def _request(self) -> Task:
        messages = self.request.get("messages")
        if not isinstance(messages, list) or not messages or messages[-1].get("role") != "user":
            raise ValueError("request.messages must end with the user's message")
        if self.request.get("stream"):
            raise ValueError("a task is graded on its whole JSON answer: no stream")
        if self.expect.json_doc is not None and self.answer_schema() is None:
            raise ValueError("expect.json needs a schema to validate against: expect.schema, or the request's "
                             "json_schema response_format")
        return self

    def answer_schema(self) -> dict[str, Any] | None:
        """The schema a JSON answer must satisfy: the expectation's own, else the request's."""
        fmt = self.request.get("response_format") or {}
        given = (fmt.get("json_schema") or {}).get("schema") if fmt.get("type") == "json_schema" else None
        return self.expect.schema_ if self.expect.schema_ is not None else given


class QualityCorpus(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: str
    tasks: tuple[Task, ...] = Field(min_length=1)
    digest: str = ""  # of the file's content (set by load_quality): what a record is bound to

    @model_validator(mode="after")
    def _unique(self) -> QualityCorpus:
        ids = [t.id for t in self.tasks]
        if len(ids) != len(set(ids)):
            raise ValueError("task ids must be unique")
        return self


def load_quality(path: Path) -> QualityCorpus:
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    return QualityCorpus.model_validate({**doc, "digest": digest_of(doc)})
