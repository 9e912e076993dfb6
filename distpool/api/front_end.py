"""The endpoints' work, apart from how they are hosted (`app.build_app` for FastAPI alone, `ingress`
for Ray Serve): each handler takes the HTTP request and returns the response, and no input reaches
past it as an exception (a bad one is an ApiError in OpenAI's shape, never a 500 or a traceback).

Order of work per generation request: the API key (401), the body (400), the model's limits (400),
room among waiting requests (503), then the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from distpool.api.admission import WaitingRoom, check_api_key
from distpool.api.engine import Engine, ModelCard
from distpool.api.errors import ApiError
from distpool.api.request.body import parse_body, read_body
from distpool.api.request.chat_request import ChatRequest
from distpool.api.request.completion_request import CompletionRequest
from distpool.api.request.prompts import chat_prompt, check_request_ids, choice_jobs, completion_prompts
from distpool.api.request.request_fields import RequestFields
from distpool.api.request.tokenizer import ApiTokenizer, load_tokenizer
from distpool.api.settings import ApiSettings
from distpool.api.stream.generation import run_choices
from distpool.api.stream.reply import (
    ClientGone,
    ReplyPlan,
    first_batch,
    sse_reply,
    unless_disconnected,
    whole_reply,
)
from distpool.api.stream.responses import ResponseHead

log = logging.getLogger(__name__)
CLIENT_CLOSED_REQUEST = 499  # nobody reads it: the client has gone
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class FrontEnd:
    """One replica's front end over `engine`: the model card and tokenizer are read once, on the
    first request that needs them."""

    def __init__(self, engine: Engine, settings: ApiSettings) -> None:
        self.engine, self.settings = engine, settings
        self.waiting = WaitingRoom(settings)
        self._model: tuple[ModelCard, ApiTokenizer | None] | None = None
        self._model_lock = asyncio.Lock()

    async def model(self) -> tuple[ModelCard, ApiTokenizer | None]:
        async with self._model_lock:
            if self._model is None:
                card = await self.engine.model_card()
                tokenizer = await asyncio.to_thread(load_tokenizer, card.tokenizer_folder)
                self._model = (card, tokenizer)
        return self._model

    async def completions(self, request: Request) -> Response:
        return await self._answer(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._answer(request, chat=True)

    async def models(self, request: Request) -> Response:
        try:
            check_api_key(request, self.settings)
        except ApiError as exc:
            return exc.response()
        card, _ = await self.model()
        entry = {
            "id": card.served_name,
            "object": "model",
            "created": 0,
            "owned_by": "distpool",
            "max_model_len": card.context_len,
        }
        return JSONResponse({"object": "list", "data": [entry]})

    async def health(self, request: Request) -> Response:
        try:
            health = await self.engine.health()
        except Exception as exc:  # the engine itself does not answer
            message = f"the engine does not answer: {type(exc).__name__}: {exc}"[:300]
            return JSONResponse({"status": "unavailable", "message": message, "silent": []}, status_code=503)
        if health.ok:
            return JSONResponse({"status": "ok", "workers": [w.name for w in health.workers]})
        silent = [{"name": w.name, "detail": w.detail} for w in health.silent]
        names = ", ".join(w.name for w in health.silent)
        return JSONResponse(
            {"status": "unavailable", "message": f"workers not answering: {names}", "silent": silent},
            status_code=503,
        )

    async def _answer(self, request: Request, chat: bool) -> Response:
        try:
            check_api_key(request, self.settings)
            body = await read_body(request)
            fields: RequestFields = parse_body(ChatRequest if chat else CompletionRequest, body)
            fields.check_supported()
            fields.log_unknown_fields("/v1/chat/completions" if chat else "/v1/completions")
            card, tokenizer = await self.model()
            if fields.model is not None and fields.model != card.served_name:
                raise ApiError(
                    status=404,
                    message=f"model {fields.model!r} is not served here; it serves {card.served_name!r}",
                    param="model",
                    code="model_not_found",
                )
            check_request_ids(fields, card, tokenizer)
            if chat:
                prompts = [await asyncio.to_thread(chat_prompt, fields, card, tokenizer)]
            else:
                prompts = await asyncio.to_thread(completion_prompts, fields, card, tokenizer)
            request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            jobs = choice_jobs(fields, request_id, prompts)
        except ApiError as exc:
            return exc.response()
        plan = ReplyPlan(
            head=ResponseHead(id=request_id, created=int(time.time()), model=card.served_name, chat=chat),
            jobs=jobs,
            include_usage=fields.include_usage,
            show_token_ids=tokenizer is None or fields.return_token_ids,
        )
        decode = tokenizer.decode if tokenizer is not None else None
        batches = run_choices(self.engine, jobs, decode, self.waiting)
        try:
            if fields.stream:
                first = await unless_disconnected(first_batch(batches), _disconnected(request))
                reply = sse_reply(plan, first, batches)
                return StreamingResponse(reply, media_type="text/event-stream", headers=SSE_HEADERS)
            return JSONResponse(await unless_disconnected(whole_reply(plan, batches), _disconnected(request)))
        except ApiError as exc:
            await batches.aclose()
            return exc.response()
        except ClientGone:
            await batches.aclose()
            return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (its body was read already, so only a disconnect is left)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
