"""`python -m enginesim`: one simulated engine, with the API front end of the provider it stands for."""

from __future__ import annotations

import argparse
import importlib
import logging
import os

from aiohttp import web

from enginesim.server import ENGINE_VERSION, FAULT_HEADER, EngineServer, build_engine

# Each provider shape's front end on the engine's server (`--api`), imported only when chosen; the
# OpenAI shape is the server's own.
FRONT_ENDS: dict[str, str | None] = {
    "openai": None,
    "anthropic": "enginesim.anthropic_api:MessagesFrontEnd",
    "azure": "enginesim.azure_api:AzureFrontEnd",
    "gemini": "enginesim.gemini_api:GeminiFrontEnd",
    "bedrock": "enginesim.bedrock_api:ConverseFrontEnd",
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m enginesim", description="simulated vLLM engine")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default="meta-llama/Llama-3.1-8B-Instruct")
    p.add_argument("--profile", default="llama-3-8b@h100", help="model@accelerator[xTP]")
    p.add_argument("--time-scale", type=float, default=1.0, help="real seconds per simulated second")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--num-gpu-blocks", type=int, dest="num_blocks_override")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="vLLM's flag (on by default): --no-enable-prefix-caching computes every prompt in full")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api", choices=sorted(FRONT_ENDS), default="openai",
                   help="anthropic: also serve POST /v1/messages, as the Messages API (enginesim/anthropic_api.py); "
                        "azure: also serve Azure OpenAI's deployment path, with its api-key header; "
                        "gemini: also serve generateContent (enginesim/gemini_api.py); "
                        "bedrock: also serve Converse (enginesim/bedrock_api.py)")
    p.add_argument("--api-key", help="(--api anthropic|azure|gemini|bedrock) the key the provider accepts "
                                     "(bedrock: ACCESS_KEY_ID:SECRET_ACCESS_KEY, checked as SigV4); unset: any")
    p.add_argument("--corrupt", action="append", choices=["usage", "tool_calls"], default=[],
                   help="a corrupted provider (conformance tests): never send usage; send tool calls that do not parse")
    p.add_argument("--runner", choices=["generate", "pooling"], default="generate",
                   help="vLLM's runner: generate (chat completions) or pooling (POST /v1/embeddings only, "
                        "enginesim/embeddings_api.py)")
    p.add_argument("--reasoning-parser", default="",
                   help="vLLM's flag for a reasoning model (qwen3, deepseek_r1, ...): every answer thinks first, "
                        "its reasoning in the message's (the delta's) `reasoning`, its tokens within max_tokens")
    p.add_argument("--embedding-dim", type=int, default=384, help="(--runner pooling) the vectors' length")
    p.add_argument("--tls-cert", help="serve HTTPS with this certificate (and --tls-key), as a hosted provider does")
    p.add_argument("--tls-key")
    p.add_argument("--engine-version", default=ENGINE_VERSION, help="what GET /version says, as vLLM's does")
    p.add_argument("--answer-model", help="the model its answers name (default: --served-model-name): a provider "
                                          "that answers with another model than the one asked for")
    p.add_argument("--quality-oracle", metavar="CORPUS", action="append", default=[],
                   help="answer the tasks of this quality corpus (YAML; repeatable) right, on --quality-accuracy "
                        "of them")
    p.add_argument("--quality-accuracy", type=float, default=1.0,
                   help="(--quality-oracle) the share of its tasks answered right, the same ones each time")
    p.add_argument("--fault-header", action="store_true",
                   help=f"honour the {FAULT_HEADER} request header (the simulator's own tests; never behind a gateway)")
    args = p.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s %(message)s")
    import uvloop

    uvloop.install()
    engine = build_engine(args.profile, args.time_scale, args.enable_prefix_caching, max_model_len=args.max_model_len,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          num_blocks_override=args.num_blocks_override)
    server = EngineServer(engine, args.served_model_name, seed=args.seed, fault_header=args.fault_header,
                          corrupt=frozenset(args.corrupt))
    key = os.environ.get("ENGINESIM_API_KEY") or args.api_key
    server.reasoning_parser = args.reasoning_parser
    server.engine_version = args.engine_version
    server.answer_model = args.answer_model or args.served_model_name
    if args.quality_oracle:
        from pathlib import Path

        from enginesim.oracle import Oracle

        server.oracle = Oracle([Path(p) for p in args.quality_oracle], args.quality_accuracy, args.seed)
    if args.runner == "pooling":
        from enginesim.embeddings_api import EmbeddingsFrontEnd

        EmbeddingsFrontEnd(server, args.embedding_dim)
    front_end = FRONT_ENDS[args.api]
    if front_end is not None:
        module, _, name = front_end.partition(":")
        getattr(importlib.import_module(module), name)(server, key)
    # Like vLLM, a client that goes away aborts its request in the engine.
    tls = None
    if args.tls_cert:
        import ssl

        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(args.tls_cert, args.tls_key)
    web.run_app(server.app, host=args.host, port=args.port, print=None, access_log=None, handler_cancellation=True,
                ssl_context=tls)
