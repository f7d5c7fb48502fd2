"""The shapes registry (extproc/shapes/registry.py) is the one list of provider API shapes: what derives from it
stays in step, and what cannot import it (the simulator, the Lua) is checked against it."""

from __future__ import annotations

import dataclasses

import pytest

from enginesim.cli import FRONT_ENDS
from extproc.shapes.registry import ADAPTERS, CREDENTIAL_HEADERS, DOORS, SHAPES, shape_of
from llmgw.cli.adapters import COLUMNS
from tests.lua_harness import lua_runtime


def test_every_list_of_shapes_derives_from_the_registry() -> None:
    assert list(ADAPTERS) == [s.name for s in SHAPES]
    assert tuple(s.door for s in SHAPES if s.door is not None) == DOORS
    # A door is named for the API its callers speak: the shape's name, or OpenAI's other API.
    assert [d.name for d in DOORS] == [s.name if s.name != "openai" else "responses" for s in SHAPES if s.door]
    assert tuple(h for d in DOORS for h in d.credential_headers) == CREDENTIAL_HEADERS
    assert list(COLUMNS) == [h for s in SHAPES for h in s.loss_columns]
    assert all(s.adapter.name == s.name for s in SHAPES)


def test_the_simulator_serves_each_shape_and_nothing_else() -> None:
    """The simulator imports nothing of the gateway, so its front-end table is checked here."""
    served = {s.name for s in SHAPES} | {api for s in SHAPES for api in s.simulator_apis.values()}
    assert set(FRONT_ENDS) == served


def test_a_hosted_openai_deployment_of_kind_azure_is_simulated_by_azure_s_front_end() -> None:
    assert shape_of("openai@1").simulator_api({"kind": "azure"}) == "azure"
    assert shape_of("openai-compat").simulator_api({}) == "openai"
    assert shape_of("bedrock@1").simulator_api({"region": "us-east-1"}) == "bedrock"


def test_a_shape_s_lua_comes_from_its_folder_and_a_missing_one_stops_the_filter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The Lua filters' dispatch comes from the registry, and each shape's translators from its own
    folder (extproc/shapes/<shape>/answers.lua, door.lua): a shape registered before its Lua exists
    fails when the bootstrap is rendered or when Envoy loads the script, never on its first answer."""
    from lupa.luajit21 import LuaError

    from llmgw.render.filters import answers_lua, doors_lua

    assert "ANSWERS.anthropic = anthropic" in answers_lua() and "DOORS.gemini = " in doors_lua()
    lua_runtime(answers_lua())  # the registry as it is loads
    lua_runtime(doors_lua())
    openai, anthropic = SHAPES[0], SHAPES[1]
    cohere = dataclasses.replace(openai, name="cohere")  # no folder of its own
    monkeypatch.setattr("llmgw.render.filters.SHAPES", (*SHAPES, cohere))
    with pytest.raises(FileNotFoundError, match=r"cohere/answers\.lua"):
        answers_lua()
    streaming = dataclasses.replace(openai, lua_streams=True)  # openai's answers.lua has no stream translator
    monkeypatch.setattr("llmgw.render.filters.SHAPES", (streaming, *SHAPES[1:]))
    with pytest.raises(LuaError, match="no stream translator for openai"):
        lua_runtime(answers_lua())
    assert anthropic.door is not None
    renamed = dataclasses.replace(anthropic, door=dataclasses.replace(anthropic.door, name="cohere"))
    monkeypatch.setattr("llmgw.render.filters.SHAPES", (openai, renamed, *SHAPES[2:]))
    with pytest.raises(LuaError, match="no translators for the door cohere"):
        lua_runtime(doors_lua())
