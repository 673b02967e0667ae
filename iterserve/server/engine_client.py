"""The engine-client contract: what the OpenAI app (server/app.py build_app) needs from what serves it.

Implementations: AsyncEngine (one engine in this process: an Engine, or the P/D front of
server/pd_engines.py, which shows the Engine's surface) and the Ray ingress's ReplicaClient (N engine
replicas on Ray Serve, server/ray_app.py). build_app checks the contract once, at construction: a
client that lacks a part fails there, naming it, not on the first request that touches it.
"""
from __future__ import annotations

import inspect
from typing import AsyncIterator, Callable, Protocol

from iterserve.engine.stats import EngineStats
from iterserve.outputs import RequestOutput
from iterserve.sampling_params import SamplingParams


class ClientStream(Protocol):
    """One request's outputs, in order (`async for`). The app marks it finished once it has ended it,
    and aborts one it gives up on through `engine.abort(request_id)`."""

    request_id: str
    finished: bool
    engine: "EngineClient"

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...


class EngineClient(Protocol):
    # The model as the app sees it: tokenizing, context checks, structured-output grammars.
    tokenizer: object | None  # a transformers tokenizer, or None: prompts must be token ids
    max_model_len: int
    vocab_size: int | None
    eos_token_ids: frozenset[int]
    # Health: a dead client answers 503 engine_dead; a draining one 503 server_shutting_down.
    dead: BaseException | None
    draining: bool
    # The metrics hook the app installs: (stats, outputs) after each engine step, on the engine's thread.
    # A client whose engines run in other processes (the Ray ingress) never calls it.
    on_step: Callable[[EngineStats, list[RequestOutput]], None] | None

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids, or ValueError (empty prompt, an id outside the vocabulary): a 400 before any engine."""

    async def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                          priority: int = 0, cache_salt: str | None = None) -> ClientStream:
        """The request's stream once accepted; ValueError (bad input), QueueFullError, EngineDeadError,
        ShuttingDownError otherwise."""

    def abort(self, request_id: str) -> None: ...

    def start(self) -> None:
        """With the app (its lifespan)."""

    def shutdown(self) -> None: ...


_ATTRIBUTES = ("tokenizer", "max_model_len", "vocab_size", "eos_token_ids", "dead", "draining", "on_step")
_METHODS = ("encode", "add_request", "abort", "start", "shutdown")


def check_engine_client(client: object) -> None:
    """Raise TypeError naming every part of the contract the client lacks or gets wrong."""
    name = type(client).__name__
    missing = [m for a in _ATTRIBUTES + _METHODS if (m := _missing(client, a))]
    if missing:
        raise TypeError(f"{name} does not implement the EngineClient contract: missing {', '.join(missing)}")
    wrong = [f"{m} is not callable" for m in _METHODS if not callable(getattr(client, m))]
    if callable(client.add_request) and not inspect.iscoroutinefunction(client.add_request):
        wrong.append("add_request is not a coroutine function (async def)")
    if not isinstance(client.max_model_len, int) or client.max_model_len < 1:
        wrong.append(f"max_model_len is {client.max_model_len!r}, not a positive integer")
    if not isinstance(client.eos_token_ids, frozenset):
        wrong.append(f"eos_token_ids is a {type(client.eos_token_ids).__name__}, not a frozenset")
    if wrong:
        raise TypeError(f"{name} does not implement the EngineClient contract: {'; '.join(wrong)}")


def _missing(client: object, name: str) -> str | None:
    """None if the client has it; else the name, and the object that lacks it when that is not the client
    (an AsyncEngine reads the model's facts from its engine)."""
    try:
        getattr(client, name)
    except AttributeError as e:
        inner = client if getattr(e, "obj", None) is None else e.obj
        return name if inner is client else f"{name} (its {type(inner).__name__} has no {e.name})"
    return None
