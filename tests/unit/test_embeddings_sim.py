"""The simulator's pooling runner (enginesim --runner pooling) as vLLM serves embeddings, over real HTTP
with the openai SDK as its users write it (its default asks for base64): one vector per input, the
same text the same vector, the inputs' tokens as usage, vLLM's refusals; and a pooling engine has no
chat completions, a generating one no embeddings (404, as vLLM answers)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import openai
import pytest

from llmgw.local.procs import Child, free_port, http_ok, python_module, wait_until
from tests.helpers import request

MODEL = "embed-sim"


def _engine(tmp: pytest.TempPathFactory, *extra: str) -> Iterator[str]:
    port = free_port()
    child = Child("enginesim", python_module("enginesim", "--port", str(port), "--served-model-name", MODEL,
                                             "--time-scale", "0.01", "--max-model-len", "64", *extra),
                  tmp.mktemp("sim") / "sim.log").start()
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: http_ok(f"{url}/health"), 30, "enginesim", child)
    yield url
    child.stop()


@pytest.fixture(scope="module")
def pooling(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _engine(tmp_path_factory, "--runner", "pooling", "--embedding-dim", "64")


@pytest.fixture(scope="module")
def generating(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _engine(tmp_path_factory)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_one_unit_vector_per_input_the_same_text_the_same_vector(pooling: str) -> None:
    r = client(pooling).embeddings.create(model=MODEL, input=["the gateway meters", "the gateway meters", "zebra"])
    vectors = [d.embedding for d in sorted(r.data, key=lambda d: d.index)]
    assert [len(v) for v in vectors] == [64, 64, 64]
    assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-5 for v in vectors)  # float32 through base64
    assert vectors[0] == vectors[1] and vectors[0] != vectors[2]
    assert r.usage.prompt_tokens == r.usage.total_tokens == 3 * 2 + 3 + 1  # each input's tokens, BOS included
    one = client(pooling).embeddings.create(model=MODEL, input="zebra", encoding_format="float")
    assert [round(x, 5) for x in one.data[0].embedding] == [round(x, 5) for x in vectors[2]]


@pytest.mark.parametrize("body, status, param", [
    ({"model": MODEL, "input": []}, 400, "input"),
    ({"model": MODEL, "input": [{"text": "x"}]}, 400, "input"),
    ({"model": MODEL, "input": "x", "dimensions": 8}, 400, None),
    ({"model": MODEL, "input": "x", "encoding_format": "binary"}, 400, "encoding_format"),
    ({"model": MODEL, "input": "word " * 80}, 400, "input"),  # beyond the 64-token window
    ({"model": "another", "input": "x"}, 404, None),
])
def test_vllms_refusals(pooling: str, body: dict[str, object], status: int, param: str | None) -> None:
    r = request(f"{pooling}/v1/embeddings", "POST", body)
    assert r.status == status and r.json()["error"]["code"] == status and r.json()["error"]["param"] == param


def test_one_runner_serves_one_api(pooling: str, generating: str) -> None:
    chat = request(f"{pooling}/v1/chat/completions", "POST", {"model": MODEL, "messages": [
        {"role": "user", "content": "x"}]})
    assert (chat.status, chat.json()) == (404, {"detail": "Not Found"})
    embed = request(f"{generating}/v1/embeddings", "POST", {"model": MODEL, "input": "x"})
    assert (embed.status, embed.json()) == (404, {"detail": "Not Found"})
