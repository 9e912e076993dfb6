"""The FastAPI app over one `FrontEnd`: OpenAI's routes, and OpenAI's error shape for everything the
routes themselves do not answer (an unknown path or method, an unexpected failure)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from distpool.api.engine import Engine
from distpool.api.errors import SERVER, ApiError
from distpool.api.front_end import FrontEnd
from distpool.api.settings import ApiSettings

log = logging.getLogger(__name__)
COMPLETIONS, CHAT_COMPLETIONS, MODELS, HEALTH = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/health",
)


def build_app(engine: Engine, settings: ApiSettings) -> FastAPI:
    """The app serving `engine` (tests run it with httpx's ASGI transport, Ray Serve via `ingress`)."""
    front = FrontEnd(engine, settings)
    app = FastAPI(title="distpool", docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)
    app.state.front_end = front
    app.add_api_route(COMPLETIONS, front.completions, methods=["POST"])
    app.add_api_route(CHAT_COMPLETIONS, front.chat_completions, methods=["POST"])
    app.add_api_route(MODELS, front.models, methods=["GET"])
    app.add_api_route(HEALTH, front.health, methods=["GET"])
    return app


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return ApiError(
            status=exc.status_code, message=f"{request.method} {request.url.path}: {exc.detail}"
        ).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
        message = f"internal error ({type(exc).__name__}); the server's log has the details"
        return ApiError(status=500, message=message, type=SERVER, code="internal_error").response()
