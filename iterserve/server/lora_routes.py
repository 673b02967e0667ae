"""LoRA adapters over HTTP, as vLLM serves them: a request's `model` field names an adapter (the base
model's name: none), /v1/models lists them with the base as parent, and /v1/load_lora_adapter and
/v1/unload_lora_adapter change them at run time, on the engine thread between steps (model/lora.py).

Adapters are served by one engine in this process (an AsyncEngine over an Engine); behind a P/D front or
Ray replicas the app sees none, so an adapter's name is an unknown model there (404), never the base.
"""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from iterserve.engine import Engine
from iterserve.executor.base import LoRANotFoundError
from iterserve.server.async_engine import AsyncEngine, EngineDeadError
from iterserve.server.errors import ApiError
from iterserve.server.protocol import ModelCard


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str


def adapters(client) -> dict[str, str]:
    """The adapters the client serves, name -> path: an AsyncEngine's over one Engine; none for the rest."""
    if isinstance(client, AsyncEngine) and isinstance(client.engine, Engine):
        return client.engine.lora_adapters
    return {}


def lora_name(client, model: str | None, served_model_name: str) -> str | None:
    """The adapter a request's model field picks: None for the base model (or no model given)."""
    return model if model is not None and model != served_model_name and model in adapters(client) else None


def model_cards(client, served_model_name: str, max_model_len: int) -> list[ModelCard]:
    return [ModelCard(id=name, root=path, parent=served_model_name, max_model_len=max_model_len)
            for name, path in adapters(client).items()]


def router(routes) -> APIRouter:
    """routes: routes.Routes (the engine client, the served model name)."""

    api = APIRouter()

    async def call(fn) -> None:
        client = routes.engine
        if not (isinstance(client, AsyncEngine) and isinstance(client.engine, Engine)):
            raise ApiError(400, "LoRA adapters are served by a single engine (not behind --pd or Ray replicas)")
        try:
            await client.call(fn)
        except LoRANotFoundError as e:
            raise ApiError(404, str(e), "not_found_error", "lora_name") from e
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        except EngineDeadError as e:
            raise ApiError(e.status, str(e), e.type) from e
        except Exception as e:  # noqa: BLE001 - the engine loop lives on (AsyncEngine._call)
            raise ApiError(500, f"the adapter operation failed: {e!r}", "internal_error") from e

    @api.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        if body.lora_name == routes.model:
            raise ApiError(400, f"lora_name {body.lora_name!r} is the base model's name", param="lora_name")
        await call(lambda engine: engine.load_lora(body.lora_name, body.lora_path))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @api.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        await call(lambda engine: engine.unload_lora(body.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return api
