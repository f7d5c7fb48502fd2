"""The engine core: continuous batching in steps, as vLLM V1 schedules them.

Each step: running sequences get their next prompt chunk or one decode token; waiting requests'
prefill chunks fill what is left of the token budget (chunked prefill), up to the sequence cap. When
KV blocks run out, the newest running request is preempted: its blocks are freed, its progress is
reset, and it goes to the front of the waiting queue. A step lasts what the physical model says,
scaled by `time_scale` (real seconds per simulated second).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from enginesim.kv import BlockTable, KVCache, block_hashes
from enginesim.physics import EngineProfile


@dataclass
class Sequence:
    request_id: str
    prompt: list[int]
    max_tokens: int
    natural_length: int
    salt: str | None
    arrival: float  # simulated seconds
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0  # tokens whose KV is in the cache
    output_len: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted
    finish_reason: str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    out: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)  # token index, None = done

    @property
    def total_len(self) -> int:
        return len(self.prompt) + self.output_len

    @property
    def prefill_target(self) -> int:
        """Tokens to compute before the next token can be sampled: all but the last output token."""
        return self.total_len - (1 if self.output_len else 0)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_target


@dataclass
class EngineStats:
    steps: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # vLLM's finished_reason labels. A client that goes away is not counted here (vLLM 0.32 does not).
    finished: dict[str, int] = field(default_factory=lambda: {
        "stop": 0, "length": 0, "abort": 0, "error": 0, "repetition": 0})
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)


class Engine:
    def __init__(self, profile: EngineProfile, time_scale: float = 1.0, prefix_caching: bool = True):
        self.profile = profile
        self.time_scale = time_scale
        self.kv = KVCache(profile.num_gpu_blocks, profile.block_size, prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = EngineStats()
        self.sim_time = 0.0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._real_start = time.monotonic()

    def now(self) -> float:
        """Simulated seconds. While busy the clock advances by modelled step times only (Python's own
        overhead is not the engine's); idle time passes at the real rate divided by the scale."""
        if self.running or self.waiting:
            return self.sim_time
        return max(self.sim_time, (time.monotonic() - self._real_start) / self.time_scale)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()

    def submit(self, seq: Sequence) -> None:
        seq.table.hashes = block_hashes(seq.prompt, self.kv.block_size, seq.salt)
        self.stats.prompt_tokens += len(seq.prompt)
        self.waiting.append(seq)
        self._wake.set()

    def abort(self, seq: Sequence) -> None:
        if seq.finish_reason is not None:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq.table)
        seq.finish_reason = "abort"  # not counted in request_success_total, as in vLLM 0.32

    # -- scheduling --------------------------------------------------------------------------------

    def _preempt_newest(self) -> Sequence:
        victim = self.running.pop()
        self.kv.free(victim.table)
        victim.num_computed = 0
        self.waiting.appendleft(victim)
        self.stats.preemptions += 1
        return victim

    def schedule(self) -> list[tuple[Sequence, int]]:
        """Decide this step's work: (sequence, tokens to compute)."""
        budget = self.profile.max_num_batched_tokens
        plan: list[tuple[Sequence, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.prefill_target - seq.num_computed, budget) if seq.in_prefill else 1
            while not self.kv.allocate(seq.table, seq.num_computed + n):
                preempted = True
                if self._preempt_newest() is seq:
                    break
            else:
                plan.append((seq, n))
                budget -= n
                i += 1
                continue
            break  # seq itself was preempted
        if preempted:
            return plan
        while self.waiting and budget > 0 and len(self.running) < self.profile.max_num_seqs:
            seq = self.waiting[0]
            # A preempted sequence recomputes prompt and output so far; only the prompt is cached.
            hit = self.kv.lookup_prefix(seq.table, len(seq.prompt))
            seq.num_computed = hit
            n = max(min(seq.prefill_target - seq.num_computed, budget), 1)
            if not self.kv.allocate(seq.table, seq.num_computed + n):
                self.kv.free(seq.table)  # give the cached blocks back: a waiting request holds nothing
                seq.num_computed = 0
                break
            self.kv.record_query(len(seq.prompt), hit)
            if seq.output_len == 0:
                seq.cached_tokens = hit  # what a provider bills as cached input (a first admission's hit)
            self.waiting.popleft()
            self.running.append(seq)
            plan.append((seq, n))
            budget -= n
        return plan

    def step_time(self, plan: list[tuple[Sequence, int]]) -> float:
        decode = [(s, n) for s, n in plan if not s.in_prefill]
        prefill = [(s.num_computed, n) for s, n in plan if s.in_prefill]
        return self.profile.step_seconds(sum(s.total_len for s, _ in decode), prefill, len(decode))

    def apply(self, plan: list[tuple[Sequence, int]], now: float) -> None:
        """Advance every planned sequence; a sequence whose prompt is complete emits a token."""
        for seq, n in plan:
            if seq.finish_reason is not None:  # aborted while the step ran
                continue
            was_prefill = seq.in_prefill
            seq.num_computed += n
            self.kv.commit_full_blocks(seq.table, seq.num_computed)
            if was_prefill and seq.in_prefill:
                continue  # more prompt chunks to go
            self._emit(seq, now)

    def _emit(self, seq: Sequence, now: float) -> None:
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.stats.ttft.append(now - seq.arrival)
        elif seq.last_token_at is not None:
            self.stats.itl.append(now - seq.last_token_at)
        seq.last_token_at = now
        seq.out.put_nowait(seq.output_len)
        seq.output_len += 1
        self.stats.generation_tokens += 1
        if seq.output_len >= seq.max_tokens or seq.output_len >= seq.natural_length:
            seq.finish_reason = "length" if seq.output_len < seq.natural_length else "stop"
            self._finish(seq, now)

    def _finish(self, seq: Sequence, now: float) -> None:
        self.running.remove(seq)
        self.kv.free(seq.table)
        self.stats.finished[seq.finish_reason or "stop"] += 1
        self.stats.e2e.append(now - seq.arrival)
        if seq.output_len > 1 and seq.first_token_at is not None:
            self.stats.tpot.append((now - seq.first_token_at) / (seq.output_len - 1))
        seq.out.put_nowait(None)

    async def _loop(self) -> None:
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
                self.sim_time = max(self.sim_time, (time.monotonic() - self._real_start) / self.time_scale)
            plan = self.schedule()
            if not plan:  # everything preempted or blocked; let time pass
                await asyncio.sleep(self.profile.step_overhead_s * self.time_scale)
                continue
            dt = self.step_time(plan)
            await asyncio.sleep(dt * self.time_scale)
            self.sim_time += dt
            self.stats.steps += 1
            self.apply(plan, self.sim_time)
