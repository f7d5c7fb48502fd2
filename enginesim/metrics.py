"""Prometheus text exposition with vLLM's metric names and labels (reference/engines-and-providers.md)."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from enginesim.engine import Engine

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


def _histogram(name: str, help_: str, labels: str, values: Iterable[float], buckets: tuple[float, ...]) -> list[str]:
    vals = sorted(values)
    out = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
    for b in buckets:
        out.append(f'{name}_bucket{{{labels},le="{b}"}} {bisect.bisect_right(vals, b)}')
    out.append(f'{name}_bucket{{{labels},le="+Inf"}} {len(vals)}')
    out.append(f"{name}_count{{{labels}}} {len(vals)}")
    out.append(f"{name}_sum{{{labels}}} {sum(vals)}")
    return out


def _scalar(kind: str, name: str, help_: str, labels: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name}{{{labels}}} {value}"]


def render_metrics(engine: Engine, model_name: str) -> str:
    s = engine.stats
    p = engine.profile
    lb = f'engine="0",model_name="{model_name}"'
    lines: list[str] = []
    lines += _scalar("gauge", "vllm:num_requests_running", "Number of requests in model execution batches.",
                     lb, len(engine.running))
    lines += _scalar("gauge", "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                     lb, len(engine.waiting))
    lines += _scalar("gauge", "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                     lb, engine.kv.usage)
    lines += _scalar("counter", "vllm:prefix_cache_queries_total",
                     "Prefix cache queries, in terms of number of queried tokens.", lb, engine.kv.queries_tokens)
    lines += _scalar("counter", "vllm:prefix_cache_hits_total",
                     "Prefix cache hits, in terms of number of cached tokens.", lb, engine.kv.hit_tokens)
    lines += _scalar("counter", "vllm:num_preemptions_total", "Cumulative number of preemption from the engine.",
                     lb, s.preemptions)
    lines += _scalar("counter", "vllm:prompt_tokens_total", "Number of prefill tokens processed.", lb,
                     s.prompt_tokens)
    lines += _scalar("counter", "vllm:generation_tokens_total", "Number of generation tokens processed.", lb,
                     s.generation_tokens)
    lines += ["# HELP vllm:request_success_total Count of successfully processed requests.",
              "# TYPE vllm:request_success_total counter"]
    lines += [f'vllm:request_success_total{{{lb},finished_reason="{r}"}} {n}' for r, n in s.finished.items()]
    lines += _histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                        lb, s.ttft, TTFT_BUCKETS)
    lines += _histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        lb, s.itl, ITL_BUCKETS)
    lines += _histogram("vllm:request_time_per_output_token_seconds",
                        "Histogram of time_per_output_token_seconds per request.", lb, s.tpot, ITL_BUCKETS)
    lines += _histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        lb, s.e2e, E2E_BUCKETS)
    lines += ["# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
              "# TYPE vllm:cache_config_info gauge",
              f'vllm:cache_config_info{{block_size="{p.block_size}",cache_dtype="auto",'
              f'enable_prefix_caching="{engine.kv.prefix_caching}",'
              f'engine="0",gpu_memory_utilization="{p.gpu_memory_utilization}",'
              f'num_gpu_blocks="{engine.kv.num_blocks}"}} 1.0']
    lines += ["# HELP vllm:lora_requests_info Running stats on lora requests.",
              "# TYPE vllm:lora_requests_info gauge",
              'vllm:lora_requests_info{max_lora="0",running_lora_adapters="",waiting_lora_adapters=""} 0.0']
    return "\n".join(lines) + "\n"
