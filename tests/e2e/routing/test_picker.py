"""The endpoint picker: metrics parsing, scoring, staleness, tenant-keyed affinity, and Envoy obeying it."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from extproc.picker import EngineLoad, Picker, parse_load
from extproc.stages.route import PickEndpoint
from llmgw.local.procs import free_port
from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, start_stack
from tests.helpers import chat_body, request, request_quietly

# vLLM 0.32's page puts labels in its own order and prints floats; the parser must not care.
VLLM_PAGE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0
"""


def test_parse_vllm_page() -> None:
    load = parse_load(VLLM_PAGE, at=1.0)
    assert (load.waiting, load.running, load.kv_usage) == (7.0, 3.0, 0.25)


def test_parse_refuses_a_page_without_the_gauges() -> None:
    with pytest.raises(ValueError):
        parse_load("vllm:num_requests_running 1\n", at=0.0)


def picker_with(loads: dict[str, tuple[float, float, float]], age: float = 0.0) -> Picker:
    p = Picker({"pool": list(loads)})
    now = time.monotonic()
    p.loads = {ep: EngineLoad(waiting=w, running=r, kv_usage=kv, at=now - age) for ep, (w, r, kv) in loads.items()}
    return p


MSGS = [{"role": "user", "content": "x" * 2000}]


def test_a_fallback_plan_lists_each_later_candidates_pool_after_the_first() -> None:
    now = time.monotonic()
    p = Picker({"a": ["a1:1", "a2:1"], "b": ["b1:1", "b2:1"]})
    p.loads = {ep: EngineLoad(waiting=0, running=running, kv_usage=0.0, at=now)
               for ep, running in (("a1:1", 3), ("a2:1", 0), ("b1:1", 3), ("b2:1", 0))}
    a, a_again, b = SimpleNamespace(pool="a"), SimpleNamespace(pool="a"), SimpleNamespace(pool="b")

    def endpoints(*candidates: Any) -> list[str]:
        ex: Any = SimpleNamespace(deployment=candidates[0], candidates=candidates, body={"messages": MSGS},
                                  cache_salt="s", endpoints=[])
        asyncio.run(PickEndpoint(p).run(ex))
        return list(ex.endpoints)

    assert endpoints(a) == ["a2:1", "a1:1"]
    # Envoy takes the list in order across attempts, skipping addresses outside the attempt's cluster:
    # a fallback to candidate 2 (pool b) starts at b's best engine. A pool listed once.
    assert endpoints(a, a_again, b) == ["a2:1", "a1:1", "b2:1", "b1:1"]
    # Only the first pool's best is noted as where a request went (pending load, prefix affinity).
    assert {ep for ep, picks in p._picked_at.items() if picks} == {"a2:1"}
    # No fresh metrics for the first pool: nothing listed (attempt 1 would use up b's addresses).
    p.loads = {ep: ld for ep, ld in p.loads.items() if ep.startswith("b")}
    assert endpoints(a, b) == []


@pytest.mark.parametrize(("loads", "best"), [
    ({"a:1": (5, 8, 0.5), "b:1": (0, 8, 0.5)}, "b:1"),  # shorter queue
    ({"a:1": (0, 8, 0.9), "b:1": (0, 8, 0.2)}, "b:1"),  # more free KV cache
    ({"a:1": (0, 2, 0.3), "b:1": (0, 9, 0.3)}, "a:1"),  # fewer running
])
def test_scores_prefer_the_less_loaded_engine(loads: dict[str, tuple[float, float, float]], best: str) -> None:
    assert picker_with(loads).pick("pool", "salt", MSGS)[0] == best


def test_stale_or_missing_metrics_are_never_picked() -> None:
    assert picker_with({"a:1": (0, 0, 0.0)}, age=3.0).pick("pool", "s", MSGS) == []
    p = picker_with({"a:1": (9, 9, 0.9)})
    p.pools["pool"] = ("a:1", "dead:1")  # no reading at all for dead:1
    assert p.pick("pool", "s", MSGS) == ["a:1"]


def test_prefix_affinity_is_per_tenant() -> None:
    p = picker_with({"a:1": (0, 0, 0.0), "b:1": (0, 0, 0.0)})
    first = p.pick("pool", "tenant-1", MSGS)[0]
    p.loads = {ep: EngineLoad(0, 0, 0.0, at=time.monotonic()) for ep in p.loads}  # a new scrape: idle again
    assert p.pick("pool", "tenant-1", MSGS)[0] == first
    # Another tenant's identical prompt matches none of tenant-1's blocks.
    from extproc.picker import prompt_blocks
    assert p._matched_blocks(prompt_blocks("tenant-1", MSGS)) == {first: len(prompt_blocks("t", MSGS))}
    assert p._matched_blocks(prompt_blocks("tenant-2", MSGS)) == {}


def test_affinity_yields_to_heavy_load() -> None:
    p = picker_with({"a:1": (0, 0, 0.0), "b:1": (0, 0, 0.0)})
    first = p.pick("pool", "t", MSGS)[0]
    other = "b:1" if first == "a:1" else "a:1"
    now = time.monotonic()
    p.loads[first] = EngineLoad(waiting=50, running=256, kv_usage=0.98, at=now)
    p.loads[other] = EngineLoad(waiting=0, running=1, kv_usage=0.1, at=now)
    assert p.pick("pool", "t", MSGS)[0] == other


def test_a_burst_spreads_before_metrics_catch_up() -> None:
    p = picker_with({"a:1": (0, 0, 0.0), "b:1": (0, 0, 0.0)})
    firsts = [p.pick("pool", f"t{i}", [{"role": "user", "content": f"{i}"}])[0] for i in range(10)]
    assert abs(firsts.count("a:1") - firsts.count("b:1")) <= 2


# -- end to end: Envoy's override_host follows the picker -----------------------------------------

@pytest.fixture
def slow_stack(tmp_path: Path) -> Stack:
    # Real-time engines that run one sequence at a time: a busy engine queues.
    s = start_stack(tmp_path, time_scale=1.0, engine_args=("--max-num-seqs", "1"))
    yield s  # type: ignore[misc]
    s.stop()


@pytest.mark.e2e
def test_requests_avoid_the_busy_engine(slow_stack: Stack) -> None:
    busy, idle = slow_stack.engine_urls("engine-pool")
    # Occupy one engine directly: one running, two waiting, for several seconds.
    threads = [threading.Thread(target=request_quietly, args=(f"{busy}/v1/chat/completions", "POST",
                                                      chat_body("meta-llama/Llama-3.1-8B-Instruct", max_tokens=400)),
                                kwargs={"timeout": 60}, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # several scrapes
    marker = uuid.uuid4().hex
    for i in range(6):
        r = request(f"{slow_stack.url}/v1/chat/completions", "POST", chat_body(content=f"{marker} {i}", max_tokens=2),
                    {"authorization": f"Bearer {DEMO_KEYS['acme']}"}, timeout=30)
        assert r.status == 200
    served = {url: sum(marker in json.dumps(e["messages"]) for e in request(f"{url}/admin/requests").json())
              for url in (busy, idle)}
    assert served == {busy: 0, idle: 6}, served
    # What the workers' GET /status says of it: the busy engine's queue, read fresh.
    readings = [e for u in slow_stack.status_urls for pool in request(u).json()["picker"]["pools"].values()
                for e in pool if f"http://{e['endpoint']}" == busy and e["fresh"]]
    assert readings and max(e["waiting"] + e["running"] for e in readings) >= 1, readings


def test_a_trickle_of_earlier_picks_is_not_load() -> None:
    p = picker_with({"idle:1": (0, 0, 0.0), "busy:1": (0, 3, 0.0)})
    now = time.monotonic()
    p.loads = {ep: EngineLoad(ld.waiting, ld.running, ld.kv_usage, at=now - 0.2) for ep, ld in p.loads.items()}
    p._picked_at["idle:1"] = [now - 0.04 * i for i in range(1, 6)]  # five picks 40-200 ms ago, since the scrape
    assert p.pick("pool", "t", [{"role": "user", "content": "x"}])[0] == "idle:1"
    p._picked_at["idle:1"] = [now] * 5  # the same five picks in a burst are load
    assert p.pick("pool", "t", [{"role": "user", "content": "y"}])[0] == "busy:1"


class MetricsServer:
    """Engines' /metrics pages on loopback ports, counting the scrapes each gets."""

    def __init__(self, n: int):
        from aiohttp import web

        self.hits: dict[str, int] = {}
        self.ports = [free_port() for _ in range(n)]
        self._runners: list[Any] = []
        self._web = web

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    async def start(self) -> None:
        web = self._web
        for port in self.ports:
            async def page(_: Any, ep: str = f"127.0.0.1:{port}") -> Any:
                self.hits[ep] = self.hits.get(ep, 0) + 1
                return web.Response(text=VLLM_PAGE)
            app = web.Application()
            app.router.add_get("/metrics", page)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            self._runners.append(runner)

    async def stop(self) -> None:
        for r in self._runners:
            await r.cleanup()


def test_idle_scraping_slows_down_and_a_pick_wakes_it() -> None:
    async def scenario() -> None:
        engines = MetricsServer(2)
        await engines.start()
        p = Picker({"pool": engines.endpoints}, interval=0.05, idle_interval=0.5, active_for=0.3)
        await p.start()
        await asyncio.sleep(1.2)  # idle from the start: three rounds (0, 0.5, 1.0 s), the last 0.2 s ago
        idle = p.scrapes
        assert 2 * 2 <= idle <= 2 * 4, idle
        # The first pick after the quiet spell does not go by a reading up to an idle interval old:
        # one round is scraped for it first.
        before = p.scrapes
        await p.ensure_fresh()
        assert p.scrapes == before + 2 and time.monotonic() - min(ld.at for ld in p.loads.values()) < 0.05
        assert p.pick("pool", "s", MSGS)
        await p.ensure_fresh()  # fresh now: nothing more to scrape
        assert p.scrapes == before + 2
        idle = p.scrapes
        await asyncio.sleep(0.25)  # woken at once, then every 50 ms while active
        assert p.scrapes - idle >= 2 * 4, p.scrapes - idle
        await p.stop()
        await engines.stop()
    asyncio.run(scenario())


def test_a_scraper_writes_the_shared_file_only_while_a_worker_reads_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        engines = MetricsServer(1)
        await engines.start()
        pools, shared = {"pool": engines.endpoints}, tmp_path / "picker"
        alone = Picker(pools, interval=0.05, idle_interval=0.05, shared_dir=shared)
        await alone.start()
        await asyncio.sleep(0.4)
        assert alone.scrapes >= 4 and not (shared / "loads.json").exists()  # the only worker: no file
        reader = Picker(pools, interval=0.05, idle_interval=0.05, shared_dir=shared)  # the lock is taken
        await reader.start()
        await asyncio.sleep(0.8)  # its mark is seen within half a second, the file written the round after
        assert (shared / "loads.json").exists()
        assert reader.scrapes == 0 and reader.pick("pool", "s", MSGS) == engines.endpoints
        await reader.stop()
        await alone.stop()
        await engines.stop()
    asyncio.run(scenario())


def test_a_reader_keeps_its_own_newer_reading_over_the_files(tmp_path: Path) -> None:
    shared = tmp_path / "picker"
    shared.mkdir()
    (shared / "loads.json").write_text(json.dumps(
        {"e:1": {"waiting": 9.0, "running": 9.0, "kv_usage": 0.9, "at": time.monotonic() - 1.0}}))
    reader = Picker({"pool": ["e:1"]}, shared_dir=shared)
    mine = EngineLoad(0.0, 1.0, 0.1, at=time.monotonic())  # scraped for itself, before the file was rewritten
    reader.loads = {"e:1": mine}
    reader._read_shared()
    assert reader.loads == {"e:1": mine}
    (shared / "loads.json").write_text(json.dumps(
        {"e:1": {"waiting": 2.0, "running": 2.0, "kv_usage": 0.2, "at": time.monotonic()}}))
    reader._read_shared()
    assert reader.loads["e:1"].waiting == 2.0  # the file's newer reading replaces it
    assert (shared / "readers").exists()  # and the scraper learns it has a reader


def test_status_shows_each_engines_reading_and_its_age() -> None:
    """What a worker's GET /status says of its picker: per pool, each engine's gauges, how old the
    reading is and whether a pick may use it; an engine never read shows none."""
    p = Picker({"b": ["e2:1"], "a": ["e1:1", "e3:1"]}, stale_after=2.0)
    now = time.monotonic()
    p.loads = {"e1:1": EngineLoad(3.0, 5.0, 0.4, at=now - 0.5), "e2:1": EngineLoad(0.0, 1.0, 0.1, at=now - 5.0)}
    p.scrapes = 7
    st = p.status()
    assert st["scrapes"] == 7 and st["shared"] is False and list(st["pools"]) == ["a", "b"]
    e1, e3 = st["pools"]["a"]
    assert (e1["endpoint"], e1["waiting"], e1["running"], e1["kv_usage"], e1["fresh"]) == ("e1:1", 3.0, 5.0, 0.4, True)
    assert 0.5 <= e1["age_s"] < 1.5
    assert e3 == {"endpoint": "e3:1", "reading": None, "fresh": False}
    (e2,) = st["pools"]["b"]
    assert e2["fresh"] is False and e2["age_s"] >= 5.0  # stale: picks leave this pool to Envoy
    assert p.pick("b", "salt", [{"role": "user", "content": "x"}]) == []


def test_an_engine_in_two_pools_is_scraped_once_a_round() -> None:
    async def scenario() -> None:
        engines = MetricsServer(2)
        await engines.start()
        shared, own = engines.endpoints
        p = Picker({"a": [shared, own], "b": [shared]}, interval=60, idle_interval=60)
        await p.start()
        await asyncio.sleep(0.3)  # the first round, at start
        assert engines.hits == {shared: 1, own: 1}, engines.hits
        assert p.pick("b", "s", MSGS) == [shared]  # its reading serves both pools
        await p.stop()
        await engines.stop()
    asyncio.run(scenario())


def test_an_engine_named_by_host_is_picked_by_the_address_it_was_read_at(tmp_path: Path) -> None:
    """Envoy's override_host matches a host by IP:port: a pool given by names (docker-compose's
    services) is picked by the addresses the names resolved to when read - by the scraper and by a
    worker reading the scraper's file."""
    async def scenario() -> None:
        engines = MetricsServer(2)
        await engines.start()
        named = {"pool": [f"localhost:{port}" for port in engines.ports]}
        scraper = Picker(named, interval=0.05, idle_interval=0.05, shared_dir=tmp_path / "picker")
        await scraper.start()
        reader = Picker(named, interval=0.05, idle_interval=0.05, shared_dir=tmp_path / "picker")
        await reader.start()
        await asyncio.sleep(0.8)
        for p in (scraper, reader):
            assert sorted(p.pick("pool", "s", MSGS)) == sorted(engines.endpoints)  # 127.0.0.1:port
        await reader.stop()
        await scraper.stop()
        await engines.stop()
    asyncio.run(scenario())


def test_workers_on_one_host_share_one_scraper(tmp_path: Path) -> None:
    async def scenario() -> None:
        engines = MetricsServer(4)
        await engines.start()
        pools = {"pool": engines.endpoints}
        workers = [Picker(pools, interval=0.05, idle_interval=0.05, shared_dir=tmp_path / "picker") for _ in range(3)]
        for w in workers:
            await w.start()
        # A worker that picks before its own schedule reads the shared readings reads them then.
        late = Picker(pools, interval=0.05, idle_interval=60, shared_dir=tmp_path / "picker")
        await late.start()
        await asyncio.sleep(0.6)
        await late.ensure_fresh()
        assert late.pick("pool", "s", MSGS) and late.scrapes == 0
        await late.stop()
        scrapers = [w for w in workers if w.scrapes]
        assert len(scrapers) == 1  # one scrapes; the others read its readings
        assert all(w.pick("pool", "s", MSGS) for w in workers)  # every worker has fresh readings
        total = sum(engines.hits.values())
        assert total <= 4 * (0.6 / 0.05 + 2), total  # one scraper's worth, not three
        # The scraper's worker goes away: another takes over, and readings stay fresh.
        await scrapers[0].stop()
        rest = [w for w in workers if w is not scrapers[0]]
        before = [w.scrapes for w in rest]
        await asyncio.sleep(0.4)
        assert sum(w.scrapes - b > 0 for w, b in zip(rest, before, strict=True)) == 1
        now = time.monotonic()
        assert all(w.fresh(ep, now) for w in rest for ep in engines.endpoints)
        for w in rest:
            await w.stop()
        await engines.stop()
    asyncio.run(scenario())
