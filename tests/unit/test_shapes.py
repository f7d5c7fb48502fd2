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
    assert [d.name for d in DOORS] == [s.name for s in SHAPES if s.door is not None]
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


def test_a_shape_registered_for_the_lua_answer_filter_without_a_translator_stops_it_loading(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The answer filter's dispatch comes from the registry: a new shape marked `lua_answers` before
    its Lua translator exists fails when Envoy loads the script, not on its first answer."""
    from lupa.luajit21 import LuaError

    from llmgw.render.filters import answers_lua

    lua_runtime(answers_lua())  # the registry as it is loads
    cohere = dataclasses.replace(SHAPES[0], name="cohere", lua_answers=True)
    monkeypatch.setattr("llmgw.render.filters.SHAPES", (*SHAPES, cohere))
    with pytest.raises(LuaError, match="no translator for the shape cohere"):
        lua_runtime(answers_lua())
