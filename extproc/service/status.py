"""The worker's status server: GET /status (the serving revision, the last reload, what this worker
received and scraped), GET /metrics (every worker of the host), GET /healthz (answered by the loop that
decides), POST /reload with the admin token."""

from __future__ import annotations

import hmac
import json
from pathlib import Path
from typing import Any

from aiohttp import web

from extproc import occupancy
from extproc.config.reload import Reloader
from extproc.contract import WORKER_HEALTH_PATH
from extproc.metrics import exposition
from extproc.picker import Picker
from extproc.service.processor import Processor
from extproc.settlement.access_log import SettlementLog

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def host_name(host: str) -> str:
    """A Host header's name, without its port or an IPv6 literal's brackets."""
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def status_guards(listen_host: str, token: str | None) -> Any:
    """The status server's two guards (issue 27): on a loopback address it answers only requests that
    name a loopback Host (a page in a local browser, its name pointed at 127.0.0.1, cannot use it);
    beyond loopback (docker-compose, where Prometheus scrapes it by service name) every Host is
    served. Either way a request that changes something (POST /reload) carries the token from the
    state directory as its bearer credential; without a token configured, the endpoint is off
    (SIGHUP and the policy directory's watcher still reload)."""
    loopback_only = host_name(listen_host) in LOOPBACK_HOSTS

    @web.middleware
    async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
        if loopback_only and host_name(request.host or "") not in LOOPBACK_HOSTS:
            return web.json_response({"error": "this server answers only requests to a loopback host"}, status=403)
        if request.method != "GET":
            if token is None:
                return web.json_response({"error": "POST /reload is off: start ext_proc with --admin-token-file "
                                                   "(SIGHUP reloads too)"}, status=403)
            sent = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not hmac.compare_digest(sent.encode(), token.encode()):
                return web.json_response({"error": "a valid admin token is required"}, status=401,
                                         headers={"www-authenticate": "Bearer"})
        return await handler(request)
    return guard


def _loops(path: Path | None) -> Any:
    """The supervised loops' state as `llmgw up` last wrote it (llmgw/ops/loops.py); {} when none run."""
    try:
        return json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}


async def status_app(reloader: Reloader, listen: str, processor: Processor | None = None,
                     access_log: SettlementLog | None = None, picker: Picker | None = None,
                     admin_token: str | None = None, loops_state: Path | None = None) -> web.AppRunner:
    """GET /status: the serving revision, the last reload's outcome (errors name file and field),
    and what this worker has received (ext_proc messages, access-log entries) and scraped. GET
    /metrics: Prometheus text for every worker of this host (extproc/metrics.py). POST /reload, with
    the admin token (status_guards)."""
    async def status(_: web.Request) -> web.Response:
        counts = {"extproc_messages": dict(processor.messages) if processor is not None else {},
                  "access_log_entries": access_log.entries if access_log is not None else 0,
                  "metrics_scrapes": picker.scrapes if picker is not None else 0,
                  "picker": picker.status() if picker is not None else None,
                  "admission": processor.admission.status() if processor is not None and processor.admission else {},
                  **(processor.decisions.status() if processor is not None else {})}
        return web.json_response({**reloader.status, **counts, "loops": _loops(loops_state)})

    async def reload(_: web.Request) -> web.Response:
        reloader.reload("admin request")
        return web.json_response(reloader.status)

    async def metrics(_: web.Request) -> web.Response:
        text, content_type = exposition()
        held = await occupancy.exposition(processor.store if processor is not None else None,
                                          reloader.live.snapshot)
        return web.Response(body=text + held, headers={"Content-Type": content_type})

    async def healthz(_: web.Request) -> web.Response:
        # Answered by the event loop that decides requests: a loop too busy to answer this in time is
        # too busy to decide (Envoy's health check and the supervisor take the worker out, then restart it).
        return web.Response(text="ok")

    host, _, port = listen.rpartition(":")
    app = web.Application(middlewares=[status_guards(host, admin_token)])
    app.router.add_get(WORKER_HEALTH_PATH, healthz)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reload", reload)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host.strip("[]"), int(port)).start()
    return runner
