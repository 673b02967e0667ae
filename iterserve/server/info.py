"""The routes that generate nothing: /health, /version, /v1/models, /tokenize, /detokenize, /metrics."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

import iterserve
from iterserve.server import lora_routes
from iterserve.server.async_engine import ShuttingDownError
from iterserve.server.errors import ApiError, error_response
from iterserve.server.protocol import (
    DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList, TokenizeRequest, TokenizeResponse,
)

if TYPE_CHECKING:
    from iterserve.server.routes import Routes


def router(routes: Routes, metrics, health=None) -> APIRouter:
    """`metrics`: what /metrics renders; `health`: the /health handler, when not one engine's (the Ray ingress:
    its replicas')."""
    api = APIRouter()
    engine, tokenizer, max_model_len = routes.engine, routes.tokenizer, routes.max_model_len

    async def engine_health():
        if engine.dead is not None:
            return error_response(503, f"the engine loop has died: {engine.dead!r}", "engine_dead")
        if engine.draining:  # load balancers stop sending here while the open requests finish
            return error_response(503, "the server is shutting down", ShuttingDownError.type)
        return Response(status_code=200)

    api.get("/health")(health or engine_health)

    @api.get("/version")
    async def version():
        return {"version": iterserve.__version__}

    @api.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=routes.model, max_model_len=max_model_len),
                               *lora_routes.model_cards(routes.engine, routes.model, max_model_len)])

    @api.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str):
        routes.check_model(model_id)
        cards = lora_routes.model_cards(routes.engine, routes.model, max_model_len)
        return next((c for c in cards if c.id == model_id), ModelCard(id=routes.model, max_model_len=max_model_len))

    @api.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        routes.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "send exactly one of prompt and messages")
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer")
        try:
            ids = routes.chat_prompt(body.messages) if body.messages is not None else \
                list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids)

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        routes.check_model(body.model)
        try:
            ids = engine.encode(body.tokens) if body.tokens else []
        except ValueError as e:
            raise ApiError(400, str(e), param="tokens") from e
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer")
        return DetokenizeResponse(prompt=tokenizer.decode(ids))

    @api.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
    return api
