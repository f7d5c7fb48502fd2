"""A gateway's loops run in threads beside its main one: what a loop says goes to its own state, and
nothing it does takes the process's stdout from the main thread (whose banner carries the demo keys)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmgw.ops import canary, gateway_loops


def test_the_canary_loop_keeps_what_it_saw_and_leaves_stdout_to_the_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def watched(client: Any, directory: Path, urls: list[str], token: str = "", say: Any = print) -> list[str]:
        say("route chat: canary c 12 requests, 0.0% errors -> holds")
        print("llmgw is up")  # the main thread's banner, printed while the loop runs
        return ["chat: error rate"]

    monkeypatch.setattr(canary, "watch_once", watched)
    token = tmp_path / "admin-token"
    token.write_text("t\n")
    targets = gateway_loops.LoopTargets(config=tmp_path, store_url="redis://127.0.0.1:1", engines={},
                                        status_urls=[], admin_token_file=token, state_file=tmp_path / "loops.json")
    state = gateway_loops.canary_watch(targets)
    assert state == "route chat: canary c 12 requests, 0.0% errors -> holds; rolled back: chat: error rate"
    assert capsys.readouterr().out == "llmgw is up\n"  # (it went into the loop's state once)
