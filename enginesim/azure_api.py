"""Azure OpenAI's deployment path on the simulated engine's server (`--api azure`)."""

from __future__ import annotations

from aiohttp import web

from enginesim.server import EngineServer


class AzureFrontEnd:
    """Azure OpenAI's deployment path on the same server: `POST /openai/deployments/{name}/chat/completions
    ?api-version=...` with the key in `api-key` (401 in Azure's shape otherwise; 404 without an
    api-version), answered as the OpenAI endpoint answers."""

    def __init__(self, server: EngineServer, api_key: str | None):
        self.server = server
        self.api_key = api_key
        server.app.router.add_post("/openai/deployments/{deployment}/chat/completions", self.chat)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        if self.api_key is not None and request.headers.get("api-key") != self.api_key:
            return web.json_response({"error": {"code": "401", "message": "Access denied due to invalid subscription "
                                                "key or wrong API endpoint."}}, status=401)
        if not request.query.get("api-version"):
            return web.json_response({"error": {"code": "404", "message": "Resource not found"}}, status=404)
        return await self.server.chat(request)
