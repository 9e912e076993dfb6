"""The front end as a Ray Serve application: a FastAPI ingress deployment over the engine.

    app = ApiIngress.bind(engine, ApiSettings(...))   # engine: an Engine, or an engine deployment
    serve.run(app)                                     # or `serve run` / `serve deploy` of a config

Each replica holds its own `FrontEnd` (its waiting room counts that replica's requests); what the
requests share (routing, reservations, caches) lives in the engine, the one home every replica uses.
"""

# No `from __future__ import annotations` here: FastAPI reads the routes' annotations (`Request`)
# after Serve rewrites the methods, and string annotations would turn `request` into a query field.
from fastapi import FastAPI, Request
from fastapi.responses import Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from distpool.api.app import CHAT_COMPLETIONS, COMPLETIONS, HEALTH, MODELS, add_error_handlers
from distpool.api.engine import Engine
from distpool.api.front_end import FrontEnd
from distpool.api.handle_engine import HandleEngine
from distpool.api.settings import ApiSettings

ingress_app = FastAPI(title="distpool", docs_url=None, redoc_url=None, openapi_url=None)
add_error_handlers(ingress_app)


@serve.deployment(name="distpool-api")
@serve.ingress(ingress_app)
class ApiIngress:
    def __init__(self, engine: Engine | DeploymentHandle, settings: ApiSettings) -> None:
        self._front = FrontEnd(
            HandleEngine(engine) if isinstance(engine, DeploymentHandle) else engine, settings
        )

    @ingress_app.post(COMPLETIONS)
    async def completions(self, request: Request) -> Response:
        return await self._front.completions(request)

    @ingress_app.post(CHAT_COMPLETIONS)
    async def chat_completions(self, request: Request) -> Response:
        return await self._front.chat_completions(request)

    @ingress_app.get(MODELS)
    async def models(self, request: Request) -> Response:
        return await self._front.models(request)

    @ingress_app.get(HEALTH)
    async def health(self, request: Request) -> Response:
        return await self._front.health(request)
