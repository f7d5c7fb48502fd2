"""The models endpoint: GET /v1/models and /v1/models/{route} (and a door's own model paths), answered
from the routes in the shape of the SDK that asked; every other path the gateway does not serve is
refused there, naming what it does serve."""

from __future__ import annotations

import re
import urllib.parse
from typing import Any

import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc.contract import MODELS_PATH, ErrorCode, GatewayError
from extproc.exchange import Exchange
from extproc.replies import immediate
from extproc.shapes.door import path_of
from extproc.shapes.registry import ENDPOINTS, models_door
from extproc.stages.identity import CallerIdentity


def model_object(route: str) -> dict[str, Any]:
    """A route as OpenAI's model object (what `client.models.list()` / `.retrieve()` return)."""
    return {"id": route, "object": "model", "created": 0, "owned_by": "llmgw"}


async def answer_models(ex: Exchange, identity: CallerIdentity) -> ep.ProcessingResponse:
    """GET /v1/models and /v1/models/{route} (and a door's own model paths) are sent with their
    headers: answered from the routes, in the shape of the SDK that asked. So is every path the
    gateway does not serve: its caller, once identified, is told what it does serve, in the shape
    its SDK's headers say, and the refusal is ledgered."""
    path = path_of(ex.path)
    door = models_door(path, ex.headers)
    own = door is not None and door.models_path and re.fullmatch(door.models_path, path)
    ex.door = door.name if door is not None else ""  # its errors in the door's shape too
    await identity.run(ex)
    if ex.method != "GET" or not (own or path == MODELS_PATH or path.startswith(MODELS_PATH + "/")):
        ex.unserved = True
        raise GatewayError(ErrorCode.ROUTE_NOT_FOUND,
                           f"no such endpoint: {ex.method} {path}; this gateway serves {', '.join(ENDPOINTS)}")
    name = urllib.parse.unquote(path.rstrip("/").partition("/models")[2].lstrip("/"))
    snap = ex.snapshot
    if name and name not in snap.routes:
        raise GatewayError(ErrorCode.ROUTE_NOT_FOUND, "no route of that name", "model")
    if door is None or door.model_object is None or door.model_list is None:
        doc = model_object(name) if name else {"object": "list", "data": [model_object(n) for n in
                                                                          sorted(snap.routes)]}
    else:
        make = door.model_object

        def shaped(route: str) -> dict[str, Any]:  # its limits: the smallest window, the route's cap
            r = snap.routes[route]
            window = min((snap.deployments[c.deployment_name].context_window for c in r.candidates), default=0)
            return make(route, window, r.max_tokens_cap or window)
        # A door's SDK calls chat routes only: its list leaves the embeddings routes out (a lookup
        # by name still answers, as the route exists).
        chats = sorted(n for n, r in snap.routes.items() if r.serves == "chat")
        doc = shaped(name) if name else door.model_list([shaped(n) for n in chats])
    return immediate(ex, 200, orjson.dumps(doc), "llmgw_models")
