"""POST /v1/embeddings (OpenAI's shape) on the generating engine.

Each input is one prompt-only request (SamplingParams.pooling): the scheduler gives it its prompt by
the one rule like any other, the runner pools the final-norm hidden states (the last token's, or the
mean over the prompt; L2-normalized) when the prompt is done, and the request ends there with no
token sampled, its KV blocks freed. Pooling is the server's (`--pooling`), not the request's.
"""
from __future__ import annotations

import base64
from dataclasses import replace
from typing import TYPE_CHECKING, Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from iterserve.sampling_params import SamplingParams
from iterserve.server import lora_routes
from iterserve.server.errors import ApiError
from iterserve.server.protocol import MAX_PROMPTS
from iterserve.server.streams import _collect

if TYPE_CHECKING:
    from iterserve.server.routes import Routes


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # unknown fields are a 400 naming them, as on every route
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # refused: no model here is trained to be cut short (Matryoshka)
    user: str | None = None  # an end-user id for abuse tracking: nothing to do with the embedding

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        many = isinstance(x, list) and x and isinstance(x[0], (str, list))
        inputs = list(x) if many else [x]
        if not inputs:
            raise ValueError("input is empty")
        if len(inputs) > MAX_PROMPTS:
            raise ValueError(f"input: at most {MAX_PROMPTS} inputs in one request")
        return inputs


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of the float32 values, little-endian


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def router(routes: Routes, pooling: str) -> APIRouter:
    api = APIRouter()
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)

    @api.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
        routes.check_model(body.model)
        # No pooling behind a fake, tensor-parallel or remote engine.
        if not getattr(routes.engine, "supports_pooling", False):
            raise ApiError(400, "this deployment's executor does not compute embeddings")
        if body.dimensions is not None:
            raise ApiError(400, f"dimensions is not supported: {routes.model} gives embeddings of its hidden size "
                                "and was not trained to be cut shorter", param="dimensions")
        try:
            prompts = [routes.engine.encode(p) for p in body.inputs()]
        except ValueError as e:
            raise ApiError(400, str(e), param="input") from e
        streams = []
        try:
            for p in prompts:
                streams.append(await routes.start(p, replace(params, lora_name=lora_routes.lora_name(
                    routes.engine, body.model, routes.model))))
        except ApiError:
            for s in streams:
                s.engine.abort(s.request_id)
            raise
        outs = [group[0] for group in await _collect(streams, request)]
        data = [Embedding(index=i, embedding=_encode(out.embedding, body.encoding_format)) for i, out in enumerate(outs)]
        tokens = sum(len(p) for p in prompts)
        return EmbeddingResponse(data=data, model=routes.model,
                                 usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))

    return api


def _encode(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return embedding
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode()
