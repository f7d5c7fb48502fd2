"""`llmgw bench trace` writes a trace of work; `llmgw bench run TRACE` replays it open-loop through a
running gateway (`llmgw up`'s, from STATE_DIR/up.json) and reports, per request class, admitted,
refused and timed-out fractions beside TTFT, TPOT and end-to-end p50/p95/p99, the output token
rate, and the cost per accepted task from the ledger: everything the run's requests were charged
(failed attempts included) over the requests that were answered (llmgw/bench/openloop.py).

Cold and warm: a cold pass starts with every engine's prefix cache emptied (vLLM's
`POST /reset_prefix_cache`); a warm pass replays the same trace again right after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmgw.bench.openloop import Outcome, replay, summarise
from llmgw.bench.stats import percentile
from llmgw.bench.workload import ClassShape, TraceShape, generate, read, write
from llmgw.ops.ledger import ledger_entries
from llmgw.ops.store import store_client

# ClassShape's length distributions, settable for every class from the command line (a small
# model's context, a hosted route's typical answer).
LENGTH_OPTIONS = {"input_median": int, "input_sigma": float, "output_median": int, "output_sigma": float,
                  "max_input": int, "max_output": int, "stream_share": float}


def cmd_trace(args: argparse.Namespace) -> int:
    lengths = {k: getattr(args, k) for k in LENGTH_OPTIONS if getattr(args, k) is not None}
    classes = []
    for item in args.classes.split(","):
        name, _, rest = item.partition("=")
        share, _, route = rest.partition("@")
        classes.append(ClassShape(name, float(share), route=route or args.route, **lengths))
    tenants = {t: float(w or 1) for t, _, w in (x.partition("=") for x in args.tenants.split(","))}
    shape = TraceShape(rate_rps=args.rate, duration_s=args.duration, arrivals=args.arrivals, classes=tuple(classes),
                       tenants=tenants, prefix_share=args.prefix_share,
                       cancel_share=args.cancel_share)
    n = write(generate(shape, args.seed), Path(args.output))
    print(f"wrote {n} requests to {args.output} (seed {args.seed})", file=sys.stderr)
    return 0


def ledger_cost(store_url: str, tenants: Sequence[str], request_ids: set[str], wait_s: float = 10.0) -> int:
    """Micro-units the run's requests were charged, once every answered one is settled."""
    client = store_client(store_url)
    deadline = time.monotonic() + wait_s
    while True:
        found = {e["request_id"]: e for e in ledger_entries(client, tenants) if e.get("request_id") in request_ids}
        if len(found) >= len(request_ids) or time.monotonic() > deadline:
            return sum(int(e.get("charged_micros") or 0) for e in found.values())
        time.sleep(0.2)


def _ms(values: tuple[float, ...]) -> list[str]:
    return [f"{v * 1000:.1f}" for v in values] if values else ["-"] * 3


def render(label: str, outcomes: Sequence[Outcome], wall_s: float, charged_micros: int | None) -> str:
    head = ["class", "requests", "admitted", "refused", "timed out", "cancelled",
            "TTFT p50/p95/p99 ms", "TPOT p50/p95/p99 ms", "E2E p50/p95/p99 ms"]
    lines = [f"### {label}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in summarise(outcomes):
        n = c.requests
        lines.append(f"| {c.request_class} | {n} | {c.admitted / n:.1%} | {c.refused / n:.1%} | "
                     f"{c.timed_out / n:.1%} | {c.cancelled / n:.1%} | {' / '.join(_ms(c.ttft_s))} | "
                     f"{' / '.join(_ms(c.tpot_s))} | {' / '.join(_ms(c.e2e_s))} |")
    answered = [o for o in outcomes if o.e2e_s is not None]
    late = [o.late_s for o in outcomes]
    tokens = sum(o.output_tokens for o in answered)
    lines += ["", f"offered {len(outcomes)} requests over {wall_s:.1f} s; answered {len(answered)}; output "
              f"{tokens / wall_s:.0f} tokens/s; sends late by p99 {percentile(late, 99) * 1000:.1f} ms, "
              f"max {max(late) * 1000:.1f} ms (open loop: the schedule, not the answers, sets the load)"]
    if charged_micros is not None and answered:
        lines.append(f"cost per accepted task (ledger): {charged_micros / len(answered) / 1e6:.6f} "
                     f"({charged_micros} micro-units charged to the run's {len(outcomes)} requests)")
    return "\n".join(lines) + "\n"


def reset_prefix_caches(engines: Sequence[str], tries: int = 20) -> list[str]:
    """Empty every engine's prefix cache (vLLM's `POST /reset_prefix_cache`, a dev-mode endpoint).
    vLLM answers `{"success": false}` while requests hold blocks: retried while the last level
    drains. Returns what could not be emptied, each with why (the pass is then not cold there)."""
    failed = []
    for url in engines:
        why = ""
        for _ in range(tries):
            req = urllib.request.Request(f"{url}/reset_prefix_cache", data=b"", method="POST")
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    answer = json.loads(r.read() or b"{}")
            except urllib.error.HTTPError as e:
                why = ("no /reset_prefix_cache (vLLM serves it only with VLLM_SERVER_DEV_MODE=1)" if e.code == 404
                       else f"HTTP {e.code}")
                break
            except (OSError, ValueError) as e:
                why = str(e)
                break
            if not isinstance(answer, dict) or answer.get("success", True):
                why = ""
                break
            why = "requests still hold cache blocks"
            time.sleep(0.5)
        if why:
            failed.append(f"{url}: {why}")
    return failed


def warn_not_cold(failed: list[str]) -> None:
    for line in failed:
        print(f"warning: prefix cache not emptied, the pass is not cold there: {line}", file=sys.stderr)


def cmd_run(args: argparse.Namespace) -> int:
    up_path = Path(args.state_dir) / "up.json"
    if not up_path.exists():
        print(f"error: no {up_path}: start the gateway with `llmgw up` first", file=sys.stderr)
        return 2
    up: dict[str, Any] = json.loads(up_path.read_text())
    try:
        trace = read(Path(args.trace))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    keys = {t: v["api_key"] for t, v in up["tenants"].items()}
    unknown = {r.tenant for r in trace} - set(keys)
    if unknown:
        print(f"error: the trace names tenants the gateway has no key for: {sorted(unknown)}", file=sys.stderr)
        return 2
    url = f"{up['url']}/v1/chat/completions"
    passes = ["cold", "warm"] if args.cache == "both" else [args.cache]
    report = [f"# Open-loop replay of {args.trace} ({len(trace)} requests, speed {args.speed:g}x)\n"]
    results: dict[str, list[dict[str, Any]]] = {}
    for label in passes:
        if label == "cold":
            warn_not_cold(reset_prefix_caches(up.get("engines", [])))
        t0 = time.monotonic()
        outcomes = asyncio.run(replay(url, keys, trace, args.speed, args.exact_lengths))
        wall = time.monotonic() - t0
        ids = {o.request_id for o in outcomes if o.request_id}
        charged = ledger_cost(up["store_url"], sorted(keys), ids) if up.get("store_url") else None
        report.append(render(f"{label} cache", outcomes, wall, charged))
        results[label] = [{"class": o.record.request_class, "at": o.record.at, "late_s": o.late_s,
                           "status": o.status, "code": o.code, "request_id": o.request_id, "ttft_s": o.ttft_s,
                           "tpot_s": o.tpot_s, "e2e_s": o.e2e_s, "output_tokens": o.output_tokens,
                           "attempts": o.attempts, "cancelled": o.cancelled} for o in outcomes]
    text = "\n".join(report)
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results))
    return 0


def register(bsub: Any) -> None:
    t = bsub.add_parser("trace", help="write a seeded, production-shaped trace of work (JSON lines)")
    t.add_argument("-o", "--output", required=True)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--rate", type=float, default=5.0, help="mean arrivals per second")
    t.add_argument("--duration", type=float, default=60.0)
    t.add_argument("--arrivals", choices=["poisson", "bursty"], default="poisson")
    t.add_argument("--classes", default="read_only_chat=1",
                   help="name=share[@route],... (each with the default shapes; the route: --route's by default)")
    t.add_argument("--route", default="chat-default")
    t.add_argument("--tenants", default="acme", help="name[=share],... (equal shares by default)")
    t.add_argument("--prefix-share", type=float, default=0.5)
    t.add_argument("--cancel-share", type=float, default=0.02)
    for name, kind in LENGTH_OPTIONS.items():
        default = ClassShape.__dataclass_fields__[name].default
        t.add_argument(f"--{name.replace('_', '-')}", type=kind, help=f"every class's (default {default})")
    t.set_defaults(func=cmd_trace)
    r = bsub.add_parser("run", help="replay a trace open-loop through the running gateway (llmgw up)")
    r.add_argument("trace")
    r.add_argument("--state-dir", default=".llmgw")
    r.add_argument("--speed", type=float, default=1.0, help="arrival offsets divided by this")
    r.add_argument("--cache", choices=["cold", "warm", "both"], default="both")
    r.add_argument("--no-exact-lengths", dest="exact_lengths", action="store_false",
                   help="leave out vLLM's ignore_eos (hosted routes refuse it): answers end where the model stops")
    r.add_argument("--output", help="also write the markdown report here")
    r.add_argument("--json", help="every request's outcome as JSON")
    r.set_defaults(func=cmd_run)
