"""`llmgw bench ablate`'s variants: each takes exactly its piece out of the rendered configuration, and
Envoy accepts every one of them; `llmgw bench stream --ablate`'s rows price a piece per token."""

from __future__ import annotations

import subprocess
from pathlib import Path

from envoy.config.bootstrap.v3 import bootstrap_pb2

from extproc.config import load_snapshot
from extproc.names import Filter
from llmgw.bench.ablate import OPTIONAL_STAGES, _hcm, variants
from llmgw.bench.stream import ablation_row
from llmgw.local.procs import envoy_binary, envoy_env
from llmgw.render.bootstrap import RenderOptions, render_bootstrap
from tests.conftest import POLICY


def _rendered() -> bootstrap_pb2.Bootstrap:
    snap = load_snapshot(POLICY)
    return render_bootstrap(snap, RenderOptions.from_snapshot(snap))


def _chain(boot: bootstrap_pb2.Bootstrap) -> list[str]:
    return [h.name for h in _hcm(boot)[1].http_filters]


def _logs(boot: bootstrap_pb2.Bootstrap) -> list[str]:
    return [a.name for a in _hcm(boot)[1].access_log]


def test_each_variant_takes_out_its_piece_and_nothing_else() -> None:
    full = _rendered()
    chain, logs = _chain(full), _logs(full)
    found = variants(full, "pool_engine-pool")
    # every filter but the router, each access log, and each optional stage: one variant each
    filters = [v for v in found if v.what == "filter"]
    assert len(filters) == len(chain) - 1  # the decision's replaced, the others taken out; not the router
    assert len([v for v in found if v.what == "access log"]) == len(logs)
    assert [dict(v.env).get("LLMGW_ABLATE_STAGES") for v in found if v.what == "stage"][2:-1] == list(OPTIONAL_STAGES)
    assert dict(found[-1].env) == {"LLMGW_ABLATE_NO_SLICES": "1"}  # every request reserving in the store
    # The floor: the same Envoy configuration, a minimal server in place of every worker.
    (floor,) = [v for v in found if v.module != "llmgw.bench.ablated_extproc"]
    assert floor.module == "llmgw.bench.floor_extproc" and floor.edit is None and not floor.env
    for v in found:
        boot = bootstrap_pb2.Bootstrap()
        boot.CopyFrom(full)
        if v.edit is not None:
            v.edit(boot)
        after_chain, after_logs = _chain(boot), _logs(boot)
        if v.what == "filter" and Filter.EXT_PROC not in after_chain:  # the decision's stand-in, in its place
            assert after_chain == [("llmgw.bench.decision_stand_in" if n == Filter.EXT_PROC else n) for n in chain]
        elif v.what == "filter":
            assert len(after_chain) == len(chain) - 1 and set(chain) - set(after_chain) == {v.name.split()[1]}
        elif v.what == "access log":
            assert after_chain == chain and set(logs) - set(after_logs) == {v.name.split()[1]}
        else:  # a stage is left out by the worker: Envoy's configuration is the full one
            assert after_chain == chain and after_logs == logs
        assert full.SerializeToString() != boot.SerializeToString() or v.what == "stage"


def test_envoy_accepts_the_decision_stand_in(tmp_path: Path) -> None:
    boot = _rendered()
    stand_in = next(v for v in variants(boot, "pool_engine-pool") if v.name.startswith("the decision -> a Lua"))
    assert stand_in.edit is not None
    stand_in.edit(boot)
    path = tmp_path / "ablated.pb"
    path.write_bytes(boot.SerializeToString())
    out = subprocess.run([str(envoy_binary()), "--mode", "validate", "-c", str(path)], env=envoy_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_a_stream_ablation_row_prices_the_piece_as_the_full_gateway_less_the_variant() -> None:
    bare = {"envoy": 80.0}
    full = {"envoy": 140.0, "ext_proc": 40.0, "store": 4.0}
    ablated = {"envoy": 100.0, "ext_proc": 15.0, "store": 4.0}
    cells = [c.strip() for c in ablation_row("- the piece", bare, full, ablated, 0).strip("|").split("|")]
    assert cells == ["- the piece", "100.0 / 15.0 / 4.0", "1.49x", "40.0 / 25.0 / 0.0", "+65.0", "2.30x", "0"]


def test_a_stream_ablation_row_whose_streams_failed_names_the_piece_needed() -> None:
    # Over zero tokens the variant's figures are meaningless (the run that printed 60,000 us per token):
    # the row says the piece is needed and prices nothing.
    row = ablation_row("- buffer", {"envoy": 80.0}, {"envoy": 160.0}, {"envoy": 60000.0}, 32)
    assert "needed: without it, 32 streams failed" in row and "60000" not in row and "2.00x" in row
