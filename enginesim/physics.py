"""Physical model of one vLLM engine: KV-cache capacity, decode and prefill step times.

Formulas (reference/engines-and-providers.md):
  KV bytes/token   = 2 x layers x kv_heads x head_dim x dtype_bytes
  KV blocks        = floor((HBM x util x TP - weights - activations x TP) / (block_size x KV bytes/token))
  memory time      = (weights/TP + sum(ctx_i) x KV bytes/TP) / (HBM bandwidth x eta)   (decode: memory-bound)
  compute time     = (2 x params x tokens + attention) / (TP x peak FLOP/s x MFU)     (prefill: compute-bound)
  step time        = max(memory time, compute time) + overhead + TP communication
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    d_model: int
    dtype_bytes: int = 2  # bf16

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class Accelerator:
    name: str
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s, datasheet
    peak_flops: float  # dense bf16 FLOP/s


MODELS = {
    "llama-3-8b": ModelShape("llama-3-8b", 8.03e9, layers=32, kv_heads=8, head_dim=128, d_model=4096),
    "llama-3-70b": ModelShape("llama-3-70b", 70.6e9, layers=80, kv_heads=8, head_dim=128, d_model=8192),
}
ACCELERATORS = {
    "h100": Accelerator("h100", 80e9, 3.35e12, 989e12),
    "h200": Accelerator("h200", 141e9, 4.8e12, 989e12),
    "a100-80g": Accelerator("a100-80g", 80e9, 2.0e12, 312e12),
}


@dataclass(frozen=True)
class EngineProfile:
    model: ModelShape
    gpu: Accelerator
    tp: int = 1
    gpu_memory_utilization: float = 0.9
    activation_bytes_per_gpu: float = 2e9
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    bandwidth_efficiency: float = 0.7  # eta
    mfu: float = 0.5
    step_overhead_s: float = 0.003  # scheduler, sampling, kernel launches
    comm_per_step_s: float = 0.0005  # all-reduce cost per step per doubling of TP
    num_blocks_override: int | None = None

    @property
    def num_gpu_blocks(self) -> int:
        if self.num_blocks_override is not None:
            return self.num_blocks_override
        free = (self.gpu.hbm_bytes * self.gpu_memory_utilization * self.tp
                - self.model.weight_bytes - self.activation_bytes_per_gpu * self.tp)
        if free <= 0:
            raise ValueError(f"{self.model.name} does not fit on {self.tp} x {self.gpu.name}")
        return int(free // (self.block_size * self.model.kv_bytes_per_token))

    def step_seconds(self, decode_contexts: int, prefill_chunks: list[tuple[int, int]],
                     decode_seqs: int) -> float:
        """One engine step.

        decode_contexts: sum of context lengths of sequences decoding one token this step.
        prefill_chunks: (start position, chunk length) of each prompt chunk computed this step.
        decode_seqs: number of sequences decoding one token this step.
        """
        m = self.model
        prefill_tokens = sum(c for _, c in prefill_chunks)
        kv_read = decode_contexts + sum(p for p, _ in prefill_chunks)
        mem = (m.weight_bytes + kv_read * m.kv_bytes_per_token) / self.tp / (
            self.gpu.hbm_bandwidth * self.bandwidth_efficiency)
        attn = sum(2 * m.layers * m.d_model * c * (2 * p + c) for p, c in prefill_chunks)
        flops = 2 * m.params * (prefill_tokens + decode_seqs) + attn
        compute = flops / (self.tp * self.gpu.peak_flops * self.mfu)
        comm = self.comm_per_step_s * math.log2(self.tp) if self.tp > 1 else 0.0
        return max(mem, compute) + self.step_overhead_s + comm


def profile(name: str, **overrides: object) -> EngineProfile:
    """`llama-3-8b@h100`, `llama-3-70b@h200x2` (model@accelerator[xTP])."""
    model_name, _, hw = name.partition("@")
    gpu_name, _, tp = (hw or "h100").partition("x")
    if model_name not in MODELS or gpu_name not in ACCELERATORS:
        raise ValueError(f"unknown profile {name!r}; models {sorted(MODELS)}, accelerators {sorted(ACCELERATORS)}")
    return EngineProfile(model=MODELS[model_name], gpu=ACCELERATORS[gpu_name], tp=int(tp or 1),
                         **overrides)  # type: ignore[arg-type]
