"""The simulator's physics: capacity, step times, batching, prefix caching and preemption."""

from __future__ import annotations

import asyncio

import pytest

from enginesim.engine import Engine, Sequence
from enginesim.kv import BlockTable, KVCache, block_hashes
from enginesim.physics import MODELS, profile
from enginesim.tokenizer import TextSampler, apply_chat_template, encode


def test_kv_bytes_per_token_match_the_reference() -> None:
    assert MODELS["llama-3-8b"].kv_bytes_per_token == 128 * 1024
    assert MODELS["llama-3-70b"].kv_bytes_per_token == 320 * 1024  # 5 MiB per 16-token block


def test_70b_on_two_80g_gpus_holds_six_or_seven_8k_sequences() -> None:
    # The planning example the reference's capacity figures use: ~20 GB left for KV, 2.6 GB per 8,000-token sequence.
    p = profile("llama-3-70b@h100x2", gpu_memory_utilization=1.0, activation_bytes_per_gpu=0)
    tokens = p.num_gpu_blocks * p.block_size
    assert 6 <= tokens / 8000 <= 7.5


def test_70b_tp8_decode_step_matches_reference_example() -> None:
    # 70B, TP8, batch 64 at 2k context: ~10 ms of memory time + 3-5 ms overhead.
    p = profile("llama-3-70b@h100x8")
    t = p.step_seconds(decode_contexts=64 * 2048, prefill_chunks=[], decode_seqs=64)
    assert 0.011 <= t <= 0.017


def test_decode_step_grows_with_batch_kv() -> None:
    p = profile("llama-3-8b@h100")
    times = [p.step_seconds(decode_contexts=b * 1024, prefill_chunks=[], decode_seqs=b) for b in (1, 16, 64, 256)]
    assert times == sorted(times) and times[-1] > 1.5 * times[0]


def test_prefill_is_compute_bound_and_grows_with_length() -> None:
    p = profile("llama-3-8b@h100")
    short = p.step_seconds(0, [(0, 128)], 0)
    long = p.step_seconds(0, [(0, 8192)], 0)
    assert long > 5 * short
    # Roofline: 8k tokens of an 8B model is compute-bound, beyond reading the weights once.
    weights_time = MODELS["llama-3-8b"].weight_bytes / (p.gpu.hbm_bandwidth * p.bandwidth_efficiency)
    assert long - p.step_overhead_s > weights_time


def test_h200_decodes_faster_than_h100() -> None:
    args = dict(decode_contexts=32 * 2048, prefill_chunks=[], decode_seqs=32)
    assert profile("llama-3-8b@h200").step_seconds(**args) < profile("llama-3-8b@h100").step_seconds(**args)


def run_engine(engine: Engine, seqs: list[Sequence], timeout: float = 30.0) -> None:
    async def main() -> None:
        engine.start()
        for s in seqs:
            engine.submit(s)

        async def drain(s: Sequence) -> None:
            while await s.out.get() is not None:
                pass

        await asyncio.wait_for(asyncio.gather(*(drain(s) for s in seqs)), timeout)
        await engine.stop()

    asyncio.run(main())


def seq(rid: str, n_prompt: int, max_tokens: int = 8, salt: str | None = None, base: int = 0) -> Sequence:
    return Sequence(request_id=rid, prompt=[base + i for i in range(n_prompt)], max_tokens=max_tokens,
                    natural_length=10_000, salt=salt, arrival=0.0)


def test_ttft_grows_with_prompt_length() -> None:
    ttfts = []
    for n in (64, 2048, 7000):
        engine = Engine(profile("llama-3-8b@h100"), time_scale=0.001)
        s = seq("r", n, max_tokens=2)
        run_engine(engine, [s])
        assert s.first_token_at is not None
        ttfts.append(engine.stats.ttft[0])
    assert ttfts == sorted(ttfts) and ttfts[-1] > 3 * ttfts[0]


def test_continuous_batching_shares_steps() -> None:
    engine = Engine(profile("llama-3-8b@h100"), time_scale=0.001)
    seqs = [seq(f"r{i}", 32, max_tokens=20, base=i * 1000) for i in range(16)]
    run_engine(engine, seqs)
    # 16 sequences x 20 tokens in far fewer than 320 steps: they decode together.
    assert engine.stats.generation_tokens == 320
    assert engine.stats.steps < 40
    assert engine.stats.finished["length"] == 16


def test_chunked_prefill_respects_token_budget() -> None:
    engine = Engine(profile("llama-3-8b@h100", max_num_batched_tokens=512), time_scale=0.001)
    s = seq("r", 2000, max_tokens=1)
    engine.submit(s)
    plan = engine.schedule()
    assert plan == [(s, 512)]


def test_preemption_when_kv_exhausted() -> None:
    # 32 blocks x 16 = 512 tokens of KV for 6 sequences that each grow to 300 tokens.
    engine = Engine(profile("llama-3-8b@h100", num_blocks_override=32), time_scale=0.001)
    seqs = [seq(f"r{i}", 100, max_tokens=200, base=i * 1000) for i in range(6)]
    run_engine(engine, seqs)
    assert engine.stats.preemptions > 0
    assert all(s.output_len == 200 and s.finish_reason == "length" for s in seqs)
    assert engine.kv.used_blocks == 0


def test_prefix_cache_hits_only_within_the_same_salt() -> None:
    engine = Engine(profile("llama-3-8b@h100"), time_scale=0.001)
    run_engine(engine, [seq("a1", 640, max_tokens=1, salt="tenant-a")])
    run_engine(engine, [seq("a2", 640, max_tokens=1, salt="tenant-a")])
    hits_same = engine.kv.hit_tokens
    assert hits_same >= 608  # all full blocks but the last token's
    run_engine(engine, [seq("b1", 640, max_tokens=1, salt="tenant-b")])
    assert engine.kv.hit_tokens == hits_same  # a different salt never hits


def test_block_hashes_chain_over_prefix_and_salt() -> None:
    toks = list(range(64))
    assert block_hashes(toks, 16, "s")[:2] == block_hashes(toks[:32] + [9] * 32, 16, "s")[:2]
    assert block_hashes(toks, 16, "s")[2] != block_hashes(toks[:32] + [9] * 32, 16, "s")[2]
    assert block_hashes(toks, 16, "s")[0] != block_hashes(toks, 16, "t")[0]


def test_freed_blocks_stay_cached_until_evicted() -> None:
    kv = KVCache(num_blocks=4, block_size=16)
    t = BlockTable(hashes=block_hashes(list(range(48)), 16, None))
    assert kv.allocate(t, 48)
    kv.commit_full_blocks(t, 48)
    kv.free(t)
    t2 = BlockTable(hashes=block_hashes(list(range(48)), 16, None))
    assert kv.lookup_prefix(t2, 48) == 32  # the last block is recomputed so a token is left to sample
    assert kv.used_blocks == 2


@pytest.mark.parametrize("text", ["hello world", "Grüße, 世界! 🙂 " * 20, "a" * 5000, "x\n\ty  z"])
def test_prompt_tokens_never_exceed_utf8_bytes(text: str) -> None:
    assert len(encode(text)) <= len(text.encode("utf-8"))
    msgs = [{"role": "user", "content": text}]
    assert len(apply_chat_template(msgs)) <= len(text.encode()) + 8  # template allowance per message


def test_output_is_deterministic_for_a_seed() -> None:
    a, b = TextSampler(42), TextSampler(42)
    assert a.natural_length == b.natural_length
    assert [a.next_piece(i) for i in range(20)] == [b.next_piece(i) for i in range(20)]
